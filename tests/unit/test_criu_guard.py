"""The runtime wrapper's check of CRIU images against the new container's bundle (issue 10, item 2).

Images are written with pycriu from entries shaped like a real runc container dump (the mount list
is the one CRIU 4.2.1 wrote for a busybox container under runc on these machines; the integration
round trips in tests/integration/test_agent_roundtrip.py pass through the same check with real
images). Each test edits one field, as a tenant editing a snapshot would.

Non-root: on these VMs CRIU cannot dump a process running under another uid (PLATFORM.md: prlimit of
another uid's task needs CAP_SYS_RESOURCE, missing from the machine's bounding set), so every
non-root case below (runAsUser 1000, groups, dropped capabilities of a non-root user) is covered with
images edited here, not with a real dump.
"""

from __future__ import annotations

import base64
import copy
import struct
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pycriu")
import pycriu.images as images

from shim.criu import guard as criu_guard
from shim.criu.guard import ImageGrantsMore, check_images, image_problems

ALL = criu_guard.CAPABILITIES
DEFAULT_CAPS = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW", "CAP_SETGID",
    "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE", "CAP_SYS_CHROOT", "CAP_KILL",
    "CAP_AUDIT_WRITE",
]  # fmt: skip


def words(names: list[str]) -> list[int]:
    mask = 0
    for n in names:
        mask |= 1 << ALL.index(n)
    return [mask & 0xFFFFFFFF, mask >> 32]


def bpf(*insns: tuple[int, int]) -> str:
    return base64.b64encode(b"".join(struct.pack("<HBBI", code, 0, 0, k) for code, k in insns)).decode()


ALLOW_ALL = bpf((0x06, 0x7FFF0000))
# ld [nr]; jeq #165 (mount) -> kill, else allow: a (tiny) real profile
PROFILE = bpf((0x20, 0), (0x15, 165), (0x06, 0x7FFF0000), (0x06, 0x80000000))


def spec(**process: Any) -> dict[str, Any]:
    caps = process.pop("caps", DEFAULT_CAPS)
    base: dict[str, Any] = {
        "process": {
            "user": {"uid": 0, "gid": 0},
            "capabilities": {k: list(caps) for k in ("bounding", "effective", "permitted")},
            "noNewPrivileges": False,
        },
        "mounts": [
            {"destination": "/proc", "type": "proc", "options": ["nosuid"]},
            {"destination": "/dev", "type": "tmpfs"},
            {"destination": "/sys", "type": "sysfs", "options": ["ro"]},
            {"destination": "/sys/fs/cgroup", "type": "cgroup", "options": ["ro"]},
            {"destination": "/etc/hosts", "type": "bind", "source": "/var/lib/x/hosts", "options": ["rbind"]},
        ],
        "linux": {
            "namespaces": [{"type": "pid"}, {"type": "mount"}, {"type": "network", "path": "/proc/1/ns/net"}],
            "readonlyPaths": ["/proc/sys"],
            "maskedPaths": ["/proc/kcore"],
        },
    }
    base["process"].update(process)
    return base


def creds(uid: int = 0, gid: int = 0, caps: list[str] = DEFAULT_CAPS, **extra: Any) -> dict[str, Any]:
    c: dict[str, Any] = {
        **{k: uid for k in ("uid", "euid", "suid", "fsuid")},
        **{k: gid for k in ("gid", "egid", "sgid", "fsgid")},
        "cap_inh": [0, 0],
        "cap_prm": words(caps),
        "cap_eff": words(caps),
        "cap_bnd": words(caps),
        "secbits": 0,
    }
    c.update(extra)
    return c


