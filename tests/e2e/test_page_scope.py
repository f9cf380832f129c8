"""Issue 42, item 1: no pod's save is made of another pod's pages.

Two pods on one node run the same container name ("app") and hold nearly the same 24 MiB heap at the
same address (the same seeded bytes; the second changes one byte in every 20th page), and both save into
one repository. Page
deltas are taken against the bases of earlier saves; were those shared between pods (an index scoped by
repository and container name, as at f057d56), the second pod's first save would be a set of deltas on
the first pod's chunks, and its restore would read the first pod's bytes for every page it holds
"unchanged". Scoped to the pod, the second pod's first save has nothing to be a delta of; its own
second save is (the legitimate increment the index is for); both restore to their own heap.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.core.oci import parse_manifest
from kubectl_snapshot.core.reference import Reference
from tests.e2e.test_snapshot_flows import pod, read, running
from tests.support.agent import agent, plugin
from tests.support.cluster import Cluster, cluster, namespace
from tests.support.images import push_tarball
from tests.support.workloads import FLASK

pytestmark = pytest.mark.e2e
__all__ = ["agent", "cluster", "namespace", "plugin"]

HEAP = r"""
import ctypes, hashlib, os, random, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
SIZE, ADDR = 24 << 20, 0x6F0000000000
# the same address in both pods (MAP_FIXED_NOREPLACE): the page index keys pages by address
assert libc.mmap(ADDR, SIZE, 3, 0x22 | 0x100000, -1, 0) == ADDR, ctypes.get_errno()
heap = memoryview((ctypes.c_char * SIZE).from_address(ADDR)).cast("B")
heap[:] = random.Random(7).randbytes(SIZE)
if sys.argv[1] == "b":
    for off in range(100, SIZE, 4096 * 20):
        heap[off] ^= 0x5A
while True:
    if os.path.exists("/tmp/mutate"):
        os.unlink("/tmp/mutate")
        for off in range(200, SIZE, 4096 * 20):
            heap[off] ^= 0x33
    digest = hashlib.sha256(heap).hexdigest()
    open("/tmp/heap.t", "w").write(digest + " %d" % os.getpid())
    os.rename("/tmp/heap.t", "/tmp/heap")
    time.sleep(0.5)
"""


def _twin(name: str, ns: str, image: str, node: str, which: str) -> dict[str, Any]:
    manifest = pod(name, ns, image, {"app": ""}, node=node)
    manifest["spec"]["containers"][0]["command"] = ["python3", "-c", HEAP, which]
    return manifest


def _chunk_entries(ref: str) -> list[dict[str, Any]]:
    """Every page chunk entry of a save's config, as its registry holds it."""
    registry = RegistryClient()
    r = Reference.parse(ref)
    manifest = parse_manifest(registry.get_manifest(r)[0])
    config = json.loads(registry.read_blob(r, manifest.config.digest))
    return [c for ctr in config["containers"] for p in ctr.get("pages", []) for c in p["chunks"]]


def _deltas_and_bases(ref: str) -> tuple[list[str], set[str]]:
    """The delta blobs of a save and the chunk digests its deltas are taken on."""
    chunks = [c for c in _chunk_entries(ref) if "delta" in c]
    return [c["delta"]["digest"] for c in chunks], {c["digest"] for c in chunks}


def _chunks(ref: str) -> set[str]:
    return {c["digest"] for c in _chunk_entries(ref)}


def test_a_pods_save_is_never_a_delta_on_another_pods_pages(cluster: Cluster, namespace, agent, plugin) -> None:  # type: ignore[no-untyped-def]
    n1, n2 = cluster.nodes[:2]
    image = push_tarball(cluster.registry, FLASK.tarball(), FLASK.image)  # Debian's python3 with ctypes
    repo = f"{cluster.registry}/e2e/{namespace}/twins"
    for name, which in (("twin-a", "a"), ("twin-b", "b")):
        cluster.apply(_twin(name, namespace, image, n1, which))
    for name in ("twin-a", "twin-b"):
        running(cluster, namespace, name, timeout=300)

        def heap_written(n: str = name) -> bool:
            return bool(cluster.kubectl("exec", "-n", namespace, n, "--", "cat", "/tmp/heap", check=False).stdout)

        cluster.wait_for(f"{name}'s heap", heap_written)

    def save(name: str) -> str:
        out = plugin("snapshot", f"pod/{name}", "-n", namespace, "--to", repo, "-o", "json")
        return str(json.loads(out.stdout)["status"]["reference"])

    ref_a = save("twin-a")
    ref_b = save("twin-b")
    deltas, _ = _deltas_and_bases(ref_b)
    assert deltas == [], f"twin-b's first save is made of deltas on twin-a's pages: {deltas}"

    # the legitimate increment: twin-b's next save after a small change is a delta on its own pages only
    before = read(cluster, namespace, "twin-b", "app", "/tmp/heap")
    cluster.kubectl("exec", "-n", namespace, "twin-b", "--", "python3", "-c", "open('/tmp/mutate','w')")
    cluster.wait_for(
        "twin-b's new heap digest", lambda: read(cluster, namespace, "twin-b", "app", "/tmp/heap") != before
    )
    ref_b2 = save("twin-b")
    deltas2, bases2 = _deltas_and_bases(ref_b2)
    assert deltas2, "twin-b's second save sent whole chunks: page deltas were not used"
    assert bases2 <= _chunks(ref_b), (bases2 - _chunks(ref_b), "bases outside twin-b's own first save")
    assert not bases2 & (_chunks(ref_a) - _chunks(ref_b))

    # each restores to its own heap, on the other node
    want = read(cluster, namespace, "twin-b", "app", "/tmp/heap").split()[0]
    cluster.kubectl("delete", "pod", "twin-b", "-n", namespace, "--wait=true")
    proc = plugin("restore", ref_b2, "-n", namespace, "--name", "twin-b2", "--node", n2, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    running(cluster, namespace, "twin-b2")
    cluster.wait_for(
        "twin-b2's heap to be twin-b's",
        lambda: read(cluster, namespace, "twin-b2", "app", "/tmp/heap").split()[0] == want,
        60,
    )
