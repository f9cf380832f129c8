"""Refuse CRIU images that grant more than the container's bundle (issue 10, item 2).

CRIU restores credentials, capabilities, seccomp, no_new_privs, LSM labels, namespaces and mounts from
its images, not from the OCI bundle that runc was given. The images come from a snapshot, which a
tenant can edit; the bundle (config.json) is what containerd wrote from the new pod's spec, which
admission and Pod Security checked. So before ``runc restore`` the runtime wrapper decodes just the
images that carry those (``pstree``, ``core-*``, ``inventory``, ``mountpoints-*``, ``seccomp``) and
refuses any of them that asks for more than the bundle grants:

- uids/gids (real, effective, saved, fs) and supplementary groups outside the bundle's
  ``process.user`` (any id only where the bundle runs as root with CAP_SETUID / CAP_SETGID, which
  could reach them anyway);
- capabilities a process of the bundle could never hold: effective and permitted beyond the bundle's
  permitted, inheritable beyond its inheritable + permitted, ambient beyond its ambient + permitted,
  bounding beyond its bounding;
- no seccomp filter where the bundle has a profile, or a filter chain of allow-everything programs;
- no_new_privs off where the bundle sets ``noNewPrivileges``;
- an AppArmor/SELinux label other than the bundle's, or an AppArmor policy blob of any kind;
- a task in namespaces other than the container's root task, a user namespace the bundle does not
  create; mounts at places the bundle does not mount, of filesystem types runc does not create.

Limitation (documented in docs/security.md): a seccomp filter is compared with the bundle's profile
only by presence, mode and "not allow-all"; the BPF that runc would compile from the profile is not
reproduced here, so a crafted filter that still denies something is not detected.

Only the standard library and pycriu (+ protobuf) are imported: the wrapper runs this on every
restore create, never on ordinary containers.
"""

from __future__ import annotations

import base64
import contextlib
import glob
import io
import json
import os
import posixpath
import stat
import struct
import sys
import time

from kubectl_snapshot.core.errors import PermissionDenied

try:  # CPython's own sha256: the hook does not load OpenSSL (hashlib's import) for its cache keys
    from _sha256 import sha256  # type: ignore[import-not-found,unused-ignore]  # up to 3.11
except ImportError:
    try:
        from _sha2 import sha256  # type: ignore[import-not-found,no-redef,unused-ignore]  # 3.12 and later
    except ImportError:  # a build without CPython's own hashes
        from hashlib import sha256  # type: ignore[assignment,unused-ignore]

TYPE_CHECKING = False  # the hook's start-up: typing is not imported at run time
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping, Sequence
    from typing import Any

MAX_IMAGE_BYTES = 64 << 20
# linux/capability.h, in bit order
_CAP_NAMES = (
    "CAP_CHOWN CAP_DAC_OVERRIDE CAP_DAC_READ_SEARCH CAP_FOWNER CAP_FSETID CAP_KILL CAP_SETGID CAP_SETUID "
    "CAP_SETPCAP CAP_LINUX_IMMUTABLE CAP_NET_BIND_SERVICE CAP_NET_BROADCAST CAP_NET_ADMIN CAP_NET_RAW "
    "CAP_IPC_LOCK CAP_IPC_OWNER CAP_SYS_MODULE CAP_SYS_RAWIO CAP_SYS_CHROOT CAP_SYS_PTRACE CAP_SYS_PACCT "
    "CAP_SYS_ADMIN CAP_SYS_BOOT CAP_SYS_NICE CAP_SYS_RESOURCE CAP_SYS_TIME CAP_SYS_TTY_CONFIG CAP_MKNOD "
    "CAP_LEASE CAP_AUDIT_WRITE CAP_AUDIT_CONTROL CAP_SETFCAP CAP_MAC_OVERRIDE CAP_MAC_ADMIN CAP_SYSLOG "
    "CAP_WAKE_ALARM CAP_BLOCK_SUSPEND CAP_AUDIT_READ CAP_PERFMON CAP_BPF CAP_CHECKPOINT_RESTORE"
)
CAPABILITIES = tuple(_CAP_NAMES.split())
_CAP_BIT = {name: i for i, name in enumerate(CAPABILITIES)}
CAP_SETGID, CAP_SETUID = 1 << _CAP_BIT["CAP_SETGID"], 1 << _CAP_BIT["CAP_SETUID"]
MS_RDONLY = 1
# mnt.proto `fstype`: what runc itself mounts in a container; anything else (AUTO = any kernel
# filesystem by name, e.g. a block device's ext4) must be one of the bundle's own (external) mounts.
_FSTYPES_RUNC_MAKES = {
    1: "proc",
    2: "sysfs",
    5: "tmpfs",
    6: "devpts",
    12: "cgroup",
    14: "mqueue",
    17: "overlay",
    23: "cgroup2",
}
_NS_FIELDS = (
    "pid_ns_id",
    "net_ns_id",
    "ipc_ns_id",
    "uts_ns_id",
    "mnt_ns_id",
    "user_ns_id",
    "cgroup_ns_id",
    "time_ns_id",
)
SECCOMP_RET_ACTION_FULL = 0xFFFF0000
SECCOMP_RET_ALLOW = 0x7FFF0000
_BPF_RET = 0x06
_HINT = (
    "the snapshot's CRIU images ask for more than the new container's spec grants (edited images, or a pod "
    "spec with fewer privileges than the snapshotted one); restore it with the original pod's security "
    "context, or take a new snapshot"
)