IDS = {"vm_id": 1, "files_id": 1, "fs_id": 1, "sighand_id": 1, "pid_ns_id": 10, "net_ns_id": 11, "mnt_ns_id": 12}
MOUNTS = [
    {"mountpoint": "/", "fstype": 17, "flags": 0x200000},
    {"mountpoint": "/proc", "fstype": 1, "flags": 0x20000E},
    {"mountpoint": "/dev", "fstype": 5, "flags": 0x1000002},
    {"mountpoint": "/sys", "fstype": 2, "flags": 0x20000F},
    {"mountpoint": "/sys/fs/cgroup", "fstype": 5, "flags": 0x20000E},
    {"mountpoint": "/sys/fs/cgroup/memory", "fstype": 12, "flags": 0x20000F, "ext_key": "/sys/fs/cgroup/memory"},
    {"mountpoint": "/proc/sys", "fstype": 1, "flags": 0x20000F},
    {"mountpoint": "/proc/kcore", "fstype": 5, "flags": 0x1000002, "ext_key": "/dev/null"},
    {"mountpoint": "/etc/hosts", "fstype": 16, "fsname": "ext4", "flags": 0, "ext_key": "/etc/hosts"},
]


def write(path: Path, magic: str, entries: list[dict[str, Any]]) -> None:
    with open(path, "wb") as f:
        images.dump({"magic": magic, "entries": entries}, f)


def make_images(
    d: Path,
    *,
    creds_by_tid: dict[int, dict[str, Any]] | None = None,
    threads: dict[int, list[int]] | None = None,
    ids: dict[int, dict[str, int]] | None = None,
    seccomp: tuple[str, int] | None = ("filter", 0),
    filters: list[dict[str, Any]] | None = None,
    mounts: list[dict[str, Any]] | None = None,
) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    threads = threads or {1: [1]}
    pstree = [
        {"pid": pid, "ppid": 0 if pid == 1 else 1, "pgid": 1, "sid": 1, "threads": t} for pid, t in threads.items()
    ]
    write(d / "pstree.img", "PSTREE", pstree)
    for pid, tids in threads.items():
        for tid in tids:
            tc: dict[str, Any] = {"futex_rla": 0, "futex_rla_len": 0, "creds": (creds_by_tid or {}).get(tid, creds())}
            if seccomp is not None:
                tc["seccomp_mode"], tc["seccomp_filter"] = seccomp
            core: dict[str, Any] = {"mtype": "X86_64", "thread_core": tc}
            if tid == pid:
                core["tc"] = {
                    "task_state": 1,
                    "exit_code": 0,
                    "personality": 0,
                    "flags": 0,
                    "blk_sigset": 0,
                    "comm": "sh",
                }
                core["ids"] = (ids or {}).get(pid, IDS)
            write(d / f"core-{tid}.img", "CORE", [core])
    write(d / "inventory.img", "INVENTORY", [{"img_version": 2, "root_ids": IDS, "lsmtype": "NO_LSM"}])
    write(d / "seccomp.img", "SECCOMP", [{"seccomp_filters": filters or [{"filter": PROFILE}]}])
    full = []
    for i, m in enumerate(mounts if mounts is not None else MOUNTS):
        full.append(
            {"mnt_id": i + 1, "root_dev": "0:1", "parent_mnt_id": 0, "root": "/", "source": "x", "options": ""}
            | {"flags": 0}
            | m
        )
    write(d / "mountpoints-12.img", "MNTS", full)
    return d


SECCOMP_SPEC = {"defaultAction": "SCMP_ACT_ERRNO", "syscalls": []}


def bundle(**kw: Any) -> dict[str, Any]:
    s = spec(**kw)
    s["linux"]["seccomp"] = SECCOMP_SPEC
    return s


NO_LSM: frozenset[str] = frozenset()


def problems(d: Path, s: dict[str, Any], lsms: frozenset[str] = NO_LSM) -> list[str]:
    return image_problems(str(d), s, lsms=lsms)


def test_an_image_that_matches_its_bundle_passes(tmp_path: Path) -> None:
    d = make_images(tmp_path / "img")
    assert problems(d, bundle()) == []
    check_images(str(d), bundle(), lsms=NO_LSM)


