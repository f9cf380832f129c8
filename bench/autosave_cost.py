#!/usr/bin/env python3
"""The steady cost of autosave, as ratios to measurements of the same run (issue 12, item 6).

    sudo .venv/bin/python -m bench.autosave_cost [--size 2048] [--saves 5] [--pct 1] [--pod-mib 64]
                                            [--no-encrypt] [--max-span MiB] [-o table|json] [--out FILE]

A workload container (bench/workload.py, `random` = incompressible pages by default) holding --size
MiB changes --pct percent of its memory (one contiguous region) before each of --saves saves, after a
first save that starts the chain. Each save is taken the way the agent's snapshot worker takes a
policy's save (shim/controller/snapshots.py, SnapshotWorker.run), in this process, with no process
start-up: shim.engine.checkpoint.checkpoint with runc run by the agent itself and the node's CRIU
(RuncCheckpointer), the cgroup freezer through a freeze guard process (the DaemonSet's sidecar),
sealed with the namespace key (the DaemonSet's default; --no-encrypt to compare) and signed, every
save of the chain pushed to one repository, so that chunks the registry has are not sent again.
What is left out is the API server's part (status patches, Events), which has no registry or CRIU in it.

Per save it reports:

* freeze: the agent's frozen time vs a raw ``criu dump --leave-running`` of a host process of the same
  program and size (one raw dump after each save, medians; the first is a warm-up);
* bytes uploaded vs bytes changed: changed = pages whose content differs between the dump of this save
  and the previous one (compared page by page, by virtual address; CRIU's dumps are kept just long
  enough to hash them), so the interpreter's own churn counts as changed; uploaded = what the registry
  lacked (chunks, the small layer of CRIU's other images, the config). The goal (issue 12): chunk bytes
  uploaded <= 2x changed, i.e. uploaded <= 2x changed + metadata;
* CPU seconds: getrusage of this process and its reaped children (runc and CRIU included) around the
  save vs the raw dump's (CRIU's) CPU seconds.

And for a --pod-mib pod (default 64; 0 skips it): the in-agent save's end-to-end time (the
checkpoint() call) vs the serial bound defined as bench/run.py does (raw dump + ``tar | zstd -1 -T0`` +
``sha256sum`` + upload of the result, each timed alone), for a full save into a fresh repository and
for an autosave save (--pct changed, same repository).

Needs root and the node deps (hack/install-node-deps.sh). It starts its own containerd and registry
(127.0.0.1, a free port) under /var/tmp, but writes runc's CRIU configuration /etc/criu/runc.conf as
install-node does: on a shared machine, run it under the e2e lock (flock /run/ks-e2e.lock ...).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import autosave_report as R
from bench.pagediff import page_hashes
from bench.run import CRIU, HOST_PY, container, machine_facts, mutate, raw_bounds, sh, wait_file
from bench.workload import args as workload_args
from kubectl_snapshot.adapters.keystore import FileKeyProvider
from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.adapters.signatures import load_signing_key
from kubectl_snapshot.core import chunks as core_chunks
from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.reference import Reference
from kubectl_snapshot.core.sealing import Sealer
from shim import freeze_guard as guard
from shim.containerd.client import ContainerdClient
from shim.containerd.runc_checkpoint import RuncCheckpointer
from shim.engine.checkpoint import CheckpointRequest, checkpoint
from shim.engine.publish import CheckpointResult
from shim.engine.staging import StatePaths
from shim.host import facts as hostfacts
from shim.host import freezer
from shim.net import dumplock, unixpeers
from tests.support.containerd import ContainerdDaemon, node_criu_config
from tests.support.registry import RegistryServer
from tests.support.signing import session_key

NAMESPACE = "bench"  # whose key seals the saves
CONTAINER_NAME = "app"


def cpu_seconds() -> float:
    """User + system CPU of this process (all threads) and of its children that have been reaped."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


