"""Lazy restore on the real cluster (issue 44, item 2): `kubectl snapshot restore --lazy` of a Debian
python pod holding a 1 GiB pattern runs on the other node before its memory is back, every page comes
from the registry's chunks (a LazyRestoreComplete Event), and the pattern is checked byte for byte (its
SHA-256, computed by the restored process over its own memory) once every page is in. A chunk the
registry no longer serves intact ends the container with a LazyRestoreFailed Event saying why, and it is
restored again, eagerly, from the same save (given up where that fails too), as it is when the agent
serving its pages restarts: never a process running on memory the kernel zero-filled for long."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.adapters.signatures import load_signed
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.reference import Reference
from tests.e2e.test_autosave_policy import private_registry, relayed_into_cluster
from tests.e2e.test_snapshot_flows import pod, read, running
from tests.e2e.test_whole_pod import _push_python_image
from tests.support.agent import agent, plugin
from tests.support.cluster import Cluster, cluster, namespace
from tests.support.faulty_proxy import FaultyProxy
from tests.support.lazyrestore import POD_PATTERN
from tests.support.registry import RegistryServer

pytestmark = pytest.mark.e2e
__all__ = ["agent", "cluster", "namespace", "plugin", "private_registry"]


def _pattern_pod(cluster: Cluster, ns: str, name: str, size: int) -> tuple[str, int]:
    manifest = pod(name, ns, _push_python_image(cluster), {"app": ""}, node=cluster.nodes[0])
    manifest["spec"]["containers"][0]["command"] = ["python3", "-c", POD_PATTERN, str(size)]
    cluster.apply(manifest)
    running(cluster, ns, name, timeout=300)
    cluster.wait_for("the pattern", lambda: _read(cluster, ns, name, "/tmp/n") not in ("", "0"), timeout=120)
    return _read(cluster, ns, name, "/tmp/sum0"), int(_read(cluster, ns, name, "/tmp/n"))


def _read(cluster: Cluster, ns: str, name: str, path: str) -> str:
    proc = cluster.kubectl("exec", "-n", ns, name, "-c", "app", "--", "cat", path, check=False)
    return proc.stdout.strip() if proc.returncode == 0 else ""


def _events(cluster: Cluster, ns: str, name: str, reason: str) -> list[dict[str, Any]]:
    sel = f"involvedObject.kind=Pod,involvedObject.name={name},reason={reason}"
    return list(cluster.get_json("events", "-n", ns, "--field-selector", sel)["items"])


def _save(plugin: Any, ns: str, name: str, repo: str) -> Reference:
    out = plugin("snapshot", f"pod/{name}", "-n", ns, "--to", repo, "-o", "json", "--timeout", "300s")
    psnap = json.loads(out.stdout)
    assert psnap["status"]["phase"] == "Succeeded", psnap
    return Reference.parse(psnap["status"]["reference"])


def test_a_lazy_restore_of_a_1gib_pattern_runs_first_and_comes_back_byte_for_byte(cluster, namespace, agent, plugin):  # type: ignore[no-untyped-def]
    ns, n2 = namespace, cluster.nodes[1]
    size = 1 << 30
    sum0, _ = _pattern_pod(cluster, ns, "big", size)
    ref = _save(plugin, ns, "big", f"{cluster.registry}/e2e/lazy-{ns}")
    proc = plugin("restore", str(ref), "-n", ns, "--name", "big-2", "--node", n2, "--lazy", "--timeout", "300s")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    restored = running(cluster, ns, "big-2", timeout=300)
    assert restored["metadata"]["annotations"].get(K.ANN_RESTORE_MODE) == K.RESTORE_MODE_LAZY
    # the nodes' containerd passes the restore annotation to the runtime wrapper (their agents' facts say so):
    # no gate init container, the wrapper held the container at its create until the agent answered
    assert [c["name"] for c in restored["spec"].get("initContainers") or []] == []
    assert restored["metadata"]["annotations"].get(K.ANN_RESTORE_STATUS) == K.RESTORE_STAGED
    # it runs on (its counter) and, once every page is in, says so
    n = int(_read(cluster, ns, "big-2", "/tmp/n") or 0)
    cluster.wait_for("the counter to go on", lambda: int(_read(cluster, ns, "big-2", "/tmp/n") or 0) > n)
    cluster.wait_for("every page in", lambda: _events(cluster, ns, "big-2", K.EVENT_LAZY_RESTORE_COMPLETE), timeout=300)
    (done,) = _events(cluster, ns, "big-2", K.EVENT_LAZY_RESTORE_COMPLETE)
    pages = int(done["message"].split(": ")[1].split()[0])
    assert pages * 4096 >= size, done["message"]  # the pattern itself came through the page server
    assert not _events(cluster, ns, "big-2", K.EVENT_LAZY_RESTORE_FAILED)
    # byte for byte: the restored process hashes its own memory
    assert _read(cluster, ns, "big-2", "/tmp/sum0") == sum0
    cluster.kubectl("exec", "-n", ns, "big-2", "-c", "app", "--", "python3", "-c", "open('/tmp/verify', 'w')")
    cluster.wait_for("the restored process's hash", lambda: _read(cluster, ns, "big-2", "/tmp/sum") != "", timeout=120)
    assert _read(cluster, ns, "big-2", "/tmp/sum") == sum0
    status = cluster.get_json("pod", "big-2", "-n", ns)["status"]["containerStatuses"][0]
    assert status["restartCount"] == 0, status
    assert "fetched first" not in done["message"]  # saved from a pod never restored lazily: no hot pages
    # most used first: its next save records the pages it faulted on first in its (sealed) layer
    # (core/hotpages.py), and a lazy restore of that save fetches them first and comes back whole; the
    # node's agent restarted in between (an upgrade, say) still has them (kept in the pod's state dir)
    cluster.kubectl("delete", "pod", "big", "-n", ns, "--wait=true")
    agent.restart(n2)
    ref2 = _save(plugin, ns, "big-2", f"{cluster.registry}/e2e/lazy-{ns}")
    proc = plugin("restore", str(ref2), "-n", ns, "--name", "big-3", "--node", cluster.nodes[0], "--lazy",
                  "--timeout", "300s")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    running(cluster, ns, "big-3", timeout=300)
    cluster.wait_for("every page in", lambda: _events(cluster, ns, "big-3", K.EVENT_LAZY_RESTORE_COMPLETE), timeout=300)
    (done3,) = _events(cluster, ns, "big-3", K.EVENT_LAZY_RESTORE_COMPLETE)
    assert "used first were fetched first" in done3["message"], done3["message"]
    # its /tmp/sum came with the save: removed first, so that the hash read is the restored process's
    cluster.kubectl("exec", "-n", ns, "big-3", "-c", "app", "--", "python3", "-c",
                    "import os; os.unlink('/tmp/sum'); open('/tmp/verify', 'w')")  # fmt: skip
    cluster.wait_for("the restored process's hash", lambda: _read(cluster, ns, "big-3", "/tmp/sum") != "", timeout=120)
    assert _read(cluster, ns, "big-3", "/tmp/sum") == sum0


def _saved_pattern(cluster: Cluster, plugin: Any, ns: str, name: str, repo: str) -> tuple[str, int, Reference]:
    """A 256 MiB pattern pod saved into `repo` (a registry the namespace is allowed to push to): the pattern's
    hash, the counter at the save's start, the save."""
    cluster.kubectl("annotate", "namespace", ns, f"{K.ANN_ALLOWED_DESTINATIONS}={repo}")
    sum0, n0 = _pattern_pod(cluster, ns, name, 256 << 20)
    return sum0, n0, _save(plugin, ns, name, repo)


