"""summarize_checkpoint against images written by the real criu dump of a real process tree."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from kubectl_snapshot.core.errors import FailedPrecondition
from shim.criu.images import summarize_checkpoint
from tests.support.criu_dump import TOUCHED_BYTES, Dumped, criu_dumped

needs_pycriu = pytest.mark.skipif(
    importlib.util.find_spec("pycriu") is None,
    reason="pycriu missing (hack/install-node-deps.sh, then hack/setup-venv.sh)",
)


def test_missing_pycriu_is_a_precondition_with_a_hint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "pycriu", None)
    monkeypatch.setitem(sys.modules, "pycriu.images", None)
    with pytest.raises(FailedPrecondition, match="pycriu") as exc:
        summarize_checkpoint(str(tmp_path))
    assert exc.value.hint and "install-node-deps" in exc.value.hint


@needs_pycriu
def test_summary_of_a_real_dump(criu_dumped: Dumped) -> None:
    s = summarize_checkpoint(str(criu_dumped.images_dir))
    assert s.process_count == 2
    by_comm = {p.comm: p for p in s.processes}
    assert set(by_comm) == {"snap-parent", "snap-child"}
    parent, child = by_comm["snap-parent"], by_comm["snap-child"]
    assert parent.pid == criu_dumped.pid and parent.ppid == 0 and parent.sid == parent.pid
    assert child.ppid == parent.pid and child.sid == parent.pid
    assert parent.threads == 2 and child.threads == 1
    # the buffer is dumped for the parent and (copy-on-write shared) for the child
    assert s.memory_bytes >= 2 * TOUCHED_BYTES
    assert s.pages_written * s.page_size == s.memory_bytes == s.pages_file_bytes
    assert s.vma_bytes >= s.memory_bytes
    assert s.frozen_time_us and s.memdump_time_us and s.memwrite_time_us and s.freezing_time_us is not None
    assert s.criu_version is not None and s.criu_version.split(".")[0] >= "4"
    assert s.img_version == 2
    assert s.warnings == []
    d = json.loads(json.dumps(s.to_dict()))
    assert d["processes"][0]["comm"] == s.processes[0].comm and d["process_count"] == 2


@needs_pycriu
def test_archive_layout_finds_stats_at_the_root(criu_dumped: Dumped, tmp_path: Path) -> None:
    """containerd/CRI-O archives: checkpoint/ holds the images, stats-dump and dump.log sit beside it."""
    root = tmp_path / "archive"
    ckpt = root / "checkpoint"
    shutil.copytree(criu_dumped.images_dir, ckpt)
    (ckpt / "stats-dump").rename(root / "stats-dump")
    (ckpt / "dump.log").rename(root / "dump.log")
    s = summarize_checkpoint(str(ckpt))
    assert s.frozen_time_us and s.criu_version
    os.remove(root / "stats-dump")
    s2 = summarize_checkpoint(str(ckpt))
    assert s2.frozen_time_us is None and s2.pages_written * s2.page_size == s2.memory_bytes


@needs_pycriu
def test_incomplete_or_corrupt_checkpoints_are_typed_errors(criu_dumped: Dumped, tmp_path: Path) -> None:
    d = tmp_path / "copy"
    shutil.copytree(criu_dumped.images_dir, d)
    pages = sorted(d.glob("pages-*.img"))
    with open(pages[0], "r+b") as f:
        f.truncate(4096)
    s = summarize_checkpoint(str(d))
    assert any("truncated" in w for w in s.warnings)
    for p in pages:
        p.unlink()
    with pytest.raises(FailedPrecondition, match=r"missing pages-\d+\.img"):
        summarize_checkpoint(str(d))

    core = d / f"core-{criu_dumped.pid}.img"
    good = core.read_bytes()
    for cut, match in ((12, "incomplete"), (8, "incomplete"), (len(good) // 2, "cannot decode|incomplete")):
        core.write_bytes(good[:cut])
        with pytest.raises(FailedPrecondition, match=match):
            summarize_checkpoint(str(d))

    (d / "pstree.img").write_bytes(b"\x00" * 16)
    with pytest.raises(FailedPrecondition, match=r"pstree\.img"):
        summarize_checkpoint(str(d))

    (d / "pstree.img").unlink()
    (d / "pstree.img").symlink_to(criu_dumped.images_dir / "pstree.img")  # never followed
    with pytest.raises(FailedPrecondition, match=r"pstree\.img"):
        summarize_checkpoint(str(d))

    (d / "pstree.img").unlink()
    with pytest.raises(FailedPrecondition, match=r"missing pstree\.img"):
        summarize_checkpoint(str(d))
