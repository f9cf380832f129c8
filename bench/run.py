#!/usr/bin/env python3
"""kubectl-snapshot benchmark: every figure is a ratio to a bound or a peer measured in the same run.

    .venv/bin/python bench/run.py [--quick] [--sizes 64,512,2048] [--kinds random,objects] [--runs 5]
                                  [--no-peers] [--python-client] [--out bench/results]

For each workload (a Python process holding N MiB of touched memory, incompressible or a realistic
object heap; bench/workload.py) it measures, as medians of --runs runs after one warm-up:

* freeze: the agent's frozen time vs a raw ``criu dump --leave-running`` of the same program;
* checkpoint -> pushed (CLI wall time, fresh repository every run) vs the serial bound (raw criu dump
  + tar|zstd -1 + sha256 + upload, each timed on its own) and vs podman ``container checkpoint
  --export --compress zstd`` (which does not even push) and ``ctr c checkpoint --task --rw`` +
  ``ctr images push``;
* pull -> running vs the bound (download + zstd -d|tar + raw ``criu restore``) and vs podman
  ``container restore --import`` and ``ctr images pull`` + ``ctr c restore --live --rw``;
* snapshot size vs RSS and vs ``zstd -1`` of the raw CRIU images;
* bytes uploaded by a second snapshot after 1% and 5% of the memory changed, vs the first's, and vs
  the pages that really changed between the two dumps, compressed like chunks (bench/pagediff.py);
  with the CPU that hashing every page (page deltas) costs vs compressing + hashing the same bytes,
  and a full save's checkpoint -> pushed with page deltas vs without (KUBECTL_SNAPSHOT_PAGE_DELTAS=0,
  alternated with the measured runs).

Writes RESULTS.md and results.json (machine facts included) under --out. Needs root, the node deps
(hack/install-node-deps.sh) and, for the peers, hack/install-bench-deps.sh (podman). Network: the
registry listens on 127.0.0.1 and podman containers run with --network none.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import criulog, launcher, pagediff, report
from bench.throttle import LinkedRegistry, ThrottledLink
from bench.workload import args as workload_args
from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.reference import Reference
from shim.host import memwork, rcu
from shim.runtime_wrapper import TRACE_ENV, parse_invocation
from shim.service import localapi
from tests.support.containerd import (
    ContainerdDaemon,
    node_criu_config,
    node_kdat_cache,
    node_memory_work_fs,
    node_rcu_expedite,
)
from tests.support.images import python_image, python_tarball
from tests.support.registry import RegistryServer
from tests.support.signing import signing_env

BIN = Path(sys.executable).parent
PY_AGENT = str(BIN / "ks-agent")  # the Python program
AGENT = PY_AGENT  # what runs as ks-agent: main() puts the launcher in front of it (agent_client)
WRAPPER = str(BIN / "ks-runc")
CTR = "/usr/local/bin/ctr"
CRIU = shutil.which("criu") or "/usr/sbin/criu"
ENV_WORK_FS = "KUBECTL_SNAPSHOT_WORK_FS"  # bench only: "0" leaves the memory work area in /dev/shm (A/B)
HOST_PY = "/usr/bin/python3"
STATE = Path(os.environ.get("KUBECTL_SNAPSHOT_STATE_DIR", "/var/lib/kubectl-snapshot"))
REPO = Path(__file__).resolve().parent.parent


def installed_like() -> None:
    """Compile the project's bytecode first, as `pip install` and the agent image do: the benchmarked
    commands then load it as an installed agent would. Without this, every module whose cached
    bytecode is missing or older than its source is compiled again by every command (never written
    back where PYTHONDONTWRITEBYTECODE is set)."""
    sh([sys.executable, "-m", "compileall", "-q", str(REPO / "kubectl_snapshot"), str(REPO / "shim")])


def sh(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, **kw)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed ({proc.returncode}): {proc.stderr.strip()[-800:]}")
    return proc


def timed(fn: Callable[..., Any], *args: Any, **kw: Any) -> float:
    t = time.monotonic()
    fn(*args, **kw)
    return time.monotonic() - t


def med(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def wait_file(path: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {path}")
        time.sleep(0.05)


def mutate(ctl: Path, pct: float) -> None:
    (ctl / "mutated").unlink(missing_ok=True)
    (ctl / "mutate.tmp").write_text(str(pct))
    (ctl / "mutate.tmp").rename(ctl / "mutate")
    wait_file(ctl / "mutated")


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


# --- raw CRIU and the serial bounds ---------------------------------------------------------------


class RawBound:
    """The serial bound of one workload, one run of its parts per call: a host process holding the
    workload, its raw `criu dump`, `tar | zstd -1 -T0`, sha256sum and the registry upload (checkpoint);
    once the process is gone (stop), the download of the last dump's blob, `zstd -d | tar x` and a raw
    `criu restore` of that dump (restore). bench/run.py calls these between the product's runs, so that
    a bound and what it is divided by are measured alternately, on the same machine at the same time."""

    CHECKPOINT_PARTS = ("dump", "zstd", "sha", "upload")
    RESTORE_PARTS = ("download", "unzstd", "restore")

    def __init__(self, work: Path, registry: RegistryServer, mib: int, kind: str) -> None:
        self.work, self.host = work, registry.host
        self.ctl = Path(tempfile.mkdtemp(dir=work))
        self.dumps = Path(tempfile.mkdtemp(prefix="raw-", dir=work))
        self.reg = RegistryClient()
        self.samples: dict[str, list[float]] = {k: [] for k in (*self.CHECKPOINT_PARTS, *self.RESTORE_PARTS)}
        self.facts: dict[str, Any] = {}
        self.last: tuple[Path, Reference, str, int] | None = None  # the last dump, and its blob in the registry
        self.opts = ["--tcp-established", "--file-locks"]
        self.proc = subprocess.Popen(
            [HOST_PY, *workload_args(self.ctl, mib, kind)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            wait_file(self.ctl / "ready")
            self.facts["rss_bytes"] = rss_bytes(self.proc.pid)
        except BaseException:
            self.close()
            raise

    def checkpoint(self, *, keep: bool = True) -> None:
        """One dump of the running process and its packaging, each part timed on its own (`keep`: record
        the times; False for a warm-up)."""
        d = Path(tempfile.mkdtemp(prefix="d", dir=self.dumps))
        t_dump = timed(sh, [CRIU, "dump", "-t", str(self.proc.pid), "-D", str(d), "--leave-running", *self.opts,
                            "-o", "dump.log"])  # fmt: skip
        blob = self.work / "raw.tar.zst"
        t_z = timed(sh, ["sh", "-c", f"tar -C {d} -cf - . | zstd -1 -T0 -q -c > {blob}"])
        t = time.monotonic()
        digest = "sha256:" + sh(["sha256sum", str(blob)]).stdout.split()[0]
        t_sha = time.monotonic() - t
        ref = Reference.parse(f"{self.host}/raw-{uuid.uuid4().hex[:8]}:x")
        size = blob.stat().st_size
        t_up = timed(self.reg.push_blob, ref, digest=digest, size=size, path=str(blob))
        blob.unlink()
        self.facts["images_bytes"] = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
        self.facts["zstd_bytes"] = size
        if self.last is not None:
            shutil.rmtree(self.last[0], ignore_errors=True)
        self.last = (d, ref, digest, size)
        if keep:
            for k, v in zip(self.CHECKPOINT_PARTS, (t_dump, t_z, t_sha, t_up), strict=True):
                self.samples[k].append(v)

    def stop(self) -> None:
        """The process goes: CRIU restores it with its own pid."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, 9)
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=5)

    def restore(self, *, keep: bool = True) -> None:
        """The last dump's blob downloaded and unpacked, and the dump restored by raw CRIU (then killed)."""
        if self.last is None:
            raise RuntimeError("no dump to restore: checkpoint() first")
        d, ref, digest, size = self.last
        dl = self.work / "dl.tar.zst"
        with open(dl, "wb") as f:
            t_dl = timed(self.reg.fetch_blob, ref, digest, f, expected_size=size)
        x = Path(tempfile.mkdtemp(prefix="x", dir=self.work))
        t_unz = timed(sh, ["sh", "-c", f"zstd -d -q -c {dl} | tar -C {x} -xf -"])
        shutil.rmtree(x)
        dl.unlink()
        t = timed(lambda: sh([CRIU, "restore", "-D", str(d), "--restore-detached", *self.opts, "-o", "r.log"]))
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, 9)
        _wait_gone(self.proc.pid)
        if keep:
            for k, v in zip(self.RESTORE_PARTS, (t_dl, t_unz, t), strict=True):
                self.samples[k].append(v)

    def summary(self) -> dict[str, Any]:
        """The sizes, and each part's median over the recorded runs (`<part>_s`)."""
        return {**self.facts, **{f"{k}_s": med(v) for k, v in self.samples.items()}}

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dumps, ignore_errors=True)
        shutil.rmtree(self.ctl, ignore_errors=True)


