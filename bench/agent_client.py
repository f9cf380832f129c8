#!/usr/bin/env python3
"""What a served `ks-agent checkpoint|restore` costs beyond the agent's own work: the client.

    sudo .venv/bin/python bench/agent_client.py [--calls 40] [--rounds 4]

`ks-agent` sends a checkpoint or restore to the node's warm agent (shim/service/localapi.py). The Python
client starts an interpreter first (with its site and the ~40 modules forwarding imports); the agent
image's `ks-agent` is the static launcher in front of it, which sends a served command itself
(launcher/agentclient.go). Both ask one `ks-agent serve` (a containerd of its own, started here)
for a checkpoint of a container that does not exist: a whole round trip through the agent (the
request, its checks, containerd's answer, the error rendered and printed) with next to no work in it.
Rounds alternate the two clients; each round times --calls commands of each, wall time from start to
exit. Prints the median per command of each and the ratio, and checks that both printed the same.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.run import PY_AGENT, ServedAgent, agent_client
from tests.support.containerd import ContainerdDaemon


def timed_calls(program: str, args: list[str], env: dict[str, str], n: int) -> tuple[list[float], str]:
    times, err = [], ""
    for _ in range(n):
        t = time.monotonic()
        proc = subprocess.run([program, *args], env=env, capture_output=True, text=True, check=False)
        times.append((time.monotonic() - t) * 1000)
        if proc.returncode == 0 or not proc.stderr.startswith("error: "):
            raise RuntimeError(f"{program}: expected the agent's error, got {proc.returncode}: {proc.stderr}")
        err = proc.stderr
    return times, err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ksclient-", dir="/var/tmp"))
    client = agent_client(work)  # as bench/run.py runs ks-agent
    if client == PY_AGENT:
        raise SystemExit("error: no Go to build the launcher (launcher)\nhint: run make go-tools")
    daemon = ContainerdDaemon("client", work / "ctrd")
    daemon.start()
    served = None
    try:
        served = ServedAgent(daemon)  # the Python ks-agent serve, as bench/run.py's
        env, log = served.env, served.log
        args = ["checkpoint", "-a", daemon.address, "-n", daemon.namespace, "--to", "127.0.0.1:1/x:y", "no-such-task"]
        clients = {"python": PY_AGENT, "launcher": str(client)}
        times: dict[str, list[float]] = {k: [] for k in clients}
        errors: dict[str, str] = {}
        timed_calls(PY_AGENT, args, env, 2)  # warm-up: the agent's first request, the page cache
        for r in range(a.rounds):
            for name in list(clients) if r % 2 == 0 else list(clients)[::-1]:
                ts, errors[name] = timed_calls(clients[name], args, env, a.calls)
                times[name].extend(ts)
        answered = sum("node-local checkpoint failed" in line for line in log.read_text().splitlines())
        total = 2 + 2 * a.rounds * a.calls
        if answered != total:
            raise RuntimeError(f"the agent answered {answered} of {total} requests (the rest ran standalone)")
        if errors["python"] != errors["launcher"]:
            raise RuntimeError(f"the clients printed different errors:\n{errors}")
        py, go = statistics.median(times["python"]), statistics.median(times["launcher"])
        print(f"served ks-agent checkpoint (the agent's error for a missing container), {len(times['python'])} each:")
        print(f"  Python client: {py:.1f} ms; the launcher's client: {go:.1f} ms: {go / py:.2f}x")
    finally:
        if served is not None:
            served.close()
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
