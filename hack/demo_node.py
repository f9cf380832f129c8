#!/usr/bin/env python3
"""The local node demo: a registry and two containerd "nodes" on this machine, a counter container on
node A snapshotted with ks-agent, killed, and restored on node B where it counts on.

Run through `make demo` (which installs what it needs first). Everything stays on loopback."""

from __future__ import annotations

import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.containerd import ContainerdDaemon
from tests.support.images import busybox_image
from tests.support.registry import RegistryServer
from tests.support.signing import write_key

BIN = Path(sys.executable).parent
COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /tmp/count; echo count $i; sleep 1; done"


def say(text: str) -> None:
    print(f"\n\033[1m== {text}\033[0m", flush=True)


def run(*args: str) -> str:
    print("$ " + " ".join(shlex.quote(a) for a in args), flush=True)
    out = subprocess.run(args, check=True, text=True, stdout=subprocess.PIPE).stdout
    print(out.rstrip(), flush=True)
    return out.strip()


def count(daemon: ContainerdDaemon, cid: str) -> int:
    with daemon.client() as c:
        code, out, err = c.exec_in_task(cid, ["cat", "/tmp/count"])
    if code != 0:
        raise SystemExit(f"exec failed: {err.decode()}")
    return int(out)


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="kubectl-snapshot-demo-", dir="/var/tmp"))
    registry = RegistryServer(work / "registry")
    node_a = ContainerdDaemon("node-a", work / "a", namespace="demo")
    node_b = ContainerdDaemon("node-b", work / "b", namespace="demo")
    try:
        say("starting a registry on loopback and two containerd instances (node A, node B)")
        registry.start()
        node_a.start()
        node_b.start()
        print(f"registry {registry.host}; node A {node_a.address}; node B {node_b.address}")
        image = busybox_image(node_a)
        busybox_image(node_b)

        say("node A: a counter container")
        with node_a.client() as c:
            c.run_container("counter", image=image, args=["sh", "-c", COUNTER], runc_options=node_a.runc_options)
        time.sleep(4)
        print(f"counter on node A is at {count(node_a, 'counter')}")

        say("snapshot it (freeze, CRIU dump, push to the registry, sign) and stop it")
        keys = write_key(work / "keys", "demo")  # the cluster's agents hold one made by `install`
        agent = str(BIN / "ks-agent")
        ref = run(
            agent,
            "checkpoint",
            "--signing-key",
            str(keys.private),
            "-a",
            node_a.address,
            "-n",
            "demo",
            "--stop",
            "--to",
            f"{registry.host}/demo/counter:v1",
            "counter",
        )
        with node_a.client() as c:
            c.remove_container("counter")
        print("the original is gone from node A")

        say("what the snapshot holds")
        run(agent, "inspect", "--trusted-key", str(keys.public), ref)

        say("restore it on node B")
        run(
            agent,
            "restore",
            "--trusted-key",
            str(keys.public),
            "-a",
            node_b.address,
            "-n",
            "demo",
            "--runtime-binary",
            str(BIN / "ks-runc"),
            "--runc-root",
            node_b.runc_root,
            ref,
            "counter-restored",
        )
        first = count(node_b, "counter-restored")
        time.sleep(3)
        later = count(node_b, "counter-restored")
        print(f"counter on node B: {first} right after the restore, {later} three seconds later")
        if first < 4 or later <= first:
            raise SystemExit("the counter did not carry on from the snapshot")
        say("the counter carried on from where it was snapshotted")
    finally:
        node_b.stop()
        node_a.stop()
        registry.stop()


if __name__ == "__main__":
    main()
