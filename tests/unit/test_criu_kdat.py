"""The pure decisions of shim/criu/kdat.py: which file CRIU caches in, and whether a node needs our tmpfs.

The mounts themselves are exercised for real in tests/integration/test_criu_kdat.py."""

from __future__ import annotations

from pathlib import Path

from shim.criu import kdat as K

# /run a plain directory of the root file system (the project's VMs)
PLAIN = """\
22 1 254:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
23 22 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:2 - proc proc rw
24 22 0:5 / /dev rw,nosuid shared:3 - devtmpfs udev rw,size=10g
41 22 0:44 / /run/containerd/io.containerd.grpc.v1.cri/sandboxes/x/shm rw - tmpfs shm rw,size=65536k
"""
# systemd's /run (and a /run/user below it)
SYSTEMD = """\
22 1 254:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
25 22 0:25 / /run rw,nosuid,nodev shared:5 - tmpfs tmpfs rw,size=2g,mode=755
60 25 0:50 / /run/user/1000 rw,nosuid,nodev shared:30 - tmpfs tmpfs rw,size=1g,mode=700
"""
OURS = """\
69 22 0:41 / /run/kubectl-snapshot-kdat rw,nosuid,nodev,noexec - tmpfs kubectl-snapshot-kdat rw,size=256k
70 22 0:41 /criu.kdat /run/criu.kdat ro,relatime - tmpfs kubectl-snapshot-kdat rw,size=256k
"""


def test_mountinfo_is_parsed_with_escapes_and_optional_fields() -> None:
    text = "36 35 98:0 /mnt1 /mnt\\040two rw,noatime master:1 shared:7 - ext3 /dev/root rw,errors=continue\n"
    [m] = K.parse_mountinfo(text + "garbage line\n")
    assert m == K.Mount(mount_point="/mnt two", root="/mnt1", fstype="ext3", source="/dev/root")


def test_the_file_system_holding_run() -> None:
    plain, systemd = K.parse_mountinfo(PLAIN), K.parse_mountinfo(SYSTEMD)
    assert K.mount_of("/run", plain).mount_point == "/"  # type: ignore[union-attr]
    assert K.mount_of("/run", systemd).fstype == "tmpfs"  # type: ignore[union-attr]
    assert K.mount_of("/run/criu.kdat", systemd).mount_point == "/run"  # type: ignore[union-attr]
    assert K.mount_of("/runx", systemd).mount_point == "/"  # type: ignore[union-attr]  # not a prefix match
    assert K.mount_at("/run/criu.kdat", plain) is None


def test_a_systemd_node_needs_nothing_and_a_plain_run_gets_the_tmpfs() -> None:
    assert K.decide("/run/criu.kdat", K.parse_mountinfo(SYSTEMD)) == "native"
    assert K.decide("/run/criu.kdat", K.parse_mountinfo(PLAIN)) == "mount"
    # our own arrangement is renewed (the file bound on /run/criu.kdat is a tmpfs, /run itself is not)
    assert K.decide("/run/criu.kdat", K.parse_mountinfo(PLAIN + OURS)) == "mount"
    # someone else's mount on the cache file is left alone
    foreign = PLAIN + "71 22 0:60 /x /run/criu.kdat rw - tmpfs other rw\n"
    assert K.decide("/run/criu.kdat", K.parse_mountinfo(foreign)) == "foreign"
    assert K.cache_dir("/run/criu.kdat") == "/run/kubectl-snapshot-kdat"


def test_the_cache_path_is_read_off_the_criu_binary() -> None:
    assert K.kdat_path(b"\x7fELF...\x00/run/criu.kdat\x00/run/criu.kdat.tmp\x00") == "/run/criu.kdat"
    assert K.kdat_path(b"\x00/var/run/criu/criu.kdat\x00") == "/var/run/criu/criu.kdat"
    assert K.kdat_path(b"no such string") == K.KDAT_FILE


def test_the_installed_criu_caches_where_the_default_setting_says() -> None:
    """The setting's default is the path the CRIU this project installs (Debian's 4.2.1) compiles in."""
    from kubectl_snapshot.core.nodesettings import DEFAULTS

    criu = Path("/usr/sbin/criu")
    if criu.exists():
        assert K.kdat_path(criu.read_bytes()) == DEFAULTS.criu_kdat == K.KDAT_FILE
    assert DEFAULTS.criu_kdat == K.KDAT_FILE