def test_dropping_privileges_inside_the_container_is_fine(tmp_path: Path) -> None:
    """A root container whose worker switched to uid 33 and dropped capabilities (nginx-like)."""
    d = make_images(tmp_path / "img", threads={1: [1], 2: [2]}, creds_by_tid={2: creds(33, 33, caps=[])})
    assert problems(d, bundle()) == []


# --- uids and gids (non-root: edited images, see the module docstring) --------------------------


def test_root_in_the_image_for_a_non_root_bundle_is_refused(tmp_path: Path) -> None:
    d = make_images(tmp_path / "img", creds_by_tid={1: creds(0, 0, caps=[])})
    out = problems(d, bundle(user={"uid": 1000, "gid": 1000}, caps=[]))
    assert any("uids" in p and "uid 1000" in p for p in out), out
    assert any("gids" in p for p in out), out


def test_one_saved_uid_is_enough_to_refuse(tmp_path: Path) -> None:
    d = make_images(tmp_path / "img", creds_by_tid={1: creds(1000, 1000, caps=[], suid=0)})
    assert problems(d, bundle(user={"uid": 1000, "gid": 1000}, caps=[])) == [
        "process 1: uids {'suid': 0} but the container runs as uid 1000"
    ]


def test_supplementary_groups_outside_the_bundle_are_refused(tmp_path: Path) -> None:
    ok = make_images(tmp_path / "ok", creds_by_tid={1: creds(1000, 1000, caps=[], groups=[1000, 2000])})
    s = bundle(user={"uid": 1000, "gid": 1000, "additionalGids": [2000]}, caps=[])
    assert problems(ok, s) == []
    bad = make_images(tmp_path / "bad", creds_by_tid={1: creds(1000, 1000, caps=[], groups=[0, 6])})
    assert any("supplementary groups [0, 6]" in p for p in problems(bad, s))


def test_root_without_setuid_cannot_become_another_uid(tmp_path: Path) -> None:
    no_setuid = [c for c in DEFAULT_CAPS if c not in ("CAP_SETUID", "CAP_SETGID")]
    d = make_images(tmp_path / "img", creds_by_tid={1: creds(0, 0, caps=no_setuid, euid=5)})
    assert any("uids" in p for p in problems(d, bundle(caps=no_setuid)))


def test_a_thread_is_checked_too(tmp_path: Path) -> None:
    d = make_images(tmp_path / "img", threads={1: [1, 7]}, creds_by_tid={7: creds(caps=list(ALL))})
    out = problems(d, bundle())
    assert out and all(p.startswith("process 1 thread 7:") for p in out), out


def read(path: Path) -> list[dict[str, Any]]:
    with open(path, "rb") as f:
        entries: list[dict[str, Any]] = images.load(f)["entries"]
    return entries


def zombie(d: Path, pid: int, *, garbage_tid: int = 1721131888, with_creds: dict[str, Any] | None = None) -> None:
    """What CRIU 4.2.1 writes for a zombie child (checked against a real dump): a core with tc only
    (task_state 2), no thread_core, and a pstree entry whose thread id is uninitialised memory."""
    pstree = read(d / "pstree.img")
    pstree.append({"pid": pid, "ppid": 1, "pgid": 1, "sid": 1, "threads": [garbage_tid]})
    write(d / "pstree.img", "PSTREE", pstree)
    tc = {"task_state": 2, "exit_code": 0, "personality": 0, "flags": 0, "blk_sigset": 0, "comm": "cat"}
    core: dict[str, Any] = {"mtype": "X86_64", "tc": tc}
    if with_creds is not None:
        core["thread_core"] = {"futex_rla": 0, "futex_rla_len": 0, "creds": with_creds}
    write(d / f"core-{pid}.img", "CORE", [core])


def test_a_zombie_child_is_not_a_thread_id_lookup(tmp_path: Path) -> None:
    d = make_images(tmp_path / "img")
    zombie(d, 9)
    assert problems(d, bundle()) == []


def test_a_zombie_core_with_credentials_is_still_checked(tmp_path: Path) -> None:
    d = make_images(tmp_path / "img")
    zombie(d, 9, with_creds=creds(caps=list(ALL)))
    out = problems(d, bundle())
    assert out and all(p.startswith("process 9:") for p in out), out