def raw_bounds(
    work: Path, registry: RegistryServer, mib: int, kind: str, runs: int, *, restore: bool = True
) -> dict[str, Any]:
    """The serial bound's parts measured on their own, one after the other (RawBound; bench/autosave_cost.py):
    medians of `runs` after a warm-up; with `restore` also the restore's parts."""
    bound = RawBound(work, registry, mib, kind)
    try:
        for i in range(runs + 1):
            bound.checkpoint(keep=i > 0)
        if restore:
            bound.stop()
            for i in range(runs + 1):
                bound.restore(keep=i > 0)
    finally:
        bound.close()
    return bound.summary()


def _wait_gone(pid: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.01)


# --- the agent -----------------------------------------------------------------------------------


@contextlib.contextmanager
def container(daemon: ContainerdDaemon, mib: int, kind: str, ctl_dir: Path | None = None) -> Iterator[tuple[str, Path]]:
    """The workload in a container; its control dir (bind-mounted at /ctl) is removed afterwards unless
    the caller passed it (restores of the checkpoint need the mount source to exist)."""
    cid = f"bench-{kind}-{mib}-{uuid.uuid4().hex[:6]}"
    ctl = ctl_dir or Path(tempfile.mkdtemp(dir=STATE))
    c = daemon.client()
    mount = {"destination": "/ctl", "type": "bind", "source": str(ctl), "options": ["rbind", "rw"]}
    c.run_container(
        cid,
        image=python_image(daemon),
        args=["python3", *workload_args("/ctl", mib, kind)],
        mounts=[mount],
        runc_options=daemon.runc_options,
    )
    try:
        wait_file(ctl / "ready")
        yield cid, ctl
    finally:
        with contextlib.suppress(Exception):
            c.remove_container(cid)
        if ctl_dir is None:
            shutil.rmtree(ctl, ignore_errors=True)


