"""Encryption at rest through the real agent on real containerd, runc, CRIU and a registry.

A process holds a marker string (computed at run time, so it is in no command line or spec) among
random memory. Sealed snapshots must not show it in any blob the registry stores (while a snapshot in
clear does, so the check can fail); the sealed snapshot restores exactly; a second sealed snapshot
after a small change still sends only the changed chunks (convergent keys); another namespace's key,
or restoring into another namespace, is refused before anything is created.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
from pathlib import Path

import pytest
import zstandard

from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.errors import NotFound
from kubectl_snapshot.core.model import parse_config
from kubectl_snapshot.core.oci import parse_manifest
from kubectl_snapshot.core.reference import Reference
from kubectl_snapshot.core.sealing import MAGIC as SEALED_MAGIC
from tests.integration.test_agent_roundtrip import agent, cleanup, client, on, restore_on, unique, wait_for
from tests.integration.test_incremental import ask_hash, exists, mutate
from tests.support.containerd import containerd_a, containerd_b
from tests.support.faulty_proxy import FaultyProxy
from tests.support.images import python_image
from tests.support.registry import RegistryServer, registry

pytestmark = pytest.mark.integration

HEAP_MIB = 32
SEED = "kubectl-snapshot encryption test"
MARKER = ("MARKER-" + hashlib.sha256(SEED.encode()).hexdigest()).encode()
# test_incremental's protocol (mutate/ask), plus the marker many times over in its own buffer
WORKLOAD = r"""
import hashlib, os, time
marker = ("MARKER-" + hashlib.sha256(b"SEED").hexdigest()).encode()
keep = bytearray(marker * 20000)
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
        h = hashlib.sha256(heap + keep).hexdigest()
        open("/tmp/answer.tmp", "w").write(h + " %d" % os.getpid())
        os.rename("/tmp/answer.tmp", "/tmp/answer")
    time.sleep(0.02)
