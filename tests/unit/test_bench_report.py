"""bench/report.py's session-12 tables: where a served checkpoint's time goes, CRIU log lines as code."""

from __future__ import annotations

from bench import report


def test_log_lines_stay_one_code_span() -> None:
    assert report._code("pie: 1: `- returned 70451200") == "``pie: 1: `- returned 70451200``"
    assert report._code("\tRPC  ") == "``RPC``"


def test_checkpoint_parts_split_the_wall_time() -> None:
    parts = {"wall_ms": 545.0, "total_ms": 503.0, "preflight_ms": 13.0, "freeze_ms": 164.0, "criu_ms": 156.0,
             "package_ms": 273.0, "upload_ms": 46.0, "sign_ms": 28.0}  # fmt: skip
    ag = {"checkpoint_breakdown": parts}
    raw = {"dump_s": 0.053, "zstd_s": 0.172, "sha_s": 0.031, "upload_s": 0.039}
    cells = report._checkpoint_parts({}, {}, ag, raw)
    assert cells[:3] == ["545 ms", "42 ms", "503 ms"]
    assert cells[8] == "28 ms"
    assert cells[9].count("ms") == 4
    assert report._checkpoint_parts({}, {}, {}, raw)[1] == "-"  # no breakdown: nothing made up
