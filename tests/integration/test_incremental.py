"""Incremental snapshots by content (format v2 chunks) on real containerd, runc, CRIU and a registry.

The bytes a second snapshot sends are counted by a loopback proxy in front of the registry (not by
the agent's own report); the restore of that second snapshot must give back the exact memory; a
chunk whose stored bytes do not match its digest must stop the restore before anything runs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.errors import NotFound
from kubectl_snapshot.core.model import parse_config
from kubectl_snapshot.core.oci import parse_manifest
from kubectl_snapshot.core.reference import Reference
from shim.containerd.client import ContainerdClient
from tests.integration.test_agent_roundtrip import agent, cleanup, client, on, restore_on, unique, wait_for
from tests.support.containerd import containerd_a, containerd_b
from tests.support.faulty_proxy import FaultyProxy
from tests.support.images import python_image
from tests.support.registry import registry

pytestmark = pytest.mark.integration

HEAP_MIB = 32
# A heap of random bytes; on /tmp/mutate it rewrites PCT% of it in place (one contiguous region),
# on /tmp/ask it writes the sha256 of the heap to /tmp/answer.
WORKLOAD = r"""
import hashlib, os, time
heap = bytearray(os.urandom(HEAP_MIB << 20))
open("/tmp/ready", "w").write("1")
while True:
    if os.path.exists("/tmp/mutate"):
        pct = float(open("/tmp/mutate").read() or 5)
        n = int(len(heap) * pct / 100)
        start = int.from_bytes(os.urandom(4), "little") % (len(heap) - n)
        heap[start:start + n] = os.urandom(n)
        os.unlink("/tmp/mutate")
        open("/tmp/mutated", "w").write("1")
    if os.path.exists("/tmp/ask"):
        os.unlink("/tmp/ask")
        open("/tmp/answer.tmp", "w").write(hashlib.sha256(heap).hexdigest() + " %d" % os.getpid())
        os.rename("/tmp/answer.tmp", "/tmp/answer")
    time.sleep(0.02)
