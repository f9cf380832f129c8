"""Page deltas (format v4) on real containerd, runc, CRIU and a registry.

The workload changes one byte in every 20th page of its heap (5% of the pages, spread over every
chunk: without page deltas every chunk would be sent again). The bytes the second snapshot sends are
counted by a loopback proxy in front of the registry; its restore on another containerd must give back
the exact memory; a delta blob whose stored bytes do not match its digest stops the restore. A second
test runs the packaging pipeline itself against the registry with sealing on, including a delta whose
base the registry no longer has.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest
import requests

from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.chunks import PAGE_SIZE, PagemapRun, chunk_digests, plan_chunks, span_layouts
from kubectl_snapshot.core.errors import NotFound
from kubectl_snapshot.core.model import parse_config
from kubectl_snapshot.core.oci import parse_manifest
from kubectl_snapshot.core.reference import Reference
from kubectl_snapshot.core.sealing import LocalNamespaceKey, Opener, Sealer
from shim.containerd.client import ContainerdClient
from shim.engine.chunks import PagesPlan, window_keys
from shim.engine.pageindex import PageIndex
from shim.engine.stream import PushedChunks, fetch_chunks, push_chunks
from tests.integration.test_agent_roundtrip import agent, cleanup, client, on, restore_on, unique, wait_for
from tests.integration.test_incremental import ask_hash, exists, sh, snapshot_via
from tests.support.containerd import containerd_a, containerd_b
from tests.support.faulty_proxy import FaultyProxy
from tests.support.images import python_image
from tests.support.registry import registry, registry_factory

pytestmark = pytest.mark.integration

HEAP_MIB = 32
# A heap of random bytes; on /tmp/mutate it changes one byte in every STEP-th page (scattered over
# the whole heap), on /tmp/ask it writes the sha256 of the heap and its pid to /tmp/answer.
WORKLOAD = r"""
import hashlib, os, time
heap = bytearray(os.urandom(HEAP_MIB << 20))
open("/tmp/ready", "w").write("1")
while True:
    if os.path.exists("/tmp/mutate"):
        step = int(open("/tmp/mutate").read() or 20)
        salt = os.urandom(1)[0] | 1
        for off in range(100, len(heap), 4096 * step):
            heap[off] ^= salt
        os.unlink("/tmp/mutate")
        open("/tmp/mutated", "w").write("1")
    if os.path.exists("/tmp/ask"):
        os.unlink("/tmp/ask")
        open("/tmp/answer.tmp", "w").write(hashlib.sha256(heap).hexdigest() + " %d" % os.getpid())
        os.rename("/tmp/answer.tmp", "/tmp/answer")
    time.sleep(0.02)
