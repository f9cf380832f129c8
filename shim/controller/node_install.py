"""Install (and remove) the runtime hook on this node: the wrapper, its launcher, the containerd drop-in.

Run by the DaemonSet's init container. The wrapper runs on the host (containerd's runc shim execs
it), so it is a zipapp of pure-Python modules run by the host's python3; the launcher pins the
node's state dir. The drop-in registers the runtime handler `kubectl-snapshot` (selected by the
RuntimeClass of the same name); containerd reads drop-ins at start, so a changed drop-in is followed
by the configured restart command, run in the host's namespaces. The node's runc CRIU configuration
(shim/criu_config.py) is written too, where it is safe and this node's CRIU supports it.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass

from kubectl_snapshot.core import kube as K
from kubectl_snapshot.core.errors import FailedPrecondition, InvalidArgument
from shim import criu_config
from shim.controller.settings import NodeSettings
from shim.hostfacts import host_pid

DROPIN_NAME = "kubectl-snapshot.toml"
PYZ_NAME = "kubectl-snapshot-runc.pyz"
HOST_PYTHON = "/usr/bin/python3"


@dataclass(frozen=True)
class InstallResult:
    launcher: str
    dropin: str
    changed: bool
    restarted: bool
    criu_config: criu_config.ConfigResult | None = None


def launcher_script(settings: NodeSettings) -> str:
    pyz = os.path.join(settings.wrapper_dir, PYZ_NAME)
    return (
        "#!/bin/sh\n"
        "# kubectl-snapshot runtime hook for node " + settings.node + " (installed by the agent DaemonSet)\n"
        f"KUBECTL_SNAPSHOT_STATE_DIR={shlex.quote(settings.state_dir)}\n"
        "export KUBECTL_SNAPSHOT_STATE_DIR\n"
        f'exec {HOST_PYTHON} -I {shlex.quote(pyz)} "$@"\n'
    )


def dropin_toml(settings: NodeSettings) -> str:
    table = f"plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.{K.RUNTIME_CLASS}"
    return (
        "# written by kubectl-snapshot-agent install-node; removed by uninstall-node\n"
        "version = 3\n"
        f"[{table}]\n"
        "  runtime_type = 'io.containerd.runc.v2'\n"
        f"[{table}.options]\n"
        f"  BinaryName = '{settings.wrapper_launcher}'\n"
        "  SystemdCgroup = false\n"
    )


def _write_if_changed(path: str, content: str, mode: int) -> bool:
    # Compared as bytes: what is there may be anything (another version's binary launcher, say).
    with contextlib.suppress(OSError), open(path, "rb") as f:
        if f.read() == content.encode():
            os.chmod(path, mode)
            return False
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(content)
    os.chmod(tmp, mode)
    os.rename(tmp, path)
    return True


def install(settings: NodeSettings, *, wrapper_pyz: str) -> InstallResult:
    if not os.path.isfile(wrapper_pyz):
        raise InvalidArgument(f"wrapper zipapp {wrapper_pyz} not found", hint="the agent image ships it")
    os.makedirs(settings.wrapper_dir, exist_ok=True)
    os.makedirs(settings.state_dir, mode=0o700, exist_ok=True)
    pyz_target = os.path.join(settings.wrapper_dir, PYZ_NAME)
    tmp = pyz_target + ".tmp"
    shutil.copyfile(wrapper_pyz, tmp)
    os.chmod(tmp, 0o755)
    os.rename(tmp, pyz_target)
    _write_if_changed(settings.wrapper_launcher, launcher_script(settings), 0o755)
    os.makedirs(settings.containerd_dropin_dir, exist_ok=True)
    dropin = os.path.join(settings.containerd_dropin_dir, DROPIN_NAME)
    changed = _write_if_changed(dropin, dropin_toml(settings), 0o644)
    restarted = False
    if changed and settings.restart_command:
        _run_on_host(settings.restart_command.replace("{node}", settings.node))
        restarted = True
    conf = criu_config.ensure(_host_path(settings.criu_config), run=_capture_on_host, criu=settings.criu_path)
    return InstallResult(settings.wrapper_launcher, dropin, changed, restarted, conf)


def uninstall(settings: NodeSettings) -> None:
    dropin = os.path.join(settings.containerd_dropin_dir, DROPIN_NAME)
    existed = os.path.exists(dropin)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(dropin)
    shutil.rmtree(settings.wrapper_dir, ignore_errors=True)
    criu_config.remove(_host_path(settings.criu_config))
    if existed and settings.restart_command:
        _run_on_host(settings.restart_command.replace("{node}", settings.node))


def _host_path(path: str) -> str:
    """A host path as this process reaches it: through the host's mount namespace when in a container."""
    pid = host_pid()
    return f"/proc/{pid}/root{path}" if pid else path


def _in_host_mounts(pid: int | None) -> list[str]:
    """The command prefix that enters the host's mount namespace (nothing when not in a container)."""
    return ["nsenter", "-t", str(pid), "-m", "--"] if pid else []


def _capture_on_host(command: str) -> tuple[int, str]:
    argv = [*_in_host_mounts(host_pid()), "sh", "-c", command]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def _run_on_host(command: str) -> None:
    """Run a shell command in the host's namespaces (the agent runs with hostPID and privileges)."""
    pid = host_pid()
    prefix = _in_host_mounts(pid)
    # Leave this container's cgroups first (join the host process's): whatever the command starts
    # (a new containerd) must not die with the init container when the kubelet cleans it up.
    escape = (
        f'while IFS=: read -r _ ctrl path; do d="/sys/fs/cgroup/${{ctrl#name=}}"; '
        f'[ -z "$ctrl" ] && d=/sys/fs/cgroup/unified; [ -d "$d" ] || d="/sys/fs/cgroup"; '
        f'echo $$ > "$d$path/cgroup.procs" 2>/dev/null || true; done < /proc/{pid}/cgroup; '
        if pid
        else ""
    )
    proc = subprocess.run(
        [*prefix, "sh", "-c", escape + command], capture_output=True, text=True, timeout=300, check=False
    )
    if proc.returncode != 0:
        raise FailedPrecondition(
            f"restarting containerd failed ({proc.returncode}): {proc.stderr.strip()[-500:]}",
            hint="restart the node's containerd by hand to activate the kubectl-snapshot runtime handler",
        )
