#!/usr/bin/env python3
"""Where the freeze goes, and which of it a node can avoid: one run, ratios of the same run.

    sudo flock /run/ks-e2e.lock .venv/bin/python bench/freeze_breakdown.py [--sizes 64] [--kind random]
                                                                          [--runs 5] [--gaps 0]

For each size, one workload container (bench/workload.py) is checkpointed over and over, alternating
between CRIU without its kernel-feature cache (what these VMs give it: /run is not a tmpfs) and with
the cache arranged the way install-node arranges it (shim/criu/kdat.py: a tmpfs file bound on
/run/criu.kdat). In each round, for both:

* the agent's save, taken in this process the way the agent's snapshot worker takes it
  (shim.engine.checkpoint.checkpoint: freeze through a freeze guard process, runc run by the agent
  with the node's CRIU configuration, writable layer captured while frozen, thaw; unsealed, into a
  registry on 127.0.0.1), with its frozen time split into the engine's steps;
* ``runc checkpoint --leave-running`` of the same container run directly (no containerd, no pause, no
  layer diff): the freeze's reference (goal: freeze <= 1.1x this + 10 ms);
* a raw ``criu dump --leave-running`` of a host process of the same program and size;

and, once per round, containerd's Pause/Resume (the agent's fallback) and a cgroup freezer write.

CRIU's own time under runc is split by its dump.log (the direct runc checkpoint's, -v4 as runc logs):
start-up and kernel probing, seizing and the network lock, the process (memory pages, registers,
files), the mount namespace, the other namespaces (IPC, UTS, network), cgroups and the inventory, the
network unlock with runc's notification, and runc's own time outside CRIU's log. Each is marked fixed
per container or growing with memory, and whether a node can avoid it.

Prints medians (after one warm-up). The cache arrangement found at the start (an installed agent's,
or none) is restored at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.autosave_cost import Agent, guard_process, host_workload
from bench.criulog import log_gaps, stamps
from bench.run import CRIU, container
from kubectl_snapshot.core.reference import Reference
from shim.criu import kdat as criu_kdat
from shim.host import rcu
from tests.support.containerd import ContainerdDaemon, node_criu_config
from tests.support.registry import RegistryServer

OFF, ON, NATIVE = "no kdat cache", "kdat cache (install-node's tmpfs)", "kdat cache (/run is a tmpfs)"

# CRIU's dump.log under runc, cut at the first line of each phase (criu/cr-dump.c, 4.2.1).
PHASES: list[tuple[str, str, str, str]] = [
    # (name, first line's pattern, fixed per container or grows, can a node avoid it)
    ("start-up and kernel probing", r"", "fixed", "yes: CRIU's kdat cache on a tmpfs (install-node)"),
    ("seize, network lock, process tree", r"Dumping processes \(pid", "fixed", "no"),
    ("the process: memory pages, registers, files", r"Dumping task \(pid", "grows with memory", "no"),
    ("mount namespace (mounts; tmpfs contents by tar)", r"Obtaining task auvx", "fixed (per mount)", "no"),
    ("IPC, UTS, network namespaces (links, addresses, rules)", r"Dumping \d+\(\d+\)'s namespaces", "fixed", "no"),
    ("cgroups, inventory", r"Namespaces dump complete", "fixed", "no"),
    # mostly not nftables: an RCU grace period where CRIU's mount namespaces go
    # (docs/performance.md, "RCU grace periods in CRIU's mount namespaces")
    (
        "network unlock, runc's notification (an RCU wait)",
        r"Running post-dump scripts",
        "fixed",
        "yes, the RCU wait: expedited grace periods (the agent's dumps, shim/host/rcu.py; --expedite-rcu)",
    ),
    ("thaw, stats", r"Unfreezing tasks", "fixed", "no"),
]
RUNC_OUTSIDE = "runc outside CRIU's log (runc start, its state, CRIU's start, exit)"
AGENT = "agent freeze"
FREEZING, CRIU_PART, DIFF, THAW, REST = (
    "freezing (cgroup freezer through the guard)",
    "CRIU through runc (runc checkpoint run by the agent)",
    "writable layer diff",
    "thaw (through the guard)",
    "the rest (work files, volumes, bookkeeping)",
)
RUNC = "runc checkpoint of the same container, run directly"
RAW = "raw criu dump of the host process"


def timed(fn: Callable[[], object]) -> float:
    t = time.monotonic()
    fn()
    return time.monotonic() - t


def run_timed(cmd: list[str]) -> float:
    t = time.monotonic()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.monotonic() - t


def phases(log: str) -> dict[str, float]:
    """Seconds CRIU spent in each phase of PHASES, from the dump.log's time stamps (a phase that did not
    appear gets 0; its time goes to the one before)."""
    lines = stamps(log)
    if not lines:
        return {}
    starts: list[tuple[str, float]] = [(PHASES[0][0], 0.0)]
    for name, pattern, _, _ in PHASES[1:]:
        hit = next((t for t, text in lines if re.search(pattern, text)), None)
        if hit is not None and hit >= starts[-1][1]:
            starts.append((name, hit))
    end = lines[-1][0]
    out = {name: 0.0 for name, *_ in PHASES}
    for (name, t), (_, t_next) in zip(starts, [*starts[1:], ("", end)], strict=True):
        out[name] = t_next - t
    out["total"] = end
    return out


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def set_cache(variant: str) -> None:
    if variant == ON:
        r = criu_kdat.ensure(CRIU)
        if r.state != "mounted":
            sys.exit(f"could not arrange CRIU's kdat cache: {r}")
    elif variant == OFF:
        criu_kdat.remove()


def measure(
    daemon: ContainerdDaemon, agent: Agent, registry: RegistryServer, work: Path, mib: int, kind: str, runs: int,
    variants: list[str], n_gaps: int,
) -> dict[str, Any]:  # fmt: skip
    rows = (AGENT, FREEZING, CRIU_PART, DIFF, THAW, REST, RUNC, RAW)
    steps: dict[str, dict[str, list[float]]] = {v: {k: [] for k in rows} for v in variants}
    logs: dict[str, dict[str, list[float]]] = {v: {} for v in variants}
    agent_logs: dict[str, dict[str, list[float]]] = {v: {} for v in variants}  # the agent's own dump.log
    fallback: dict[str, list[float]] = {"pause": [], "resume": [], "freezer write": []}
    last_log: dict[str, str] = {}

    def add(table: dict[str, list[float]], key: str, value: float, keep: bool) -> None:
        if keep:
            table.setdefault(key, []).append(value)

    with host_workload(work, mib, kind) as host_pid, container(daemon, mib, kind) as (cid, _ctl):
        c = daemon.client()
        ns_root = next(p for p in Path(daemon.runc_root).iterdir() if (p / cid).is_dir())
        for i in range(runs + 1):
            keep = i > 0  # the first round warms up
            for variant in variants if i % 2 == 0 else variants[::-1]:
                set_cache(variant)

                def agent_step(variant: str = variant, keep: bool = keep) -> None:
                    target = Reference.parse(f"{registry.host}/freeze-{uuid.uuid4().hex[:8]}:v1")
                    s = agent.save(cid, target, keep_work=True)
                    t = s["timings_ms"]
                    parts = {
                        AGENT: t["freeze_ms"],
                        FREEZING: t.get("freezing_ms", 0.0),
                        CRIU_PART: t.get("criu_ms", 0.0),
                        DIFF: t.get("layer_diff_ms", 0.0),
                        THAW: t.get("thaw_ms", 0.0),
                    }
                    parts[REST] = parts[AGENT] - sum(v for k, v in parts.items() if k != AGENT)
                    for k, v in parts.items():
                        add(steps[variant], k, v / 1000, keep)
                    if s["work"] is not None:
                        for log in Path(s["work"]).rglob("dump.log"):
                            for k, v in phases(log.read_text(errors="replace")).items():
                                add(agent_logs[variant], k, v, keep)
                        shutil.rmtree(s["work"], ignore_errors=True)

                def runc_step(variant: str = variant, keep: bool = keep) -> None:
                    r = work / "runc"
                    r.mkdir()
                    cmd = ["runc", "--root", str(ns_root), "checkpoint", "--leave-running", "--tcp-established",
                           "--file-locks", "--image-path", str(r), "--work-path", str(r), cid]  # fmt: skip
                    wall = run_timed(cmd)
                    log = (r / "dump.log").read_text(errors="replace")
                    shutil.rmtree(r)
                    add(steps[variant], RUNC, wall, keep)
                    ph = phases(log)
                    for k, v in ph.items():
                        add(logs[variant], k, v, keep)
                    add(logs[variant], RUNC_OUTSIDE, wall - ph.get("total", 0.0), keep)
                    last_log[variant] = log

                def raw_step(variant: str = variant, keep: bool = keep) -> None:
                    d = work / "raw"
                    d.mkdir()
                    raw = [CRIU, "dump", "-t", str(host_pid), "-D", str(d), "--leave-running", "--tcp-established",
                           "--file-locks", "-o", "dump.log"]  # fmt: skip
                    add(steps[variant], RAW, run_timed(raw), keep)
                    shutil.rmtree(d)

                # the same conditions for each: written back what the step before wrote (a 2 GiB dump
                # otherwise slows the next one down), and the agent and runc take turns going first
                order = [agent_step, runc_step, raw_step] if i % 2 == 0 else [runc_step, agent_step, raw_step]
                for step in order:
                    os.sync()
                    step()
            add(fallback, "pause", timed(lambda: c.pause_task(cid)), keep)
            add(fallback, "resume", timed(lambda: c.resume_task(cid)), keep)
            task = c.get_task(cid)
            fz = agent.guard.freezer_for(task.pid) if task is not None else None
            if fz is not None:
                add(fallback, "freezer write", timed(fz.direct.freeze), keep)
                fz.direct.thaw()
    return {
        "runs": {v: {k: d[k] for k in (AGENT, RUNC)} for v, d in steps.items()},
        "steps": {v: {k: med(xs) for k, xs in d.items()} for v, d in steps.items()},
        "phases": {v: {k: med(xs) for k, xs in d.items()} for v, d in logs.items()},
        "agent_phases": {v: {k: med(xs) for k, xs in d.items()} for v, d in agent_logs.items()},
        "fallback": {k: med(xs) for k, xs in fallback.items()},
        "gaps": {v: log_gaps(log, n_gaps) for v, log in last_log.items()},
    }


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _ms(x: float) -> str:
    return f"{x * 1000:.1f} ms"


def report(mib: int, kind: str, runs: int, res: dict[str, Any]) -> None:
    steps, variants = res["steps"], list(res["steps"])
    both = len(variants) == 2  # no cache, cache: one more column with their ratio
    print(f"\n## {mib} MiB, {kind}: medians of {runs} runs after a warm-up\n")
    print(_row(["step", *variants, *(["cache / no cache"] if both else [])]))
    print(_row(["---"] * (len(variants) + 1 + both)))
    for key in steps[variants[0]]:
        vals = [steps[v][key] for v in variants]
        name = key if key in (AGENT, RUNC, RAW) else f"&nbsp;&nbsp;of which {key}"
        print(_row([name, *(_ms(x) for x in vals), *([f"{vals[1] / vals[0]:.2f}x"] if both else [])]))
    extra = [""] if both else []
    print(_row(["freeze / runc checkpoint", *(f"{steps[v][AGENT] / steps[v][RUNC]:.2f}x" for v in variants), *extra]))
    goal = []
    for v in variants:
        f, bound = steps[v][AGENT], 1.1 * steps[v][RUNC] + 0.010
        goal.append(f"{'met' if f <= bound else '**missed**'} ({_ms(f)} vs {_ms(bound)})")
    print(_row(["goal: freeze <= 1.1x runc checkpoint + 10 ms", *goal, *extra]))
    print(_row(["freeze / raw criu dump", *(f"{steps[v][AGENT] / steps[v][RAW]:.2f}x" for v in variants), *extra]))

    for v in variants:
        each = "; ".join(f"{k}: " + ", ".join(f"{x * 1000:.0f}" for x in res["runs"][v][k]) for k in (AGENT, RUNC))
        print(f"\nEach run, ms ({v}): {each}")

    print("\nCRIU under runc (the direct runc checkpoint; in parentheses the agent's, of its frozen container),")
    print("by their dump.logs:\n")
    print(_row(["phase", *variants, "per container", "a node can avoid it"]))
    print(_row(["---"] * (len(variants) + 3)))
    agent = res.get("agent_phases") or {}

    def cell(v: str, name: str) -> str:
        mine = (agent.get(v) or {}).get(name)
        return _ms(res["phases"][v].get(name, 0.0)) + ("" if mine is None else f" ({_ms(mine)})")

    for name, _, grows, avoid in [*PHASES, (RUNC_OUTSIDE, "", "fixed", "no")]:
        print(_row([name, *(cell(v, name) for v in variants), grows, avoid]))
    print(_row(["CRIU's log, start to end", *(cell(v, "total") for v in variants), "", ""]))

    fb = res["fallback"]
    print(
        f"\ncontainerd Pause {_ms(fb['pause'])}, Resume {_ms(fb['resume'])} (the agent's fallback); "
        f"cgroup freezer write {_ms(fb.get('freezer write', float('nan')))} (what the guard does)."
    )
    for v, gaps in res["gaps"].items():
        if gaps:
            print(f"\nThe {len(gaps)} longest pauses between lines of the last runc dump.log ({v}):\n")
            print("| pause | last line before it | first line after it |\n|---|---|---|")
            for sec, before, after in gaps:
                print(f"| {_ms(sec)} | `{before}` | `{after}` |")


def _fstype(path: Path) -> str:
    best, kind = "", "?"
    for line in Path("/proc/self/mounts").read_text().splitlines():
        f = line.split()
        if len(f) > 2 and str(path).startswith(f[1].rstrip("/") + "/") and len(f[1]) >= len(best):
            best, kind = f[1], f[2]
    return kind


def _switch() -> str:
    try:
        return Path("/sys/kernel/rcu_expedited").read_text().strip()
    except OSError:
        return ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64", help="MiB of touched memory, comma-separated")
    ap.add_argument("--kind", default="random", choices=("random", "objects"))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--gaps", type=int, default=0, help="also list the N longest pauses in the last dump.log")
    ap.add_argument(
        "--expedite-rcu",
        action="store_true",
        help="RCU grace periods expedited for the whole run, every dump alike (shim/host/rcu.py's switch, "
        "put back after)",
    )
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    mounts = criu_kdat.parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    native = criu_kdat.decide(criu_kdat.KDAT_FILE, mounts) == "native"
    had_cache = criu_kdat.mount_at(criu_kdat.KDAT_FILE, mounts) is not None
    variants = [NATIVE] if native else [OFF, ON]
    work = Path(tempfile.mkdtemp(prefix="ksfreeze-", dir="/var/tmp"))
    results = {}
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, work, True)
        if not native:  # leave the machine's arrangement as it was found
            stack.callback(lambda: criu_kdat.ensure(CRIU) if had_cache else criu_kdat.remove())
        conf = stack.enter_context(node_criu_config())
        expedite = "normal grace periods"
        if a.expedite_rcu:  # one token held throughout: the agent's dumps, runc's and the raw dump alike
            os.makedirs(rcu.directory(str(work)))
            token = stack.enter_context(rcu.expedited(str(work)))
            expedite = "expedited" if token and (token.switched or _switch() == "1") else "could not expedite"
        daemon = ContainerdDaemon("freeze", work / "ctrd")
        registry = RegistryServer(work / "registry")
        daemon.start()
        stack.callback(daemon.stop)
        registry.start()
        stack.callback(registry.stop)
        agent = Agent(daemon, work, stack.enter_context(guard_process(work)), seal=False)
        stack.callback(agent.close)
        for mib in (int(x) for x in a.sizes.split(",")):
            results[mib] = measure(daemon, agent, registry, work, mib, a.kind, a.runs, variants, a.gaps)
    print(f"CRIU {CRIU}; runc's CRIU configuration {conf.path}: {conf.state}" if conf else f"CRIU {CRIU}")
    print(f"RCU grace periods: {expedite}")
    # the agent's saves keep their work dir for its dump.log, and a kept work dir is never in memory
    # (shim/engine/checkpoint.py, _expected_dump): every dump here goes to the same filesystem
    print(f"every dump (the agent's, runc checkpoint's, the raw one) in {work} ({_fstype(work)})")
    for mib, res in results.items():
        report(mib, a.kind, a.runs, res)


if __name__ == "__main__":
    main()