def _pattern_chunk(ref: Reference) -> str:
    """The middle chunk of the save's largest page file: inside the pattern, private memory, so never staged
    ahead of a lazy restore, only served."""
    artifact, _ = load_signed(RegistryClient(plain_http=True), ref)
    (record,) = artifact.config.containers
    biggest = max(record.pages, key=lambda pf: pf.size)
    return biggest.chunks[len(biggest.chunks) // 2].digest


def _damage(reg: RegistryServer, ref: Reference) -> tuple[Path, bytes]:
    """Damage, in the registry's storage, the middle chunk of the save's largest page file (inside the
    pattern: private memory, so never staged ahead, only served): every read of it fails its digest check.
    Returns the blob's path and its bytes, to repair it."""
    blob = reg.blob_path(_pattern_chunk(ref))
    good = blob.read_bytes()
    data = bytearray(good)
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    return blob, good


def _container(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    return dict((cluster.get_json("pod", name, "-n", ns)["status"].get("containerStatuses") or [{}])[0])


def _restored_again_eagerly(cluster: Cluster, ns: str, name: str, n0: int, sum0: str) -> None:
    """The container came back after its restart from the eager staging of the same save (its RestoreStaged
    says so), as the saved process: its counter goes on from the save, its memory hashes to the pattern's."""
    cluster.wait_for(
        "the eager restore",
        lambda: bool(_container(cluster, ns, name).get("ready") and _read(cluster, ns, name, "/tmp/n")),
        timeout=300,
    )
    assert _container(cluster, ns, name)["restartCount"] >= 1
    staged = [e["message"] for e in _events(cluster, ns, name, K.EVENT_RESTORE_STAGED)]
    assert any("staged again, eagerly" in m for m in staged), staged
    assert int(_read(cluster, ns, name, "/tmp/n")) >= n0
    assert _read(cluster, ns, name, "/tmp/sum0") == sum0
    cluster.kubectl("exec", "-n", ns, name, "-c", "app", "--", "python3", "-c", "open('/tmp/verify', 'w')")
    cluster.wait_for("the restored process's hash", lambda: _read(cluster, ns, name, "/tmp/sum") != "", timeout=120)
    assert _read(cluster, ns, name, "/tmp/sum") == sum0


def test_a_lazy_restore_that_cannot_fetch_a_page_is_restored_eagerly_or_given_up_with_the_reason(  # type: ignore[no-untyped-def]
    cluster, namespace, agent, plugin, private_registry
):
    ns, n2 = namespace, cluster.nodes[1]
    reg: RegistryServer = private_registry
    sum0, n0, ref = _saved_pattern(cluster, plugin, ns, "doomed", f"{reg.host}/e2e/lazy-fail-{ns}")

    # 1. the registry serves the chunk damaged while the pages are fetched, intact again afterwards (a
    # registry that came back): the container is stopped with the reason, then restored eagerly from the
    # same save, the kubelet's restart waiting at its create meanwhile
    blob, good = _damage(reg, ref)
    proc = plugin("restore", str(ref), "-n", ns, "--name", "doomed-2", "--node", n2, "--lazy", "--timeout", "300s")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cluster.wait_for(
        "the LazyRestoreFailed event",
        lambda: _events(cluster, ns, "doomed-2", K.EVENT_LAZY_RESTORE_FAILED),
        timeout=300,
    )
    blob.write_bytes(good)
    (failed,) = _events(cluster, ns, "doomed-2", K.EVENT_LAZY_RESTORE_FAILED)
    assert failed["type"] == "Warning"
    message = failed["message"]
    assert "could not all be fetched" in message and "digest" in message.lower(), failed
    assert "restored again, eagerly, from the same save" in message, failed
    assert not _events(cluster, ns, "doomed-2", K.EVENT_LAZY_RESTORE_COMPLETE)
    _restored_again_eagerly(cluster, ns, "doomed-2", n0, sum0)

    # 2. the chunk stays damaged: the eager restore cannot be staged either (after its tries), and a
    # `kubectl snapshot restore` is given up with the reason, never started from its image
    _damage(reg, ref)
    proc = plugin("restore", str(ref), "-n", ns, "--name", "doomed-3", "--node", n2, "--lazy", "--timeout", "300s")
    assert proc.returncode == 0, proc.stdout + proc.stderr

    def given_up() -> list[dict[str, Any]]:
        return [e for e in _events(cluster, ns, "doomed-3", K.EVENT_LAZY_RESTORE_FAILED)
                if "not started from its image" in e["message"]]  # fmt: skip

    cluster.wait_for("the restore to be given up", given_up, timeout=300)
    assert "digest" in given_up()[0]["message"].lower(), given_up()
    assert not _container(cluster, ns, "doomed-3").get("ready")
    assert _read(cluster, ns, "doomed-3", "/tmp/sum0") == ""  # no fresh pattern: it never ran from its image


@pytest.fixture
def held_registry(private_registry: RegistryServer, tmp_path: Path) -> Iterator[FaultyProxy]:
    """The private registry behind a proxy (reached at the proxy's address from the cluster too) that can
    hold chosen requests unanswered."""
    reg = private_registry
    with FaultyProxy("127.0.0.1", reg.port) as proxy, relayed_into_cluster(proxy.host, tmp_path / "proxy.sock"):
        yield proxy


def test_an_agent_restart_in_a_lazy_phase_restores_the_container_again_eagerly(  # type: ignore[no-untyped-def]
    cluster, namespace, agent, plugin, held_registry
):
    """The agent serving a lazy restore dies (killed, as a crash or an upgrade's roll would) while a chunk
    of the pattern is still on its way (the registry holds it). The next agent stops the container (its
    lazy pages would come zero-filled) and restores it again, eagerly, from the same save: the saved
    process runs on with its memory whole (before, the kubelet started it afresh from its image)."""
    ns, n2 = namespace, cluster.nodes[1]
    proxy: FaultyProxy = held_registry
    sum0, n0, ref = _saved_pattern(cluster, plugin, ns, "kept", f"{proxy.host}/e2e/lazy-restart-{ns}")
    held = _pattern_chunk(ref)
    proxy.hold_on = ("GET", re.compile(f"/blobs/{held}$"))

    proc = plugin("restore", str(ref), "-n", ns, "--name", "kept-2", "--node", n2, "--lazy", "--timeout", "300s")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    running(cluster, ns, "kept-2", timeout=300)
    assert proxy.holding.wait(120), "the lazy phase never asked for the held chunk"
    assert not _events(cluster, ns, "kept-2", K.EVENT_LAZY_RESTORE_COMPLETE)
    old = agent.agent_pod(n2)
    assert old is not None
    cluster.kubectl(
        "delete", "pod", "-n", K.AGENT_NAMESPACE, old["metadata"]["name"], "--grace-period=0", "--force",
        "--wait=false",
    )  # fmt: skip
    agent.wait_ready(n2, not_uid=old["metadata"]["uid"])
    proxy.hold_on = None
    proxy.release()  # the held request ends (its agent is gone); the chunk is served from now on

    def ended() -> list[dict[str, Any]]:
        return [e for e in _events(cluster, ns, "kept-2", K.EVENT_LAZY_RESTORE_FAILED)
                if "agent restarted" in e["message"]]  # fmt: skip

    cluster.wait_for("the next agent to end the lazy phase", ended, timeout=180)
    assert "restored again, eagerly, from the same save" in ended()[0]["message"], ended()

    _restored_again_eagerly(cluster, ns, "kept-2", n0, sum0)