class ImageGrantsMore(PermissionDenied):
    """The staged CRIU images grant more than the container's bundle."""


class BundleGrant:
    """What config.json lets the container's processes have (bundle_grant). A plain class: the hook
    imports no dataclasses (shim/runtime_wrapper.py, "what it imports at start")."""

    __slots__ = (
        "ambient",
        "apparmor",
        "bounding",
        "effective",
        "gids",
        "inheritable",
        "masked",
        "mounts",
        "no_new_privs",
        "permitted",
        "readonly",
        "seccomp",
        "selinux",
        "uid",
        "user_namespace",
    )

    def __init__(
        self,
        *,
        uid: int | None,  # None: any (a bound known before the container exists: shim/engine/precheck.py)
        gids: frozenset[int] | None,  # the primary gid and additionalGids; None: any
        bounding: int,
        effective: int,
        permitted: int,
        inheritable: int,
        ambient: int,
        seccomp: bool,
        no_new_privs: bool,
        apparmor: str,
        selinux: str,
        user_namespace: bool,
        mounts: Mapping[str, Mapping[str, Any]] | None,  # destination -> the bundle's mount; None: unknown
        masked: frozenset[str],
        readonly: frozenset[str],
    ) -> None:
        self.uid = uid
        self.gids = gids
        self.bounding = bounding
        self.effective = effective
        self.permitted = permitted
        self.inheritable = inheritable
        self.ambient = ambient
        self.seccomp = seccomp
        self.no_new_privs = no_new_privs
        self.apparmor = apparmor
        self.selinux = selinux
        self.user_namespace = user_namespace
        self.mounts = mounts
        self.masked = masked
        self.readonly = readonly


def cap_mask(names: Iterable[Any]) -> int:
    out = 0
    for n in names or ():
        bit = _CAP_BIT.get(str(n).upper())
        if bit is not None:
            out |= 1 << bit
    return out


def _norm(path: str) -> str:
    return posixpath.normpath("/" + str(path).lstrip(".").lstrip("/"))


# --- where runc really puts a mount -----------------------------------------------------------------
# runc resolves each mount destination inside the container's root filesystem before mounting there
# (filepath-securejoin): symlinks are followed as if the rootfs were `/` (an absolute link starts again at
# the rootfs, `..` stops at it), through the mounts made before it; a component that does not exist is
# taken as written (runc creates it). A Debian image's /var/run is a symlink to /run, so the
# service-account token the spec mounts at /var/run/secrets/... is at /run/secrets/... in the kernel's
# mount table, which is what CRIU's images record. Masked and read-only paths are applied after
# pivot_root, where the kernel resolves them the same way.

MAX_SYMLINKS = 255  # what filepath-securejoin follows before giving up (runc then fails the create)


def resolve_in_root(rootfs: str, path: str, binds: Sequence[tuple[str, str | None]] = ()) -> str | None:
    """`path` resolved inside `rootfs` the way runc resolves a mount destination; None where it would fail
    (too many links). `binds`: (resolved destination, host source) of the mounts made before it,
    whose contents replace the rootfs's below their destination (source None: not a bind)."""
    resolved: list[str] = []
    pending = [c for c in reversed(path.split("/")) if c and c != "."]
    links = 0
    while pending:
        part = pending.pop()
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = "/" + "/".join([*resolved, part])
        host = _host_path(rootfs, candidate, binds)
        try:
            st = os.lstat(host) if host is not None else None
        except OSError:
            st = None
        if host is None or st is None or not stat.S_ISLNK(st.st_mode):  # missing: runc creates it, as written
            resolved.append(part)
            continue
        links += 1
        if links > MAX_SYMLINKS:
            return None
        try:
            target = os.readlink(host)
        except OSError:
            return None
        if target.startswith("/"):
            resolved = []
        pending.extend(c for c in reversed(target.split("/")) if c and c != ".")
    return "/" + "/".join(resolved)


