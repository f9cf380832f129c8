"""Work directories removed after the answer (shim/host/reaper.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from shim.host import reaper


def _tree(root: Path) -> Path:
    d = root / "123-abc"
    (d / "c" / "checkpoint").mkdir(parents=True)
    (d / "c" / "checkpoint" / "pages-1.img").write_bytes(b"x" * 65536)
    return d


def test_taken_away_at_once_removed_on_a_thread_then_told(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = _tree(tmp_path)
    go, told = threading.Event(), []
    rmtree = shutil.rmtree

    def held(path: str, ignore_errors: bool = False) -> None:
        go.wait(10)
        rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(shutil, "rmtree", held)
    reaper.remove_later(str(d), then=lambda: told.append(os.listdir(tmp_path)))
    assert os.listdir(tmp_path) == [reaper.PREFIX + "123-abc"]  # renamed before remove_later returned
    assert told == [] and not reaper.drain(0.05)  # still being removed
    go.set()
    assert reaper.drain(10)
    assert told == [[]] and os.listdir(tmp_path) == []  # `then` ran once the directory was gone


def test_a_missing_directory_is_only_told(tmp_path: Path) -> None:
    told: list[bool] = []
    reaper.remove_later(str(tmp_path / "gone"), then=lambda: told.append(True))
    assert told == [True] and reaper.drain(1)


def test_a_dot_name_in_the_way_still_removes_the_directory(tmp_path: Path) -> None:
    d = _tree(tmp_path)
    (tmp_path / (reaper.PREFIX + "123-abc")).mkdir()
    (tmp_path / (reaper.PREFIX + "123-abc") / "x").write_text("an earlier one's")
    reaper.remove_later(str(d))
    assert reaper.drain(10)
    assert os.listdir(tmp_path) == [reaper.PREFIX + "123-abc"]  # removed where it was; the other stays


def test_a_process_waits_for_its_removals_before_it_exits(tmp_path: Path) -> None:
    """A standalone command answers and exits; the dump it leaves to the thread is gone by then."""
    d = _tree(tmp_path)
    code = (
        "import shutil, sys, time\n"
        "from shim.host import reaper\n"
        "rmtree = shutil.rmtree\n"
        "def slow(p, ignore_errors=False):\n"
        "    time.sleep(0.5)\n"
        "    rmtree(p, ignore_errors=ignore_errors)\n"
        "reaper.shutil.rmtree = slow\n"
        f"reaper.remove_later({str(d)!r})\n"
        "print('answered', flush=True)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30,
                         cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    assert out.stdout == "answered\n"
    assert os.listdir(tmp_path) == []
