"""bench/autosave_cost.py's maths, pure: which pages changed between two dumps, per-save ratios, goal
verdicts and the Markdown table. No I/O here (tests/unit/test_bench_autosave.py checks it).

Every absolute number is printed beside the measurement of the same run it is divided by.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

PAGE = 4096
# The goal: a save uploads at most 2x the bytes that changed, plus metadata (the small layer
# of CRIU's other images and the config). Chunk blobs are what must stay within 2x.
UPLOAD_GOAL_FACTOR = 2.0
# The project's standing freeze goal (docs/performance.md): at most 1.1x a raw dump + 30 ms.
FREEZE_GOAL_FACTOR, FREEZE_GOAL_SLACK_S = 1.1, 0.030

PageKey = tuple[str, int]  # (pagemap image name, virtual address of the page)
FileOffset = tuple[str, int]  # (page file name, byte offset of the page in it)


def changed_keys(before: Mapping[PageKey, bytes], after: Mapping[PageKey, bytes]) -> list[PageKey]:
    """Pages of `after` whose content differs from the same page of `before`, or that `before` lacked."""
    return [key for key, digest in after.items() if before.get(key) != digest]


def _blobs(c: Mapping[str, Any]) -> list[tuple[str, int, int]]:
    """(digest, raw bytes, stored bytes) of the blobs a chunk record names: the chunk, or (format v4)
    its base and its page delta (whose raw bytes are its literal pages)."""
    delta = c.get("delta")
    if not delta:
        return [(str(c["digest"]), int(c["length"]), int(c["size"]))]
    return [
        (str(c["digest"]), int(delta["baseLength"]), int(c["size"])),
        (str(delta["digest"]), int(delta["pages"]) * PAGE, int(delta["size"])),
    ]


def chunk_breakdown(
    chunks: Sequence[Mapping[str, Any]], seen: set[str], changed_at: set[FileOffset]
) -> list[dict[str, int]]:
    """For each chunk with a blob the registry lacked (the chunk, or its page delta): its raw length,
    how many of its bytes are changed pages (`changed_at`: where the changed pages lie in the page
    files) and the bytes sent for it. Shows what chunking costs."""
    out: list[dict[str, int]] = []
    fresh: set[str] = set()
    for c in chunks:
        sent = 0
        for d, _raw, stored in _blobs(c):
            if d not in seen and d not in fresh:
                fresh.add(d)
                sent += stored
        if not sent:
            continue
        start, length = int(c["offset"]), int(c["length"])
        inside = sum(1 for off in range(start, start + length, PAGE) if (str(c["file"]), off) in changed_at)
        out.append({"offset": start, "length": length, "changed": inside * PAGE, "stored": sent})
    return out


def median(xs: Sequence[float | int | None]) -> float | None:
    vals = [float(x) for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def new_chunks(chunks: Sequence[Mapping[str, Any]], seen: set[str]) -> tuple[int, int, int]:
    """(count, raw bytes, stored bytes) of the chunk and page delta blobs whose digest no earlier save
    of the repository had: what the registry had to receive. A digest listed twice in one save counts
    once."""
    count = raw = stored = 0
    fresh: set[str] = set()
    for c in chunks:
        for d, r, st in _blobs(c):
            if d in seen or d in fresh:
                continue
            fresh.add(d)
            count += 1
            raw += r
            stored += st
    return count, raw, stored


def stored_bytes(chunks: Sequence[Mapping[str, Any]]) -> int:
    """Stored bytes of the page blobs the records name, each time it is named (as the agent counts a
    snapshot's size: a chunk with a page delta is its base and its delta)."""
    return sum(stored for c in chunks for _, _, stored in _blobs(c))


def blob_digests(chunks: Sequence[Mapping[str, Any]]) -> set[str]:
    """Every chunk and page delta digest the records name."""
    return {d for c in chunks for d, _, _ in _blobs(c)}


def derive_save(save: Mapping[str, Any], raw_dump_s: float | None, raw_cpu_s: float | None) -> dict[str, Any]:
    """One incremental save's ratios (the chain's first save is the base, not judged)."""
    changed = save.get("changed_bytes")
    chunk_up = save.get("chunk_uploaded")
    meta = save.get("metadata_bytes")
    if meta is None and save.get("uploaded") is not None and chunk_up is not None:  # results before session 27
        meta = save["uploaded"] - chunk_up
    goal = None
    if changed and chunk_up is not None:
        goal = chunk_up <= UPLOAD_GOAL_FACTOR * changed
    freeze_goal = None
    if save.get("freeze_s") is not None and raw_dump_s is not None:
        freeze_goal = save["freeze_s"] <= FREEZE_GOAL_FACTOR * raw_dump_s + FREEZE_GOAL_SLACK_S
    return {
        "freeze_vs_raw_dump": ratio(save.get("freeze_s"), raw_dump_s),
        "freeze_goal_met": freeze_goal,
        "uploaded_vs_changed": ratio(save.get("uploaded"), changed),
        "chunks_uploaded_vs_changed": ratio(chunk_up, changed),
        "new_chunk_raw_vs_changed": ratio(save.get("new_chunk_raw"), changed),
        "metadata_uploaded": meta,
        "upload_goal_met": goal,
        "cpu_vs_raw_dump_cpu": ratio(save.get("cpu_s"), raw_cpu_s),
        "changed_vs_written": ratio(changed, save.get("written_bytes")),
    }


def _all(flags: Sequence[bool | None]) -> bool | None:
    known = [f for f in flags if f is not None]
    return all(known) if known else None


def summarize(result: Mapping[str, Any]) -> dict[str, Any]:
    """Medians and verdicts over the incremental saves and the 64 MiB pod's saves."""
    steady = result["steady"]
    raw = steady["raw"]
    raw_dump_s, raw_cpu_s = median(raw["dump_s"]), median(raw["cpu_s"])
    saves = steady["saves"][1:]  # [0] is the chain's base (a full upload), also the warm-up
    per = [derive_save(s, raw_dump_s, raw_cpu_s) for s in saves]
    out: dict[str, Any] = {
        "raw_dump_s": raw_dump_s,
        "raw_dump_cpu_s": raw_cpu_s,
        "freeze_s": median([s.get("freeze_s") for s in saves]),
        "cpu_s": median([s.get("cpu_s") for s in saves]),
        "uploaded": median([s.get("uploaded") for s in saves]),
        "chunk_uploaded": median([s.get("chunk_uploaded") for s in saves]),
        "changed_bytes": median([s.get("changed_bytes") for s in saves]),
        "written_bytes": median([s.get("written_bytes") for s in saves]),
        "base_uploaded": steady["saves"][0].get("uploaded") if steady["saves"] else None,
        "per_save": per,
    }
    out["freeze_vs_raw_dump"] = ratio(out["freeze_s"], raw_dump_s)
    out["freeze_goal_met"] = (
        None if out["freeze_s"] is None or raw_dump_s is None
        else out["freeze_s"] <= FREEZE_GOAL_FACTOR * raw_dump_s + FREEZE_GOAL_SLACK_S
    )  # fmt: skip
    out["cpu_vs_raw_dump_cpu"] = ratio(out["cpu_s"], raw_cpu_s)
    out["uploaded_vs_changed"] = median([p["uploaded_vs_changed"] for p in per])
    out["chunks_uploaded_vs_changed"] = median([p["chunks_uploaded_vs_changed"] for p in per])
    out["upload_goal_met_saves"] = sum(1 for p in per if p["upload_goal_met"])
    out["upload_goal_judged_saves"] = sum(1 for p in per if p["upload_goal_met"] is not None)
    out["upload_goal_met"] = _all([p["upload_goal_met"] for p in per])
    pod = result.get("pod")
    if pod:
        b = pod["bound"]
        parts = [b.get(k) for k in ("dump_s", "zstd_s", "sha_s", "upload_s")]
        serial = sum(p for p in parts if p is not None) if all(p is not None for p in parts) else None
        out["pod_serial_bound_s"] = serial
        out["pod_full_save_s"] = median(pod["full_s"])
        out["pod_incremental_save_s"] = median(pod["incremental_s"])
        out["pod_full_vs_serial_bound"] = ratio(out["pod_full_save_s"], serial)
        out["pod_incremental_vs_serial_bound"] = ratio(out["pod_incremental_save_s"], serial)
    return out


def _x(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v * 1000:.0f} ms"


def _mib(v: float | None) -> str:
    return "n/a" if v is None else f"{v / 2**20:.1f} MiB"


def _sent(chunks: Sequence[Mapping[str, int]] | None) -> str:
    if chunks is None:
        return "n/a"
    return ", ".join(f"{c['length'] / 2**20:.1f} ({c['changed'] / 2**20:.1f})" for c in chunks) or "none"


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "**missed**")