def criu_tar(work: Path) -> str:
    """CRIU's `tar` as the node bundle has it (launcher as ``bin/tar``, first in CRIU's PATH): the
    launcher archives and extracts the containers' small tmpfs trees itself and runs GNU tar (here the
    host's) for anything else, or for everything with KUBECTL_SNAPSHOT_NATIVE_TAR=0. Put first in PATH
    for the whole run, so every CRIU (the agent's, the peers', the references') runs the same tar.
    Returns what the results say about it."""
    gnu = shutil.which("tar")
    tar = work / "bin" / "tar"
    if gnu is None or not launcher.build_tar(tar, gnu, work / "tar.launches"):
        return "the host's GNU tar (no Go to build the launcher)"
    os.environ["PATH"] = f"{tar.parent}:{os.environ.get('PATH', '')}"
    native = "off: GNU tar behind it" if os.environ.get(launcher.NATIVE_TAR_ENV) == "0" else "on"
    return f"the node bundle's launcher, tmpfs trees in-process {native}"


def runtime_hook(work: Path) -> str:
    """The runtime wrapper as nodes run it: the static launcher (launcher, built here) in front of the
    hook's zipapp (hack/build-wrapper-pyz.py) on a bare ``python3 -I -S``; the launcher passes runc's
    plain calls (start, state, kill, delete) on without starting Python. Falls back to the hook alone
    (ks-runc in this venv) where Go or the host's python3 is missing."""
    repo = Path(__file__).resolve().parent.parent
    hook = work / "hook"
    hook_launcher, pyz = hook / "kubectl-snapshot-runc", hook / "kubectl-snapshot-runc.pyz"
    if not os.path.exists(HOST_PY) or not launcher.build(hook_launcher):
        print("[bench] no Go or python3: the runtime wrapper runs without its launcher", file=sys.stderr)
        return WRAPPER
    sh([HOST_PY, str(repo / "hack/build-wrapper-pyz.py"), str(pyz)])
    config = {
        "argv": [HOST_PY, "-I", "-S", "-B", str(pyz)],
        "log": str(hook / LAUNCHES),  # every call containerd's shim makes (time, pid, args): the breakdown
        # pycriu and the upb protobuf runtime from this venv, as the node bundle's lib/hook-site has them
        "env": {
            "KUBECTL_SNAPSHOT_STATE_DIR": str(STATE),
            "KUBECTL_SNAPSHOT_PYCRIU_PATH": sysconfig.get_paths()["purelib"],
            TRACE_ENV: str(hook / TRACES),  # where the hook's create got to, and when
        },
        "runcHook": True,
    }
    Path(f"{hook_launcher}.launch").write_text(json.dumps(config))
    return str(hook_launcher)


def agent_client(work: Path) -> str:
    """`ks-agent` as the agent image has it (hack/agent_image.py): the static launcher in front of the
    Python program, sending a served `checkpoint` or `restore` to the agent itself, without starting an
    interpreter (launcher/agentclient.go); everything else (serve, standalone runs) goes on to this
    venv's ks-agent. Falls back to that alone where Go is missing (the results say which ran)."""
    client = work / "client" / "ks-agent"
    if not launcher.build(client):
        print("[bench] no Go: ks-agent runs without its launcher", file=sys.stderr)
        return PY_AGENT
    Path(f"{client}.launch").write_text(localapi.client_launch([PY_AGENT]))
    return str(client)


LAUNCHES, TRACES = "launches.jsonl", "traces.jsonl"
RESTORE_LOG = TRACES + ".restore.log"  # CRIU's restore.log, kept by the traced hook (runtime_wrapper.trace_copy)
_CREATE_PHASES = {"started", "image-check", "rootfs-diff", "runc-restore", "after-restore"}