@contextlib.contextmanager
def guard_process(work: Path) -> Iterator[guard.GuardClient]:
    """The freeze guard as the DaemonSet runs it: a process of its own beside the agent (its CPU is
    not the agent's and is not counted)."""
    sock, state = work / "guard.sock", work / "guard-holds"
    log = open(work / "guard.log", "wb")  # noqa: SIM115 (handed to the child)
    proc = subprocess.Popen(
        [sys.executable, "-m", "shim.freeze_guard", "--socket", str(sock), "--state-dir", str(state)],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
        cwd=str(Path(__file__).resolve().parent.parent),
        start_new_session=True,
    )
    log.close()
    try:
        deadline = time.monotonic() + 15
        while not sock.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the freeze guard did not start: {(work / 'guard.log').read_text()[-800:]}")
            time.sleep(0.02)
        yield guard.GuardClient(str(sock), {"namespace": NAMESPACE, "name": "autosave-bench", "uid": ""})
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Agent:
    """SnapshotWorker.run's save path, minus the API server: the same checkpoint() call and arguments."""

    def __init__(self, daemon: ContainerdDaemon, work: Path, guard_client: guard.GuardClient, *, seal: bool) -> None:
        self.containerd = ContainerdClient(daemon.address, daemon.namespace, checkpointer=RuncCheckpointer(CRIU))
        self.registry = RegistryClient()
        self.paths = StatePaths(str(work / "agent-state"))
        self.guard = guard_client
        self.facts = hostfacts.gather(containerd_version=self.containerd.version()[0])  # once, as the agent
        keys = FileKeyProvider(str(work / "keys"))
        self.sealer = Sealer(keys.namespace_key(NAMESPACE, create=True), NAMESPACE) if seal else None
        self.signing_key = load_signing_key(str(session_key().private))

    def close(self) -> None:
        self.containerd.close()

    def save(self, cid: str, target: Reference, *, keep_work: bool = False) -> dict[str, Any]:
        """One save; wall and CPU seconds of the checkpoint() call, and its dump dir if kept."""
        work_root = Path(self.paths.root) / "work"
        before = set(work_root.iterdir()) if work_root.exists() else set()
        req = CheckpointRequest(
            containers=[cid],
            names=[CONTAINER_NAME],
            target=target,
            group="autosave-bench",
            namespace=NAMESPACE,
            keep_work=keep_work,
            signing_key=self.signing_key,
            node=os.uname().nodename,
        )
        cpu0, t0 = cpu_seconds(), time.monotonic()
        result: CheckpointResult = checkpoint(
            req,
            containerd=self.containerd,
            registry=self.registry,
            paths=self.paths,
            host=self.facts,
            freezer_for=self.guard.freezer_for,
            memory_of=freezer.task_memory,
            sealer=self.sealer,
            unix_links=unixpeers.find_cross_links,
            net_lock=dumplock.pod_network_locked,
        )
        wall, cpu = time.monotonic() - t0, cpu_seconds() - cpu0
        kept = sorted(set(work_root.iterdir()) - before) if keep_work else []
        chunks = [
            {**c.to_dict(), "file": pf.name} for rec in result.config.containers for pf in rec.pages for c in pf.chunks
        ]
        return {
            "wall_s": wall,
            "cpu_s": cpu,
            "freeze_s": result.timings_ms["freeze_ms"] / 1000,
            "uploaded": result.uploaded,
            "size": result.size,
            "frozen_by": result.frozen_by,
            "timings_ms": {k: round(v, 1) for k, v in result.timings_ms.items()},
            "chunks": chunks,
            "work": kept[0] if kept else None,
        }


def raw_dump(pid: int, d: Path) -> tuple[float, float]:
    """(wall, CPU) seconds of a raw ``criu dump --leave-running`` of a host process (bench/run.py's options)."""
    d.mkdir(parents=True)
    cpu0, t0 = cpu_seconds(), time.monotonic()
    sh([CRIU, "dump", "-t", str(pid), "-D", str(d), "--leave-running", "--tcp-established", "--file-locks",
        "-o", "dump.log"])  # fmt: skip
    wall, cpu = time.monotonic() - t0, cpu_seconds() - cpu0
    shutil.rmtree(d)
    return wall, cpu