def test_a_live_process_naming_a_missing_thread_is_refused(tmp_path: Path) -> None:
    d = make_images(tmp_path / "img")
    pstree = read(d / "pstree.img")
    pstree[0]["threads"] = [1, 1721131888]
    write(d / "pstree.img", "PSTREE", pstree)
    with pytest.raises(ImageGrantsMore, match=r"core-1721131888\.img"):
        problems(d, bundle())


# --- capabilities ------------------------------------------------------------------------------


SETS = [("cap_eff", "effective"), ("cap_prm", "permitted"), ("cap_bnd", "bounding"), ("cap_inh", "inheritable")]


@pytest.mark.parametrize(("field", "label"), [*SETS, ("cap_amb", "ambient")])
def test_each_capability_set_beyond_the_bundle_is_refused(tmp_path: Path, field: str, label: str) -> None:
    c = creds()
    c[field] = words([*DEFAULT_CAPS, "CAP_SYS_ADMIN"])
    d = make_images(tmp_path / "img", creds_by_tid={1: c})
    out = problems(d, bundle())
    assert any(f"{label} capabilities CAP_SYS_ADMIN (0x200000) beyond" in p for p in out), out


def test_the_issues_image_every_capability_from_an_all_dropped_pod(tmp_path: Path) -> None:
    """CapEff 000001fffeffffff restored into a pod that dropped ALL and ran RuntimeDefault seccomp."""
    every = [c for c in ALL if c != "CAP_SYS_RESOURCE"]  # 0x1fffeffffff
    c = creds(caps=every)
    d = make_images(tmp_path / "img", creds_by_tid={1: c}, seccomp=None)
    with pytest.raises(ImageGrantsMore) as e:
        check_images(str(d), bundle(caps=[]), lsms=NO_LSM)
    assert "CAP_SYS_ADMIN" in e.value.message and "no seccomp filter" in e.value.message
    assert e.value.hint


def test_unknown_capability_bits_are_refused(tmp_path: Path) -> None:
    c = creds()
    c["cap_bnd"] = [words(DEFAULT_CAPS)[0], 1 << 20]  # bit 52: no such capability yet
    d = make_images(tmp_path / "img", creds_by_tid={1: c})
    assert any("cap#52" in p for p in problems(d, bundle()))


# --- seccomp, no_new_privs, LSM ------------------------------------------------------------------


def test_no_seccomp_filter_where_the_bundle_has_one_is_refused(tmp_path: Path) -> None:
    d = make_images(tmp_path / "img", seccomp=("disabled", 0))
    assert problems(d, bundle()) == ["process 1: no seccomp filter, but the container has a seccomp profile"]
    assert problems(d, spec()) == []  # an unconfined bundle: nothing to compare


def test_an_allow_everything_filter_is_refused(tmp_path: Path) -> None:
    d = make_images(tmp_path / "img", filters=[{"filter": ALLOW_ALL}])
    assert any("allows every system call" in p for p in problems(d, bundle()))


def test_one_filter_at_index_0_is_what_criu_writes_and_passes(tmp_path: Path) -> None:
    """CRIU 4.x numbers seccomp.img's filters from 0: a RuntimeDefault process has one filter, index 0."""
    d = make_images(tmp_path / "img", seccomp=("filter", 0), filters=[{"filter": PROFILE}])
    assert problems(d, bundle()) == []


def test_a_chain_of_filters_is_followed_oldest_first(tmp_path: Path) -> None:
    """Two stacked filters (the runtime's profile, then one the application installed): the thread names
    the oldest (index 1 here), whose `prev` names the newer one (index 0), which has no `prev`."""
    chain: list[dict[str, Any]] = [{"filter": ALLOW_ALL}, {"filter": PROFILE, "prev": 0}]
    d = make_images(tmp_path / "img", seccomp=("filter", 1), filters=chain)
    assert problems(d, bundle()) == []
    allow = make_images(
        tmp_path / "allow", seccomp=("filter", 1), filters=[{"filter": ALLOW_ALL}, {"filter": ALLOW_ALL, "prev": 0}]
    )
    assert any("allows every system call" in p for p in problems(allow, bundle()))


