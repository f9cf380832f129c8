"""bench/autosave_report.py: the maths behind bench/autosave_cost.py's ratios and verdicts."""

from __future__ import annotations

from typing import Any

import pytest

from bench import autosave_report as R

MIB = 1 << 20


def test_changed_pages_counts_differing_and_new_pages_only() -> None:
    before = {("pagemap-1.img", 0x1000): b"a", ("pagemap-1.img", 0x2000): b"b", ("pagemap-1.img", 0x3000): b"c"}
    after = {
        ("pagemap-1.img", 0x1000): b"a",  # same
        ("pagemap-1.img", 0x2000): b"B",  # changed
        ("pagemap-1.img", 0x4000): b"d",  # new mapping
        ("pagemap-2.img", 0x1000): b"a",  # same address, another process: new
    }  # 0x3000 unmapped: nothing to upload for it
    assert R.changed_keys(before, after) == [
        ("pagemap-1.img", 0x2000),
        ("pagemap-1.img", 0x4000),
        ("pagemap-2.img", 0x1000),
    ]
    assert R.changed_keys(after, after) == []
    assert len(R.changed_keys({}, after)) == 4


def test_chunk_breakdown_shows_how_much_of_each_sent_chunk_had_changed() -> None:
    chunks = [
        {"file": "pages-1.img", "offset": 0, "length": 4 * R.PAGE, "digest": "sha256:a", "size": 100},
        {"file": "pages-1.img", "offset": 4 * R.PAGE, "length": 8 * R.PAGE, "digest": "sha256:b", "size": 200},
        {"file": "pages-1.img", "offset": 12 * R.PAGE, "length": 2 * R.PAGE, "digest": "sha256:c", "size": 300},
    ]
    changed_at = {("pages-1.img", 5 * R.PAGE), ("pages-1.img", 6 * R.PAGE), ("pages-2.img", 12 * R.PAGE)}
    assert R.chunk_breakdown(chunks, {"sha256:a"}, changed_at) == [
        {"offset": 4 * R.PAGE, "length": 8 * R.PAGE, "changed": 2 * R.PAGE, "stored": 200},
        {"offset": 12 * R.PAGE, "length": 2 * R.PAGE, "changed": 0, "stored": 300},  # another file's page
    ]


def test_new_chunks_counts_digests_the_repository_lacked_once() -> None:
    chunks = [
        {"digest": "sha256:a", "length": 4 * MIB, "size": 4 * MIB + 10},
        {"digest": "sha256:b", "length": 2 * MIB, "size": 1 * MIB},
        {"digest": "sha256:b", "length": 2 * MIB, "size": 1 * MIB},  # the same content twice in one save
        {"digest": "sha256:c", "length": 1 * MIB, "size": 100},
    ]
    assert R.new_chunks(chunks, {"sha256:a"}) == (2, 3 * MIB, MIB + 100)
    assert R.new_chunks(chunks, {"sha256:a", "sha256:b", "sha256:c"}) == (0, 0, 0)


def test_a_page_delta_counts_as_what_was_sent_for_its_chunk_not_its_base() -> None:
    delta = {"digest": "sha256:d", "size": 300, "pages": 2, "copies": 1, "baseLength": 8 * R.PAGE}
    chunks = [
        {"file": "pages-1.img", "offset": 0, "length": 8 * R.PAGE, "digest": "sha256:a", "size": 100, "delta": delta},
        {"file": "pages-1.img", "offset": 8 * R.PAGE, "length": 4 * R.PAGE, "digest": "sha256:b", "size": 50},
    ]
    seen = {"sha256:a", "sha256:b"}  # the base was stored by an earlier save
    assert R.new_chunks(chunks, seen) == (1, 2 * R.PAGE, 300)
    assert R.chunk_breakdown(chunks, seen, {("pages-1.img", R.PAGE)}) == [
        {"offset": 0, "length": 8 * R.PAGE, "changed": R.PAGE, "stored": 300}
    ]
    assert R.blob_digests(chunks) == {"sha256:a", "sha256:b", "sha256:d"}
    # the snapshot's size counts the base and the delta of each chunk: the rest of it is its metadata,
    # and all a save uploaded beyond that is page blobs, a delta sent again by a later save included
    assert R.stored_bytes(chunks) == 100 + 300 + 50


def test_metadata_is_what_the_save_measured_not_what_is_left_of_new_digests() -> None:
    d = R.derive_save(_save(uploaded=40 * MIB, chunk_uploaded=30 * MIB, metadata_bytes=10 * MIB), 1.0, 2.0)
    assert d["metadata_uploaded"] == 10 * MIB and d["chunks_uploaded_vs_changed"] == pytest.approx(1.5)


def _save(**kw: Any) -> dict[str, Any]:
    base = {
        "freeze_s": 1.2,
        "cpu_s": 6.0,
        "uploaded": 40 * MIB,
        "chunk_uploaded": 39 * MIB,
        "new_chunk_raw": 40 * MIB,
        "changed_bytes": 20 * MIB,
        "written_bytes": 20 * MIB,
        "new_chunks": 3,
    }
    return {**base, **kw}


