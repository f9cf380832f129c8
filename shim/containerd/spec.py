"""The default OCI runtime spec for containers the project creates itself (tests, the agent CLI).

Kubernetes pods get their spec from the kubelet through CRI; this spec is for `run_container`, the
equivalent of ``ctr run``. It follows the OCI runtime-spec fields for Linux and the defaults
containerd uses for a new Linux container: root in ``rootfs``, the 14 default capabilities, a
NOFILE rlimit of 1024, the standard kernel filesystems, masked and read-only /proc paths, a
deny-all device cgroup plus the usual character devices, and fresh pid/ipc/uts/mount/network
namespaces. The spec is plain JSON data (a dict) because containerd stores it as JSON in an ``Any``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

from kubectl_snapshot.core.runtimegrant import CONTAINERD_DEFAULT_CAPABILITIES

OCI_VERSION: Final = "1.2.0"
DEFAULT_PATH: Final = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

DEFAULT_CAPABILITIES: Final[tuple[str, ...]] = CONTAINERD_DEFAULT_CAPABILITIES  # what the CRI gives a container too

# Kernel interfaces a container must not read (host information, hardware, keys).
MASKED_PATHS: Final[tuple[str, ...]] = (
    "/proc/acpi",
    "/proc/asound",
    "/proc/interrupts",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
)
READONLY_PATHS: Final[tuple[str, ...]] = (
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
)

# (type, major, minor) of the character devices a container may use: null, zero, full, random,
# urandom, tty, console, ptmx and the pty slaves (-1 = any minor).
ALLOWED_DEVICES: Final[tuple[tuple[str, int, int], ...]] = (
    ("c", 1, 3),
    ("c", 1, 5),
    ("c", 1, 7),
    ("c", 1, 8),
    ("c", 1, 9),
    ("c", 5, 0),
    ("c", 5, 1),
    ("c", 5, 2),
    ("c", 136, -1),
)


def _mount(destination: str, fstype: str, source: str, *options: str) -> dict[str, Any]:
    return {"destination": destination, "type": fstype, "source": source, "options": list(options)}


def default_mounts() -> list[dict[str, Any]]:
    """The kernel filesystems every Linux container gets (/proc, /dev, /dev/pts, ..., /sys/fs/cgroup)."""
    return [
        _mount("/proc", "proc", "proc", "nosuid", "noexec", "nodev"),
        _mount("/dev", "tmpfs", "tmpfs", "nosuid", "strictatime", "mode=755", "size=65536k"),
        _mount(
            "/dev/pts",
            "devpts",
            "devpts",
            "nosuid",
            "noexec",
            "newinstance",
            "ptmxmode=0666",
            "mode=0620",
            "gid=5",
        ),
        _mount("/dev/shm", "tmpfs", "shm", "nosuid", "noexec", "nodev", "mode=1777", "size=65536k"),
        _mount("/dev/mqueue", "mqueue", "mqueue", "nosuid", "noexec", "nodev"),
        _mount("/sys", "sysfs", "sysfs", "nosuid", "noexec", "nodev", "ro"),
        _mount("/sys/fs/cgroup", "cgroup", "cgroup", "nosuid", "noexec", "nodev", "relatime", "ro"),
        _mount("/run", "tmpfs", "tmpfs", "nosuid", "strictatime", "mode=755", "size=65536k"),
    ]


def _with_path(env: Iterable[str]) -> list[str]:
    """Programs are found through PATH: add the usual one unless the caller set PATH."""
    out = list(env)
    if not any(e.startswith("PATH=") for e in out):
        out.insert(0, DEFAULT_PATH)
    return out


def _merge_mounts(base: list[dict[str, Any]], extra: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Extra mounts replace a default mount with the same destination, else are appended in order."""
    extra_list = [dict(m) for m in extra]
    for m in extra_list:
        if "destination" not in m:
            raise ValueError(f"mount without destination: {m!r}")
    replaced = {m["destination"] for m in extra_list}
    return [m for m in base if m["destination"] not in replaced] + extra_list


def default_spec(
    cid: str,
    *,
    namespace: str,
    args: Sequence[str],
    env: Iterable[str] = (),
    cwd: str = "/",
    mounts: Iterable[Mapping[str, Any]] = (),
    host_network: bool = False,
    netns_path: str | None = None,
    hostname: str | None = None,
    no_new_privileges: bool = False,
) -> dict[str, Any]:
    """An OCI runtime spec (JSON data) for container `cid` running `args` as root.

    `mounts` are OCI mount objects (``{"destination", "type", "source", "options"}``); one with the
    destination of a default mount replaces it. With `host_network` the container joins the host's
    network namespace (no network namespace entry); with `netns_path` it joins that network
    namespace, as a pod's containers join their sandbox's. The cgroup is ``/<namespace>/<cid>``, as
    containerd names it, so cgroups of two containerd namespaces never collide.
    """
    if not args:
        raise ValueError("a container needs a command (args is empty)")
    caps = list(DEFAULT_CAPABILITIES)
    namespaces = [{"type": t} for t in ("pid", "ipc", "uts", "mount")]
    if netns_path is not None:
        namespaces.append({"type": "network", "path": netns_path})
    elif not host_network:
        namespaces.append({"type": "network"})
    devices: list[dict[str, Any]] = [{"allow": False, "access": "rwm"}]
    for dtype, major, minor in ALLOWED_DEVICES:
        rule: dict[str, Any] = {"allow": True, "type": dtype, "major": major, "access": "rwm"}
        if minor >= 0:
            rule["minor"] = minor
        devices.append(rule)
    spec: dict[str, Any] = {
        "ociVersion": OCI_VERSION,
        "process": {
            "terminal": False,
            "user": {"uid": 0, "gid": 0},
            "args": list(args),
            "env": _with_path(env),
            "cwd": cwd,
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
            "noNewPrivileges": no_new_privileges,
        },
        "root": {"path": "rootfs"},
        "mounts": _merge_mounts(default_mounts(), mounts),
        "linux": {
            "resources": {"devices": devices},
            "cgroupsPath": f"/{namespace}/{cid}",
            "namespaces": namespaces,
            "maskedPaths": list(MASKED_PATHS),
            "readonlyPaths": list(READONLY_PATHS),
        },
    }
    if hostname is not None:
        spec["hostname"] = hostname
    return spec