def _host_path(rootfs: str, point: str, binds: Sequence[tuple[str, str | None]]) -> str | None:
    """Where `point` of the container is on the host, given the mounts made so far (the innermost wins);
    None below a mount that is not a bind (tmpfs, proc: not what runc's resolution walks on the host)."""
    best = ""
    source: str | None = rootfs
    for dest, src in binds:
        if (point == dest or point.startswith(dest.rstrip("/") + "/")) and len(dest) >= len(best):
            best, source = dest, src
    if source is None:
        return None
    rest = point[len(best) :].lstrip("/") if best else point.lstrip("/")
    return os.path.join(source, rest) if rest else source


def resolved_mounts(spec: Mapping[str, Any], rootfs: str | None) -> dict[str, Mapping[str, Any]]:
    """The bundle's mounts by where runc puts them (the destination as written where `rootfs` is None)."""
    out: dict[str, Mapping[str, Any]] = {}
    binds: list[tuple[str, str | None]] = []
    for m in spec.get("mounts") or ():
        dest = m.get("destination")
        if not dest:
            continue
        where = resolve_in_root(rootfs, str(dest), binds) if rootfs else None
        point = where or _norm(str(dest))
        out[point] = m
        if rootfs:
            binds.append((point, _bind_source(m)))
    return out


def _bind_source(m: Mapping[str, Any]) -> str | None:
    bind = m.get("type") == "bind" or any(o in ("bind", "rbind") for o in m.get("options") or ())
    return str(m["source"]) if bind and m.get("source") else None


def _resolved_paths(
    paths: Iterable[Any], rootfs: str | None, mounts: Mapping[str, Mapping[str, Any]]
) -> frozenset[str]:
    binds = [(d, _bind_source(m)) for d, m in mounts.items()]
    out = set()
    for p in paths:
        where = resolve_in_root(rootfs, str(p), binds) if rootfs else None
        out.add(where or _norm(str(p)))
    return frozenset(out)


def bundle_grant(spec: Mapping[str, Any], rootfs: str | None = None) -> BundleGrant:
    """What `spec` grants; `rootfs` (the bundle's root filesystem, as runc will see it) resolves mount
    destinations, masked and read-only paths where runc and the kernel will really put them."""
    process = spec.get("process") or {}
    user = process.get("user") or {}
    caps = process.get("capabilities") or {}
    linux = spec.get("linux") or {}
    gid = int(user.get("gid") or 0)
    mounts = resolved_mounts(spec, rootfs)
    return BundleGrant(
        uid=int(user.get("uid") or 0),
        gids=frozenset([gid, *(int(g) for g in user.get("additionalGids") or ())]),
        bounding=cap_mask(caps.get("bounding") or ()),
        effective=cap_mask(caps.get("effective") or ()),
        permitted=cap_mask(caps.get("permitted") or ()),
        inheritable=cap_mask(caps.get("inheritable") or ()),
        ambient=cap_mask(caps.get("ambient") or ()),
        seccomp=bool(linux.get("seccomp")),
        no_new_privs=bool(process.get("noNewPrivileges")),
        apparmor=str(process.get("apparmorProfile") or ""),
        selinux=str(process.get("selinuxLabel") or ""),
        user_namespace=any(ns.get("type") == "user" for ns in linux.get("namespaces") or ()),
        mounts=mounts,
        masked=_resolved_paths(linux.get("maskedPaths") or (), rootfs, mounts),
        readonly=_resolved_paths(linux.get("readonlyPaths") or (), rootfs, mounts),
    )


def _caps(words: Sequence[int] | None) -> int:
    out = 0
    for i, w in enumerate(words or ()):
        out |= (int(w) & 0xFFFFFFFF) << (32 * i)
    return out


_WORST_FIRST = ("CAP_SYS_ADMIN", "CAP_SYS_MODULE", "CAP_SYS_PTRACE", "CAP_SYS_RAWIO", "CAP_NET_ADMIN", "CAP_BPF")