def test_a_save_is_judged_on_chunk_bytes_against_twice_the_changed_bytes() -> None:
    d = R.derive_save(_save(), raw_dump_s=1.0, raw_cpu_s=2.0)
    assert d["freeze_vs_raw_dump"] == pytest.approx(1.2)
    assert d["freeze_goal_met"] is False  # 1.2 > 1.1 * 1.0 + 0.03
    assert d["uploaded_vs_changed"] == pytest.approx(2.0)
    assert d["chunks_uploaded_vs_changed"] == pytest.approx(1.95)
    assert d["metadata_uploaded"] == MIB
    assert d["upload_goal_met"] is True  # 39 MiB of chunks <= 2 x 20 MiB; the 1 MiB of metadata is allowed
    assert d["cpu_vs_raw_dump_cpu"] == pytest.approx(3.0)
    assert d["changed_vs_written"] == pytest.approx(1.0)
    missed = R.derive_save(_save(chunk_uploaded=48 * MIB, uploaded=49 * MIB), raw_dump_s=1.0, raw_cpu_s=2.0)
    assert missed["upload_goal_met"] is False
    assert R.derive_save(_save(freeze_s=1.13), raw_dump_s=1.0, raw_cpu_s=2.0)["freeze_goal_met"] is True


def test_nothing_measured_gives_no_verdict() -> None:
    d = R.derive_save(_save(changed_bytes=None, freeze_s=None, cpu_s=None), raw_dump_s=None, raw_cpu_s=0.0)
    assert d["upload_goal_met"] is None and d["freeze_goal_met"] is None
    assert d["uploaded_vs_changed"] is None and d["cpu_vs_raw_dump_cpu"] is None


def _result() -> dict[str, Any]:
    saves = [
        _save(changed_bytes=None, uploaded=2048 * MIB, chunk_uploaded=2047 * MIB),  # the chain's base
        _save(freeze_s=1.0),
        _save(
            freeze_s=1.4,
            chunk_uploaded=48 * MIB,
            uploaded=49 * MIB,
            sent_chunks=[{"length": 16 * MIB, "changed": 4 * MIB}, {"length": 16 * MIB, "changed": 0}],
        ),
        _save(freeze_s=1.2, cpu_s=8.0),
    ]
    return {
        "machine": {
            "cpus": 2,
            "cpu_model": "x",
            "kernel": "k",
            "criu": "c",
            "runc": "r",
            "loadavg": (1.0, 1.0, 1.0),
            "time": "t",
        },
        "sealed": True,
        "steady": {
            "mib": 2048,
            "kind": "random",
            "pct": 1.0,
            "saves": saves,
            "raw": {"dump_s": [0.9, 1.0, 1.1], "cpu_s": [2.0, 2.0, 3.0]},
        },
        "pod": {
            "mib": 64,
            "bound": {"dump_s": 0.1, "zstd_s": 0.2, "sha_s": 0.3, "upload_s": 0.4},
            "full_s": [2.0, 3.0, 2.5],
            "incremental_s": [1.0, 0.5, 0.7],
        },
    }


def test_summary_takes_medians_over_the_saves_after_the_base() -> None:
    s = R.summarize(_result())
    assert s["raw_dump_s"] == pytest.approx(1.0) and s["raw_dump_cpu_s"] == pytest.approx(2.0)
    assert s["freeze_s"] == pytest.approx(1.2)  # the base's freeze is the warm-up, left out
    assert s["freeze_vs_raw_dump"] == pytest.approx(1.2)
    assert s["cpu_vs_raw_dump_cpu"] == pytest.approx(3.0)  # median of 6, 6, 8 over 2
    assert s["base_uploaded"] == 2048 * MIB
    assert s["uploaded_vs_changed"] == pytest.approx(2.0)  # median of 2.0, 2.45, 2.0
    assert (s["upload_goal_met_saves"], s["upload_goal_judged_saves"]) == (2, 3)
    assert s["upload_goal_met"] is False  # the goal holds for every save, not on average
    assert s["pod_serial_bound_s"] == pytest.approx(1.0)
    assert s["pod_full_vs_serial_bound"] == pytest.approx(2.5)
    assert s["pod_incremental_vs_serial_bound"] == pytest.approx(0.7)


def test_without_the_pod_part_the_summary_has_no_pod_ratios() -> None:
    result = _result()
    result["pod"] = None
    s = R.summarize(result)
    assert "pod_serial_bound_s" not in s
    assert "MiB pod" not in R.markdown(result)


def test_the_table_shows_each_ratio_beside_what_it_divides() -> None:
    md = R.markdown(_result())
    assert "| 2 | 1.40x (1400 ms) | 2.45x (49.0 MiB / 20.0 MiB) | 2.40x (3 chunks, 48.0 MiB) **missed** |" in md
    assert "1.20x | raw `criu dump --leave-running` of a host process of the same size (1200 ms / 1000 ms)" in md
    assert "**missed** (2 of 3 saves)" in md
    assert "| 16.0 (4.0), 16.0 (0.0) |" in md
    assert "| 64 MiB pod: full save (fresh repository) | 2.50x |" in md
    assert "sealed" in md
