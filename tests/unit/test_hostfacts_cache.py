"""hostfacts.gather_cached: a warm agent asks `criu --version` and `runc --version` once, and again as
soon as either binary is another file, the TTL has passed, or one was missing."""

from __future__ import annotations

import os
from pathlib import Path

from shim.host import facts as hostfacts
from shim.host.facts import HostProbe


def _tool(path: Path, banner: str, calls: Path) -> None:
    path.write_text(f"#!/bin/sh\necho {path.name} >> {calls}\necho '{banner}'\n")
    path.chmod(0o755)


def _probe(tmp_path: Path) -> tuple[HostProbe, Path]:
    calls = tmp_path / "calls"
    _tool(tmp_path / "criu", "Version: 4.2.1", calls)
    _tool(tmp_path / "runc", "runc version 1.1.15", calls)
    return HostProbe(criu=str(tmp_path / "criu"), runc=str(tmp_path / "runc")), calls


def _runs(calls: Path) -> int:
    return len(calls.read_text().split()) if calls.exists() else 0


def test_asked_once_while_the_tools_are_the_same_files(tmp_path: Path) -> None:
    probe, calls = _probe(tmp_path)
    now = [1000.0]
    first = hostfacts.gather_cached("v2", probe, clock=lambda: now[0])
    assert (first.criu_version, first.runc_version) == ("4.2.1", "1.1.15")
    assert _runs(calls) == 2
    now[0] += 30
    assert hostfacts.gather_cached("v2", probe, clock=lambda: now[0]) == first
    assert _runs(calls) == 2
    assert hostfacts.gather_cached("v3", probe, clock=lambda: now[0]).containerd_version == "v3"  # another key
    assert _runs(calls) == 4


def test_a_replaced_tool_is_asked_again_at_once(tmp_path: Path) -> None:
    probe, calls = _probe(tmp_path)
    hostfacts.gather_cached("", probe)
    new = tmp_path / "runc.new"
    _tool(new, "runc version 1.2.0", calls)
    os.replace(new, tmp_path / "runc")  # what an upgrade does: another inode at the same path
    assert hostfacts.gather_cached("", probe).runc_version == "1.2.0"
    assert _runs(calls) == 4


def test_the_ttl_bounds_how_long_an_answer_is_kept(tmp_path: Path) -> None:
    probe, calls = _probe(tmp_path)
    now = [50.0]
    hostfacts.gather_cached("", probe, clock=lambda: now[0])
    now[0] += hostfacts.FACTS_TTL_S + 1
    hostfacts.gather_cached("", probe, clock=lambda: now[0])
    assert _runs(calls) == 4


def test_a_missing_tool_is_never_remembered(tmp_path: Path) -> None:
    probe, calls = _probe(tmp_path)
    (tmp_path / "runc").unlink()
    assert hostfacts.gather_cached("", probe).runc_version == ""
    _tool(tmp_path / "runc", "runc version 1.1.15", calls)  # installed afterwards: seen on the next ask
    assert hostfacts.gather_cached("", probe).runc_version == "1.1.15"
