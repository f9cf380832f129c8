"""bench/autosave_cost.py end to end at a tiny size, on real containerd, runc, CRIU and a registry: the bench
runs, its chain is incremental, its page diff sees what the workload wrote, every ratio is measured.
(Its own containerd and registry; it writes /etc/criu/runc.conf like the other integration tests, so
run it under the e2e lock on a shared machine.)"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.containerd import missing_requirements

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parent.parent.parent


def test_autosave_bench_at_32_mib_with_two_saves(tmp_path: Path) -> None:
    why = missing_requirements()
    if why:
        pytest.skip(why)
    out = tmp_path / "result.json"
    cmd = [sys.executable, "-m", "bench.autosave_cost", "--size", "32", "--saves", "2", "--pod-mib", "32",
           "--pod-runs", "1", "-o", "json", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert json.loads(out.read_text())["summary"] == result["summary"]

    saves = result["steady"]["saves"]
    assert len(saves) == 3 and result["sealed"]
    base, later = saves[0], saves[1:]
    assert base["uploaded"] >= 32 << 20  # the chain's first save sends the (incompressible) heap
    for s in later:
        assert s["frozen_by"] == "cgroup freezer"
        # the chain is incremental: far less than the base is sent, and only chunks the registry lacked
        assert 0 < s["uploaded"] < 0.3 * base["uploaded"], s
        assert 0 < s["new_chunks"] < s["chunks_total"], s
        # the page diff sees at least what the workload wrote (1% of 32 MiB), and not the whole heap
        assert s["written_bytes"] <= s["changed_bytes"] < 0.3 * (32 << 20), s
        assert s["cpu_s"] > 0 and s["freeze_s"] > 0

    summary = result["summary"]
    for key in ("freeze_vs_raw_dump", "uploaded_vs_changed", "chunks_uploaded_vs_changed", "cpu_vs_raw_dump_cpu",
                "pod_full_vs_serial_bound", "pod_incremental_vs_serial_bound"):  # fmt: skip
        assert isinstance(summary[key], float) and math.isfinite(summary[key]) and summary[key] > 0, key
    assert summary["upload_goal_met"] in (True, False) and summary["upload_goal_judged_saves"] == 2
    # each CPU ratio is against CRIU's own dump: the agent's save includes a CRIU dump, so it costs more
    assert summary["cpu_vs_raw_dump_cpu"] > 1
