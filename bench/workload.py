"""The benchmark workload: a Python process holding N MiB of touched memory, driven through files.

Run as ``python3 -c SOURCE CTL_DIR MIB KIND`` (the source is handed over, not imported: it runs in
the test image's python3 and on the host alike). KIND is ``random`` (incompressible pages) or
``objects`` (a realistic heap: many small dicts, strings and ints). In CTL_DIR it writes ``ready``;
on ``mutate`` (holding a percentage) it rewrites that share of its memory in place, as one
contiguous region, then writes ``mutated``.
"""

from __future__ import annotations

from pathlib import Path

SOURCE = r"""
import os, sys, time
ctl, mib, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
size = mib << 20
if kind == "random":
    heap = bytearray(os.urandom(size))
else:
    # ~200 bytes per record: a dict, a short str, an int, a float (what services and trainers hold)
    heap = [{"id": i, "name": "user-%08d" % i, "score": i * 0.5, "tags": ["a", str(i % 97)]}
            for i in range(size // 420)]
open(os.path.join(ctl, "ready"), "w").write(str(os.getpid()))
while True:
    m = os.path.join(ctl, "mutate")
    if os.path.exists(m):
        pct = float(open(m).read() or 5)
        os.unlink(m)
        n = int(len(heap) * pct / 100)
        start = int.from_bytes(os.urandom(4), "little") % max(1, len(heap) - n)
        if kind == "random":
            heap[start:start + n] = os.urandom(n)
        else:
            for i in range(start, start + n):
                heap[i]["score"] = -heap[i]["score"] - 1.0
                heap[i]["name"] = "changed-%08d" % i
        open(os.path.join(ctl, "mutated"), "w").write("1")
    time.sleep(0.02)
"""


def args(ctl: str | Path, mib: int, kind: str) -> list[str]:
    return ["-c", SOURCE, str(ctl), str(mib), kind]
