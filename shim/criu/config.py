"""The node's runc-specific CRIU configuration (/etc/criu/runc.conf), owned by install-node.

runc hands CRIU this file with every checkpoint and restore (unless a container names another one in
its ``org.criu.config`` annotation); options in it override what runc asks for over RPC. It is the
only knob between containerd's checkpoint API and CRIU, and kubectl-snapshot sets two options there:

``network-lock nftables``: while a task is frozen CRIU locks its network namespace, so that no TCP
state moves between the dump of a socket and the end of the dump. The default method runs
``iptables-restore`` in the namespace twice (lock and unlock), tens of ms of the freeze on the
project's VMs. nftables does the same lock through netlink in CRIU's own process:
same guarantee, a fraction of the time (bench/freeze_breakdown.py shows both).

``skip-in-flight``: a connection that reached a listening socket of the frozen pod but that the pod had
not accepted yet (an HTTP readiness probe every second, a client) made the whole dump fail ("In-flight
connection"). It is left out of the dump instead: its client sees the connection reset, as it would if
the server had restarted, and retries (a probe counts one failure). runc has no flag for it.

Rules: a file that kubectl-snapshot did not write is never touched (it is reported instead); the
option is written only after a real CRIU dump with it succeeded on this node (a kernel without
nf_tables would otherwise make every checkpoint fail); uninstall-node removes only our own file.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

RUNC_CONF = "/etc/criu/runc.conf"
MARKER = "# managed by kubectl-snapshot (install-node); removed by uninstall-node"
OPTIONS = ("network-lock nftables", "skip-in-flight")

# (shell command) -> (exit status, output): runs the command in the host's mount namespace.
HostRunner = Callable[[str], tuple[int, str]]


@dataclass(frozen=True)
class ConfigResult:
    path: str
    state: str  # "written", "unchanged", "foreign" (left alone), "unsupported" (probe failed), "removed", "absent"
    detail: str = ""


def render() -> str:
    return MARKER + "\n" + "".join(f"{o}\n" for o in OPTIONS)


def probe_script(criu: str = "criu") -> str:
    """A real `criu dump --network-lock nftables` of a throwaway process in a new network namespace."""
    c = shlex.quote(criu)
    return (
        "set -u; d=$(mktemp -d); "
        "setsid unshare -n sleep 30 </dev/null >/dev/null 2>&1 & p=$!; "
        'i=0; while [ $i -lt 50 ] && [ "$(readlink /proc/$p/ns/net)" = "$(readlink /proc/self/ns/net)" ]; '
        "do i=$((i+1)); sleep 0.02; done; "
        f'{c} dump -t $p -D "$d" --leave-running --network-lock nftables -o dump.log >/dev/null 2>&1; rc=$?; '
        '[ $rc -eq 0 ] || tail -n 5 "$d/dump.log" 2>/dev/null; '
        'kill $p 2>/dev/null; rm -rf "$d"; exit $rc'
    )


def run_locally(command: str) -> tuple[int, str]:
    proc = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60, check=False)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def is_ours(text: str | None) -> bool:
    return text is not None and text.startswith(MARKER)


def ensure(path: str = RUNC_CONF, *, run: HostRunner = run_locally, criu: str = "criu") -> ConfigResult:
    """Write our configuration to `path` (a host path as this process sees it) if that is safe."""
    current = _read(path)
    if current is not None and not is_ours(current):
        return ConfigResult(path, "foreign", "an existing CRIU configuration not written by kubectl-snapshot")
    if current == render():
        return ConfigResult(path, "unchanged")
    rc, out = run(probe_script(criu))
    if rc != 0:
        with contextlib.suppress(FileNotFoundError):
            if is_ours(current):
                os.unlink(path)  # an older file of ours, now unsupported: fall back to CRIU's defaults
        return ConfigResult(path, "unsupported", f"CRIU cannot lock the network with nftables here: {out[-300:]}")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.kubectl-snapshot-{os.getpid()}-{secrets.token_hex(4)}.tmp"  # several agents may share a host
    with open(tmp, "w") as f:
        f.write(render())
    os.chmod(tmp, 0o644)
    os.rename(tmp, path)
    return ConfigResult(path, "written")


def remove(path: str = RUNC_CONF) -> ConfigResult:
    current = _read(path)
    if current is None:
        return ConfigResult(path, "absent")
    if not is_ours(current):
        return ConfigResult(path, "foreign", "not written by kubectl-snapshot: left in place")
    with contextlib.suppress(FileNotFoundError):  # another node's agent on the same host was first
        os.unlink(path)
    return ConfigResult(path, "removed")