@contextlib.contextmanager
def host_workload(work: Path, mib: int, kind: str) -> Iterator[int]:
    ctl = Path(tempfile.mkdtemp(dir=work))
    proc = subprocess.Popen(
        [HOST_PY, *workload_args(ctl, mib, kind)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_file(ctl / "ready")
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(ctl, ignore_errors=True)


def measure_steady(
    daemon: ContainerdDaemon, agent: Agent, registry: RegistryServer, work: Path, mib: int, kind: str, pct: float,
    saves: int,
) -> dict[str, Any]:  # fmt: skip
    """The chain: a base save, then `saves` saves each after `pct`% of the memory changed; a raw dump of
    the host process of the same size after each (the first is the warm-up)."""
    samples: list[dict[str, Any]] = []
    raw: dict[str, list[float]] = {"dump_s": [], "cpu_s": []}
    seen: set[str] = set()
    previous: dict[R.PageKey, bytes] | None = None
    with host_workload(work, mib, kind) as host_pid, container(daemon, mib, kind) as (cid, ctl):
        repo = f"{registry.host}/autosave/{cid}"
        for i in range(saves + 1):
            written = None
            if i:
                mutate(ctl, pct)
                written = int((mib << 20) * pct / 100) if kind == "random" else None
            print(f"[autosave] {mib} MiB save {i}/{saves}", file=sys.stderr)
            s = agent.save(cid, Reference.parse(f"{repo}:{cid}-{i}"), keep_work=True)
            work_dir = s.pop("work")
            if work_dir is None:
                raise RuntimeError("the save's dump directory was not kept")
            hashes, where = page_hashes(work_dir / CONTAINER_NAME / C.CHECKPOINT_DIRECTORY)
            cpu0 = cpu_seconds()  # the agent deletes its dump dir: that is the agent's CPU too
            shutil.rmtree(work_dir)
            s["cpu_s"] += cpu_seconds() - cpu0
            chunks = s.pop("chunks")
            s["new_chunks"], s["new_chunk_raw"], _ = R.new_chunks(chunks, seen)
            # what the page blobs cost on the wire: all the save uploaded but its layer and config (the
            # save's size less its page blobs'), so a blob an earlier save had, sent again, counts
            s["metadata_bytes"] = s["size"] - R.stored_bytes(chunks)
            s["chunk_uploaded"] = s["uploaded"] - s["metadata_bytes"]
            changed = None if previous is None else R.changed_keys(previous, hashes)
            if changed is not None:  # which chunks were sent, and how much of each had changed
                s["sent_chunks"] = R.chunk_breakdown(chunks, seen, {where[k] for k in changed})
            s["chunks_total"] = len(chunks)
            s["chunk_raw_max"] = max((int(c["length"]) for c in chunks), default=0)
            seen |= R.blob_digests(chunks)
            s["dumped_pages"] = len(hashes)
            s["changed_bytes"] = None if changed is None else len(changed) * R.PAGE
            s["written_bytes"] = written
            previous = hashes
            samples.append(s)
            wall, cpu = raw_dump(host_pid, work / "raw" / str(i))
            if i:
                raw["dump_s"].append(wall)
                raw["cpu_s"].append(cpu)
    return {"mib": mib, "kind": kind, "pct": pct, "saves": samples, "raw": raw}


def measure_pod(
    daemon: ContainerdDaemon, agent: Agent, registry: RegistryServer, work: Path, mib: int, kind: str, pct: float,
    runs: int,
) -> dict[str, Any]:  # fmt: skip
    """A small pod's save end to end (in the agent: no process start-up) vs bench/run.py's serial bound."""
    print(f"[autosave] {mib} MiB pod: serial bound", file=sys.stderr)
    bound = raw_bounds(work, registry, mib, kind, runs, restore=False)
    full: list[float] = []
    incremental: list[float] = []
    cpu: list[float] = []
    with container(daemon, mib, kind) as (cid, ctl):
        for i in range(runs + 1):  # a fresh repository each time: everything is uploaded
            s = agent.save(cid, Reference.parse(f"{registry.host}/pod-{uuid.uuid4().hex[:8]}:{cid}"))
            if i:
                full.append(s["wall_s"])
        repo = f"{registry.host}/autosave/{cid}"
        agent.save(cid, Reference.parse(f"{repo}:base"))
        for i in range(runs):
            mutate(ctl, pct)
            s = agent.save(cid, Reference.parse(f"{repo}:{i}"))
            incremental.append(s["wall_s"])
            cpu.append(s["cpu_s"])
    return {"mib": mib, "kind": kind, "bound": bound, "full_s": full, "incremental_s": incremental, "cpu_s": cpu}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=2048, help="MiB of touched memory of the autosaved process")
    ap.add_argument("--saves", type=int, default=5, help="saves measured after the chain's first")
    ap.add_argument("--pct", type=float, default=1.0, help="percent of the memory changed before each save")
    ap.add_argument("--kind", default="random", choices=["random", "objects"], help="bench/workload.py kind")
    ap.add_argument("--pod-mib", type=int, default=64, help="the small pod's MiB (0: skip that part)")
    ap.add_argument("--pod-runs", type=int, default=None, help="the small pod's runs (default: --saves)")
    ap.add_argument("--no-encrypt", action="store_true", help="do not seal (the DaemonSet seals by default)")
    ap.add_argument(
        "--max-span",
        type=int,
        default=0,
        choices=[0, 1, 2, 4, 8, 16],
        help="experiment: cap the chunk span at this many MiB in this process (0: the product's MAX_SPAN)",
    )
    ap.add_argument("-o", "--output", default="table", choices=["table", "json"])
    ap.add_argument("--out", default="", help="also write the JSON result to this file")
    a = ap.parse_args(argv)
    if a.saves < 1 or a.size < 1:
        ap.error("--saves and --size must be at least 1")
    if a.max_span:  # what-if for the chunking trade-off (docs/performance.md); restores accept any span <= 16 MiB
        core_chunks.MAX_SPAN = a.max_span << 20
    # a SIGTERM (timeout, kill) unwinds like ^C: daemons stopped, workloads killed, CRIU config removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="ksbench-autosave-", dir="/var/tmp"))
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, work, True)
        conf = stack.enter_context(node_criu_config())
        daemon = ContainerdDaemon("autosave", work / "ctrd")
        registry = RegistryServer(work / "registry")
        daemon.start()
        stack.callback(daemon.stop)
        registry.start()
        stack.callback(registry.stop)
        agent = Agent(daemon, work, stack.enter_context(guard_process(work)), seal=not a.no_encrypt)
        stack.callback(agent.close)
        steady = measure_steady(daemon, agent, registry, work, a.size, a.kind, a.pct, a.saves)
        pod = None
        if a.pod_mib:
            runs = a.pod_runs if a.pod_runs is not None else a.saves
            pod = measure_pod(daemon, agent, registry, work, a.pod_mib, a.kind, a.pct, runs)
        facts = machine_facts()
        facts["criu_config"] = f"{conf.path}: {conf.state}" if conf else "n/a"
    result: dict[str, Any] = {
        "machine": facts,
        "command": " ".join(["python -m bench.autosave_cost", *(argv if argv is not None else sys.argv[1:])]),
        "sealed": not a.no_encrypt,
        "max_span_mib": core_chunks.MAX_SPAN >> 20,
        "elapsed_s": time.monotonic() - started,
        "steady": steady,
        "pod": pod,
    }
    result["summary"] = R.summarize(result)
    text = json.dumps(result, indent=2)
    if a.out:
        Path(a.out).write_text(text)
    print(text if a.output == "json" else R.markdown(result))


if __name__ == "__main__":
    main()