""".replace("HEAP_MIB", str(HEAP_MIB)).replace("SEED", SEED)


@pytest.fixture
def marker_workload(containerd_a, cleanup):  # type: ignore[no-untyped-def]
    a = client(containerd_a)
    cid = unique("sealed")
    cleanup(a, cid)
    a.run_container(
        cid, image=python_image(containerd_a), args=["python3", "-c", WORKLOAD], runc_options=containerd_a.runc_options
    )
    wait_for(lambda: exists(a, cid, "/tmp/ready"), timeout=60, what="the workload to start")
    return a, cid


def unzstd(blob: bytes) -> bytes:
    out = io.BytesIO()
    zstandard.ZstdDecompressor().copy_stream(io.BytesIO(blob), out)
    return out.getvalue()


def stored_blobs(registry: RegistryServer, ref: str) -> tuple[list[tuple[str, bytes]], dict]:  # type: ignore[type-arg]
    """(media type, the bytes as the registry stores them) of every layer and chunk, and the config."""
    reg = RegistryClient()
    r = Reference.parse(ref)
    manifest = parse_manifest(reg.get_manifest(r)[0])
    config = json.loads(reg.read_blob(r, manifest.config.digest))
    return [(d.media_type, registry.blob_path(d.digest).read_bytes()) for d in manifest.layers], config


def test_sealed_snapshots_hide_memory_dedupe_and_restore(  # type: ignore[no-untyped-def]
    containerd_a, containerd_b, registry, marker_workload, cleanup, tmp_path
):
    a, cid = marker_workload
    keys = str(tmp_path / "keys")
    seal = ["--encrypt", "--key-dir", keys, "--key-namespace", "team-a"]
    repo = unique("sealed")

    # in clear, the stored blobs decompress to the memory that holds the marker: the checks below can fail
    clear = agent("checkpoint", *on(containerd_a), "--to", registry.ref(repo + "-clear", "v1"), cid).stdout.strip()
    clear_blobs, _ = stored_blobs(registry, clear)
    assert any(MARKER in unzstd(b) for _, b in clear_blobs)

    host, port = registry.host.split(":")
    with FaultyProxy(host, int(port)) as proxy:

        def snap(tag: str) -> tuple[str, dict, int]:  # type: ignore[type-arg]
            before = proxy.body_bytes
            to = f"{proxy.host}/{repo}:{tag}"
            out = json.loads(agent("checkpoint", *on(containerd_a), *seal, "-o", "json", "--to", to, cid).stdout)
            return out["reference"].replace(proxy.host, registry.host), out, proxy.body_bytes - before

        ref1, out1, sent1 = snap("v1")
        mutate(a, cid, 5)
        expected = ask_hash(a, cid)
        ref2, out2, sent2 = snap("v2")
    assert out1["encrypted"] and out2["encrypted"]

    blobs, config = stored_blobs(registry, ref2)
    assert blobs and all(mt.endswith(C.ENCRYPTED_SUFFIX) for mt, _ in blobs)
    assert not any(MARKER in b for _, b in blobs), "a sealed blob holds plaintext memory"
    assert all(b.startswith(SEALED_MAGIC) for _, b in blobs)  # every blob is sealed, none a zstd frame
    assert config["encryption"]["namespace"] == "team-a"
    assert parse_config(json.dumps(config).encode()).encryption is not None

    # convergent chunk keys: the second snapshot sends only what changed (as in clear, test_incremental)
    assert sent1 >= HEAP_MIB << 20
    assert sent2 < 0.25 * sent1, (sent1, sent2)
    reg = RegistryClient()
    m1 = parse_manifest(reg.get_manifest(Reference.parse(ref1))[0])
    m2 = parse_manifest(reg.get_manifest(Reference.parse(ref2))[0])
    # what changed is new chunks or page deltas (of a base chunk both snapshots list)
    page_types = {C.CHUNK_MEDIA_TYPE + C.ENCRYPTED_SUFFIX, C.DELTA_MEDIA_TYPE + C.ENCRYPTED_SUFFIX}
    chunks1 = {d.digest for d in m1.layers if d.media_type in page_types}
    chunks2 = {d.digest for d in m2.layers if d.media_type in page_types}
    assert chunks1 & chunks2 and chunks2 - chunks1

    b = client(containerd_b)
    python_image(containerd_b)
    state = Path(os.environ.get(C.ENV_STATE_DIR, C.DEFAULT_STATE_DIR))

    # restoring into another namespace: refused before any download
    name = unique("sealed-otherns")
    proc = agent(*restore_on(containerd_b), "--key-dir", keys, "--key-namespace", "team-b", ref2, name, check=False)
    assert proc.returncode == 1 and "encrypted for namespace 'team-a'" in proc.stderr, proc.stderr

    # another key where team-a's should be (a mixed-up or substituted key): the data keys do not open
    wrong = tmp_path / "wrong-keys"
    wrong.mkdir(mode=0o700)
    kid = config["encryption"]["keyId"]
    (wrong / f"team-a.{kid}.key").write_bytes(base64.b64encode(os.urandom(32)))
    as_a = ["--key-namespace", "team-a", ref2, name]
    proc = agent(*restore_on(containerd_b), "--key-dir", str(wrong), *as_a, check=False)
    assert proc.returncode == 1 and "does not open with this namespace's key" in proc.stderr, proc.stderr
    assert not (state / C.STAGING_SUBDIR / "by-id" / name).exists()
    with pytest.raises(NotFound):
        b.get_container(name)
    # no key at all for that id: said plainly
    proc = agent(*restore_on(containerd_b), "--key-dir", str(tmp_path / "none"), *as_a, check=False)
    assert proc.returncode == 1 and "which this cluster does not have" in proc.stderr, proc.stderr

    # the right key: the exact memory, the same process
    new = unique("sealed-restored")
    cleanup(b, new)
    agent(*restore_on(containerd_b), "--key-dir", keys, "--key-namespace", "team-a", ref2, new)
    got = ask_hash(b, new)
    assert got.split() == expected.split()
