"""Writable-layer capture and apply against real overlayfs mounts (root), plus bad-input cases.

The round trip: changes made through an overlay's merged dir are captured from its upperdir, applied
onto a fresh overlay of the same lower dir, and the two merged trees must be identical.
"""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
from pathlib import Path

import pytest

from kubectl_snapshot.core.errors import FailedPrecondition, UnsafeArchive
from shim.files.rootfs_diff import apply_rootfs_diff, capture_rootfs_diff, upperdir_from_mounts
from tests.support.overlay import overlay_mount, require_overlay
from tests.support.tarcraft import craft_tar, dev, reg


def test_upperdir_from_mounts() -> None:
    overlay = (
        "overlay",
        "overlay",
        ["index=off", "workdir=/s/2/work", "upperdir=/s/2/fs", "lowerdir=/s/1/fs:/s/0/fs"],
    )
    assert upperdir_from_mounts([overlay]) == "/s/2/fs"
    assert upperdir_from_mounts([("format/mkdir/overlay", "overlay", ["upperdir=/u", "lowerdir=/l"])]) == "/u"
    assert upperdir_from_mounts([("bind", "/s/1/fs", ["rbind", "rw"])]) is None
    assert upperdir_from_mounts([("overlay", "overlay", ["lowerdir=/a:/b"])]) is None  # read-only view
    assert upperdir_from_mounts([]) is None


def tree(root: Path) -> dict[str, tuple[object, ...]]:
    out: dict[str, tuple[object, ...]] = {}
    inodes: dict[int, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in sorted(dirnames + filenames):
            p = Path(dirpath) / n
            st = p.lstat()
            rel = str(p.relative_to(root))
            item: tuple[object, ...] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)
            if stat.S_ISLNK(st.st_mode):
                item += (os.readlink(p),)
            elif stat.S_ISREG(st.st_mode):
                # hard-link groups: the first path seen with this inode
                item += (p.read_bytes(), int(st.st_mtime), st.st_nlink, inodes.setdefault(st.st_ino, rel))
            elif stat.S_ISDIR(st.st_mode):
                item += (int(st.st_mtime),)
            out[rel] = item
    return out


def build_lower(lower: Path) -> None:
    for d in ("etc", "usr/bin", "usr/lib", "var/cache/apt", "opt/dir/sub", "srv", "data", "home/u", "bin"):
        (lower / d).mkdir(parents=True)
    (lower / "etc/hosts").write_text("127.0.0.1 localhost\n")
    (lower / "etc/passwd").write_text("root:x:0:0\n")
    (lower / "etc/keep").write_text("unchanged\n")
    (lower / "usr/bin/tool").write_bytes(b"\x7fELF" + os.urandom(4096))
    (lower / "usr/bin/tool").chmod(0o755)
    (lower / "usr/bin/other").write_text("other")
    (lower / "usr/lib/libx.so.1").write_text("lib")
    (lower / "usr/lib/libx.so").symlink_to("libx.so.1")
    (lower / "bin/sh").symlink_to("/usr/bin/tool")
    for i in range(20):
        (lower / f"var/cache/apt/pkg{i}").write_text(str(i))
    (lower / "opt/dir/sub/f").write_text("f")
    (lower / "srv/file").write_text("file")
    (lower / "data/a").write_text("renamed")
    (lower / "old-link").symlink_to("etc/keep")


def mutate(m: Path) -> None:
    """What a container does to its rootfs."""
    (m / "etc/hosts").write_text("127.0.0.1 localhost\n10.0.0.1 db\n")
    (m / "etc/passwd").unlink()
    (m / "usr/bin/tool").chmod(0o4755)
    (m / "bin/sh").unlink()
    (m / "bin/sh").symlink_to("/usr/bin/other")
    subprocess.run(["rm", "-rf", str(m / "var/cache")], check=True)
    (m / "var/cache").mkdir()  # opaque: the lower pkg* files must not come back
    (m / "var/cache/fresh").write_text("new")
    subprocess.run(["rm", "-rf", str(m / "opt/dir")], check=True)
    (m / "opt/dir").write_text("dir became a file")
    (m / "srv/file").unlink()
    (m / "srv/file").mkdir()
    (m / "srv/file/inside").write_text("file became a dir")
    (m / "data/a").rename(m / "data/b")
    (m / "home/u/notes").write_text("mine")
    os.chown(m / "home/u/notes", 1000, 1000)
    (m / "tmp").mkdir(mode=0o777)
    (m / "tmp").chmod(0o1777)
    (m / "a/b/c/d").mkdir(parents=True)
    (m / "a/b/c/d/deep").write_text("deep")
    (m / "a/b/c/d/link-to-deep").symlink_to("deep")
    (m / "new-file").write_text("x" * 100_000)
    os.link(m / "new-file", m / "new-hardlink")
    (m / "empty").touch()
    (m / "spaces and ünïcode").write_text("name")
    os.mkfifo(m / "pipe")
    (m / "old-link").unlink()