def test_a_filter_index_pointing_nowhere_is_refused(tmp_path: Path) -> None:
    d = make_images(tmp_path / "img", seccomp=("filter", 9))
    assert any("without a valid filter chain" in p for p in problems(d, bundle()))
    past_end = make_images(tmp_path / "end", seccomp=("filter", 1), filters=[{"filter": PROFILE}])
    assert any("without a valid filter chain" in p for p in problems(past_end, bundle()))
    loop = make_images(
        tmp_path / "loop",
        seccomp=("filter", 0),
        filters=[{"filter": PROFILE, "prev": 1}, {"filter": PROFILE, "prev": 0}],
    )
    assert any("without a valid filter chain" in p for p in problems(loop, bundle()))
    dangling = make_images(tmp_path / "dangling", seccomp=("filter", 0), filters=[{"filter": PROFILE, "prev": 5}])
    assert any("without a valid filter chain" in p for p in problems(dangling, bundle()))


def test_no_new_privs_off_is_refused_where_the_bundle_sets_it(tmp_path: Path) -> None:
    d = make_images(tmp_path / "img")
    assert any("no_new_privs" in p for p in problems(d, bundle(noNewPrivileges=True)))
    on = make_images(tmp_path / "on", creds_by_tid={1: creds(no_new_privs=1)})
    assert problems(on, bundle(noNewPrivileges=True)) == []


def test_apparmor_label_and_policy_blob(tmp_path: Path) -> None:
    aa = frozenset({"apparmor"})
    s = bundle(apparmorProfile="cri-containerd.apparmor.d")
    ok = make_images(tmp_path / "ok", creds_by_tid={1: creds(lsm_profile="cri-containerd.apparmor.d (enforce)")})
    assert problems(ok, s, aa) == []
    other = make_images(tmp_path / "other", creds_by_tid={1: creds(lsm_profile="unconfined")})
    assert any("LSM label 'unconfined'" in p for p in problems(other, s, aa))
    none = make_images(tmp_path / "none")
    assert any("no LSM label" in p for p in problems(none, s, aa))
    blob = make_images(
        tmp_path / "blob", creds_by_tid={1: creds(apparmor_data=base64.b64encode(b"profile x {}").decode())}
    )
    assert any("AppArmor policy" in p for p in problems(blob, s, aa))


def test_selinux_label(tmp_path: Path) -> None:
    se = frozenset({"selinux"})
    s = bundle(selinuxLabel="system_u:system_r:container_t:s0:c1,c2")
    other = make_images(tmp_path / "img", creds_by_tid={1: creds(lsm_profile="system_u:system_r:spc_t:s0")})
    assert any("spc_t" in p for p in problems(other, s, se))


# --- namespaces and mounts -------------------------------------------------------------------------


def test_a_task_in_a_namespace_of_its_own_is_refused(tmp_path: Path) -> None:
    d = make_images(tmp_path / "img", threads={1: [1], 2: [2]}, ids={2: {**IDS, "net_ns_id": 99}})
    assert problems(d, bundle()) == ["task 2: in net namespace(s) other than the container's own"]


def test_a_user_namespace_image_is_refused_without_one_in_the_bundle(tmp_path: Path) -> None:
    d = make_images(tmp_path / "img")
    (d / "userns-13.img").write_bytes(b"")
    assert any("user namespace" in p for p in problems(d, bundle()))