def _names(mask: int) -> str:
    """`CAP_SYS_ADMIN,CAP_SYS_PTRACE,... (0x...)`: the most dangerous named first."""
    bits = [i for i in range(mask.bit_length()) if mask >> i & 1]
    names = [CAPABILITIES[i] if i < len(CAPABILITIES) else f"cap#{i}" for i in bits]
    names.sort(key=lambda n: (_WORST_FIRST.index(n) if n in _WORST_FIRST else len(_WORST_FIRST), n))
    shown = ",".join(names[:6]) + (f",+{len(names) - 6} more" if len(names) > 6 else "")
    return f"{shown} (0x{mask:x})"


# --- the decisions, over decoded image entries (pure; unit-tested with edited images) ------------


def creds_problems(
    where: str, creds: Mapping[str, Any] | None, grant: BundleGrant, *, lsms: frozenset[str]
) -> list[str]:
    if not creds:
        return [f"{where}: no credentials in the image"]
    out: list[str] = []
    root_setuid = grant.uid == 0 and grant.permitted & CAP_SETUID
    root_setgid = grant.uid == 0 and grant.permitted & CAP_SETGID
    if not root_setuid and grant.uid is not None:
        uids = {k: creds.get(k) for k in ("uid", "euid", "suid", "fsuid")}
        bad = {k: v for k, v in uids.items() if v != grant.uid}
        if bad:
            out.append(f"{where}: uids {bad} but the container runs as uid {grant.uid}")
    if not root_setgid and grant.gids is not None:
        gids = {k: creds.get(k) for k in ("gid", "egid", "sgid", "fsgid")}
        bad = {k: v for k, v in gids.items() if v not in grant.gids}
        if bad:
            out.append(f"{where}: gids {bad} outside the container's groups {sorted(grant.gids)}")
        extra = sorted(set(int(g) for g in creds.get("groups") or ()) - grant.gids)
        if extra:
            out.append(f"{where}: supplementary groups {extra} outside the container's groups {sorted(grant.gids)}")
    limits = {
        "cap_eff": ("effective", grant.permitted | grant.effective),
        "cap_prm": ("permitted", grant.permitted),
        "cap_inh": ("inheritable", grant.inheritable | grant.permitted),
        "cap_amb": ("ambient", grant.ambient | grant.permitted),
        "cap_bnd": ("bounding", grant.bounding),
    }
    for key, (label, allowed) in limits.items():
        extra_caps = _caps(creds.get(key)) & ~allowed
        if extra_caps:
            out.append(f"{where}: {label} capabilities {_names(extra_caps)} beyond the container's")
    if grant.no_new_privs and not creds.get("no_new_privs"):
        out.append(f"{where}: no_new_privs is off but the container sets noNewPrivileges")
    if creds.get("apparmor_data"):
        out.append(f"{where}: carries an AppArmor policy to load into the kernel")
    label = str(creds.get("lsm_profile") or "")
    want = grant.apparmor if "apparmor" in lsms else grant.selinux if "selinux" in lsms else ""
    have = label.split(" (", 1)[0] if "apparmor" in lsms else label
    if label and want and have != want:
        out.append(f"{where}: LSM label {label!r}, the container's is {want!r}")
    elif label and not want and lsms & {"apparmor", "selinux"} and have not in ("unconfined", ""):
        out.append(f"{where}: LSM label {label!r} but the container sets none")
    elif want and not label and lsms & {"apparmor", "selinux"}:
        out.append(f"{where}: no LSM label, the container's is {want!r}")
    return out


def _allow_all(filter_b64: Any) -> bool:
    """True when a classic-BPF program can only ever return SECCOMP_RET_ALLOW."""
    try:
        prog = base64.b64decode(filter_b64) if isinstance(filter_b64, str) else bytes(filter_b64)
    except (ValueError, TypeError):
        return False
    rets = []
    for i in range(0, len(prog) - len(prog) % 8, 8):
        code, _jt, _jf, k = struct.unpack_from("<HBBI", prog, i)
        if code & 0x07 == _BPF_RET:
            if code & 0x18 != 0x00:  # RET A / RET X: computed, not provably allow
                return False
            rets.append(k & SECCOMP_RET_ACTION_FULL)
    return bool(rets) and all(r == SECCOMP_RET_ALLOW for r in rets)


