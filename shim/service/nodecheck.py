"""What this node runs for kubectl-snapshot and what blocks it, as the agent publishes it for `doctor`.

- which CRIU and which runtime wrapper are in use and where they came from (install-node's install.json);
- every other tool the node side uses and where it comes from: the bundle's tar (CRIU's tmpfs dumps),
  and the network work in pods' namespaces that runs in-process (setns, nf_tables, rtnetlink,
  sock_diag: no host nsenter, sh, iptables, ip or ss), with the kernel features it needs probed;
- `criu check` with that CRIU (the kernel features CRIU needs), the cgroup version;
- containerd: its version, whether its configuration imports the drop-in directory (its ``imports``;
  containerd 2.x imports /etc/containerd/conf.d/*.toml when the config does not say, 1.x nothing),
  and whether a restart is still pending (the drop-in is newer than the running containerd).

Everything is read from /proc (the agent has hostPID) and files; nothing runs a host shell.
"""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import tomllib
from dataclasses import dataclass
from typing import Any

from kubectl_snapshot.core import kubenames as K
from shim.net import nftlock, tcpabort

DEFAULT_CONFIG = "/etc/containerd/config.toml"
DEFAULT_IMPORTS = ("/etc/containerd/conf.d/*.toml",)  # containerd v2 (cmd/containerd/command/config.go)
DEFAULT_SOCKET = "/run/containerd/containerd.sock"


@dataclass(frozen=True)
class Containerd:
    pid: int
    config_path: str
    config: dict[str, Any] | None  # None: no config file (containerd's defaults)


def _argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def config_path_of(argv: list[str]) -> str:
    for i, a in enumerate(argv):
        if a in ("--config", "-c") and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--config="):
            return a.split("=", 1)[1]
    return DEFAULT_CONFIG


def socket_of(config: dict[str, Any] | None) -> str:
    grpc = (config or {}).get("grpc") or {}
    return str(grpc.get("address") or DEFAULT_SOCKET).removeprefix("unix://")


def find_containerd(socket: str) -> Containerd | None:
    """The containerd process serving `socket` (several may run on one machine: the local cluster)."""
    socket = socket.removeprefix("unix://")
    for entry in sorted(os.listdir("/proc")):
        if not entry.isdigit():
            continue
        argv = _argv(int(entry))
        if not argv or os.path.basename(argv[0]) != "containerd":
            continue
        path = config_path_of(argv)
        config: dict[str, Any] | None
        try:
            with open(f"/proc/{entry}/root{path}", "rb") as f:
                config = tomllib.load(f)
        except FileNotFoundError:
            config = None
        except (OSError, tomllib.TOMLDecodeError):
            continue
        if socket_of(config) == socket:
            return Containerd(int(entry), path, config)
    return None


def imports_dropin(c: Containerd, dropin_file: str, containerd_version: str = "") -> bool:
    """Whether containerd's `imports` cover the drop-in file (relative patterns: beside the config)."""
    patterns = (c.config or {}).get("imports")
    if patterns is None:
        patterns = [] if containerd_version.lstrip("v").startswith("1.") else list(DEFAULT_IMPORTS)
    base = os.path.dirname(c.config_path)
    return any(fnmatch.fnmatch(dropin_file, p if os.path.isabs(p) else os.path.join(base, p)) for p in patterns)


def started_at(pid: int) -> float | None:
    """A process's start time (seconds since the epoch) from /proc."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def restart_pending(c: Containerd, dropin_file: str) -> bool | None:
    """True when the drop-in changed after containerd started (it reads drop-ins only at start)."""
    start = started_at(c.pid)
    try:
        mtime = os.stat(dropin_file).st_mtime
    except OSError:
        return None
    return None if start is None else mtime > start + 1


def dropin_pod_annotations(dropin_file: str) -> list[str]:
    """The pod annotations the drop-in's kubectl-snapshot runtime handler passes to the runtime wrapper
    (containerd 1.7's and 2.x's layouts alike); [] when the file is absent or unreadable."""
    try:
        with open(dropin_file, "rb") as f:
            doc = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError):
        return []

    def walk(node: Any) -> list[str]:
        if not isinstance(node, dict):
            return []
        runtimes = node.get("runtimes")
        handler = runtimes.get(K.RUNTIME_CLASS) if isinstance(runtimes, dict) else None
        if isinstance(handler, dict) and isinstance(handler.get("pod_annotations"), list):
            return [str(a) for a in handler["pod_annotations"]]
        return next((found for v in node.values() if (found := walk(v))), [])

    return walk(doc)


def criu_check(criu: str, timeout: float = 60) -> dict[str, Any]:
    """`criu check` with the given (installed) CRIU: ok, or CRIU's reasons."""
    try:
        proc = subprocess.run([criu, "check"], capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"ok": False, "detail": f"{criu} check could not run: {e}"}
    out = (proc.stdout + proc.stderr).strip()
    lines = [line for line in out.splitlines() if "RLIMIT_NOFILE" not in line]  # harmless without CAP_SYS_RESOURCE
    return {"ok": proc.returncode == 0, "detail": "\n".join(lines[-8:])}