""".replace("HEAP_MIB", str(HEAP_MIB))


def sh(c: ContainerdClient, cid: str, code: str) -> str:
    rc, out, err = c.exec_in_task(cid, ["python3", "-c", code])
    assert rc == 0, err
    return out.decode().strip()


def exists(c: ContainerdClient, cid: str, path: str) -> bool:
    return sh(c, cid, f"import os; print(os.path.exists({path!r}))") == "True"


def ask_hash(c: ContainerdClient, cid: str) -> str:
    sh(c, cid, "import os\ntry: os.unlink('/tmp/answer')\nexcept FileNotFoundError: pass\nopen('/tmp/ask','w')")
    wait_for(lambda: exists(c, cid, "/tmp/answer"), what="the workload to answer")
    return sh(c, cid, "print(open('/tmp/answer').read())")


def mutate(c: ContainerdClient, cid: str, pct: float) -> None:
    sh(
        c,
        cid,
        "import os\ntry: os.unlink('/tmp/mutated')\nexcept FileNotFoundError: pass\n"
        f"open('/tmp/mutate','w').write('{pct}')",
    )
    wait_for(lambda: exists(c, cid, "/tmp/mutated"), what="the workload to change its memory")


@pytest.fixture
def heap_workload(containerd_a, cleanup):  # type: ignore[no-untyped-def]
    a = client(containerd_a)
    cid = unique("heap")
    cleanup(a, cid)
    a.run_container(
        cid, image=python_image(containerd_a), args=["python3", "-c", WORKLOAD], runc_options=containerd_a.runc_options
    )
    wait_for(lambda: exists(a, cid, "/tmp/ready"), timeout=60, what="the workload to start")
    return a, cid


def snapshot_via(proxy: FaultyProxy, daemon, repo: str, tag: str, cid: str) -> tuple[str, dict, int]:  # type: ignore[no-untyped-def, type-arg]
    before = proxy.body_bytes
    out = json.loads(agent("checkpoint", *on(daemon), "-o", "json", "--to", f"{proxy.host}/{repo}:{tag}", cid).stdout)
    return out["reference"], out, proxy.body_bytes - before


def test_second_snapshot_uploads_only_changed_chunks_and_restores_exactly(  # type: ignore[no-untyped-def]
    containerd_a,
    containerd_b,
    registry,
    heap_workload,
    cleanup,
):
    a, cid = heap_workload
    host, port = registry.host.split(":")
    repo = unique("incr")
    with FaultyProxy(host, int(port)) as proxy:
        ref1, out1, sent1 = snapshot_via(proxy, containerd_a, repo, "v1", cid)
        mutate(a, cid, 5)
        expected = ask_hash(a, cid)
        ref2, out2, sent2 = snapshot_via(proxy, containerd_a, repo, "v2", cid)
    assert sent1 >= HEAP_MIB << 20  # random bytes do not compress: the first snapshot sends the heap
    # 5% of the heap changed: the second sends the changed chunks, the small layer and the interpreter's
    # own churn, far less than the first (the benchmark measures the ratio; this guards the mechanism)
    assert sent2 < 0.25 * sent1, (sent1, sent2)
    assert out2["uploaded"] < 0.25 * out2["size"], out2
    assert abs(out1["size"] - out2["size"]) < 0.1 * out1["size"]  # each snapshot is still complete

    # the second manifest lists chunks shared with the first: both stay complete in the registry
    reg = RegistryClient()
    m1 = parse_manifest(reg.get_manifest(Reference.parse(ref1.replace(proxy.host, registry.host)))[0])
    m2 = parse_manifest(reg.get_manifest(Reference.parse(ref2.replace(proxy.host, registry.host)))[0])
    # what changed is new chunks or page deltas (of a base chunk both snapshots list)
    page_types = {C.CHUNK_MEDIA_TYPE, C.DELTA_MEDIA_TYPE}
    chunks1 = {d.digest for d in m1.layers if d.media_type in page_types}
    chunks2 = {d.digest for d in m2.layers if d.media_type in page_types}
    assert chunks1 & chunks2 and chunks2 - chunks1

    # restore the incremental snapshot elsewhere: the memory is exactly the mutated heap
    b = client(containerd_b)
    python_image(containerd_b)
    new = unique("heap-restored")
    cleanup(b, new)
    agent(*restore_on(containerd_b), ref2.replace(proxy.host, registry.host), new)
    got = ask_hash(b, new)
    assert got.split()[0] == expected.split()[0]
    assert got.split()[1] == expected.split()[1]  # same pid: the process itself came back


def test_a_chunk_with_a_wrong_digest_is_refused(containerd_a, containerd_b, registry, heap_workload):  # type: ignore[no-untyped-def]
    _, cid = heap_workload
    ref = agent("checkpoint", *on(containerd_a), "--to", registry.ref(unique("badchunk"), "v1"), cid).stdout.strip()
    reg = RegistryClient()
    r = Reference.parse(ref)
    manifest = parse_manifest(reg.get_manifest(r)[0])
    config = parse_config(reg.read_blob(r, manifest.config.digest))
    chunks = [c for p in config.containers[0].pages for c in p.chunks]
    assert len(chunks) >= 4, "a 32 MiB heap is stored as chunks"  # of 8 MiB (core/chunks.choose_span)
    # flip a byte of a chunk in the registry's storage (its digest no longer matches its content)
    victim = chunks[len(chunks) // 2].digest
    blob = registry.blob_path(victim)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))

    python_image(containerd_b)
    name = unique("badchunk")
    proc = agent(*restore_on(containerd_b), ref, name, check=False)
    assert proc.returncode == 1
    assert "error:" in proc.stderr and victim in proc.stderr and "digest" in proc.stderr.lower()
    state = Path(os.environ.get(C.ENV_STATE_DIR, C.DEFAULT_STATE_DIR))
    assert not (state / C.STAGING_SUBDIR / "by-id" / name).exists()
    with pytest.raises(NotFound):
        client(containerd_b).get_container(name)