def filter_chain(index: Any, filters: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]] | None:
    """The filters a thread gets back, oldest first, as CRIU 4.x restores them (criu/seccomp.c): the
    thread's ``seccomp_filter`` is a 0-based index into seccomp.img's list and names the chain's oldest
    filter; each filter's ``prev``, present only where the chain goes on, names the next newer one.
    None where CRIU itself would refuse the chain (an index out of range, a loop)."""
    if not isinstance(index, int) or isinstance(index, bool):
        return None
    chain: list[Mapping[str, Any]] = []
    seen: set[int] = set()
    while True:
        if not 0 <= index < len(filters) or index in seen:
            return None
        seen.add(index)
        f = filters[index]
        chain.append(f)
        nxt = f.get("prev")
        if nxt is None:
            return chain
        if not isinstance(nxt, int) or isinstance(nxt, bool):
            return None
        index = nxt


SECCOMP_FILTER_FLAG_TSYNC = 1


def synced_to_threads(leader_core: Mapping[str, Any], filters: Sequence[Mapping[str, Any]]) -> bool:
    """True when the leader's filters come back with SECCOMP_FILTER_FLAG_TSYNC: CRIU writes the other
    threads of a process whose threads all hold the leader's filters as "disabled" and restores the
    leader's chain with TSYNC, which gives every thread of the process the leader's filters
    (criu/seccomp.c, try_use_tsync). Only the newest filter's flag matters to the kernel: it syncs the
    whole chain."""
    tc = leader_core.get("thread_core") or {}
    if tc.get("seccomp_mode") not in ("filter", 2):
        return False
    chain = filter_chain(tc.get("seccomp_filter"), filters)
    return chain is not None and bool(int(chain[-1].get("flags") or 0) & SECCOMP_FILTER_FLAG_TSYNC)


def seccomp_problems(
    where: str,
    thread_core: Mapping[str, Any],
    filters: Sequence[Mapping[str, Any]],
    grant: BundleGrant,
    *,
    synced: bool = False,
) -> list[str]:
    """`synced`: a thread other than the leader, whose leader's filters are restored with TSYNC."""
    if not grant.seccomp:
        return []
    mode = thread_core.get("seccomp_mode") or "disabled"
    if mode in ("disabled", 0):
        if synced:
            return []  # the leader's filters reach this thread (its own are checked with the leader)
        return [f"{where}: no seccomp filter, but the container has a seccomp profile"]
    if mode in ("strict", 1):
        return []  # strict mode allows less than any profile
    chain = filter_chain(thread_core.get("seccomp_filter"), filters)
    if chain is None:
        return [f"{where}: seccomp filter mode without a valid filter chain in the image"]
    if all(_allow_all(f.get("filter")) for f in chain):
        return [f"{where}: its seccomp filter allows every system call, the container's profile does not"]
    return []


def namespace_problems(tasks: Mapping[int, Mapping[str, Any]], root_ids: Mapping[str, Any] | None) -> list[str]:
    out = []
    for pid, ids in sorted(tasks.items()):
        ref = root_ids or {}
        diff = [f[: -len("_ns_id")] for f in _NS_FIELDS if f in ids and f in ref and ids[f] != ref[f]]
        if diff:
            out.append(f"task {pid}: in {', '.join(diff)} namespace(s) other than the container's own")
    return out


def mount_problems(mounts: Sequence[Mapping[str, Any]], grant: BundleGrant) -> list[str]:
    out = []
    bundle_mounts = grant.mounts or {}
    cgroup_roots = [d for d, m in bundle_mounts.items() if m.get("type") in ("cgroup", "cgroup2")]
    allowed = {"/", *bundle_mounts, *grant.masked, *grant.readonly}
    for m in mounts:
        point = _norm(str(m.get("mountpoint", "")))
        external = bool(m.get("ext_mount") or m.get("ext_key"))
        below_cgroup = any(point.startswith(r.rstrip("/") + "/") for r in cgroup_roots)
        if point not in allowed and not below_cgroup:
            out.append(f"mount at {point}: the container's spec mounts nothing there")
            continue
        fstype = m.get("fstype")
        if not external and fstype not in _FSTYPES_RUNC_MAKES and point != "/":
            name = m.get("fsname") or f"fstype {fstype}"
            out.append(f"mount at {point}: {name} filesystem, which runc does not create for a container")
        bundle_mount = bundle_mounts.get(point) or {}
        # runc leaves the tmpfs that holds cgroup v1 hierarchies writable (the hierarchies are ro)
        wants_ro = point in grant.readonly or (
            "ro" in (bundle_mount.get("options") or ()) and bundle_mount.get("type") not in ("cgroup", "cgroup2")
        )
        if wants_ro and not (int(m.get("flags") or 0) | int(m.get("sb_flags") or 0)) & MS_RDONLY:
            out.append(f"mount at {point}: read-write, the container's spec mounts it read-only")
    return out