def installed(wrapper_dir: str) -> dict[str, Any]:
    """install-node's record of what it installed on this node ({} when nothing)."""
    try:
        with open(os.path.join(wrapper_dir, "install.json")) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


IN_PROCESS = "in-process"
NETWORK_TOOLS = {
    # name: (what it replaces, how)
    "enter a pod's network namespace": ("nsenter", "setns(2) from a thread of the hook / the agent"),
    "pod network lock": ("sh, iptables-restore, ip6tables-restore", "nf_tables over netlink (an inet table)"),
    "lend/return old pod addresses": ("ip addr", "rtnetlink RTM_NEWADDR/RTM_DELADDR"),
    "abort connections from the old address": ("ss -K", "sock_diag SOCK_DESTROY"),
    "restored container's lo up": ("ip link", "SIOCSIFFLAGS ioctl"),
}


def tools(record: dict[str, Any], origin: str) -> dict[str, dict[str, Any]]:
    """{tool: {path, version, from, replaces?, ok?, detail?}}: what the node side runs besides CRIU and
    the hook, and where it comes from; kernel features of the in-process ones are probed here."""
    out: dict[str, dict[str, Any]] = {}
    for name, tool in sorted((record.get("tools") or {}).items()):
        if isinstance(tool, dict):
            out[name] = {
                "path": str(tool.get("launcher") or ""),
                "version": str(tool.get("version") or ""),
                "from": f"{tool.get('from', '')}, {origin}".strip(", "),
            }
    probes = {"pod network lock": nftlock.probe(), "abort connections from the old address": tcpabort.probe()}
    for name, (replaces, how) in NETWORK_TOOLS.items():
        entry: dict[str, Any] = {
            "path": IN_PROCESS,
            "version": "",
            "from": f"{how}, in the hook (the bundle's python) and the agent",
            "replaces": replaces,
        }
        if name in probes:
            entry["ok"], entry["detail"] = not probes[name], probes[name] or "the kernel supports it"
        out[name] = entry
    return out


def blockers(status: dict[str, Any]) -> list[str]:
    """What keeps this node from snapshots and restores, from a published node status."""
    out = []
    if not status.get("criu", {}).get("path"):
        out.append("no CRIU installed by kubectl-snapshot (install-node has not run)")
    check = status.get("criuCheck") or {}
    if check and not check.get("ok"):
        last = (str(check.get("detail") or "").strip().splitlines() or ["no output"])[-1]
        out.append(f"`criu check` with the installed CRIU fails: {last}")
    c = status.get("containerd") or {}
    version = str(c.get("version") or "")
    if version and not version.lstrip("v").startswith(("2.",)):
        out.append(f"containerd {version}: the runtime handler drop-in needs containerd 2.x")
    if c.get("found") is False:
        out.append("the containerd serving the agent's socket was not found in the host's processes")
    if c.get("importsDropin") is False:
        out.append(f"containerd's config {c.get('config')} does not import {c.get('dropin')}")
    if c.get("restartPending"):
        out.append("containerd has not been restarted since the drop-in changed (handler not active yet)")
    lock = (status.get("tools") or {}).get("pod network lock") or {}
    if lock.get("ok") is False:
        out.append(f"pods' network cannot be locked (whole-pod restores, dumps of pods): {lock.get('detail', '')}")
    return out


def node_status(
    *, wrapper_dir: str, criu: str, socket: str, dropin_file: str, containerd_version: str, cgroup: str
) -> dict[str, Any]:
    """The status the agent publishes (node annotation) and `kubectl snapshot doctor` shows."""
    record = installed(wrapper_dir)
    bundle_criu = record.get("criu") or {}
    python = record.get("python") or {}
    hook = record.get("hook") or {}
    origin = record.get("from", "")
    status: dict[str, Any] = {
        "criu": {
            "path": criu if os.access(criu, os.X_OK) else "",
            "version": bundle_criu.get("version", "") if criu == bundle_criu.get("launcher") else "",
            "from": f"{bundle_criu.get('from', '')}, {origin}".strip(", ")
            if criu == bundle_criu.get("launcher")
            else "configured criuPath (not installed by kubectl-snapshot)",
        },
        "hook": {
            "path": hook.get("launcher", ""),
            "python": python.get("version", ""),
            "from": f"{python.get('from', '')}, {origin}".strip(", "),
            "bundle": record.get("bundle", ""),
        },
        "criuCheck": criu_check(criu) if os.access(criu, os.X_OK) else {},
        "tools": tools(record, origin),
        "cgroup": cgroup,
    }
    c = find_containerd(socket)
    status["containerd"] = {
        "version": containerd_version,
        "found": c is not None,
        "config": c.config_path if c else "",
        "dropin": dropin_file,
        "importsDropin": imports_dropin(c, dropin_file, containerd_version) if c else None,
        "restartPending": restart_pending(c, dropin_file) if c else None,
    }
    # what containerd passes to the wrapper now: the drop-in's, once containerd has read it
    active = c is not None and status["containerd"]["importsDropin"] and status["containerd"]["restartPending"] is False
    status["containerd"]["podAnnotations"] = dropin_pod_annotations(dropin_file) if active else []
    status["blockers"] = blockers(status)
    return status
