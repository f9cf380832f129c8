"""The agent's scratch is root's alone (threat D8): dirs 0700, files 0600, runc and CRIU under umask 077.

Each test runs under umask 0 (the widest a process may have): what is private here is private because the
code asked for it, not because of the umask the agent happened to start with. The walk over a real dump's
directory is tests/integration/test_agent_roundtrip.py::test_a_dumps_scratch_is_private_and_removed_after.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from shim.containerd.runc_checkpoint import RuncCheckpointer
from shim.host import private


@pytest.fixture(autouse=True)
def wide_umask() -> Iterator[None]:
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_every_directory_made_for_a_dump_is_0700_the_intermediate_ones_too(tmp_path: Path) -> None:
    work = tmp_path / "state" / "work" / "1-abc" / "app" / "checkpoint"
    private.makedirs(str(work))
    for d in (tmp_path / "state", tmp_path / "state" / "work", tmp_path / "state" / "work" / "1-abc", work):
        assert _mode(d) == 0o700, (d, oct(_mode(d)))
    private.makedirs(str(work))  # again: nothing to do, no error
    os.makedirs(tmp_path / "plain" / "x", mode=0o700)  # what the code used before: the parent is 0777 & ~umask
    assert _mode(tmp_path / "plain") & 0o077


def test_files_are_created_0600_an_old_one_made_private_and_a_planted_link_refused(tmp_path: Path) -> None:
    with private.create(str(tmp_path / "spec.dump")) as f:
        f.write("{}")
    with private.create_binary(str(tmp_path / "rootfs-diff.tar")) as b:
        b.write(b"\0")
    assert _mode(tmp_path / "spec.dump") == 0o600 and _mode(tmp_path / "rootfs-diff.tar") == 0o600
    old = tmp_path / "old"
    old.write_text("x")
    old.chmod(0o644)
    with private.create(str(old)) as f:
        f.write("y")
    assert _mode(old) == 0o600 and old.read_text() == "y"
    target = tmp_path / "host-file"
    target.write_text("keep")
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(OSError):
        private.create(str(tmp_path / "link"))
    assert target.read_text() == "keep"


def test_runc_and_what_it_runs_get_umask_077(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """runc checkpoint, its CRIU and CRIU's tar write under the umask runc is started with."""
    monkeypatch.setattr(RuncCheckpointer, "host_prefix", lambda self: [])
    rc, _ = RuncCheckpointer("criu").run(["sh", "-c", f"umask > {tmp_path / 'umask'}; : > {tmp_path / 'made'}"], 10)
    assert rc == 0
    assert (tmp_path / "umask").read_text().strip() == "0077"
    assert _mode(tmp_path / "made") == 0o600


def test_a_dump_containerd_wrote_is_tightened_without_following_links(tmp_path: Path) -> None:
    dump = tmp_path / "work" / "app"
    (dump / "checkpoint").mkdir(parents=True, mode=0o755)
    (dump / "checkpoint" / "pages-1.img").write_bytes(b"\0")
    (dump / "checkpoint" / "pages-1.img").chmod(0o644)
    (dump / "stats-dump").write_bytes(b"\0")
    (dump / "stats-dump").chmod(0o664)
    outside = tmp_path / "outside"
    outside.write_text("x")
    outside.chmod(0o644)
    (dump / "link").symlink_to(outside)
    private.tighten(str(dump))
    assert _mode(dump / "checkpoint") == 0o700
    assert _mode(dump / "checkpoint" / "pages-1.img") == 0o600 and _mode(dump / "stats-dump") == 0o600
    assert _mode(outside) == 0o644  # a link is never followed


def test_install_makes_the_state_dir_and_what_is_directly_in_it_0700(tmp_path: Path) -> None:
    """An older agent left staged/ and restored/ 0755: below a 0700 directory nothing is in others' reach."""
    state = tmp_path / "state"
    (state / "staged" / "pod-gates").mkdir(parents=True, mode=0o755)
    state.chmod(0o755)
    (state / "restored").mkdir(mode=0o755)
    (state / "restored" / "abc").write_text("/staged/by-id/abc")
    (state / "escape").symlink_to(tmp_path)
    tmp_path.chmod(0o755)
    private.restrict_top(str(state))
    assert _mode(state) == _mode(state / "staged") == _mode(state / "restored") == 0o700
    assert _mode(tmp_path) == 0o755  # a link in the state dir is not followed