def unmasked_problems(points: Iterable[str], grant: BundleGrant, present: Callable[[str], bool]) -> list[str]:
    """Masked and read-only paths of the bundle that the images leave without their mount. runc masks a
    path with /dev/null or an empty read-only tmpfs and makes a read-only path a read-only bind of itself;
    CRIU mounts only what its images list, so an image without one of those mounts restores the container
    with /proc/kcore readable or /proc/sys writable. runc skips a path the kernel does not have
    (`present`: the path exists on this node, whose kernel the restored container's /proc and /sys show)."""
    have = set(points)
    out = []
    for path, what in [
        *((p, "masks it") for p in sorted(grant.masked)),
        *((p, "mounts it read-only") for p in sorted(grant.readonly)),
    ]:
        if path not in have and present(path):
            out.append(f"{path}: the container's spec {what}, the images leave it without that mount")
    return out


# --- reading the images --------------------------------------------------------------------------


def _read_image(path: str) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise ImageGrantsMore(f"cannot open CRIU image {os.path.basename(path)}: {e.strerror}", hint=_HINT) from e
    with os.fdopen(fd, "rb") as f:
        if os.fstat(f.fileno()).st_size > MAX_IMAGE_BYTES:
            raise ImageGrantsMore(f"CRIU image {os.path.basename(path)} is too large", hint=_HINT)
        return f.read(MAX_IMAGE_BYTES + 1)


def _decode(images: Any, data: bytes, name: str) -> list[dict[str, Any]]:
    try:
        entries = images.load(io.BytesIO(data))["entries"]
    except Exception as e:  # pycriu raises many kinds on bad input
        raise ImageGrantsMore(f"cannot decode CRIU image {name}: {type(e).__name__}: {e}", hint=_HINT) from e
    if not isinstance(entries, list):
        raise ImageGrantsMore(f"CRIU image {name} has no entries", hint=_HINT)
    return entries


def load_image(images: Any, path: str) -> list[dict[str, Any]]:
    return _decode(images, _read_image(path), os.path.basename(path))


# --- the decode cache ----------------------------------------------------------------------------
# Importing pycriu (its protobuf modules) is most of what the check costs the wrapper on every restore
# create. The agent has pycriu loaded when it stages a restore, so it decodes the images the wrapper will
# read and keeps each one's entries under the SHA-256 of the image's bytes, in a directory of its own
# state dir (root's, never inside a staged tree a snapshot's layer is extracted into). The wrapper reads
# the bytes, hashes them and takes the entries kept for exactly those bytes; any image the cache does not
# hold (or holds unreadably) is decoded with pycriu as before. So what the check sees is pycriu's
# decoding of the bytes it is about to restore, whoever decoded them: the cache is trusted for who
# writes it (the agent, root) and bound to content, so a stale entry can only ever answer for the same
# bytes. Entries unused for CACHE_MAX_AGE_S are pruned when the agent stages.

CACHED_IMAGES = ("pstree.img", "seccomp.img", "inventory.img", "files.img", "core-*.img", "mountpoints-*.img")
CACHE_MAX_AGE_S = 24 * 3600
PRUNE_EVERY_S = 600.0
_pruned_at: dict[str, float] = {}  # cache dir -> when this process last pruned it (time.monotonic)
_CACHE_SUFFIX = ".json"


class ImageReader:
    """Decoded CRIU images: from the agent's decode cache (`cache_dir`) for bytes it has decoded, else
    with pycriu (imported on the first image the cache lacks)."""

    def __init__(self, cache_dir: str | None = None) -> None:
        self.cache_dir = cache_dir
        self.decoded_here = 0  # images this reader had to decode itself (tests, the bench's breakdown)

    def load(self, path: str) -> list[dict[str, Any]]:
        data = _read_image(path)
        if self.cache_dir:
            entries = _cached(self.cache_dir, sha256(data).hexdigest())
            if entries is not None:
                return entries
        self.decoded_here += 1
        return _decode(pycriu_images(), data, os.path.basename(path))


