"""Lazy restore against eager restore of the same checkpoint: how much sooner the process runs.

    sudo flock /run/ks-e2e.lock .venv/bin/python bench/lazy_restore.py [--sizes 128,512] [--runs 5]

A runc container holding N MiB of a random pattern (tests/support/lazyrestore.py) is checkpointed once
with plain ``runc checkpoint``; then, alternating, per round:

* eager: ``runc restore -d`` of the dump, timed to its return (the process runs with all its memory);
* lazy: the agent's page server and ``criu lazy-pages --page-server`` started, then ``runc restore -d
  --lazy-pages`` of the lazy images: timed from the start of all three to runc's return (running), and
  to the daemon's exit (every page resident, the background transfer done, the program idle); and
  ``runc restore --lazy-pages`` alone (the daemon and page server started ahead, as staging could).

The lazy images are prepared once (shim/criu/lazyimages.py, timed apart): on a node that is staging's
work, done while the pages are downloaded. Each restored process checks its pattern (SHA-256) once
resident. Prints the medians of --runs rounds after a warm-up round, as ratios to eager in the same
round; absolute times only to read the ratios by.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support import lazyrestore as lr


def measure(mib: int, runs: int, base: Path) -> dict[str, list[float]]:
    box = lr.Box(base, f"ks-lazy-bench-{os.getpid()}", size=mib << 20).make()
    try:
        box.run()
        box.checkpoint(base / "images", base / "dump-work")
        t = time.monotonic()
        prepared = lr.prepare(base / "images", base / "lazy")
        prepare_s = time.monotonic() - t
        want = lr.expected_sum(box.size, box.seed)
        keys = ("eager", "lazy running", "lazy restore alone", "lazy resident", "prepare")
        out: dict[str, list[float]] = {k: [] for k in keys}
        for i in range(runs + 1):
            eager = box.restore_eager(base / "images", base / f"eager-{i}")
            if box.verify() != want:
                raise AssertionError("the eagerly restored pattern differs")
            box.kill()
            box.remove()
            lazy = lr.restore_lazy(box, base / "images", prepared, base / f"lazy-{i}")
            try:
                resident = lazy.wait_resident()
                if lazy.daemon.returncode != 0 or box.verify() != want:
                    raise AssertionError(f"the lazy restore failed or its pattern differs\n{lazy.daemon_log()}")
            finally:
                lazy.close()
                box.kill()
                box.remove()
            if i:
                out["eager"].append(eager)
                out["lazy running"].append(lazy.running_s)
                out["lazy restore alone"].append(lazy.restore_s)
                out["lazy resident"].append(resident)
                out["prepare"].append(prepare_s)
            print(f"# {mib} MiB round {i}: eager {eager:.3f} s, lazy running {lazy.running_s:.3f} s, "
                  f"resident {resident:.3f} s", file=sys.stderr, flush=True)  # fmt: skip
        return out
    finally:
        box.kill()
        box.remove()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="128,512")
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    print(f"# runc restore -d, eager vs --lazy-pages from the agent's page server; medians of {a.runs} rounds\n")
    print("| pattern | lazy running / eager | the same, daemon started ahead | lazy resident / eager "
          "| preparing the lazy images / eager | eager |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for mib in (int(s) for s in a.sizes.split(",")):
        with tempfile.TemporaryDirectory(prefix="ks-lazy-bench-") as tmp:
            got = measure(mib, a.runs, Path(tmp))
        ratio = {k: statistics.median(e / x for e, x in zip(v, got["eager"], strict=True)) for k, v in got.items()}
        print(f"| {mib} MiB | {ratio['lazy running']:.2f}x | {ratio['lazy restore alone']:.2f}x | "
              f"{ratio['lazy resident']:.2f}x | "
              f"{ratio['prepare']:.2f}x | {statistics.median(got['eager']):.2f} s |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