@pytest.mark.parametrize(
    ("mount", "what"),
    [
        ({"mountpoint": "/host", "fstype": 16, "fsname": "ext4", "source": "/dev/sda1"}, "mounts nothing there"),
        ({"mountpoint": "/dev", "fstype": 16, "fsname": "ext4"}, "ext4 filesystem"),
        ({"mountpoint": "/proc", "fstype": 4}, "fstype 4"),
        ({"mountpoint": "/sys", "fstype": 2, "flags": 0x20000E}, "read-write"),
        ({"mountpoint": "/proc/sys", "fstype": 1, "flags": 0}, "read-write"),
    ],
    ids=["new-mountpoint", "block-fs-over-dev", "binfmt-misc", "rw-sys", "rw-readonly-path"],
)
def test_mounts_the_bundle_does_not_make_are_refused(tmp_path: Path, mount: dict[str, Any], what: str) -> None:
    mounts = [m for m in copy.deepcopy(MOUNTS) if m["mountpoint"] != mount["mountpoint"]] + [mount]
    d = make_images(tmp_path / "img", mounts=mounts)
    out = problems(d, bundle())
    assert any(what in p for p in out), out


def test_corrupt_images_are_refused_not_skipped(tmp_path: Path) -> None:
    d = make_images(tmp_path / "img")
    (d / "core-1.img").write_bytes(b"\x00" * 12)
    with pytest.raises(ImageGrantsMore, match="cannot decode"):
        check_images(str(d), bundle(), lsms=NO_LSM)
    (d / "core-1.img").unlink()
    (d / "core-1.img").symlink_to(d / "pstree.img")
    with pytest.raises(ImageGrantsMore, match="cannot open"):
        check_images(str(d), bundle(), lsms=NO_LSM)


# --- the decode cache (the agent decodes at staging, the wrapper reads by content hash) -------------


def _cached_reader(d: Path, cache: Path) -> criu_guard.ImageReader:
    assert criu_guard.cache_decoded(str(d), str(cache)) >= 5  # pstree, inventory, seccomp, core, mountpoints
    return criu_guard.ImageReader(str(cache))


def test_cached_images_are_read_without_decoding_and_judged_the_same(tmp_path: Path) -> None:
    d = make_images(tmp_path / "img", threads={1: [1], 2: [2]}, creds_by_tid={2: creds(33, 33, caps=[])})
    reader = _cached_reader(d, tmp_path / "cache")
    assert problems(d, bundle()) == image_problems(str(d), bundle(), lsms=NO_LSM, reader=reader) == []
    assert reader.decoded_here == 0
    nonroot = bundle(user={"uid": 1000, "gid": 1000}, caps=[])
    assert image_problems(str(d), nonroot, lsms=NO_LSM, reader=reader) == problems(d, nonroot) != []


def test_an_image_changed_after_caching_is_decoded_and_refused(tmp_path: Path) -> None:
    """Entries are bound to the bytes they were decoded from: an edited image (or a cache entry that does
    not belong to it) never answers for it."""
    d = make_images(tmp_path / "img")
    reader = _cached_reader(d, tmp_path / "cache")
    make_images(d, creds_by_tid={1: creds(caps=list(ALL))})  # core-1.img now asks for every capability
    out = image_problems(str(d), bundle(), lsms=NO_LSM, reader=reader)
    assert reader.decoded_here == 1
    assert any("CAP_SYS_ADMIN" in p for p in out), out


def test_a_damaged_cache_entry_falls_back_to_decoding(tmp_path: Path) -> None:
    d = make_images(tmp_path / "img", creds_by_tid={1: creds(caps=list(ALL))})
    cache = tmp_path / "cache"
    reader = _cached_reader(d, cache)
    for entry in cache.iterdir():
        entry.write_text("{not json")
    assert any("CAP_SYS_ADMIN" in p for p in image_problems(str(d), bundle(), lsms=NO_LSM, reader=reader))
    assert reader.decoded_here >= 5