def hook_breakdown(hook: Path) -> dict[str, Any] | None:
    """What the runtime wrapper did for one restore (its logs emptied before): how many calls containerd's
    shim made, by runc command, and for the create (the restore) the milliseconds from the launcher's
    start to Python running the hook, of the CRIU image check, and of `runc restore` (CRIU's restore and
    runc's setup around it); None when the hook ran without its launcher."""
    if not (hook / LAUNCHES).exists():
        return None
    launches = [json.loads(line) for line in (hook / LAUNCHES).read_text().splitlines() if line.strip()]
    traces: dict[int, dict[str, float]] = {}
    decoded: dict[int, int] = {}  # images the hook's check decoded itself (not from the agent's decode cache)
    with contextlib.suppress(FileNotFoundError):
        for line in (hook / TRACES).read_text().splitlines():
            t = json.loads(line)
            traces.setdefault(int(t["pid"]), {})[t["phase"]] = float(t["t"])
            if "images_decoded" in t:
                decoded[int(t["pid"])] = int(t["images_decoded"])
    calls: dict[str, int] = {}
    out: dict[str, Any] = {"calls": calls}
    for entry in launches:
        command = parse_invocation(entry["args"]).command or "(none)"
        calls[command] = calls.get(command, 0) + 1
        ph = traces.get(int(entry["pid"]), {})
        if command == "create" and ph.keys() >= _CREATE_PHASES:
            begun = launcher.launch_time(entry["time"])
            out["python_startup_ms"] = (ph["started"] - begun) * 1000
            out["image_check_ms"] = (ph["rootfs-diff"] - ph["image-check"]) * 1000
            if int(entry["pid"]) in decoded:
                out["images_decoded_in_hook"] = decoded[int(entry["pid"])]
            out["runc_restore_ms"] = (ph["after-restore"] - ph["runc-restore"]) * 1000
            if "done" in ph:  # the pod's loopback, the marker, the used staged dir taken away
                out["after_restore_ms"] = (ph["done"] - ph["after-restore"]) * 1000
            # created while the data downloaded: the hook waited at the staging gate (not part of its work)
            waited = ph["staged"] - ph["started"] if "staged" in ph else 0.0
            out["staged_wait_ms"] = waited * 1000
            out["create_ms"] = (ph.get("done", ph["after-restore"]) - begun - waited) * 1000
    with contextlib.suppress(FileNotFoundError):
        log = (hook / RESTORE_LOG).read_text(errors="replace")
        criu = criulog.span(log)
        if criu is not None:  # runc restore = CRIU (its log's first to last line) + runc around it
            out["criu_restore_log_ms"] = criu * 1000
            # an early restore: CRIU waited at the pages gate (runc's answer, held by the relay) for the page files
            waited = criulog.action_wait(log, "post-setup-namespaces")
            if waited is not None:
                out["criu_pages_wait_ms"] = waited * 1000
            out["restore_log_gaps"] = criulog.log_gaps(log, 6)
            # after the memory: the steps to resume (at 61209aa CRIU ran an action script for each; since,
            # the launcher relays runc's socket to CRIU: launcher/criurelay.go)
            tail = criulog.after_memory(log)
            if tail is not None:
                out["criu_after_memory_ms"] = tail * 1000
            # the container's tmpfs mounts, each with its contents put back by CRIU's `tar` (bench/criu_tar.py)
            out["criu_tmpfs_mounts"], tmpfs_s = criulog.tmpfs_mounts(log)
            out["criu_tmpfs_ms"] = tmpfs_s * 1000
    return out


def agent_checkpoint(
    daemon: ContainerdDaemon, ref: str, cid: str, *, page_deltas: bool = True, agent_socket: str = "none"
) -> tuple[float, dict[str, Any]]:
    """`ks-agent checkpoint`'s wall time and JSON: served by the node's agent on `agent_socket` (see
    served_agent), or standalone ("none")."""
    t = time.monotonic()
    env = {**os.environ, C.ENV_PAGE_DELTAS: "1" if page_deltas else "0", localapi.SOCKET_ENV: agent_socket}
    proc = sh([AGENT, "checkpoint", "-a", daemon.address, "-n", daemon.namespace, "-o", "json", "--to", ref, cid],
              env=env)  # fmt: skip
    return time.monotonic() - t, json.loads(proc.stdout)


class ServedAgent:
    """`ks-agent serve` for one containerd, as the DaemonSet's agent serves a node's (shim/service/localapi.py):
    the measured `ks-agent checkpoint|restore` are its clients. Its log counts what it served, so a
    request it declined (then run standalone) cannot pass for a served one."""

    def __init__(self, daemon: ContainerdDaemon, extra_env: dict[str, str] | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="ks-serve-", dir="/tmp"))
        self.socket, self.log = str(self.dir / "agent.sock"), self.dir / "serve.log"
        # what the served clients set: the same environment (an agent serves only requests made in its own)
        self.env = {**os.environ, C.ENV_PAGE_DELTAS: "1", **(extra_env or {}), localapi.SOCKET_ENV: self.socket}
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [AGENT, "serve", "-a", daemon.address, "-n", daemon.namespace, "--socket", self.socket],
                stderr=out, env=self.env,
            )  # fmt: skip
        deadline = time.monotonic() + 60
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ks-agent serve did not start:\n{self.log.read_text()}")
            time.sleep(0.05)

    def served(self, command: str) -> int:
        return sum(f"node-local {command} served" in line for line in self.log.read_text().splitlines())

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        shutil.rmtree(self.dir, ignore_errors=True)


def kept_checkpoint(daemon: ContainerdDaemon, ref: str, cid: str) -> tuple[dict[str, Any], Path]:
    """A snapshot whose dump directory the agent keeps (--keep-work): (its JSON, the CRIU image dir)."""
    work_root = STATE / "work"
    before = set(work_root.iterdir()) if work_root.exists() else set()
    proc = sh([AGENT, "checkpoint", "-a", daemon.address, "-n", daemon.namespace, "-o", "json", "--keep-work",
               "--to", ref, cid])  # fmt: skip
    kept = sorted(set(work_root.iterdir()) - before)
    if len(kept) != 1:
        raise RuntimeError(f"expected one kept dump directory under {work_root}, found {len(kept)}")
    return json.loads(proc.stdout), kept[0]


