"""Checkpoint a containerd task with the node's runc, handing it the installed CRIU (`runc --criu`).

containerd's Tasks.Checkpoint has the runc shim run ``runc checkpoint`` with whatever ``criu`` is on
containerd's PATH: containerd v2's runc options have no CRIU path (``CriuPath`` is gone from
containerd-shim-runc-v2's ``NewRunc``), and pods that are snapshotted run under the node's default
runtime, not the kubectl-snapshot handler. So the agent runs the same command the shim would
(go-runc's ``Checkpoint``: same runc binary, same ``--root``, same options) itself, in the host's
mount namespace, with ``--criu`` naming the CRIU that install-node put in the node's directory. A
host CRIU, present or not, is never used. The task stays the shim's: with ``--leave-running`` (what
the project uses) nothing changes for containerd; without it CRIU ends the task and the shim, its
parent, reaps it as after any exit.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

from kubectl_snapshot.core.errors import FailedPrecondition
from shim.containerd.model import ContainerInfo
from shim.host import private
from shim.host.facts import host_pid, host_root

SHIM_RUNC_ROOT = "/run/containerd/runc"  # containerd-shim-runc-v2 process.RuncRoot (joined with the namespace)
RUNC_CANDIDATES = ("/usr/sbin/runc", "/usr/bin/runc", "/usr/local/sbin/runc", "/usr/local/bin/runc", "/bin/runc")


@dataclass(frozen=True)
class CheckpointArgs:
    image_path: str
    work_path: str
    exit: bool = False
    open_tcp: bool = True
    file_locks: bool = False
    external_unix_sockets: bool = False
    terminal: bool = False


@dataclass(frozen=True)
class RuncCheckpointer:
    """How this node checkpoints: the installed CRIU, and optionally a runc path (default: the shim's)."""

    criu: str
    runc: str = ""

    def host_prefix(self) -> list[str]:
        """Enter the host's mount and cgroup namespaces (where the shim's runc runs) from a container."""
        pid = host_pid()
        return ["nsenter", "-t", str(pid), "-m", "-C", "--"] if pid else []

    def runc_binary(self, info: ContainerInfo) -> str:
        """The runc the shim runs for this container: its BinaryName, else the node's runc."""
        if info.runc_options and info.runc_options.binary_name:
            return info.runc_options.binary_name
        if self.runc:
            return self.runc
        root = host_root() or ""
        for candidate in RUNC_CANDIDATES:
            if os.access(root + candidate, os.X_OK):
                return candidate
        raise FailedPrecondition(
            "runc was not found on this node",
            hint="set runcPath for this node in the agent's node map (the runc containerd's shim runs)",
        )

    def _global(self, namespace: str, info: ContainerInfo) -> list[str]:
        """runc and its global options as containerd-shim-runc-v2 runs it for this container."""
        opts = info.runc_options
        root = os.path.join((opts.root if opts and opts.root else SHIM_RUNC_ROOT), namespace)
        cmd = [self.runc_binary(info), "--root", root]
        return [*cmd, "--systemd-cgroup"] if opts and opts.systemd_cgroup else cmd

    def pause_command(self, cid: str, namespace: str, info: ContainerInfo) -> list[str]:
        """``runc pause`` of the container, as the shim would run it (its cgroup frozen by runc)."""
        return [*self._global(namespace, info), "pause", cid]

    def command(self, cid: str, namespace: str, info: ContainerInfo, a: CheckpointArgs) -> list[str]:
        """go-runc's Runc.Checkpoint argv as containerd-shim-runc-v2 builds it, plus ``--criu``."""
        g = self._global(namespace, info)
        cmd = [*g[:3], "--criu", self.criu, *g[3:]]
        cmd += ["checkpoint", "--image-path", a.image_path, "--work-path", a.work_path]
        if a.open_tcp:
            cmd.append("--tcp-established")
        if a.external_unix_sockets:
            cmd.append("--ext-unix-sk")
        if a.terminal:
            cmd.append("--shell-job")
        if a.file_locks:
            cmd.append("--file-locks")
        if not a.exit:
            cmd.append("--leave-running")
        return [*cmd, cid]

    def run(self, argv: Sequence[str], timeout: float) -> tuple[int, str]:
        """Run runc (on the host); (exit status, its stderr). Under umask 077: what runc, CRIU and the tar CRIU
        runs write (images, dump.log, tmpfs archives) is root's alone (shim/host/private.py)."""
        proc = subprocess.run(
            [*self.host_prefix(), *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            umask=private.UMASK,
        )
        return proc.returncode, proc.stderr.strip()
