#!/usr/bin/env python3
"""The registry client's own CPU per request: the project's session against requests' default one.

    sudo .venv/bin/python bench/client_cpu.py [--requests 300] [--rounds 6] [--service-vars 400]

A snapshot of a small pod is a dozen blobs of three requests each, and every chunk worker shares two
cores with the registry and the compression: what the client spends per request counts. requests'
default session (`trust_env`) reads the process environment twice per request for proxy settings;
the project's session (kubectl_snapshot/adapters/registry/transport.py: new_session) reads it once
where that gives the same answer. Each round times `--requests` blob HEADs against the Debian
docker-registry the benchmarks use (a blob that exists) with each session in turn, in this process's
environment and again with `--service-vars` more variables, the kind Kubernetes gives every container
for the services of its namespace (7 per service). Prints the median CPU per request and the ratio.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import requests

from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.core.reference import Reference
from tests.support.registry import RegistryServer

# what Kubernetes sets for each service of a pod's namespace (enableServiceLinks), after SVC_
SERVICE_SUFFIXES = ("SERVICE_HOST", "SERVICE_PORT", "PORT", "PORT_80_TCP", "PORT_80_TCP_PROTO", "PORT_80_TCP_PORT",
                    "PORT_80_TCP_ADDR")  # fmt: skip


def cpu_per_head(client: RegistryClient, ref: Reference, digest: str, n: int) -> float:
    start = time.process_time()
    for _ in range(n):
        assert client.blob_exists(ref, digest)
    return (time.process_time() - start) / n * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--service-vars", type=int, default=400)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ksclientcpu-", dir="/var/tmp"))
    server = RegistryServer(work / "registry")
    server.start()
    try:
        ref = Reference.parse(f"{server.host}/client-cpu:v1")
        blob = os.urandom(1024)
        digest = "sha256:" + hashlib.sha256(blob).hexdigest()
        RegistryClient().push_blob(ref, digest=digest, size=len(blob), data=blob)
        services = {f"SVC{i // len(SERVICE_SUFFIXES)}_{SERVICE_SUFFIXES[i % len(SERVICE_SUFFIXES)]}": "10.96.0.1"
                    for i in range(a.service_vars)}  # fmt: skip
        print(f"environment: {len(os.environ)} variables, then {len(os.environ) + len(services)}")
        for label, extra in (("as is", {}), (f"+{a.service_vars} service variables", services)):
            with mock.patch.dict(os.environ, extra):
                clients = {"project": RegistryClient(), "requests default": RegistryClient(session=requests.Session())}
                times: dict[str, list[float]] = {k: [] for k in clients}
                for r in range(a.rounds):
                    for name in list(clients) if r % 2 == 0 else list(clients)[::-1]:
                        times[name].append(cpu_per_head(clients[name], ref, digest, a.requests))
                mine, theirs = statistics.median(times["project"]), statistics.median(times["requests default"])
                print(
                    f"{label}: CPU per request {mine:.3f} ms (project session) vs {theirs:.3f} ms (requests' "
                    f"default): {mine / theirs:.2f}x"
                )
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
