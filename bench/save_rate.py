#!/usr/bin/env python3
"""Save time per GiB, to size terminationGracePeriodSeconds for the final save (docs/kubernetes.md,
"Final save").

    sudo .venv/bin/python bench/save_rate.py [--sizes 256,1024] [--kinds random] [--runs 2]

For each size, a container holding that much touched memory (bench/workload.py; ``random`` is
incompressible, the slowest to save; ``objects`` a Python heap) is saved by the node engine
(``ks-agent checkpoint``: freeze, dump, package, push to a registry on 127.0.0.1, fresh repository each
run), median wall time of --runs runs after one warm-up. Printed: each size's time, and the line
through the smallest and the largest size: seconds per GiB (slope) and the fixed part (intercept),
plus the ratio of each size's time to that line (how straight it is). These are this machine's rates
(2 vCPUs, loopback registry): measure on your nodes and your registry link before setting a grace
period. Same setup as bench/run.py (root, hack/install-node-deps.sh; the CRIU configuration of a node).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import sys
import tempfile
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.run import agent_checkpoint, container, med
from tests.support.containerd import ContainerdDaemon, node_criu_config
from tests.support.registry import RegistryServer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="256,1024", help="MiB of touched memory (comma-separated, 2 or more)")
    ap.add_argument("--kinds", default="random", help="random (incompressible), objects (Python heap)")
    ap.add_argument("--runs", type=int, default=2, help="measured runs per size (after one warm-up)")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sizes = sorted(int(x) for x in a.sizes.split(","))
    if len(sizes) < 2:
        ap.error("--sizes needs two sizes or more (the rate is the slope between the smallest and the largest)")
    work = Path(tempfile.mkdtemp(prefix="ksbench-", dir="/var/tmp"))
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, work, True)
        stack.enter_context(node_criu_config())
        daemon = ContainerdDaemon("bench", work / "ctrd")
        registry = RegistryServer(work / "registry")
        daemon.start()
        stack.callback(daemon.stop)
        registry.start()
        stack.callback(registry.stop)
        for kind in a.kinds.split(","):
            times: dict[int, float] = {}
            for mib in sizes:
                print(f"[save_rate] {kind} {mib} MiB", file=sys.stderr)
                walls = []
                with container(daemon, mib, kind) as (cid, _ctl):
                    for i in range(a.runs + 1):
                        ref = f"{registry.host}/rate-{uuid.uuid4().hex[:8]}:v1"
                        wall, _res = agent_checkpoint(daemon, ref, cid)
                        if i:
                            walls.append(wall)
                t = med(walls)
                assert t is not None
                times[mib] = t
            lo, hi = sizes[0], sizes[-1]
            slope = (times[hi] - times[lo]) / ((hi - lo) / 1024)  # seconds per GiB
            intercept = times[lo] - slope * lo / 1024
            print(f"\n{kind}: save (freeze, dump, package, push) wall time, median of {a.runs}")
            print("| size | seconds | vs the line |")
            print("|---|---|---|")
            for mib in sizes:
                line = intercept + slope * mib / 1024
                print(f"| {mib} MiB | {times[mib]:.2f} | {times[mib] / line:.2f}x |")
            print(f"{kind}: {slope:.2f} s per GiB + {intercept:.2f} s fixed (this machine)")


if __name__ == "__main__":
    main()
