"""Where a machine's CPU went during a window, by component of the local cluster (bench/evacuate.py).

Each long-lived process's user and system time, with that of the children it reaped (a CRIU under runc
under the agent; not a shim's: it reaps its pod's processes, whose whole life would count), read from
/proc/PID/stat at the window's start and end, grouped by what they are for the cluster (the agent of
ks-n1, ks-n2's containerd, the API server, the registry, the bench itself with the kubectl it runs). The
machine's busy time (/proc/stat) is the total; what the groups leave of it is the pods' own work and
short-lived processes reaped by none of them.
"""

from __future__ import annotations

import contextlib
import os

TICK = os.sysconf("SC_CLK_TCK")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def component(pid: int) -> str:
    """What process `pid` is for, in the local cluster's terms ("" when it is none of them)."""
    try:
        argv = [a.decode(errors="replace") for a in _read(f"/proc/{pid}/cmdline").split(b"\0") if a]
    except OSError:
        return ""
    if not argv:
        return ""
    cmd = " ".join(argv)
    name = os.path.basename(argv[0])
    node = next((n for n in ("ks-n1", "ks-n2") if n in cmd), "")
    if "ks-agent" in cmd or (name == "python3" and "shim.guard" in cmd):
        with contextlib.suppress(OSError):
            env = _read(f"/proc/{pid}/environ").split(b"\0")
            node = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"NODE_NAME=")), node)
        return f"agent {node}".strip()
    for known in ("kube-apiserver", "etcd", "kube-controller-manager", "kube-scheduler"):
        if name == known:
            return known
    if name in ("registry", "docker-registry"):
        return "registry"
    if name == "kubelet":
        return f"kubelet {node}".strip()
    if name.startswith("containerd-shim"):
        return f"shims {node}".strip()
    if name == "containerd":
        return f"containerd {node}".strip()
    return ""


def _cpu(pid: int, children: bool) -> float:
    """utime + stime of `pid`, with cutime + cstime (its reaped children's) where `children`, in seconds."""
    fields = _read(f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()
    return sum(int(x) for x in fields[11 : 15 if children else 13]) / TICK


Sample = tuple[dict[int, tuple[str, float]], float]


def sample() -> Sample:
    """Every cluster process's CPU seconds so far (by pid, with its component), and the machine's busy seconds."""
    procs: dict[int, tuple[str, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        what = component(pid)
        if what:
            with contextlib.suppress(OSError, IndexError, ValueError):
                # a shim reaps its pod's processes: their whole life's CPU would land in the window
                procs[pid] = (what, _cpu(pid, children=not what.startswith("shims")))
    me = os.times()  # this script and the kubectl it runs (its polling)
    procs[os.getpid()] = ("the bench and its kubectl", me.user + me.system + me.children_user + me.children_system)
    cpu = _read("/proc/stat").split(b"\n", 1)[0].split()[1:]
    busy = (sum(int(x) for x in cpu) - int(cpu[3]) - int(cpu[4])) / TICK  # all but idle and iowait
    return procs, busy


def shares(start: Sample, end: Sample) -> dict[str, float]:
    """CPU seconds per component between two samples (a process that ended meanwhile counts for its
    parent, where the parent reaped it), and "machine busy" for the whole machine."""
    got: dict[str, float] = {}
    for pid, (what, secs) in end[0].items():
        before = start[0].get(pid)
        got[what] = got.get(what, 0.0) + secs - (before[1] if before and before[0] == what else 0.0)
    out = {k: round(v, 2) for k, v in sorted(got.items(), key=lambda kv: -kv[1])}
    busy = end[1] - start[1]
    out["the rest (the pods' own work, ...)"] = round(busy - sum(got.values()), 2)
    out["machine busy"] = round(busy, 2)
    return out