def incremental(daemon: ContainerdDaemon, registry: RegistryServer, cid: str, ctl: Path) -> dict[str, Any]:
    """A base snapshot, then 1% changed, then 5% more changed (same repository): bytes uploaded by each,
    and the pages that really changed between consecutive dumps (compressed like chunks)."""
    repo = f"{registry.host}/incr-{uuid.uuid4().hex[:8]}"
    out: dict[str, Any] = {}
    hashes = None
    for label, pct in (("base", 0.0), ("1pct", 1.0), ("5pct", 5.0)):
        if pct:
            mutate(ctl, pct)
        res, work = kept_checkpoint(daemon, f"{repo}:{label}", cid)
        try:
            dump = work / cid / "checkpoint"
            hashes, diff = pagediff.changed_pages(hashes, dump)
            out[f"incr_{label}_uploaded"] = res["uploaded"]
            out[f"incr_{label}_package_ms"] = res["timingsMs"].get("package_ms")
            if diff:
                out[f"incr_{label}_changed_bytes"] = diff["changed_bytes"]
                out[f"incr_{label}_changed_packed"] = diff["changed_packed_bytes"]
            if label == "5pct":
                out.update(pagediff.hashing_cost(dump))
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return out


def _ratio(d: dict[str, Any], num: str, den: str) -> float | None:
    return d[num] / d[den] if d.get(num) is not None and d.get(den) else None