def _cached(cache_dir: str, digest: str) -> list[dict[str, Any]] | None:
    try:
        fd = os.open(os.path.join(cache_dir, digest + _CACHE_SUFFIX), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            entries = json.loads(f.read(MAX_IMAGE_BYTES))
    except (OSError, ValueError):
        return None
    return entries if isinstance(entries, list) else None


def cache_decoded(image_dir: str, cache_dir: str) -> int:
    """Decode the images of `image_dir` that the check reads into `cache_dir` (the agent, when staging).
    Best effort: an image that cannot be decoded is left to the wrapper, which refuses it. Returns how
    many entries were written."""
    images = pycriu_images()
    os.makedirs(cache_dir, mode=0o700, exist_ok=True)
    _prune(cache_dir)
    written = 0
    for pattern in CACHED_IMAGES:
        for path in sorted(glob.glob(os.path.join(glob.escape(image_dir), pattern))):
            try:
                data = _read_image(path)
                target = os.path.join(cache_dir, sha256(data).hexdigest() + _CACHE_SUFFIX)
                if os.path.exists(target):
                    os.utime(target)
                    continue
                entries = _decode(images, data, os.path.basename(path))
                text = json.dumps(entries, separators=(",", ":"))
                if json.loads(text) != entries:  # only what JSON carries exactly
                    continue
            except (ImageGrantsMore, OSError, TypeError, ValueError):
                continue
            tmp = f"{target}.{os.urandom(6).hex()}.tmp"  # restores staged at once may decode the same image
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), "w") as f:
                f.write(text)
            os.replace(tmp, target)
            written += 1
    return written


def _prune(cache_dir: str) -> None:
    """Remove entries unused for CACHE_MAX_AGE_S: at most once per PRUNE_EVERY_S per dir in this process
    (a stat of every entry, on a restore's way to its containers, is not worth doing on every stage)."""
    now = time.monotonic()
    last = _pruned_at.get(cache_dir)
    if last is not None and now - last < PRUNE_EVERY_S:
        return
    _pruned_at[cache_dir] = now
    cutoff = time.time() - CACHE_MAX_AGE_S
    with os.scandir(cache_dir) as it:
        for e in it:
            with contextlib.suppress(OSError):
                if e.stat(follow_symlinks=False).st_mtime < cutoff:
                    os.unlink(e.path)


def host_lsms() -> frozenset[str]:
    """The major LSMs active on this host (what CRIU would apply a label for)."""
    try:
        with open("/sys/kernel/security/lsm") as f:
            active = set(f.read().strip().split(","))
    except OSError:
        active = set()
        try:
            with open("/sys/module/apparmor/parameters/enabled") as f:
                if f.read().strip() == "Y":
                    active.add("apparmor")
        except OSError:
            pass
        if os.path.exists("/sys/fs/selinux/enforce"):
            active.add("selinux")
    return frozenset(active & {"apparmor", "selinux"})


# Where the wrapper (run by containerd as `python3 -I -S`, no site-packages) finds pycriu and protobuf
# when they are not on its own path: an explicit directory, else Debian's python3-pycriu.
PYCRIU_PATH_ENV = "KUBECTL_SNAPSHOT_PYCRIU_PATH"
_PYCRIU_FALLBACK = "/usr/lib/python3/dist-packages"


def pycriu_images() -> Any:
    """pycriu.images, imported only on restore (ordinary creates never load it); fails closed."""
    try:
        import pycriu.images as images

        return images
    except ImportError:
        pass
    for extra in (os.environ.get(PYCRIU_PATH_ENV), _PYCRIU_FALLBACK):
        if extra and os.path.isdir(os.path.join(extra, "pycriu")) and extra not in sys.path:
            sys.path.append(extra)  # appended: nothing already importable is shadowed
            try:
                import pycriu.images as images

                return images
            except ImportError:
                continue
    raise ImageGrantsMore(
        "cannot check the snapshot's CRIU images: pycriu (and protobuf) cannot be imported",
        hint=f"install python3-pycriu on the node, or set {PYCRIU_PATH_ENV} to a directory holding pycriu "
        "and google/protobuf; a restore is never run unchecked",
    )


TASK_DEAD = 2  # CRIU's task_state of a zombie (criu/include/pstree.h; core.proto tc.task_state)


def _is_zombie(core: Mapping[str, Any]) -> bool:
    return int((core.get("tc") or {}).get("task_state") or 0) == TASK_DEAD


