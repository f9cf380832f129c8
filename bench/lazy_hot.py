"""Most used first: a lazy restore's first answer with and without the snapshot's hot pages (issue 44).

    sudo flock /run/ks-e2e.lock .venv/bin/python -m bench.lazy_hot [--mib 1024] [--hot 24] [--rounds 3]

A runc container (tests/support/lazyrestore.py's box) holds MIB MiB of a random pattern and, in a loop,
reads one byte of each of HOT pages spread evenly over it, then writes its counter: its answer needs
that working set. It is checkpointed once; its page file is pushed to a local registry in chunks of the
span a save would choose (core/chunks.choose_span). Each round restores it lazily as the agent does
(shim/engine/lazyrestore.py: `stage_lazy`, a `LazySession` from the registry, ``runc restore -d
--lazy-pages``), started together as a restore whose staging just finished, twice in turn:

* without a hot list (the chunks come as the faults and the daemon's fill ask for them);
* with the hot list the first round's session recorded (`LazySession.trace`: what the next save of
  the pod would carry in its layer), whose chunks the session fetches first.

Measured from the session's start: runc restore's return (the process runs) and the first counter
written after the checkpoint's (the first answer). Prints the medians of --rounds rounds after the
recording one, as with / without; absolute times only beside the ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core import hotpages
from kubectl_snapshot.core.chunks import PagesFile, choose_span
from kubectl_snapshot.core.hotpages import HotRange
from kubectl_snapshot.core.reference import Reference
from shim.engine import lazyrestore
from shim.engine.lazyrestore import LazySession, stage_lazy
from shim.engine.staging import lazy_used_dir
from tests.support import lazyrestore as lr
from tests.support.registry import RegistryServer

WORKLOAD = """
import os, random, sys, time
size, seed = int(sys.argv[1]), int(sys.argv[2])
hot = int(open('/data/hot').read())
r, buf = random.Random(seed), bytearray(size)
for off in range(0, size, 16 << 20):
    buf[off : off + (16 << 20)] = r.randbytes(min(16 << 20, size - off))
step = size // hot
def put(name, text):
    with open(f'/data/{name}.tmp', 'w') as f:
        f.write(text)
    os.replace(f'/data/{name}.tmp', f'/data/{name}')
put('sum0', 'written')
i = 0
while True:
    i += 1
    s = sum(buf[k * step + 4096 * 7] for k in range(hot))  # the working set: one page in each step
    put('n', f'{i} {s}')
    time.sleep(0.01)
"""


@dataclass
class Record:  # what stage_lazy reads of a snapshot's ContainerRecord
    name: str
    pages: tuple[PagesFile, ...]


def _counter(box: lr.Box) -> int:
    try:
        return int((box.data / "n").read_text().split()[0])
    except (FileNotFoundError, IndexError, ValueError):
        return 0


def _push(images: Path, registry: RegistryServer) -> tuple[list[Path], tuple[PagesFile, ...], Reference]:
    ref = Reference.parse(f"{registry.host}/bench/hot@sha256:" + "0" * 64)
    client = RegistryClient(plain_http=True)
    others, files = [], []
    for f in sorted(images.iterdir()):
        if f.name.startswith("pages-"):
            files.append(lr.push_chunks(client, ref, f, span=choose_span(f.stat().st_size)))
        else:
            others.append(f)
    return others, tuple(files), ref


def _round(box0: lr.Box, others: list[Path], record: Record, ref: Reference, work: Path, saved: int,
           hot: tuple[HotRange, ...] = ()) -> tuple[float, float, tuple[HotRange, ...]]:  # fmt: skip
    """(restore's return, first answer) in seconds from the session's start, and the session's trace."""
    staged = work / "app"
    cp = staged / C.CHECKPOINT_DIRECTORY
    cp.mkdir(parents=True)
    for f in others:
        shutil.copyfile(f, cp / f.name)
    if hot:  # as the layer of the pod's next save holds it
        (staged / C.HOT_PAGES_FILE).write_bytes(hotpages.to_bytes(hot))
    stage = stage_lazy(record, str(staged), registry=RegistryClient(plain_http=True), ref=ref, opener=None)  # type: ignore[arg-type]
    if stage is None:
        raise SystemExit("the dump cannot be restored lazily")
    assert lazyrestore.take_slots(1)
    failures: list[str] = []
    session = LazySession(stage, criu=["criu"], criu_version=lr.criu_version(), on_failure=failures.append)
    with lr.fresh(box0) as box:
        t0 = time.monotonic()
        session.start()
        try:
            res = box.restore_cmd(cp, staged, "--lazy-pages")
            running = time.monotonic() - t0
            if res.returncode:
                raise SystemExit(f"runc restore failed: {res.stdout}\n{lr.log_tail(staged / 'restore.log')}")
            os.rename(staged, lazy_used_dir(str(staged)))  # as the runtime wrapper does
            box.wait_for(lambda: _counter(box) > saved, 120, "the first answer")
            answer = time.monotonic() - t0
            assert session.thread is not None
            session.thread.join(300)
            if failures:
                raise SystemExit(f"the lazy restore failed: {failures}")
            return running, answer, session.trace()
        finally:
            session.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--hot", type=int, default=24, help="working-set pages, spread evenly over the pattern")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    lr.require()
    with tempfile.TemporaryDirectory(prefix="ks-lazy-hot-") as tmp:
        base = Path(tmp)
        registry = RegistryServer(base / "registry")
        registry.start()
        box = lr.Box(base, f"ks-lazy-hot-{os.getpid()}", size=a.mib << 20).make()
        (box.data / "work.py").write_text(WORKLOAD)
        (box.data / "hot").write_text(str(a.hot))
        try:
            box.run()
            box.wait_for(lambda: _counter(box) > 2, 300, "the pattern")
            box.checkpoint(base / "images", base / "dump-work")
            saved = _counter(box)
            others, files, ref = _push(base / "images", registry)
            span = files[0].chunks[0].length if files and files[0].chunks else 0
            _, _, trace = _round(box, others, Record("app", files), ref, base / "r0", saved)
            got: dict[str, list[float]] = {k: [] for k in ("run", "answer", "hot run", "hot answer")}
            for i in range(a.rounds):
                order = (False, True) if i % 2 == 0 else (True, False)
                for hot in order:
                    rec = Record("app", files)
                    run, answer, _ = _round(box, others, rec, ref, base / f"r{i}-{hot}", saved, trace if hot else ())
                    got["hot run" if hot else "run"].append(run)
                    got["hot answer" if hot else "answer"].append(answer)
        finally:
            box.kill()
            box.remove()
            registry.stop()
    med = {k: statistics.median(v) for k, v in got.items()}
    ratio = {
        k: statistics.median(h / n for h, n in zip(got[f"hot {k}"], got[k], strict=True)) for k in ("run", "answer")
    }
    print(f"# lazy restore of a {a.mib} MiB pattern whose answer reads {a.hot} pages spread over it; chunks of "
          f"{span >> 20} MiB; {len(trace)} hot ranges recorded; medians of {a.rounds} rounds\n")  # fmt: skip
    print("| | without hot pages | with | with / without |")
    print("|---|---|---|---|")
    print(f"| running (runc restore returned) | {med['run']:.2f} s | {med['hot run']:.2f} s | {ratio['run']:.2f}x |")
    print(f"| first answer | {med['answer']:.2f} s | {med['hot answer']:.2f} s | {ratio['answer']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
