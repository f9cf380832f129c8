"""`ks-agent restore --lazy` on a node without Kubernetes (shim/engine/nodelazy.py), on real containerd,
runc, CRIU and a registry: the container runs before its memory is back, the command serves its pages
from the registry's chunks and returns once every page is in, with the process's heap whole. When pages
cannot come (a chunk the registry holds damaged), or when the command is stopped while pages are still
on their way, the container is killed and the command fails saying so: never a process running on the
zeros the kernel would give for what had not come. Root; run under ``flock /run/ks-e2e.lock``."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from typing import Any

import pytest

from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.adapters.signatures import load_signed
from kubectl_snapshot.core.reference import Reference
from tests.integration.test_agent_roundtrip import (
    AGENT,
    ASK,
    HEAP_SERVER,
    agent,
    cleanup,
    on,
    python_pair,
    restore_on,
    task_status,
    wait_for,
)
from tests.support.containerd import containerd_a, containerd_b
from tests.support.faulty_proxy import FaultyProxy
from tests.support.registry import RegistryServer, registry
from tests.support.signing import signing_env

pytestmark = pytest.mark.integration
__all__ = ["cleanup", "containerd_a", "containerd_b", "registry"]  # fixtures

HEAP = HEAP_SERVER.replace("200 << 20", "96 << 20")  # 96 MiB of random heap, its hash and pid on ASK
assert HEAP != HEAP_SERVER


def _pattern_chunk(ref: str) -> str:
    """A chunk inside the heap (private memory): never staged ahead of a lazy restore, only served."""
    artifact, _ = load_signed(RegistryClient(plain_http=True), Reference.parse(ref))
    (record,) = artifact.config.containers
    biggest = max(record.pages, key=lambda pf: pf.size)
    return biggest.chunks[len(biggest.chunks) // 2].digest


def _saved(da, db, cleanup, host: str) -> tuple[Any, str, str, str]:  # type: ignore[no-untyped-def]
    """A Python process holding 96 MiB of random heap, saved to `host` and stopped: (db's client, the id
    to restore as, the save, its answer)."""
    a, b, cid, new = python_pair(da, db, cleanup, "lazyheap", HEAP)
    code, out, err = a.exec_in_task(cid, ["python3", "-c", ASK])
    assert code == 0, err
    ref = agent("checkpoint", *on(da), "--stop", "--to", f"{host}/lazyheap", cid).stdout.strip()
    a.remove_container(cid)
    return b, new, ref, out.decode().strip()


@pytest.fixture
def saved(containerd_a, containerd_b, registry, cleanup) -> tuple[Any, str, str, str]:  # type: ignore[no-untyped-def]
    return _saved(containerd_a, containerd_b, cleanup, registry.host)


def test_a_lazy_restore_runs_first_and_gets_every_page(containerd_b, saved) -> None:  # type: ignore[no-untyped-def]
    b, new, ref, answer = saved
    done = json.loads(agent(*restore_on(containerd_b), "--lazy", "-o", "json", ref, new).stdout)
    (lazy,) = done["lazy"]
    assert lazy["name"] == new and lazy["pages"] * 4096 >= 64 << 20, lazy  # the heap came through the server
    assert "eagerBecause" not in done
    assert task_status(b, new) == "running"
    code, out, err = b.exec_in_task(new, ["python3", "-c", ASK])
    assert code == 0, err
    assert out.decode().strip() == answer  # the same heap, byte for byte, in the same process


def test_pages_that_cannot_come_end_the_container_and_the_command_says_why(  # type: ignore[no-untyped-def]
    containerd_b, registry: RegistryServer, saved
) -> None:
    b, new, ref, _ = saved
    blob = registry.blob_path(_pattern_chunk(ref))
    good = blob.read_bytes()
    blob.write_bytes(good[: len(good) // 2] + bytes([good[len(good) // 2] ^ 0xFF]) + good[len(good) // 2 + 1 :])
    try:
        failed = agent(*restore_on(containerd_b), "--lazy", ref, new, check=False, timeout=400)
    finally:
        blob.write_bytes(good)
    assert failed.returncode != 0
    assert f"container {new}'s memory could not all be fetched" in failed.stderr, failed.stderr
    assert "hint: restore it eagerly" in failed.stderr, failed.stderr
    assert task_status(b, new) in (None, "stopped")  # killed, never running on zero-filled memory


def test_stopping_the_command_mid_way_ends_the_container(  # type: ignore[no-untyped-def]
    containerd_a, containerd_b, registry: RegistryServer, cleanup
) -> None:
    with FaultyProxy("127.0.0.1", registry.port) as proxy:
        b, new, ref, _ = _saved(containerd_a, containerd_b, cleanup, proxy.host)
        proxy.hold_on = ("GET", re.compile(f"/blobs/{_pattern_chunk(ref)}$"))
        argv = [AGENT, *restore_on(containerd_b), "--lazy", ref, new]
        env = {**os.environ, **signing_env()}
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            assert proxy.holding.wait(180), "the lazy phase never asked for the held chunk"
            wait_for(lambda: task_status(b, new) == "running", 60, "the container to run")
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)  # as systemd or a terminal's hangup would stop it
            _, stderr = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
            proxy.release()
    assert proc.returncode == 1, stderr
    assert "the restore command was stopped before every page was in" in stderr, stderr
    assert f"container(s) {new} were ended (killed)" in stderr, stderr
    wait_for(lambda: task_status(b, new) in (None, "stopped"), 30, "the container to be ended")


def test_what_a_lazy_restore_killed_outright_left_running_is_ended_by_recover(  # type: ignore[no-untyped-def]
    containerd_a, containerd_b, registry: RegistryServer, cleanup
) -> None:
    """SIGKILL cannot be caught: the container runs on, its missing pages zero-filled once the daemon's
    connection goes. `ks-agent recover` finds that its server is gone and kills it."""
    with FaultyProxy("127.0.0.1", registry.port) as proxy:
        b, new, ref, _ = _saved(containerd_a, containerd_b, cleanup, proxy.host)
        proxy.hold_on = ("GET", re.compile(f"/blobs/{_pattern_chunk(ref)}$"))
        argv = [AGENT, *restore_on(containerd_b), "--lazy", ref, new]
        proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env={**os.environ, **signing_env()})
        try:
            assert proxy.holding.wait(180), "the lazy phase never asked for the held chunk"
            wait_for(lambda: task_status(b, new) == "running", 60, "the container to run")
            proc.kill()
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
            proxy.release()
    assert task_status(b, new) == "running"  # nothing could end it
    out = agent("recover", *on(containerd_b)).stdout
    assert f"{new}\tended (its lazy restore was killed with pages still to come)" in out, out
    wait_for(lambda: task_status(b, new) in (None, "stopped"), 30, "the container to be ended")
    assert "nothing to recover" in agent("recover", *on(containerd_b)).stdout
