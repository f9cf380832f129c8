"""shim/host/safefs: nothing below a tenant-writable directory is reached through a link.

Each refusal is checked with openat2 (RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS) and with the O_NOFOLLOW
component walk that replaces it on kernels without openat2.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from shim.host import safefs
from shim.host.safefs import UnsafePath

MODES = [pytest.param(False, id="nofollow-walk"), pytest.param(True, id="openat2")]


@pytest.fixture(params=MODES)
def use_openat2(request: pytest.FixtureRequest) -> bool:
    if request.param and not safefs.openat2_available():
        pytest.skip("openat2 is not available on this kernel")
    return bool(request.param)


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """root/vol is the tenant's volume; secret is a host file outside it."""
    vol = tmp_path / "root" / "vol"
    (vol / "sub").mkdir(parents=True)
    secret = tmp_path / "secret"
    secret.write_text("host data\n")
    yield tmp_path / "root", secret


def test_openat2_is_there_on_this_kernel() -> None:
    # The project's machines run Linux 6.x on x86_64: the fast path must be the one used.
    assert safefs.openat2_available()


@pytest.mark.parametrize("rel", ["/etc", "../x", "a/../../x", "a\x00b"])
def test_names_that_leave_the_root_are_refused(rel: str) -> None:
    with pytest.raises(UnsafePath):
        safefs.split_relative(rel)


def test_opens_plain_directories(tree: tuple[Path, Path], use_openat2: bool) -> None:
    root, _ = tree
    fd = safefs.open_dir(str(root), "vol/sub", use_openat2=use_openat2)
    try:
        assert os.path.samestat(os.fstat(fd), os.stat(root / "vol" / "sub"))
    finally:
        os.close(fd)


def test_symlinked_directory_is_refused(tree: tuple[Path, Path], use_openat2: bool) -> None:
    root, secret = tree
    (root / "vol" / "up").symlink_to(secret.parent)
    with pytest.raises(UnsafePath, match="symlink"):
        safefs.open_dir(str(root), "vol/up", use_openat2=use_openat2)
    with pytest.raises(UnsafePath, match="symlink"):
        safefs.open_dir(str(root), "vol/up/root", use_openat2=use_openat2)


def test_the_volume_itself_being_a_link_is_refused(tree: tuple[Path, Path], use_openat2: bool) -> None:
    root, secret = tree
    (root / "vol2").symlink_to(secret.parent)
    with pytest.raises(UnsafePath):
        safefs.open_dir(str(root), "vol2", use_openat2=use_openat2)


def test_relative_link_inside_the_root_is_refused_too(tree: tuple[Path, Path], use_openat2: bool) -> None:
    root, _ = tree
    (root / "vol" / "alias").symlink_to("sub")
    with pytest.raises(UnsafePath):
        safefs.open_dir(str(root), "vol/alias", use_openat2=use_openat2)


def test_file_below_a_non_directory_is_refused(tree: tuple[Path, Path], use_openat2: bool) -> None:
    root, _ = tree
    (root / "vol" / "f").write_text("x")
    with pytest.raises(UnsafePath, match="not a directory"):
        safefs.open_dir(str(root), "vol/f/x", use_openat2=use_openat2)


def test_read_file_refuses_links_and_non_regular_files(tree: tuple[Path, Path], use_openat2: bool) -> None:
    root, secret = tree
    vol = root / "vol"
    (vol / "ok").write_text("fine")
    (vol / "link").symlink_to(secret)
    os.mkfifo(vol / "fifo")
    with safefs.opened_dir(str(root), "vol", use_openat2=use_openat2) as fd:
        assert safefs.read_file(fd, "ok") == b"fine"
        with pytest.raises(UnsafePath):
            safefs.read_file(fd, "link")
        with pytest.raises(UnsafePath, match="not a regular file"):
            safefs.read_file(fd, "fifo")


def test_write_file_replaces_a_planted_link_and_leaves_its_target_alone(
    tree: tuple[Path, Path], use_openat2: bool
) -> None:
    """The attack of issue 10: symlinks at the gate file's name (and at the old fixed temp name)."""
    root, secret = tree
    vol = root / "vol"
    (vol / "failed").symlink_to(secret)
    (vol / ".failed.tmp").symlink_to(secret)
    with safefs.opened_dir(str(root), "vol", use_openat2=use_openat2) as fd:
        safefs.write_file(fd, "failed", b"registry said: tenant text\n")
    assert secret.read_text() == "host data\n"
    assert not (vol / "failed").is_symlink()
    assert (vol / "failed").read_text() == "registry said: tenant text\n"
    assert oct((vol / "failed").stat().st_mode & 0o777) == oct(0o644)
    assert sorted(p.name for p in vol.iterdir()) == [".failed.tmp", "failed", "sub"]  # no temp file left


def test_write_file_refuses_a_directory_in_the_way(tree: tuple[Path, Path]) -> None:
    root, _ = tree
    (root / "vol" / "staged").mkdir()
    with safefs.opened_dir(str(root), "vol") as fd, pytest.raises(UnsafePath, match="directory"):
        safefs.write_file(fd, "staged", b"x")
    assert [p.name for p in (root / "vol").iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize("name", ["a/b", "..", "", "."])
def test_write_file_takes_plain_names_only(tree: tuple[Path, Path], name: str) -> None:
    root, _ = tree
    with safefs.opened_dir(str(root), "vol") as fd, pytest.raises(UnsafePath):
        safefs.write_file(fd, name, b"x")


def test_a_unix_socket_appears_at_its_path_only_once_it_listens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Who waits for the path to exist (a freeze guard's client) must never meet a socket that is bound
    but not yet listening (ECONNREFUSED): the name appears by rename, after listen."""
    import socket
    import stat

    path = tmp_path / "guard.sock"
    path.write_text("stale")  # a dead server's leftover is replaced
    seen: list[bool] = []
    real_rename = os.rename

    def rename(src: str, dst: str) -> None:
        assert dst == str(path) and path.read_text() == "stale"  # not there before the rename
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.connect(src)  # already listening under the temporary name
            seen.append(True)
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with safefs.listen_unix(str(path), 4) as srv:
        assert seen == [True]
        assert stat.S_ISSOCK(path.lstat().st_mode) and oct(path.lstat().st_mode & 0o777) == "0o700"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["guard.sock"]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.connect(str(path))
            srv.accept()[0].close()


def test_a_unix_socket_whose_temporary_name_would_be_too_long_is_bound_in_place(tmp_path: Path) -> None:
    long_dir = tmp_path / ("d" * max(1, safefs.SUN_PATH_MAX - len(str(tmp_path)) - 9))
    long_dir.mkdir()
    path = long_dir / "g.sock"
    assert len(str(path)) <= safefs.SUN_PATH_MAX < len(str(path)) + len(".new")
    with safefs.listen_unix(str(path), 4):
        assert sorted(p.name for p in long_dir.iterdir()) == ["g.sock"]