def test_entries_unused_for_a_day_are_pruned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import time

    cache = tmp_path / "cache"
    cache.mkdir()
    old, fresh = cache / ("0" * 64 + ".json"), cache / ("1" * 64 + ".json")
    for f in (old, fresh):
        f.write_text("[]")
    day_ago = time.time() - criu_guard.CACHE_MAX_AGE_S - 60
    os.utime(old, (day_ago, day_ago))
    criu_guard.cache_decoded(str(make_images(tmp_path / "img")), str(cache))
    assert not old.exists() and fresh.exists()
    # at most once per PRUNE_EVERY_S: the next stage soon after leaves an expired entry to a later one
    os.utime(fresh, (day_ago, day_ago))
    criu_guard.cache_decoded(str(make_images(tmp_path / "img2")), str(cache))
    assert fresh.exists()
    monkeypatch.setattr(criu_guard, "PRUNE_EVERY_S", 0.0)
    criu_guard.cache_decoded(str(make_images(tmp_path / "img3")), str(cache))
    assert not fresh.exists()


# --- mount destinations where runc really puts them (issue 41) ----------------------------------------

SA_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount"


def debian_rootfs(root: Path) -> Path:
    """The part of a debootstrap bookworm rootfs that matters here: /var/run is a link to /run."""
    (root / "run").mkdir(parents=True)
    (root / "var").mkdir()
    (root / "var" / "run").symlink_to("/run")
    (root / "var" / "lock").symlink_to("../run/lock")
    (root / "etc").mkdir()
    return root


def with_token(s: dict[str, Any], dest: str = SA_TOKEN) -> dict[str, Any]:
    s["mounts"].append(
        {"destination": dest, "type": "bind", "source": "/var/lib/kubelet/pods/u/token", "options": ["rbind", "ro"]}
    )
    return s


def token_mounts(point: str, flags: int = 0x1) -> list[dict[str, Any]]:
    return [
        *copy.deepcopy(MOUNTS),
        {"mountpoint": point, "fstype": 16, "fsname": "tmpfs", "flags": flags, "ext_key": point},
    ]


def test_resolve_in_root_follows_links_inside_the_rootfs(tmp_path: Path) -> None:
    root = debian_rootfs(tmp_path / "rootfs")
    (root / "escape").symlink_to("../../../../etc")  # `..` stops at the rootfs, as in runc
    (root / "loop").symlink_to("loop")
    r = str(root)
    assert criu_guard.resolve_in_root(r, SA_TOKEN) == "/run/secrets/kubernetes.io/serviceaccount"
    assert criu_guard.resolve_in_root(r, "/var/lock/x") == "/run/lock/x"
    assert criu_guard.resolve_in_root(r, "/escape/passwd") == "/etc/passwd"
    assert criu_guard.resolve_in_root(r, "/a/../var/./run/../run/s") == "/run/s"
    assert criu_guard.resolve_in_root(r, "/missing/../var/run/x") == "/run/x"
    assert criu_guard.resolve_in_root(r, "/missing/deeper") == "/missing/deeper"
    assert criu_guard.resolve_in_root(r, "/loop/x") is None  # runc gives up too


def test_resolve_in_root_walks_through_earlier_bind_mounts(tmp_path: Path) -> None:
    """A volume mounted before a nested mount: runc resolves the nested destination inside the volume."""
    root = debian_rootfs(tmp_path / "rootfs")
    vol = tmp_path / "volume"
    (vol / "real").mkdir(parents=True)
    (vol / "data").symlink_to("real")  # as a configMap's ..data link
    binds = [("/etc/app", str(vol))]
    assert criu_guard.resolve_in_root(str(root), "/etc/app/data/x", binds) == "/etc/app/real/x"
    assert criu_guard.resolve_in_root(str(root), "/etc/app/data/x", [("/etc/app", None)]) == "/etc/app/data/x"


def test_a_token_under_a_var_run_link_restores_where_runc_mounts_it(tmp_path: Path) -> None:
    """The legitimate case: a Debian image's pod with the service-account token (issue 41, pod 2)."""
    root = debian_rootfs(tmp_path / "rootfs")
    d = make_images(tmp_path / "img", mounts=token_mounts("/run/secrets/kubernetes.io/serviceaccount"))
    assert image_problems(str(d), with_token(bundle()), lsms=NO_LSM, rootfs=str(root)) == []
    # without the rootfs the spec's text is all there is, and the two do not meet
    assert any("mounts nothing there" in p for p in problems(d, with_token(bundle())))