def image_problems(
    image_dir: str,
    spec: Mapping[str, Any],
    *,
    lsms: frozenset[str] | None = None,
    reader: ImageReader | None = None,
    rootfs: str | None = None,
    present: Callable[[str], bool] | None = None,
    grant: BundleGrant | None = None,
) -> list[str]:
    """Everything in the CRIU images of `image_dir` that grants more than the bundle `spec`, whose root
    filesystem is `rootfs` (None: destinations taken as written). `present`: whether a masked or
    read-only path exists for the restored container (default: on this node). `grant`: what to check
    against instead of `spec`'s (a bound known before the bundle exists; its mounts None: not checked)."""
    load = (reader or ImageReader()).load
    grant = bundle_grant(spec, rootfs) if grant is None else grant
    lsms = host_lsms() if lsms is None else lsms
    problems: list[str] = []
    pstree = load(os.path.join(image_dir, "pstree.img"))
    if not pstree:
        return ["pstree.img lists no process"]
    filters: list[Mapping[str, Any]] = []
    seccomp_img = os.path.join(image_dir, "seccomp.img")
    if os.path.lexists(seccomp_img):
        for e in load(seccomp_img):
            filters.extend(e.get("seccomp_filters") or ())
    task_ids: dict[int, Mapping[str, Any]] = {}
    for entry in pstree:
        pid = int(entry.get("pid") or 0)
        leader = load(os.path.join(image_dir, f"core-{pid}.img"))
        threads = entry.get("threads") or [pid]
        if leader and _is_zombie(leader[0]):
            # CRIU writes no thread ids for a zombie (its pstree entry holds whatever was in memory) and
            # restores it as a child of its parent that exits at once with the saved code: it runs with
            # the parent's credentials, which are checked. A zombie core holding credentials anyway is
            # checked like a live one.
            threads = [pid]
            if not leader[0].get("thread_core"):
                continue
        synced = bool(leader) and synced_to_threads(leader[0], filters)
        for tid in threads:
            where = f"process {pid}" + (f" thread {tid}" if tid != pid else "")
            core = leader if tid == pid else load(os.path.join(image_dir, f"core-{int(tid)}.img"))
            if not core:
                problems.append(f"{where}: empty core image")
                continue
            tc = core[0].get("thread_core") or {}
            problems += creds_problems(where, tc.get("creds"), grant, lsms=lsms)
            problems += seccomp_problems(where, tc, filters, grant, synced=synced and tid != pid)
            if tid == pid:
                task_ids[pid] = core[0].get("ids") or {}
    inventory = os.path.join(image_dir, "inventory.img")
    root_ids = None
    if os.path.lexists(inventory):
        inv = load(inventory)
        root_ids = (inv[0].get("root_ids") if inv else None) or None
    if root_ids is None and pstree:
        root_ids = task_ids.get(int(pstree[0].get("pid") or 0))
    problems += namespace_problems(task_ids, root_ids)
    if not grant.user_namespace and glob.glob(os.path.join(glob.escape(image_dir), "userns-*.img")):
        problems.append("the images hold a user namespace (uid maps); the container's spec creates none")
    if grant.mounts is None:
        return problems
    points: set[str] = set()
    mount_images = sorted(glob.glob(os.path.join(glob.escape(image_dir), "mountpoints-*.img")))
    for path in mount_images:
        mounts = load(path)
        problems += mount_problems(mounts, grant)
        points.update(_norm(str(m.get("mountpoint", ""))) for m in mounts)
    if mount_images:  # a container's images always hold its mount namespace
        problems += unmasked_problems(points, grant, present or os.path.exists)
    return problems


def check_images(
    image_dir: str,
    spec: Mapping[str, Any],
    *,
    lsms: frozenset[str] | None = None,
    reader: ImageReader | None = None,
    rootfs: str | None = None,
) -> None:
    """Raise ImageGrantsMore listing (the first few of) what the images grant beyond the bundle."""
    problems = image_problems(image_dir, spec, lsms=lsms, reader=reader, rootfs=rootfs)
    if problems:
        raise refusal(problems)


def refusal(problems: Sequence[str]) -> ImageGrantsMore:
    """The error a restore is refused with (the first few problems named)."""
    shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
    return ImageGrantsMore(
        f"refusing to restore: the CRIU images grant more than the container's spec: {shown}", hint=_HINT
    )