def test_round_trip_through_real_overlays(tmp_path: Path) -> None:
    require_overlay()
    lower = tmp_path / "lower"
    lower.mkdir()
    build_lower(lower)
    lower_before = tree(lower)
    with overlay_mount(lower, tmp_path / "src") as src:
        mutate(src.merged)
        os.sync()
        buf = io.BytesIO()
        deleted = capture_rootfs_diff(str(src.upper), buf)
        expected = tree(src.merged)

        # whiteouts: data/a (renamed), etc/passwd, old-link; opaque dirs: var/cache (rm -rf + mkdir) and
        # srv/file (a file replaced by a dir). bin/sh and opt/dir were recreated over their whiteouts
        # as non-directories, so they are plain tar members that replace the lower entry.
        assert deleted == ["/data/a", "/etc/passwd", "/old-link", "/srv/file", "/var/cache"]
        names = _tar_names(buf.getvalue())
        assert {"bin/sh", "opt/dir", "srv/file", "srv/file/inside", "pipe"} <= set(names)
        assert "var/cache/fresh" in names and "var/cache/apt" not in names
        assert "etc/keep" not in names and not any(n.startswith("usr/lib") for n in names)
        # deleted.files is JSON-serializable as-is (the archive member format)
        deleted = json.loads(json.dumps(deleted))

        with overlay_mount(lower, tmp_path / "dst") as dst:
            apply_rootfs_diff(str(dst.merged), io.BytesIO(buf.getvalue()), deleted)
            assert tree(dst.merged) == expected
            assert (dst.merged / "usr/bin/tool").stat().st_mode & stat.S_ISUID
            assert not (dst.merged / "var/cache/apt").exists()
            assert (dst.merged / "new-file").stat().st_ino == (dst.merged / "new-hardlink").stat().st_ino
    assert tree(lower) == lower_before  # the shared lower dir was never written


def _tar_names(data: bytes) -> list[str]:
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        return tf.getnames()


def test_redirected_dirs_are_refused_not_silently_lost(tmp_path: Path) -> None:
    require_overlay()
    lower = tmp_path / "lower"
    (lower / "d").mkdir(parents=True)
    (lower / "d/data").write_text("lives in the lower layer")
    with overlay_mount(lower, tmp_path / "o", extra_options="redirect_dir=on") as ov:
        (ov.merged / "d").rename(ov.merged / "moved")
        with pytest.raises(FailedPrecondition, match="redirect"):
            capture_rootfs_diff(str(ov.upper), io.BytesIO())


def test_bad_deleted_paths_are_refused_before_any_change(tmp_path: Path) -> None:
    rootfs, victim = tmp_path / "rootfs", tmp_path / "victim"
    rootfs.mkdir()
    victim.mkdir()
    (victim / "secret").write_text("keep")
    (rootfs / "file").write_text("keep too")
    for deleted in (["/file", "/../victim/secret"], ["/file", "../../../../victim/secret"], ["/"], "/file", [1]):
        with pytest.raises(UnsafeArchive):
            apply_rootfs_diff(str(rootfs), io.BytesIO(craft_tar([])), deleted)  # type: ignore[arg-type]
        assert (rootfs / "file").read_text() == "keep too"
    assert (victim / "secret").read_text() == "keep"


def test_deletions_never_follow_symlinks_out_of_rootfs(tmp_path: Path) -> None:
    rootfs, victim = tmp_path / "rootfs", tmp_path / "victim"
    rootfs.mkdir()
    victim.mkdir()
    (victim / "secret").write_text("keep")
    (rootfs / "lnk").symlink_to(victim)  # absolute link, as container rootfs links are
    (rootfs / "lnk2").symlink_to(victim / "secret")
    apply_rootfs_diff(str(rootfs), io.BytesIO(craft_tar([])), ["/lnk/secret", "/lnk2", "/missing/x"])
    assert (victim / "secret").read_text() == "keep"
    assert (rootfs / "lnk").is_symlink() and not (rootfs / "lnk2").exists()


def test_diff_writes_never_go_through_rootfs_symlinks(tmp_path: Path) -> None:
    rootfs, victim = tmp_path / "rootfs", tmp_path / "victim"
    rootfs.mkdir()
    victim.mkdir()
    (victim / "secret").write_text("keep")
    (rootfs / "etc").symlink_to(victim)
    with pytest.raises(UnsafeArchive, match="symlink"):
        apply_rootfs_diff(str(rootfs), io.BytesIO(craft_tar([reg("etc/secret", b"pwn")])), [])
    assert (victim / "secret").read_text() == "keep"
    with pytest.raises(UnsafeArchive, match="device"):
        apply_rootfs_diff(str(rootfs), io.BytesIO(craft_tar([dev("dev/mem", major=1, minor=1)])), [])
    assert not (rootfs / "dev").exists() or not (rootfs / "dev/mem").exists()
