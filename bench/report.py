"""Turn bench/run.py's measurements into ratios, goal verdicts and a Markdown table.

No absolute number appears without the ratio it belongs to (PLATFORM.md: shared, noisy machines).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _r(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _fmt(x: float | None, unit: str = "x") -> str:
    return "n/a" if x is None else f"{x:.2f}{unit}"


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1000:.0f} ms"


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "**missed**")


SMALL_POD_MIB = 512  # below: issue 16's small pods (checkpoint and restore goals against the bound and ctr)


def derive(row: dict[str, Any]) -> dict[str, Any]:
    raw, ag = row["raw"], row["agent"]
    pod, ctr = row.get("podman", {}), row.get("ctr", {})
    parts = [raw.get(k) for k in ("dump_s", "zstd_s", "sha_s", "upload_s")]
    serial = sum(p for p in parts if p is not None) if all(p is not None for p in parts) else None
    rparts = [raw.get(k) for k in ("download_s", "unzstd_s", "restore_s")]
    rbound = sum(p for p in rparts if p is not None) if all(p is not None for p in rparts) else None
    d: dict[str, Any] = {
        "freeze_vs_raw_dump": _r(ag.get("freeze_s"), raw.get("dump_s")),
        "freeze_goal_met": None
        if ag.get("freeze_s") is None or raw.get("dump_s") is None
        else ag["freeze_s"] <= 1.1 * raw["dump_s"] + 0.030,
        "freeze_vs_runc_checkpoint": _r(ag.get("freeze_s"), ag.get("runc_checkpoint_s")),
        "serial_bound_s": serial,
        "pushed_vs_serial_bound": _r(ag.get("pushed_s"), serial),
        "pushed_internal_vs_serial_bound": _r(ag.get("pushed_internal_s"), serial),
        "pushed_standalone_vs_serial_bound": _r(ag.get("pushed_standalone_s"), serial),
        "pushed_vs_podman_export": _r(ag.get("pushed_s"), pod.get("checkpoint_export_s")),
        "pushed_vs_ctr_checkpoint_push": _r(ag.get("pushed_s"), ctr.get("checkpoint_push_s")),
        "restore_bound_s": rbound,
        "restore_vs_bound": _r(ag.get("restore_s"), rbound),
        "restore_internal_vs_bound": _r(ag.get("restore_internal_s"), rbound),
        "restore_standalone_vs_bound": _r(ag.get("restore_standalone_s"), rbound),
        "restore_vs_podman_import": _r(ag.get("restore_s"), pod.get("restore_import_s")),
        "restore_vs_ctr_pull_restore": _r(ag.get("restore_s"), ctr.get("pull_restore_s")),
        "size_vs_rss": _r(ag.get("size_bytes"), raw.get("rss_bytes")),
        "size_vs_zstd1_raw": _r(ag.get("size_bytes"), raw.get("zstd_bytes")),
        "incr_1pct_vs_first": _r(ag.get("incr_1pct_uploaded"), ag.get("incr_base_uploaded")),
        "incr_5pct_vs_first": _r(ag.get("incr_5pct_uploaded"), ag.get("incr_base_uploaded")),
        # vs the pages that really changed between the two dumps, compressed like chunks (bench/pagediff.py)
        "incr_1pct_vs_changed": _r(ag.get("incr_1pct_uploaded"), ag.get("incr_1pct_changed_packed")),
        "incr_5pct_vs_changed": _r(ag.get("incr_5pct_uploaded"), ag.get("incr_5pct_changed_packed")),
        "page_hash_vs_pack_cpu": _r(ag.get("page_hash_cpu_s"), ag.get("chunk_pack_cpu_s")),
        # like for like: both standalone (a save without page deltas runs standalone, bench/run.py)
        "pushed_vs_no_deltas": _r(ag.get("pushed_standalone_s", ag.get("pushed_s")), ag.get("pushed_no_deltas_s")),
        "pushed_internal_vs_no_deltas": _r(ag.get("pushed_internal_s"), ag.get("pushed_internal_no_deltas_s")),
        # containers created while the data downloads vs only after it (both served, alternated)
        "restore_vs_late_create": _r(ag.get("restore_s"), ag.get("restore_late_create_s")),
        "restore_internal_vs_late_create": _r(ag.get("restore_internal_s"), ag.get("restore_late_create_internal_s")),
        "restore_vs_one_phase": _r(ag.get("restore_s"), ag.get("restore_one_phase_s")),
    }
    # <= 1.5x the bound and faster than ctr; from 512 MiB also faster than podman (the goal before issue 16,
    # whose small-pod goal names the bound and ctr only)
    small = row.get("mib", SMALL_POD_MIB) < SMALL_POD_MIB
    pv, cv = d["pushed_vs_podman_export"], d["pushed_vs_ctr_checkpoint_push"]
    d["pushed_goal_met"] = None if d["pushed_vs_serial_bound"] is None else (
        d["pushed_vs_serial_bound"] <= 1.5 and (small or pv is None or pv < 1) and (cv is None or cv < 1)
    )  # fmt: skip
    rv, rp, rc = d["restore_vs_bound"], d["restore_vs_podman_import"], d["restore_vs_ctr_pull_restore"]
    d["restore_goal_met"] = None if rv is None else (
        rv <= 1.5 and (small or rp is None or rp < 1) and (rc is None or rc < 1)
    )  # fmt: skip
    # issue 16: the freeze at most 1.1x `runc checkpoint` of the same container plus 10 ms
    fz, rcp = ag.get("freeze_s"), ag.get("runc_checkpoint_s")
    d["freeze_vs_runc_goal_met"] = None if fz is None or rcp is None else fz <= 1.1 * rcp + 0.010
    d["size_goal_met"] = None if d["size_vs_zstd1_raw"] is None else d["size_vs_zstd1_raw"] <= 1.05
    v5, c5 = d["incr_5pct_vs_first"], d["incr_5pct_vs_changed"]
    d["incr_goal_met"] = None if v5 is None else v5 <= 0.10 and (c5 is None or c5 <= 1.5)
    return d


Cells = Callable[[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]], list[str]]


def _table(result: dict[str, Any], header: list[str], cells: Cells) -> list[str]:
    """A Markdown table with one row per workload; `cells(row, derived, agent, raw)` gives the rest."""
    out = ["| workload | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    for row in result["rows"]:
        values = cells(row, derive(row), row["agent"], row["raw"])
        out.append(f"| {row['kind']} {row['mib']} MiB | " + " | ".join(values) + " |")
    return out


def _standalone(ratio: float | None) -> str:
    """The same command run standalone (no agent serving it), where the run measured it."""
    return "" if ratio is None else f"standalone {_fmt(ratio)}; "


def _speed(row: dict[str, Any], d: dict[str, Any], ag: dict[str, Any], raw: dict[str, Any]) -> list[str]:
    pod, ctr = row.get("podman", {}), row.get("ctr", {})
    return [
        f"{_fmt(d['freeze_vs_raw_dump'])} ({_ms(ag.get('freeze_s'))} / {_ms(raw.get('dump_s'))})",
        _verdict(d["freeze_goal_met"]),
        f"{_fmt(d['pushed_vs_serial_bound'])} ({_ms(ag.get('pushed_s'))} / {_ms(d['serial_bound_s'])}; "
        f"{_standalone(d['pushed_standalone_vs_serial_bound'])}in-agent {_fmt(d['pushed_internal_vs_serial_bound'])})",
        f"{_fmt(d['pushed_vs_podman_export'])} ({_ms(pod.get('checkpoint_export_s'))})",
        f"{_fmt(d['pushed_vs_ctr_checkpoint_push'])} ({_ms(ctr.get('checkpoint_push_s'))})",
        _verdict(d["pushed_goal_met"]),
        f"{_fmt(d['restore_vs_bound'])} ({_ms(ag.get('restore_s'))} / {_ms(d['restore_bound_s'])}; "
        f"{_standalone(d['restore_standalone_vs_bound'])}in-agent {_fmt(d['restore_internal_vs_bound'])})",
        f"{_fmt(d['restore_vs_podman_import'])} ({_ms(pod.get('restore_import_s'))})",
        f"{_fmt(d['restore_vs_ctr_pull_restore'])} ({_ms(ctr.get('pull_restore_s'))})",
        _verdict(d["restore_goal_met"]),
    ]


def _incr_range(ag: dict[str, Any]) -> str:
    """With --incr-runs N: the reported run is the median one; the range of all N ratios."""
    rs = [r for r in ag.get("incr_5pct_vs_changed_runs") or [] if r is not None]
    if len(rs) < 2:
        return ""
    over = sum(r > 1.5 for r in rs)
    return f"; median run of {len(rs)}: {min(rs):.2f}x-{max(rs):.2f}x, {over} over 1.5x"


def _size(row: dict[str, Any], d: dict[str, Any], ag: dict[str, Any], raw: dict[str, Any]) -> list[str]:
    return [
        _fmt(d["size_vs_rss"]),
        f"{_fmt(d['size_vs_zstd1_raw'])} ({ag.get('size_bytes', 0) / 2**20:.1f} / "
        f"{raw.get('zstd_bytes', 0) / 2**20:.1f} MiB)",
        _verdict(d["size_goal_met"]),
        f"{_fmt(d['incr_1pct_vs_first'] and d['incr_1pct_vs_first'] * 100, '%')}; "
        f"{_fmt(d['incr_1pct_vs_changed'])} changed",
        f"{_fmt(d['incr_5pct_vs_first'] and d['incr_5pct_vs_first'] * 100, '%')} of "
        f"{ag.get('incr_base_uploaded', 0) / 2**20:.1f} MiB; {_fmt(d['incr_5pct_vs_changed'])} of "
        f"{ag.get('incr_5pct_changed_packed', 0) / 2**20:.2f} MiB changed "
        f"({ag.get('incr_5pct_changed_bytes', 0) / 2**20:.1f} MiB raw)" + _incr_range(ag),
        _verdict(d["incr_goal_met"]),
        f"{_fmt(d['page_hash_vs_pack_cpu'])}; full save {_fmt(d['pushed_vs_no_deltas'])} "
        f"(in-agent {_fmt(d['pushed_internal_vs_no_deltas'])}) of one without",
        " / ".join(_ms(raw.get(k)) for k in ("dump_s", "zstd_s", "sha_s", "upload_s")),
    ]


def _freeze(row: dict[str, Any], d: dict[str, Any], ag: dict[str, Any], raw: dict[str, Any]) -> list[str]:
    return [
        _ms(ag.get("freeze_s")),
        _ms(ag.get("runc_checkpoint_s")),
        _fmt(d["freeze_vs_runc_checkpoint"]),
        _verdict(d["freeze_vs_runc_goal_met"]),
        _ms(raw.get("dump_s")),
        _each(ag.get("freeze_runs_ms")) + " / " + _each(ag.get("runc_checkpoint_runs_ms")),
    ]


def _each(xs: list[float] | None) -> str:
    return "-" if not xs else ", ".join(f"{x:.0f}" for x in xs)


def _decoded(n: float | None) -> str:
    """How many CRIU images the hook decoded itself (the rest came from the agent's decode cache)."""
    return "" if n is None else f" ({n:.0f} images decoded)"


def _restore_parts(row: dict[str, Any], d: dict[str, Any], ag: dict[str, Any], raw: dict[str, Any]) -> list[str]:
    b = ag.get("restore_breakdown") or {}

    def ms(key: str) -> str:
        return "-" if b.get(key) is None else f"{b[key]:.0f} ms"

    calls = b.get("hook_calls") or {}
    split = (
        f" ({ms('layers_ms')} / {ms('extract_ms')} / {ms('pages_ms')}, {ms('pages_wait_ms')} after)"
        if b.get("pages_ms")
        else ""
    )
    return [
        f"{_fmt(d['restore_vs_late_create'])} (in-agent {_fmt(d['restore_internal_vs_late_create'])})",
        _fmt(d["restore_vs_one_phase"]),
        ms("total_ms"),
        ms("resolve_ms"),
        ms("download_ms") + split,
        ms("restore_ms"),
        ms("create_ms"),
        ms("staged_wait_ms"),
        ms("python_startup_ms"),
        ms("image_check_ms") + _decoded(b.get("images_decoded_in_hook")),
        ms("runc_restore_ms")
        + (f" (CRIU's log {ms('criu_restore_log_ms')})" if b.get("criu_restore_log_ms") else "")
        + (f", of which waiting for the pages {ms('criu_pages_wait_ms')}" if "criu_pages_wait_ms" in b else "")
        + (f", {b['criu_tmpfs_mounts']:.0f} tmpfs mounts {ms('criu_tmpfs_ms')}" if b.get("criu_tmpfs_mounts") else "")
        + (f", after the memory {ms('criu_after_memory_ms')}" if "criu_after_memory_ms" in b else ""),
        ms("after_restore_ms"),
        _ms(raw.get("restore_s")),
        ", ".join(f"{k} {v}" for k, v in sorted(calls.items())) or "-",
    ]


def _code(text: str) -> str:
    """A log line as inline code (CRIU's lines hold backticks and tabs)."""
    return "``" + " ".join(text.split()) + "``"


def _checkpoint_parts(row: dict[str, Any], d: dict[str, Any], ag: dict[str, Any], raw: dict[str, Any]) -> list[str]:
    b = ag.get("checkpoint_breakdown") or {}

    def ms(key: str) -> str:
        return "-" if b.get(key) is None else f"{b[key]:.0f} ms"

    outside = None if b.get("wall_ms") is None or b.get("total_ms") is None else b["wall_ms"] - b["total_ms"]
    return [
        ms("wall_ms"),
        "-" if outside is None else f"{outside:.0f} ms",
        ms("total_ms"),
        ms("preflight_ms"),
        ms("freeze_ms"),
        ms("criu_ms"),
        ms("package_ms"),
        ms("package_cpu_ms"),
        ms("upload_ms"),
        ms("sign_ms"),
        ag.get("dumped_to") or "-",
        " / ".join(_ms(raw.get(k)) for k in ("dump_s", "zstd_s", "sha_s", "upload_s")),
    ]


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        "# kubectl-snapshot benchmark",
        "",
        f"Machine: {m['cpus']} CPUs ({m['cpu_model']}), {m['memory_bytes'] >> 30} GiB, kernel {m['kernel']}, "
        f"{m['criu']}, {m['runc']}, {m['containerd']}, {m['podman'] or 'no podman'}; "
        f"runc's CRIU configuration {m.get('criu_config', 'n/a')}; "
        f"CRIU's kdat cache {m.get('criu_kdat', 'n/a')}; expedited RCU grace periods: "
        f"{m.get('rcu_expedite', 'n/a')}; dumps in memory: {m.get('memory_work', 'n/a')}; "
        f"CRIU's tar: {m.get('criu_tar', 'n/a')}; ks-agent: {m.get('ks_agent', 'the Python program')}; "
        "load average at the end "
        f"{', '.join(f'{x:.2f}' for x in m['loadavg'])}; {m['time']}."
        + (f" **The registry is behind a {m['link']} link** (bench/throttle.py)." if m.get("link") else ""),
        f"Each figure: median of {result['rows'][0]['runs'] if result['rows'] else '?'} runs after one warm-up; "
        "every absolute number is shown next to the bound or peer it is divided by, measured in the same run.",
        "",
    ]
    speed_header = ["freeze vs raw criu dump", "goal <=1.1x+30ms", "checkpoint->pushed vs serial bound",
                    "vs podman export", "vs ctr checkpoint+push", "goal", "pull->running vs bound",
                    "vs podman import", "vs ctr pull+restore", "goal"]  # fmt: skip
    lines += _table(result, speed_header, _speed)
    lines += [
        "",
        "checkpoint->pushed and pull->running: `ks-agent checkpoint|restore` (wall time) served by the node's "
        "warm agent (`ks-agent serve`, as the DaemonSet's agent serves a node; shim/service/localapi.py); "
        "standalone: the "
        "same command with no agent to serve it (its own process start-up, imports, gRPC channel and freeze "
        "guard); in-agent: the agent's own timing of the work. Goals: at most 1.5x the bound and faster than "
        f"ctr; from {SMALL_POD_MIB} MiB also faster than podman (below it, issue 16's small pods: bound and ctr). "
        "The bounds' parts (each timed on its own) are measured between the product's runs: one run of the "
        "checkpoint's parts after each run of the checkpoints, one of the restore's in each round of the "
        "restores, whose variants (served, created after the download, one phase, standalone, the bound) run "
        "in an order shuffled each round (bench/run.py RawBound, measure_agent).",
    ]
    size_header = ["size vs RSS", "size vs zstd -1 of raw images", "goal <=1.05x",
                   "2nd snapshot after 1% changed: vs 1st; vs changed pages",
                   "after 5% more changed: vs 1st; vs changed pages", "goal <=10% and <=1.5x changed",
                   "page hashing: CPU vs chunk zstd+sha256; full save vs without page deltas",
                   "serial bound parts (dump / zstd / sha256 / upload)"]  # fmt: skip
    lines += ["", *_table(result, size_header, _size)]
    lines += [
        "",
        "Changed pages: pages whose content differs between the two consecutive dumps (matched by virtual "
        "address), compressed with the agent's zstd level as one frame (bench/pagediff.py); uploaded counts "
        "everything the registry lacked (page deltas, chunks, the layer of CRIU's other images, the config).",
    ]
    lines += [
        "",
        "The freeze against a second reference: `runc checkpoint --leave-running` of the same container, run "
        "directly (CRIU under runc with the container's namespaces, mounts and cgroups; no containerd, no pause, "
        "no rootfs diff).",
        "",
    ]
    freeze_header = ["freeze", "runc checkpoint of the same container", "freeze / runc checkpoint",
                     "goal <=1.1x+10ms", "raw criu dump of the host process",
                     "each run, ms: freeze / runc checkpoint"]  # fmt: skip
    lines += _table(result, freeze_header, _freeze)
    lines += [
        "",
        "Where an in-agent restore's time goes (medians): resolve (manifest, config, signature), download (every "
        "blob fetched, verified, decrypted, page files rebuilt; in parentheses: the layer of CRIU's other images "
        "downloaded / extracted, decode cache filled / page files rebuilt from their chunks meanwhile, and how long "
        "that went on after the extraction); meanwhile containerd creates the container and "
        "starts its shim and the runtime wrapper, whose create waits at the staging gate until all but the page files "
        "is staged (hook waited), then starts `runc restore`, whose CRIU waits for the page files after restoring "
        "the namespaces and mounts (of which waiting for the pages; and the tmpfs mounts CRIU restored, with the "
        "time their `tar` calls took: bench/criu_tar.py; and CRIU's steps after it put the memory back, from "
        "'Running post-restore scripts' to its last line); create + start is what is left after the "
        "download. The hook's create is the restore (its "
        "launcher starting Python on the hook, the CRIU image check with the number of images it decoded itself, "
        "the rest coming from the agent's decode cache, `runc restore`, what the hook does after it: the pod's "
        "loopback, the restored marker, the used staged dir taken away; hook create leaves out the wait); every "
        "other call containerd's shim makes goes from the launcher to runc without Python (the count of calls per "
        "runc command during the last run's restore). The first column: pull->running (served; in-agent) against "
        "the same restores with the containers created only after the download "
        "(KUBECTL_SNAPSHOT_EARLY_CREATE=0, served by a second agent, in the same rounds); the second: against the same "
        "restores with the hook's `runc restore` started only after all of the data, page files included "
        "(KUBECTL_SNAPSHOT_EARLY_RESTORE=0, a third agent, in the same rounds).",
        "",
    ]
    parts_header = ["pull->running vs created after the download", "vs runc restore after all data",
                    "in-agent restore", "resolve", "download",
                    "create + start", "hook create", "hook waited", "hook: Python start-up", "hook: image check",
                    "hook: runc restore", "hook: after it", "raw criu restore", "hook calls"]  # fmt: skip
    lines += _table(result, parts_header, _restore_parts)
    breakdowns = [((row.get("agent") or {}).get("restore_breakdown") or {}) for row in result["rows"]]
    gaps = [(row, b.get("restore_log_gaps")) for row, b in zip(result["rows"], breakdowns, strict=True)]
    if any(g for _, g in gaps):
        lines += ["", "The longest pauses in the last restore's CRIU log (runc restore), per workload:", ""]
        for row, g in gaps:
            for sec, before, after in g or []:
                where = f"{_code(before)} and {_code(after)}"
                lines.append(f"- {row['kind']} {row['mib']} MiB: {sec * 1000:.1f} ms between {where}")
    lines += [
        "",
        "Where a served checkpoint's time goes (medians): the command's wall time, of which outside the agent's "
        "own timing (the client's start-up, the request, the answer) and in-agent: preflight (the containers, "
        "the registry, the node's facts, the liveness budgets), the freeze (of which CRIU under runc), package "
        "(page chunks compressed, hashed and pushed, the layer of CRIU's other images beside them; and the CPU "
        "time the agent's process spent meanwhile, all threads: compression, hashing, the registry client), upload "
        "(config, manifest and signature, of which signing); where the dumps went (the node's tmpfs or the "
        "state dir on disk, shim/host/memwork.py); last, the serial bound's parts.",
        "",
    ]
    ckpt_header = ["checkpoint->pushed", "outside the agent", "in-agent", "preflight", "freeze", "of which CRIU",
                   "package", "agent CPU while packaging", "config, manifest, signature", "of which signing",
                   "dumped to", "serial bound parts (dump / zstd / sha256 / upload)"]  # fmt: skip
    lines += _table(result, ckpt_header, _checkpoint_parts)
    errors = [
        f"- {row['kind']} {row['mib']} MiB {p}: {row[p]['error']}"
        for row in result["rows"]
        for p in ("podman", "ctr")
        if isinstance(row.get(p), dict) and "error" in row[p]
    ]
    if errors:
        lines += ["", "Peer failures (reported, not hidden):", *errors]
    return "\n".join(lines) + "\n"