def test_a_mount_elsewhere_than_the_resolved_destination_is_refused(tmp_path: Path) -> None:
    """The edited counterpart: the image puts the token mount where the spec's path does not resolve."""
    root = debian_rootfs(tmp_path / "rootfs")
    (root / "var" / "run").unlink()
    (root / "var" / "run").mkdir()  # an image whose /var/run is a directory: runc mounts at /var/run/...
    d = make_images(tmp_path / "img", mounts=token_mounts("/run/secrets/kubernetes.io/serviceaccount"))
    out = image_problems(str(d), with_token(bundle()), lsms=NO_LSM, rootfs=str(root))
    assert out == ["mount at /run/secrets/kubernetes.io/serviceaccount: the container's spec mounts nothing there"]


def test_read_only_is_checked_at_the_resolved_destination(tmp_path: Path) -> None:
    root = debian_rootfs(tmp_path / "rootfs")
    d = make_images(tmp_path / "img", mounts=token_mounts("/run/secrets/kubernetes.io/serviceaccount", flags=0))
    out = image_problems(str(d), with_token(bundle()), lsms=NO_LSM, rootfs=str(root))
    assert out == [
        "mount at /run/secrets/kubernetes.io/serviceaccount: read-write, the container's spec mounts it read-only"
    ]


def test_masked_and_read_only_paths_resolve_like_mounts(tmp_path: Path) -> None:
    root = debian_rootfs(tmp_path / "rootfs")
    s = bundle()
    s["linux"]["readonlyPaths"].append("/var/run/ro")
    s["linux"]["maskedPaths"].append("/var/run/masked")
    mounts = [
        *copy.deepcopy(MOUNTS),
        {"mountpoint": "/run/ro", "fstype": 5, "flags": 0x1},
        {"mountpoint": "/run/masked", "fstype": 5, "flags": 0x1},
    ]
    d = make_images(tmp_path / "img", mounts=mounts)
    assert image_problems(str(d), s, lsms=NO_LSM, rootfs=str(root)) == []
    mounts[-2]["flags"] = 0
    d2 = make_images(tmp_path / "rw", mounts=mounts)
    assert image_problems(str(d2), s, lsms=NO_LSM, rootfs=str(root)) == [
        "mount at /run/ro: read-write, the container's spec mounts it read-only"
    ]


@pytest.mark.parametrize(
    ("dropped", "what"),
    [
        ("/proc/kcore", "/proc/kcore: the container's spec masks it"),
        ("/proc/sys", "/proc/sys: the container's spec mounts it read-only"),
    ],
    ids=["unmasked-kcore", "writable-proc-sys"],
)
def test_images_without_a_mask_or_read_only_mount_are_refused(tmp_path: Path, dropped: str, what: str) -> None:
    """The legitimate dump has both (test_an_image_that_matches_its_bundle_passes); the edited one drops
    one, and CRIU would restore the container without it."""
    everything = lambda _path: True  # noqa: E731
    assert image_problems(str(make_images(tmp_path / "ok")), bundle(), lsms=NO_LSM, present=everything) == []
    mounts = [m for m in copy.deepcopy(MOUNTS) if m["mountpoint"] != dropped]
    d = make_images(tmp_path / "img", mounts=mounts)
    out = image_problems(str(d), bundle(), lsms=NO_LSM, present=everything)
    assert out == [f"{what}, the images leave it without that mount"]


def test_a_masked_path_this_kernel_does_not_have_is_not_asked_for(tmp_path: Path) -> None:
    """runc skips a masked path the kernel lacks (/proc/acpi without ACPI): no mount, nothing refused."""
    mounts = [m for m in copy.deepcopy(MOUNTS) if m["mountpoint"] != "/proc/kcore"]
    d = make_images(tmp_path / "img", mounts=mounts)
    assert image_problems(str(d), bundle(), lsms=NO_LSM, present=lambda p: p != "/proc/kcore") == []