""".replace("HEAP_MIB", str(HEAP_MIB))


def scatter(c: ContainerdClient, cid: str, step: int) -> None:
    sh(
        c,
        cid,
        "import os\ntry: os.unlink('/tmp/mutated')\nexcept FileNotFoundError: pass\n"
        f"open('/tmp/mutate','w').write('{step}')",
    )
    wait_for(lambda: exists(c, cid, "/tmp/mutated"), what="the workload to change its memory")


@pytest.fixture
def scatter_workload(containerd_a, cleanup):  # type: ignore[no-untyped-def]
    a = client(containerd_a)
    cid = unique("pdelta")
    cleanup(a, cid)
    a.run_container(
        cid, image=python_image(containerd_a), args=["python3", "-c", WORKLOAD], runc_options=containerd_a.runc_options
    )
    wait_for(lambda: exists(a, cid, "/tmp/ready"), timeout=60, what="the workload to start")
    return a, cid


def deltas_of(ref: str) -> tuple[dict, list[str]]:  # type: ignore[type-arg]
    reg = RegistryClient()
    r = Reference.parse(ref)
    manifest = parse_manifest(reg.get_manifest(r)[0])
    config = json.loads(reg.read_blob(r, manifest.config.digest))
    layers = {d.digest: d.media_type for d in manifest.layers}
    deltas = [
        c["delta"]["digest"] for p in config["containers"][0].get("pages", []) for c in p["chunks"] if "delta" in c
    ]
    for p in config["containers"][0].get("pages", []):
        for c in p["chunks"]:
            assert layers[c["digest"]] == C.CHUNK_MEDIA_TYPE  # every base is listed: registry GC keeps it
            if "delta" in c:
                assert layers[c["delta"]["digest"]] == C.DELTA_MEDIA_TYPE
    return config, deltas


def test_scattered_changes_upload_only_changed_pages_and_restore_exactly(  # type: ignore[no-untyped-def]
    containerd_a, containerd_b, registry, scatter_workload, cleanup
):
    a, cid = scatter_workload
    host, port = registry.host.split(":")
    repo = unique("pdelta")
    with FaultyProxy(host, int(port)) as proxy:
        ref1, _, sent1 = snapshot_via(proxy, containerd_a, repo, "v1", cid)
        scatter(a, cid, 20)
        expected = ask_hash(a, cid)
        ref2, _, sent2 = snapshot_via(proxy, containerd_a, repo, "v2", cid)
    assert sent1 >= HEAP_MIB << 20
    # 5% of the heap's pages changed, in every chunk: the second snapshot sends those pages (random
    # bytes: incompressible), the small layer and the interpreter's own churn
    print(f"first snapshot sent {sent1} bytes, the second {sent2} ({sent2 / sent1:.3f})")
    assert sent2 < 0.12 * sent1, (sent1, sent2)
    ref1 = ref1.replace(proxy.host, registry.host)
    ref2 = ref2.replace(proxy.host, registry.host)
    config1, deltas1 = deltas_of(ref1)
    config2, deltas2 = deltas_of(ref2)
    assert config1["formatVersion"] == C.FORMAT_VERSION and not deltas1  # nothing to be a delta of
    # every chunk of the heap (8 MiB spans: core/chunks.choose_span) holds changed pages: each is a delta
    assert config2["formatVersion"] == C.DELTA_FORMAT_VERSION and len(deltas2) >= 4, config2["containers"][0]

    b = client(containerd_b)
    python_image(containerd_b)
    new = unique("pdelta-restored")
    cleanup(b, new)
    agent(*restore_on(containerd_b), ref2, new)
    got = ask_hash(b, new)
    assert got.split() == expected.split()  # the exact heap, and the same process (pid)


def test_a_delta_with_a_wrong_digest_is_refused(containerd_a, containerd_b, registry, scatter_workload):  # type: ignore[no-untyped-def]
    a, cid = scatter_workload
    repo = unique("pdelta-bad")
    agent("checkpoint", *on(containerd_a), "--to", registry.ref(repo, "v1"), cid)
    scatter(a, cid, 20)
    ref = agent("checkpoint", *on(containerd_a), "--to", registry.ref(repo, "v2"), cid).stdout.strip()
    _, deltas = deltas_of(ref)
    assert deltas
    victim = deltas[len(deltas) // 2]
    blob = registry.blob_path(victim)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))

    python_image(containerd_b)
    name = unique("pdelta-bad")
    proc = agent(*restore_on(containerd_b), ref, name, check=False)
    assert proc.returncode == 1
    assert "error:" in proc.stderr and victim in proc.stderr and "digest" in proc.stderr.lower(), proc.stderr
    state = Path(os.environ.get(C.ENV_STATE_DIR, C.DEFAULT_STATE_DIR))
    assert not (state / C.STAGING_SUBDIR / "by-id" / name).exists()
    with pytest.raises(NotFound):
        client(containerd_b).get_container(name)


def _plan(path: Path, runs: list[PagemapRun]) -> PagesPlan:
    size = path.stat().st_size
    spans = plan_chunks(runs, size, 1 << 20)
    layouts = span_layouts(runs, size, spans)
    assert layouts is not None
    keys = tuple(window_keys(path.name, 1 << 20, lay) for lay in layouts)
    return PagesPlan(path.name, str(path), size, tuple(spans), tuple(layouts), keys)


def test_sealed_deltas_round_trip_through_the_registry_and_a_lost_base_means_a_full_chunk(  # type: ignore[no-untyped-def]
    registry, tmp_path
):
    rng = random.Random(7)
    pages = 4 * 256  # 4 MiB: four 1 MiB chunks
    runs = [PagemapRun(0x7F0000000000, pages)]
    src = tmp_path / "src"
    src.mkdir()
    data = bytearray(rng.randbytes(pages * PAGE_SIZE))
    (src / "pages-1.img").write_bytes(data)
    key = LocalNamespaceKey(bytes(range(32)))
    ref = Reference.parse(registry.ref(unique("pdelta-seal"), "x"))
    reg = RegistryClient()
    index_dir = str(tmp_path / "index")

    def save(index_dir: str = index_dir) -> tuple[Sealer, PushedChunks]:
        sealer = Sealer(key, "team-a")
        index = PageIndex.load(index_dir, "s")
        pushed = push_chunks(reg, ref, [_plan(src / "pages-1.img", runs)], sealer=sealer, index=index)
        index.save()
        return sealer, pushed

    def restore(sealer: Sealer, pushed: PushedChunks) -> bytes:
        out = tmp_path / unique("out")
        out.mkdir()
        digests = [
            d for f in pushed.files for c in f.chunks for d in (c.digest, *([c.delta.digest] if c.delta else []))
        ]
        fetch_chunks(reg, ref, pushed.files, str(out), opener=Opener(sealer.info(dict.fromkeys(digests)), key))
        return Path(out, "pages-1.img").read_bytes()

    _, first = save()
    assert all(c.delta is None for c in first.files[0].chunks)
    # convergent without the node's memory: another node (no page index) seals the same pages to the
    # same blobs (the key seed is the compressed chunk's sha256)
    _, elsewhere = save(str(tmp_path / "index-of-another-node"))
    assert [c.digest for c in elsewhere.files[0].chunks] == [c.digest for c in first.files[0].chunks]
    assert elsewhere.uploaded == 0
    # chunk 0: 3 pages change (a delta), chunk 1: all pages (stored whole), chunks 2, 3: unchanged
    for i in (0, 5, 200):
        data[i * PAGE_SIZE] ^= 1
    data[256 * PAGE_SIZE : 512 * PAGE_SIZE] = rng.randbytes(256 * PAGE_SIZE)
    (src / "pages-1.img").write_bytes(data)
    sealer, second = save()
    c0, c1, c2, c3 = second.files[0].chunks
    assert (
        c0.delta is not None
        and c0.delta.pages == 3
        and c0.delta.copies == 3
        and c0.digest == first.files[0].chunks[0].digest
    )
    assert c1.delta is None and c1.digest != first.files[0].chunks[1].digest
    assert (c2.digest, c3.digest) == (first.files[0].chunks[2].digest, first.files[0].chunks[3].digest)
    assert c2.delta is None and c3.delta is None
    assert second.uploaded < 256 * PAGE_SIZE + 4 * PAGE_SIZE + 8192  # chunk 1 + three pages (+ framing)
    assert restore(sealer, second) == bytes(data)

    # nothing changed since: the next save names the same delta again and sends nothing (a chunk still
    # equal to its last version is not a new delta, so its blob is asked for, not pushed again)
    sealer, again = save()
    assert again.files[0].chunks == second.files[0].chunks
    assert again.uploaded == 0
    assert restore(sealer, again) == bytes(data)

    # the registry lost chunk 0's base (retention, GC): the next save stores it whole again
    gone = requests.delete(f"http://{registry.host}/v2/{ref.repository}/blobs/{c0.digest}", timeout=30)
    assert gone.status_code == 202, gone.text
    assert not reg.blob_exists(ref, c0.digest)
    data[7 * PAGE_SIZE] ^= 1
    (src / "pages-1.img").write_bytes(data)
    sealer, third = save()
    assert third.files[0].chunks[0].delta is None
    assert restore(sealer, third) == bytes(data)


def test_the_newer_snapshot_keeps_its_bases_through_deletion_and_garbage_collection(  # type: ignore[no-untyped-def]
    containerd_a, containerd_b, registry_factory, scatter_workload, cleanup
):
    """Retention deletes the older snapshot's manifest; the registry's garbage collection then frees
    what no manifest names. The newer snapshot's manifest lists the bases its deltas need, so they stay."""
    a, cid = scatter_workload
    registry = registry_factory()  # its own: garbage collection must not touch other tests' blobs
    repo = unique("pdelta-gc")
    ref1 = agent("checkpoint", *on(containerd_a), "--to", registry.ref(repo, "v1"), cid).stdout.strip()
    scatter(a, cid, 20)
    expected = ask_hash(a, cid)
    ref2 = agent("checkpoint", *on(containerd_a), "--to", registry.ref(repo, "v2"), cid).stdout.strip()
    config2, deltas = deltas_of(ref2)
    assert deltas
    bases = {c["digest"] for p in config2["containers"][0]["pages"] for c in p["chunks"] if "delta" in c}
    reg = RegistryClient()
    r1 = Reference.parse(ref1)
    reg.delete_manifest(r1, r1.digest or "")
    registry.stop()
    try:
        gc = subprocess.run(
            [registry.binary, "garbage-collect", "--delete-untagged", str(registry.config_path)],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
    finally:
        registry.start()
    assert gc.returncode == 0, gc.stderr[-2000:]
    assert "deleting" in (gc.stdout + gc.stderr).lower()  # it did free the older snapshot's own blobs
    r2 = Reference.parse(ref2)
    assert all(reg.blob_exists(r2, d) for d in bases)

    b = client(containerd_b)
    python_image(containerd_b)
    new = unique("pdelta-gc-restored")
    cleanup(b, new)
    agent(*restore_on(containerd_b), ref2, new)
    assert ask_hash(b, new).split() == expected.split()