def markdown(result: Mapping[str, Any]) -> str:
    s = summarize(result)
    steady, m = result["steady"], result["machine"]
    lines = [
        f"# autosave's steady cost: {steady['mib']} MiB {steady['kind']}, {steady['pct']}% changed per interval, "
        f"{len(steady['saves']) - 1} saves after the base{'; sealed' if result.get('sealed') else ''}"
        + (f"; chunk span at most {result['max_span_mib']} MiB" if result.get("max_span_mib") else ""),
        "",
        f"Machine: {m['cpus']} CPUs ({m['cpu_model']}), kernel {m['kernel']}, {m['criu']}, {m['runc']}; "
        f"load average at the end {', '.join(f'{x:.2f}' for x in m['loadavg'])}; {m['time']}.",
        "",
        "| save | freeze / raw criu dump | uploaded / changed | chunks uploaded / changed (goal <=2x) | "
        "metadata uploaded | changed (page diff) / written by the workload | agent CPU / raw dump CPU | "
        "chunks sent: raw MiB (changed MiB in it) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, (save, p) in enumerate(zip(steady["saves"][1:], s["per_save"], strict=True), start=1):
        lines.append(
            f"| {i} | {_x(p['freeze_vs_raw_dump'])} ({_ms(save.get('freeze_s'))}) | "
            f"{_x(p['uploaded_vs_changed'])} ({_mib(save.get('uploaded'))} / {_mib(save.get('changed_bytes'))}) | "
            f"{_x(p['chunks_uploaded_vs_changed'])} ({save.get('new_chunks')} chunks, "
            f"{_mib(save.get('chunk_uploaded'))}) {_verdict(p['upload_goal_met'])} | "
            f"{_mib(p['metadata_uploaded'])} | {_x(p['changed_vs_written'])} | "
            f"{_x(p['cpu_vs_raw_dump_cpu'])} ({save.get('cpu_s', 0):.2f} s) | {_sent(save.get('sent_chunks'))} |"
        )
    lines += [
        "",
        "| metric | median | divided by (same run) | goal |",
        "|---|---|---|---|",
        f"| freeze per save | {_x(s['freeze_vs_raw_dump'])} | raw `criu dump --leave-running` of a host process "
        f"of the same size ({_ms(s['freeze_s'])} / {_ms(s['raw_dump_s'])}) | <=1.1x+30ms: "
        f"{_verdict(s['freeze_goal_met'])} |",
        f"| bytes uploaded per save | {_x(s['uploaded_vs_changed'])} (chunks alone "
        f"{_x(s['chunks_uploaded_vs_changed'])}) | bytes changed, by page contents of consecutive dumps "
        f"({_mib(s['uploaded'])} / {_mib(s['changed_bytes'])}; the base save uploaded "
        f"{_mib(s['base_uploaded'])}) | <=2x changed + metadata: {_verdict(s['upload_goal_met'])} "
        f"({s['upload_goal_met_saves']} of {s['upload_goal_judged_saves']} saves) |",
        f"| agent CPU seconds per save | {_x(s['cpu_vs_raw_dump_cpu'])} | the raw dump's CPU seconds "
        f"({s['cpu_s'] or 0:.2f} s / {s['raw_dump_cpu_s'] or 0:.2f} s) | none |",
    ]
    if "pod_serial_bound_s" in s:
        pod = result["pod"]
        lines += [
            f"| {pod['mib']} MiB pod: full save (fresh repository) | {_x(s['pod_full_vs_serial_bound'])} | serial "
            f"bound: raw dump + tar\\|zstd -1 + sha256 + upload ({_ms(s['pod_full_save_s'])} / "
            f"{_ms(s['pod_serial_bound_s'])}) | none |",
            f"| {pod['mib']} MiB pod: autosave save ({steady['pct']}% changed) | "
            f"{_x(s['pod_incremental_vs_serial_bound'])} | the same serial bound ({_ms(s['pod_incremental_save_s'])}) "
            "| none |",
        ]
    return "\n".join(lines) + "\n"