def measure_agent(
    daemon: ContainerdDaemon,
    registry: RegistryServer,
    mib: int,
    kind: str,
    runs: int,
    hook: str = WRAPPER,
    incr_runs: int = 1,
    bound: RawBound | None = None,
) -> dict[str, Any]:
    """The product's runs; with `bound`, one run of the serial bound's parts after each run of the
    product's checkpoints and restores (alternated: both measured on the machine as it is then)."""
    os.environ.update(signing_env())  # the agent signs each snapshot and verifies it before a restore, as in use
    freeze, pushed, internal, sizes, restores, runc_dumps = [], [], [], [], [], []
    pushed_plain, internal_plain = [], []  # full saves without page hashing (no page deltas), alternated
    restores_internal: list[float] = []
    breakdowns: list[dict[str, Any]] = []
    ckpt_breakdowns: list[dict[str, Any]] = []  # the served checkpoints' own timings, + the wall time
    dumped_to: set[str] = set()  # where the served checkpoints' dumps went (shim/host/memwork.py)
    out: dict[str, Any] = {}
    served = ServedAgent(daemon)
    pushed_alone, restores_alone = [], []  # the same commands standalone (no agent serving them)
    restores_late, restores_late_internal = [], []
    restores_one_phase: list[float] = []
    with contextlib.ExitStack() as stack:
        stack.callback(served.close)
        # restores whose containers are created only after the download (no staging gate), alternated
        late = ServedAgent(daemon, {C.ENV_EARLY_CREATE: "0"})
        stack.callback(late.close)
        # restores whose hooks wait for all of the data before `runc restore` (one-phase gates), alternated
        one_phase = ServedAgent(daemon, {C.ENV_EARLY_RESTORE: "0"})
        stack.callback(one_phase.close)
        cid, ctl = stack.enter_context(container(daemon, mib, kind))
        ref = ""

        def new_ref() -> str:
            return f"{registry.host}/agent-{uuid.uuid4().hex[:8]}:v1"

        for i in range(runs + 1):
            wall, res = agent_checkpoint(daemon, new_ref(), cid, agent_socket=served.socket)
            ref = res["reference"]
            if i:
                freeze.append(res["timingsMs"]["freeze_ms"] / 1000)
                pushed.append(wall)
                internal.append(res["timingsMs"]["total_ms"] / 1000)
                sizes.append(res["size"])
                out["timings_ms_last"] = res["timingsMs"]
                ckpt_breakdowns.append({**res["timingsMs"], "wall_ms": wall * 1000})
                dumped_to.add(res.get("dumpedTo", "disk"))
            wall, res = agent_checkpoint(daemon, new_ref(), cid)
            if i:
                pushed_alone.append(wall)
            wall, res = agent_checkpoint(daemon, new_ref(), cid, page_deltas=False)
            if i:
                pushed_plain.append(wall)
                internal_plain.append(res["timingsMs"]["total_ms"] / 1000)
            if bound is not None:
                bound.checkpoint(keep=i > 0)
                if i == 0:
                    # Every later round's bound frees its previous dump (page cache) as it keeps a new one;
                    # the warm-up's first did not, and took the memory freed last: the next dump, the first
                    # measured, went to memory the VM had taken back (docs/performance.md, "Memory the VM
                    # took back"). A second warm-up dump leaves the machine as every later round does.
                    bound.checkpoint(keep=False)
        if served.served("checkpoint") != runs + 1:
            raise RuntimeError(f"the agent served {served.served('checkpoint')} of {runs + 1} checkpoints")
        hook_dir = Path(hook).parent
        if bound is not None:
            bound.stop()  # its raw restores need its pid
        base = [AGENT, "restore", "-a", daemon.address, "-n", daemon.namespace, "--runtime-binary", hook,
                "--runc-root", daemon.runc_root, "-o", "json", ref]  # fmt: skip

        def measured(i: int) -> None:  # the served restore, with its breakdown (the hook's logs emptied first)
            for log in (LAUNCHES, TRACES, RESTORE_LOG):
                with contextlib.suppress(FileNotFoundError):
                    (hook_dir / log).unlink()
            wall, proc = restore_as(f"r-{uuid.uuid4().hex[:8]}", served.env)
            if i:
                restores.append(wall)
                timings = json.loads(proc.stdout)["timingsMs"]
                restores_internal.append(timings["total_ms"] / 1000)
                breakdowns.append({**timings, **(hook_breakdown(hook_dir) or {})})

        def late_created(i: int) -> None:
            wall, proc = restore_as(f"l-{uuid.uuid4().hex[:8]}", late.env)
            if i:
                restores_late.append(wall)
                restores_late_internal.append(json.loads(proc.stdout)["timingsMs"]["total_ms"] / 1000)

        def one_phased(i: int) -> None:
            wall, _ = restore_as(f"o-{uuid.uuid4().hex[:8]}", one_phase.env)
            if i:
                restores_one_phase.append(wall)

        def standalone(i: int) -> None:
            wall, _ = restore_as(f"s-{uuid.uuid4().hex[:8]}", {**os.environ, localapi.SOCKET_ENV: "none"})
            if i:
                restores_alone.append(wall)

        def restore_as(new: str, env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess[str]]:
            t = time.monotonic()
            proc = sh([*base, new], env=env)
            wall = time.monotonic() - t
            with contextlib.suppress(Exception):
                daemon.client().remove_container(new)
            return wall, proc

        def raw(i: int) -> None:
            if bound is not None:
                bound.restore(keep=i > 0)

        # A new order each round (seeded: the same in every run of the bench): no variant always follows
        # the bound's raw restore (its 'tar x' writes, a killed process's memory) or another variant.
        variants = [measured, late_created, one_phased, standalone, raw]
        for i in range(runs + 1):
            for variant in random.Random(i).sample(variants, len(variants)):
                variant(i)
        for agent_, what in (
            (served, "restores"),
            (late, "restores without early create"),
            (one_phase, "restores with one-phase gates"),
        ):
            if agent_.served("restore") != runs + 1:
                raise RuntimeError(f"the agent served {agent_.served('restore')} of {runs + 1} {what}")
        # the same container dumped by runc alone (no containerd, no pause, no packaging): what CRIU
        # under runc costs for this container, a second reference for the freeze
        ns_root = next(p for p in Path(daemon.runc_root).iterdir() if (p / cid).is_dir())
        for i in range(runs + 1):
            d = Path(tempfile.mkdtemp(dir=STATE))
            cmd = ["runc", "--root", str(ns_root), "checkpoint", "--leave-running", "--tcp-established",
                   "--file-locks", "--image-path", str(d), "--work-path", str(d), cid]  # fmt: skip
            t = timed(sh, cmd)
            shutil.rmtree(d, ignore_errors=True)
            if i:
                runc_dumps.append(t)
        # the sequence changes a random region each time: with --incr-runs N it runs N times (a fresh
        # repository each) and the run with the median 5% ratio is reported, with the range of all
        seqs = [incremental(daemon, registry, cid, ctl) for _ in range(max(1, incr_runs))]
        ratios = [_ratio(q, "incr_5pct_uploaded", "incr_5pct_changed_packed") for q in seqs]
        order = sorted(range(len(seqs)), key=lambda i: ratios[i] if ratios[i] is not None else 0.0)
        out.update(seqs[order[len(order) // 2]])
        if len(seqs) > 1:
            out["incr_5pct_vs_changed_runs"] = ratios
    out.update(
        freeze_s=med(freeze),
        runc_checkpoint_s=med(runc_dumps),
        pushed_s=med(pushed),
        pushed_standalone_s=med(pushed_alone),
        pushed_internal_s=med(internal),
        pushed_no_deltas_s=med(pushed_plain),
        pushed_internal_no_deltas_s=med(internal_plain),
        size_bytes=med(sizes),
        restore_s=med(restores),
        restore_standalone_s=med(restores_alone),
        restore_internal_s=med(restores_internal),
        restore_late_create_s=med(restores_late),
        restore_late_create_internal_s=med(restores_late_internal),
        restore_one_phase_s=med(restores_one_phase),
        restore_breakdown=_median_breakdown(breakdowns),
        checkpoint_breakdown=_median_breakdown(ckpt_breakdowns),
        dumped_to=" and ".join(sorted(dumped_to)),
        # each run's, in the order taken (a median hides which runs were slow, and how slow)
        freeze_runs_ms=[round(x * 1000, 1) for x in freeze],
        criu_runs_ms=[round(b.get("criu_ms", 0.0), 1) for b in ckpt_breakdowns],
        runc_checkpoint_runs_ms=[round(x * 1000, 1) for x in runc_dumps],
    )
    return out


def _median_breakdown(items: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per field, the median over the runs (the hook's call counts: those of the last run)."""
    keys = sorted({k for it in items for k, v in it.items() if isinstance(v, int | float)})
    out: dict[str, Any] = {k: med([float(it[k]) for it in items if k in it]) for k in keys}
    if items and "calls" in items[-1]:
        out["hook_calls"] = items[-1]["calls"]
    if items and "restore_log_gaps" in items[-1]:
        out["restore_log_gaps"] = items[-1]["restore_log_gaps"]
    return out


# --- peers ---------------------------------------------------------------------------------------


def measure_ctr(
    daemon: ContainerdDaemon, other: ContainerdDaemon, registry: RegistryServer, mib: int, kind: str, runs: int
) -> dict[str, Any]:
    """ctr checkpoint+push on `daemon`, then pull+restore on `other`, after the original is gone: ctr keeps
    the original's cgroup path from the checkpoint, so removing a restored copy kills that cgroup."""
    base = [CTR, "-a", daemon.address, "-n", daemon.namespace]
    there = [CTR, "-a", other.address, "-n", other.namespace]
    python_image(other)
    ckpt, restore, refs = [], [], []
    ctl = Path(tempfile.mkdtemp(dir=STATE))  # the restored copies bind-mount it too
    before = _ctrd_checkpoint_dirs()
    try:
        with container(daemon, mib, kind, ctl) as (cid, _ctl):
            for i in range(runs + 1):
                ref = f"{registry.host}/ctr-{uuid.uuid4().hex[:8]}:v1"
                t = time.monotonic()
                sh([*base, "c", "checkpoint", "--task", "--rw", cid, ref])
                sh([*base, "images", "push", "--plain-http", ref])
                if i:
                    ckpt.append(time.monotonic() - t)
                sh([*base, "images", "rm", ref])
                refs.append(ref)
        for i, ref in enumerate(refs):
            new = f"ctr-r-{uuid.uuid4().hex[:6]}"
            t = time.monotonic()
            sh([*there, "images", "pull", "--plain-http", ref])
            sh([*there, "c", "restore", "--live", "--rw", new, ref])
            if i:
                restore.append(time.monotonic() - t)
            with contextlib.suppress(Exception):
                other.client().remove_container(new)
            with contextlib.suppress(Exception):
                sh([*there, "images", "rm", ref])
    finally:
        shutil.rmtree(ctl, ignore_errors=True)
        for d in _ctrd_checkpoint_dirs() - before:  # the workload's memory, left by containerd's restores
            shutil.rmtree(d, ignore_errors=True)
    return {"checkpoint_push_s": med(ckpt), "pull_restore_s": med(restore)}


def _ctrd_checkpoint_dirs() -> set[Path]:
    """containerd unpacks a checkpoint to restore into $XDG_RUNTIME_DIR (or the temp dir)/ctrd-checkpoint*
    and never removes it (its Tasks.Create, containerd 2.x)."""
    bases = {Path(tempfile.gettempdir()), Path("/tmp")}
    if os.environ.get("XDG_RUNTIME_DIR"):
        bases.add(Path(os.environ["XDG_RUNTIME_DIR"]))
    return {d for b in bases for d in b.glob("ctrd-checkpoint*") if d.is_dir() and not d.is_symlink()}


def podman_image() -> str:
    out = sh(["podman", "load", "-q", "-i", str(python_tarball())]).stdout
    return out.strip().split()[-1]


def measure_podman(work: Path, image: str, mib: int, kind: str, runs: int) -> dict[str, Any]:
    name = f"pb-{kind}-{mib}-{uuid.uuid4().hex[:6]}"
    ctl = Path(tempfile.mkdtemp(dir=work))
    sh(["podman", "run", "-d", "--runtime", "runc", "--network", "none", "--name", name, "-v", f"{ctl}:/ctl",
        image, "python3", *workload_args("/ctl", mib, kind)])  # fmt: skip
    ckpt, restore, sizes = [], [], []
    try:
        wait_file(ctl / "ready")
        for i in range(runs + 1):
            f = work / f"{name}.tar.zst"
            t = timed(sh, ["podman", "container", "checkpoint", "--leave-running", "--export", str(f),
                           "--compress", "zstd", name])  # fmt: skip
            new = f"{name}-r{i}"
            t_r = timed(sh, ["podman", "container", "restore", "--import", str(f), "--name", new])
            sh(["podman", "rm", "-f", new])
            if i:
                ckpt.append(t)
                restore.append(t_r)
                sizes.append(f.stat().st_size)
            f.unlink()
    finally:
        subprocess.run(["podman", "rm", "-f", name], capture_output=True, check=False)
        shutil.rmtree(ctl, ignore_errors=True)
    return {"checkpoint_export_s": med(ckpt), "restore_import_s": med(restore), "export_bytes": med(sizes)}


def peer(fn: Callable[[], dict[str, Any]], what: str) -> dict[str, Any]:
    try:
        return fn()
    except Exception as e:  # a peer that fails here is reported, not fatal
        print(f"  {what} failed: {e}", file=sys.stderr)
        return {"error": str(e)[-300:]}


def machine_facts() -> dict[str, Any]:
    def version(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout.strip().splitlines()[0]
        except (OSError, IndexError):
            return ""

    model = ""
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    mem = 0
    with contextlib.suppress(OSError):
        lines = Path("/proc/meminfo").read_text().splitlines()
        mem = int(next(ln.split()[1] for ln in lines if ln.startswith("MemTotal"))) * 1024
    return {
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "memory_bytes": mem,
        "python": platform.python_version(),
        "criu": version([CRIU, "--version"]),
        "runc": version(["runc", "--version"]),
        "containerd": version(["/usr/local/bin/containerd", "--version"]),
        "podman": version(["podman", "--version"]),
        "loadavg": os.getloadavg(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="64,512,2048", help="MiB of touched memory (comma-separated)")
    ap.add_argument("--kinds", default="random,objects", help="random (incompressible), objects (Python heap)")
    ap.add_argument("--runs", type=int, default=5, help="measured runs per metric (after one warm-up)")
    ap.add_argument(
        "--incr-runs", type=int, default=1, help="incremental sequences per workload (the median one is reported)"
    )
    ap.add_argument("--quick", action="store_true", help="64 and 512 MiB only")
    ap.add_argument("--no-peers", action="store_true", help="skip podman and ctr")
    ap.add_argument(
        "--link-mbps",
        type=float,
        default=0,
        help="put the registry behind a link of this many Mbit/s (a loopback proxy, bench/throttle.py)",
    )
    ap.add_argument(
        "--python-client",
        action="store_true",
        help="run ks-agent without the launcher in front of it (the Python client; to compare)",
    )
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    a = ap.parse_args()
    # a SIGTERM (timeout, kill) unwinds like ^C: daemons stopped, workloads killed, CRIU config removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    installed_like()
    sizes = [64, 512] if a.quick else [int(x) for x in a.sizes.split(",")]
    kinds = a.kinds.split(",")
    work = Path(tempfile.mkdtemp(prefix="ksbench-", dir="/var/tmp"))
    # The node as install-node leaves it (runc's CRIU configuration: nftables network lock; CRIU's
    # kernel-feature cache on a tmpfs where /run is not one; RCU grace periods expedited during the
    # product's dumps and restores, shim/host/rcu.py: not during the peers' or the bounds'); runc reads the
    # configuration for podman's checkpoints too, and every CRIU of the same build loads the cache, so
    # the peers and the raw bounds run with the same CRIU as the agent.
    stack = contextlib.ExitStack()
    tar = criu_tar(work)  # before the daemons start: they and everything below inherit its PATH
    global AGENT
    # every ks-agent below (serve, the measured clients, standalone) through it
    AGENT = PY_AGENT if a.python_client else agent_client(work)
    conf = stack.enter_context(node_criu_config())
    kdat = stack.enter_context(node_kdat_cache())
    # KUBECTL_SNAPSHOT_EXPEDITE_RCU=0: the node as install-node leaves it with that opt-out (to compare)
    expedite = stack.enter_context(node_rcu_expedite(STATE)) if rcu.enabled(os.environ) else f"off ({rcu.ENV}=0)"
    # the memory work area on install-node's tmpfs with large folios (shim/host/workfs.py); KUBECTL_SNAPSHOT_WORK_FS=0:
    # /dev/shm's directory as before (to compare)
    work_fs = stack.enter_context(node_memory_work_fs(STATE)) if os.environ.get(ENV_WORK_FS, "1") != "0" else None
    daemon = ContainerdDaemon("bench", work / "ctrd")
    other = ContainerdDaemon("bench-b", work / "ctrd-b")
    registry = RegistryServer(work / "registry")
    daemon.start()
    other.start()
    registry.start()
    link = ThrottledLink(registry.host, a.link_mbps) if a.link_mbps > 0 else None
    reached: Any = LinkedRegistry(registry, link) if link is not None else registry  # what every client uses
    rows = []
    hook = runtime_hook(work)
    started = time.monotonic()
    try:
        pimage = (
            None if a.no_peers or not shutil.which("podman") else peer(lambda: {"i": podman_image()}, "podman load")
        )
        for kind in kinds:
            for mib in sizes:
                print(f"[bench] {kind} {mib} MiB", file=sys.stderr)
                row: dict[str, Any] = {"kind": kind, "mib": mib, "runs": a.runs}
                # the serial bound's parts are measured between the product's runs (RawBound)
                bound = RawBound(work, reached, mib, kind)
                try:
                    row["agent"] = measure_agent(daemon, reached, mib, kind, a.runs, hook, a.incr_runs, bound)
                finally:
                    bound.close()
                row["raw"] = bound.summary()
                if not a.no_peers:
                    if pimage and "i" in pimage:
                        row["podman"] = peer(lambda: measure_podman(work, pimage["i"], mib, kind, a.runs), "podman")  # noqa: B023 (called at once)
                    row["ctr"] = peer(lambda: measure_ctr(daemon, other, reached, mib, kind, a.runs), "ctr")  # noqa: B023 (called at once)
                rows.append(row)
    finally:
        daemon.stop()
        other.stop()
        if link is not None:
            link.close()
        registry.stop()
        shutil.rmtree(work, ignore_errors=True)
        facts = machine_facts()
        if link is not None:
            facts["link"] = f"{a.link_mbps:g} Mbit/s"
        facts["criu_config"] = f"{conf.path}: {conf.state}" if conf else "n/a"
        facts["criu_kdat"] = f"{kdat.path}: {kdat.state}" if kdat else "n/a"
        facts["rcu_expedite"] = expedite
        facts["memory_work"] = f"{memwork.ENV_MIB}={memwork.limit_bytes() >> 20}" + (
            f", on {work_fs.state} tmpfs ({work_fs.detail})" if work_fs is not None else f", /dev/shm ({ENV_WORK_FS}=0)"
        )
        facts["criu_tar"] = tar
        facts["ks_agent"] = (
            "the static launcher in front of the Python program" if AGENT != PY_AGENT else "the Python program"
        )
        stack.close()
    result = {"machine": facts, "elapsed_s": time.monotonic() - started, "rows": rows}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    md = report.markdown(result)
    (out / "RESULTS.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
