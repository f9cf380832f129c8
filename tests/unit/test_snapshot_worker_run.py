"""SnapshotWorker.run end to end over fakes of its ports: Kubernetes (tests/support/fakekube), the
registry and containerd (tests/support/fakenode), no freeze guard process. What the agent writes
where, in which order, for a save that works and one whose upload fails.

(The same flow on a real API server, containerd, CRIU and registry: tests/e2e/test_snapshot_flows.py.)
"""

from __future__ import annotations

import contextlib
import stat
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kubectl_snapshot.adapters.keystore import FileKeyProvider
from kubectl_snapshot.adapters.signatures import sign_snapshot, trust_from_data, verify_for_restore
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import timestamps as T
from kubectl_snapshot.core.errors import NotFound, PermissionDenied, Unavailable
from kubectl_snapshot.core.model import HostFacts, parse_config
from kubectl_snapshot.core.oci import parse_manifest
from kubectl_snapshot.core.provenance import Origin, SigningKey, signature_tag
from kubectl_snapshot.core.reference import Reference
from kubectl_snapshot.core.sealing import KeyProvider, KeyUse, NamespaceKey
from shim.controller.settings import NodeSettings
from shim.controller.snapshots import SnapshotWorker, _StatusReporter
from tests.support.fakekube import EventRecorder, RecordedEvent
from tests.support.fakenode import FakeContainerd, FakeRegistry

HOST = HostFacts(kernel="6.18", arch="x86_64", criu_version="4.2.1")
DEST = "127.0.0.1:5000/team/app"


@dataclass
class Kube(EventRecorder):
    statuses: list[dict[str, Any]] = field(default_factory=list)
    metadata: list[dict[str, Any]] = field(default_factory=list)
    events: list[RecordedEvent] = field(default_factory=list)

    def patch_snapshot_status(
        self, ns: str, name: str, status: dict[str, Any], *, resource_version: str | None = None
    ) -> dict[str, Any]:
        self.statuses.append(status)
        return {}

    def patch_snapshot_metadata(
        self,
        ns: str,
        name: str,
        *,
        labels: Mapping[str, str | None] | None = None,
        annotations: Mapping[str, str | None] | None = None,
        resource_version: str | None = None,
    ) -> dict[str, Any]:
        self.metadata.append({"labels": dict(labels or {}), "annotations": dict(annotations or {})})
        return {}

    def list_snapshots(self, ns: str | None, *, label_selector: str | None = None) -> list[dict[str, Any]]:
        return []  # no earlier snapshot of the pod: nothing to mount blobs from

    # the trust ConfigMap as install made it; None: there is none
    trust: dict[str, str] | None = field(default_factory=lambda: {"cluster-id": "c-uid"})
    trust_patches: list[dict[str, str]] = field(default_factory=list)

    def get_config_map(self, ns: str, name: str) -> dict[str, Any]:
        assert (ns, name) == (K.AGENT_NAMESPACE, K.TRUST_CONFIG_MAP)
        if self.trust is None:
            raise NotFound(f"configmaps {name!r} not found")
        return {"metadata": {"name": name, "namespace": ns}, "data": dict(self.trust)}

    def patch_config_map_data(self, ns: str, name: str, data: dict[str, str]) -> dict[str, Any]:
        assert (ns, name) == (K.AGENT_NAMESPACE, K.TRUST_CONFIG_MAP) and self.trust is not None
        self.trust_patches.append(dict(data))
        self.trust.update(data)
        return self.get_config_map(ns, name)


class Worker(SnapshotWorker):
    @contextlib.contextmanager
    def _guard(self, report: dict[str, str]) -> Iterator[Any]:
        yield SimpleNamespace(freezer_for=lambda pid: None)  # no cgroup: containerd's pause is used


def pod() -> dict[str, Any]:
    return {
        "metadata": {"name": "web-0", "namespace": "team", "uid": "pod-uid"},
        "spec": {"nodeName": "n1", "containers": [{"name": "app", "image": "img"}, {"name": "side", "image": "img"}]},
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {"name": "app", "containerID": "containerd://a", "state": {"running": {}}},
                {"name": "side", "containerID": "containerd://b", "state": {"running": {}}},
            ],
        },
    }


def snapshot() -> dict[str, Any]:
    return {
        "kind": K.KIND,
        "metadata": {"name": "web-0-1", "namespace": "team", "uid": "snap-uid", "resourceVersion": "3"},
        "spec": {"podName": "web-0", "destination": f"{DEST}:v1", "includeVolumes": False},
    }


def worker(kube: Kube, cd: FakeContainerd, reg: FakeRegistry, tmp_path: Path, node: str = "n1") -> Worker:
    settings = NodeSettings(
        node=node,
        state_root=str(tmp_path / "state"),
        kubelet_root=str(tmp_path / "kubelet"),
        trust_dir=str(tmp_path / "no-trust"),
    )
    return Worker(
        kube=kube,
        settings=settings,
        facts=HOST,
        registries=lambda ns, secret, insecure: reg,
        containerd=lambda checkpointer: contextlib.nullcontext(cd),
    )


def test_a_save_freezes_both_containers_pushes_and_reports_success(tmp_path: Path) -> None:
    kube, cd, reg = Kube(), FakeContainerd({"a", "b"}), FakeRegistry()
    worker(kube, cd, reg, tmp_path).run(snapshot(), pod())
    # provenance first (before anything is frozen), from the real pod: its labels and images
    assert kube.metadata[0]["labels"][K.LABEL_POD] == "web-0"
    assert kube.metadata[0]["annotations"][K.ANN_CLAIMED_BY] is None
    # the pod frozen as a whole, dumped, thawed
    assert [c for c in cd.calls if c[0] != "checkpoint"] == [
        ("pause", "a"),
        ("pause", "b"),
        ("resume", "a"),
        ("resume", "b"),
    ]
    # progress (written beside the save, so maybe not every stage: test_progress_* below), then the
    # outcome: reference, size and timings
    stages = [s.get("stage") for s in kube.statuses if s.get("stage")]
    assert set(stages[:-1]) <= {"freeze", "dump", "upload"} and stages[-1] == "done", stages
    final = kube.statuses[-1]
    assert final["phase"] == K.PHASE_SUCCEEDED and final["node"] == "n1"
    assert final["reference"].startswith(f"{DEST}@sha256:") and final["size"] > 0
    # what was pushed names both containers and the pod
    manifest = parse_manifest(reg.manifests["v1"])
    config = parse_config(reg.blobs[manifest.config.digest])
    assert [c.name for c in config.containers] == ["app", "side"] and config.pod is not None
    assert config.pod.name == "web-0" and config.pod.uid == "pod-uid"
    assert [e.reason for e in kube.events] == [K.EVENT_SNAPSHOT_STARTED] * 2 + [K.EVENT_SNAPSHOT_SUCCEEDED] * 2


def test_a_failed_upload_thaws_the_pod_and_reports_why(tmp_path: Path) -> None:
    kube, cd, reg = Kube(), FakeContainerd({"a", "b"}), FakeRegistry(fail_push=True)
    worker(kube, cd, reg, tmp_path).run(snapshot(), pod())
    assert cd.paused == set() and cd.killed == set()
    final = kube.statuses[-1]
    assert final["phase"] == K.PHASE_FAILED
    assert "connection reset" in final["message"] and final["reason"] == "Unavailable"
    assert reg.manifests == {}  # no tag left behind
    assert kube.events[-1].reason == K.EVENT_SNAPSHOT_FAILED and kube.events[-1].type == "Warning"


def saved(kube: Kube, reg: FakeRegistry) -> Reference:
    final = kube.statuses[-1]
    assert final["phase"] == K.PHASE_SUCCEEDED, final
    return Reference.parse(final["reference"])


def test_a_save_is_signed_with_the_nodes_own_key_which_verifies_for_that_node(tmp_path: Path) -> None:
    """The agent makes its node's key (root's, 0600, in its state dir), registers it in the trust
    ConfigMap bound to its node, and signs with it: a restore reading that ConfigMap verifies the save."""
    kube, cd, reg = Kube(), FakeContainerd({"a", "b"}), FakeRegistry()
    worker(kube, cd, reg, tmp_path).run(snapshot(), pod())
    ref = saved(kube, reg)
    key_file = tmp_path / "state" / "n1" / "signing" / "node.key"
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
    [patch] = kube.trust_patches
    [kid] = [name.removesuffix(".pub") for name in patch if name.endswith(".pub")]
    assert patch[f"{kid}.node"] == "n1" and set(patch) == {f"{kid}.pub", f"{kid}.node"}
    assert kube.trust is not None
    verdict = verify_for_restore(reg, ref, "team", "pod-uid", trust_from_data(kube.trust))
    assert verdict.verified and verdict.key_id == kid and verdict.key_node == "n1"
    assert verdict.claim is not None and verdict.claim.origin.node == "n1"
    # the next save (even by a restarted agent) signs with the same key, already registered
    kube.statuses.clear()
    worker(kube, cd, reg, tmp_path).run(snapshot(), pod())
    assert verify_for_restore(reg, saved(kube, reg), "team", "pod-uid", trust_from_data(kube.trust)).key_id == kid
    assert len(kube.trust_patches) == 1


def test_a_key_an_administrator_retired_is_replaced_before_it_signs_again(tmp_path: Path) -> None:
    """Threat C10's legitimate case: retiring a node's key (`<id>.not-after`) must not make that node's
    next saves unrestorable. The agent sees the retirement, makes a new key, registers it and signs with
    it; the save before the retirement still verifies with the old key, the one after with the new."""
    kube, cd, reg = Kube(), FakeContainerd({"a", "b"}), FakeRegistry()
    worker(kube, cd, reg, tmp_path).run(snapshot(), pod())
    before = saved(kube, reg)
    assert kube.trust is not None
    [old] = [k.removesuffix(".pub") for k in kube.trust if k.endswith(".pub")]
    kube.trust[f"{old}.not-after"] = T.rfc3339(time.time() + 60)  # retired in a minute: replaced now
    kube.statuses.clear()
    worker(kube, cd, reg, tmp_path).run(snapshot(), pod())
    after = saved(kube, reg)
    trust = trust_from_data(kube.trust)
    assert verify_for_restore(reg, before, "team", "pod-uid", trust).key_id == old  # signed before: still good
    new = verify_for_restore(reg, after, "team", "pod-uid", trust)
    assert new.verified and new.key_id != old and new.key_node == "n1"
    assert kube.trust[f"{new.key_id}.node"] == "n1"


def test_a_key_retired_later_signs_on_until_its_retirement_comes_near(tmp_path: Path) -> None:
    kube, cd, reg = Kube(), FakeContainerd({"a", "b"}), FakeRegistry()
    worker(kube, cd, reg, tmp_path).run(snapshot(), pod())
    assert kube.trust is not None
    [old] = [k.removesuffix(".pub") for k in kube.trust if k.endswith(".pub")]
    kube.trust[f"{old}.not-after"] = T.rfc3339(time.time() + 86400)  # retired tomorrow
    kube.statuses.clear()
    worker(kube, cd, reg, tmp_path).run(snapshot(), pod())
    assert verify_for_restore(reg, saved(kube, reg), "team", "pod-uid", trust_from_data(kube.trust)).key_id == old
    assert len([k for k in kube.trust if k.endswith(".pub")]) == 1  # no new key


def test_the_nodes_key_taken_off_the_node_cannot_vouch_for_another_node(tmp_path: Path) -> None:
    """Root on n1 reads n1's key and signs a save as if it were taken on n2 (a pod of any namespace there):
    the restore refuses it, naming the mismatch; n1's own, legitimate save verifies."""
    kube, cd, reg = Kube(), FakeContainerd({"a", "b"}), FakeRegistry()
    worker(kube, cd, reg, tmp_path).run(snapshot(), pod())
    ref = saved(kube, reg)
    assert kube.trust is not None
    trust = trust_from_data(kube.trust)
    assert verify_for_restore(reg, ref, "team", "pod-uid", trust).verified
    stolen = SigningKey.from_pem((tmp_path / "state" / "n1" / "signing" / "node.key").read_bytes())
    forged = Origin(namespace="team", pod="web-0", pod_uid="pod-uid", node="n2")
    reg.manifests.pop(signature_tag(ref.digest or ""))  # only the forged signature is left
    sign_snapshot(reg, ref, forged, stolen)
    with pytest.raises(PermissionDenied, match=r"signed by the key of node n1 .* but its origin names node n2"):
        verify_for_restore(reg, ref, "team", "pod-uid", trust)


def test_no_trust_configmap_fails_the_save_before_anything_is_frozen(tmp_path: Path) -> None:
    kube, cd, reg = Kube(trust=None), FakeContainerd({"a", "b"}), FakeRegistry()
    worker(kube, cd, reg, tmp_path).run(snapshot(), pod())
    final = kube.statuses[-1]
    assert final["phase"] == K.PHASE_FAILED and "signing key is not registered" in final["message"]
    assert cd.calls == [] and reg.manifests == {}


def final_pod(hook_ends_in_s: float) -> dict[str, Any]:
    """web-0 being terminated with a 30 s grace period, its 24 s preStop sleep ending in `hook_ends_in_s`."""
    import time

    from kubectl_snapshot.core import timestamps as T

    p = pod()
    for c in p["spec"]["containers"]:
        c["lifecycle"] = {"preStop": {"sleep": {"seconds": 24}}}
    p["metadata"]["deletionTimestamp"] = T.rfc3339(time.time() + hook_ends_in_s + 6)
    p["metadata"]["deletionGracePeriodSeconds"] = 30
    return p


def final_snapshot() -> dict[str, Any]:
    s = snapshot()
    s["metadata"]["labels"] = {K.LABEL_FINAL_SAVE: "true"}
    s["spec"]["stop"] = True
    return s


def test_where_a_save_goes_in_the_queue_final_saves_by_their_thaw_by(tmp_path: Path) -> None:
    from kubectl_snapshot.core import finalsave as F
    from kubectl_snapshot.core import saveorder as O

    kube, cd, reg = Kube(), FakeContainerd({"a", "b"}), FakeRegistry()
    w = worker(kube, cd, reg, tmp_path)
    p = final_pod(20.0)
    final = w.order_of(final_snapshot(), p)
    assert final.kind == O.URGENT and final.pod == "pod-uid" and final.deadline == F.thaw_by(p)
    periodic = snapshot()
    periodic["metadata"]["labels"] = {K.LABEL_POLICY: "web"}
    assert w.order_of(periodic, pod()).kind == O.PERIODIC and w.order_of(snapshot(), pod()).kind == O.USER
    assert w.order_of(snapshot(), pod()).estimate == 0
    w.run(snapshot(), pod())
    assert w.order_of(snapshot(), pod()).estimate == kube.statuses[-1]["size"]  # the last save's bytes


def test_a_final_save_too_close_to_its_thaw_by_is_refused_before_anything_is_frozen(tmp_path: Path) -> None:
    kube, cd, reg = Kube(), FakeContainerd({"a", "b"}), FakeRegistry()
    worker(kube, cd, reg, tmp_path).run(final_snapshot(), final_pod(1.5))  # thaw_by in 0.5 s
    assert [c for c in cd.calls if c[0] in ("pause", "checkpoint")] == [] and cd.killed == set()
    final = kube.statuses[-1]
    assert final["phase"] == K.PHASE_FAILED and "was not frozen" in final["message"], final
    assert "thaw_by" in final["message"] and reg.manifests == {}


def test_the_sizes_kept_for_the_save_order_are_bounded_the_latest_pods_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shim.controller import snapshots

    monkeypatch.setattr(snapshots, "SENT_KEPT", 3)
    w = worker(Kube(), FakeContainerd({"a", "b"}), FakeRegistry(), tmp_path)
    for i in range(5):
        w._remember_sent(f"uid-{i}", 100 + i)
    w._remember_sent("uid-2", 7)  # saved again: the newest
    assert list(w._sent) == ["uid-3", "uid-4", "uid-2"] and w._sent["uid-2"] == 7


class RecordingKeys:
    """A key store that records for whose save each key is asked (the key broker checks that pod), and
    can be down like an unreachable broker."""

    def __init__(self, directory: Path, *, down: bool = False) -> None:
        self.inner, self.down = FileKeyProvider(str(directory)), down
        self.uses: list[KeyUse | None] = []

    def namespace_key(
        self, namespace: str, *, create: bool, key_id: str | None = None, use: KeyUse | None = None
    ) -> NamespaceKey:
        self.uses.append(use)
        if self.down:
            raise Unavailable("keys unavailable: the key broker at https://broker:9643 cannot be reached")
        return self.inner.namespace_key(namespace, create=create, key_id=key_id, use=use)


def sealing_worker(kube: Kube, cd: FakeContainerd, reg: FakeRegistry, tmp_path: Path, keys: KeyProvider) -> Worker:
    w = worker(kube, cd, reg, tmp_path)
    w.keys = keys
    return w


def test_a_save_asks_for_its_namespace_key_for_this_pod_and_seals_with_it(tmp_path: Path) -> None:
    kube, cd, reg = Kube(), FakeContainerd({"a", "b"}), FakeRegistry()
    keys = RecordingKeys(tmp_path / "keys")
    sealing_worker(kube, cd, reg, tmp_path, keys).run(snapshot(), pod())
    ref = saved(kube, reg)
    config = parse_config(reg.blobs[parse_manifest(reg.manifests[ref.tag or "v1"]).config.digest])
    assert config.encryption is not None and config.encryption.namespace == "team"
    assert keys.uses == [KeyUse("team", "web-0", "pod-uid")]  # a save: no snapshot named


def test_keys_unavailable_fail_the_save_before_anything_is_frozen(tmp_path: Path) -> None:
    kube, cd, reg = Kube(), FakeContainerd({"a", "b"}), FakeRegistry()
    sealing_worker(kube, cd, reg, tmp_path, RecordingKeys(tmp_path / "keys", down=True)).run(snapshot(), pod())
    final = kube.statuses[-1]
    assert final["phase"] == K.PHASE_FAILED and final["message"].startswith("keys unavailable"), final
    assert cd.calls == [] and reg.manifests == {}


class SlowKube(Kube):
    """A status write takes until `go` is set; each write's stage is recorded as it starts."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()
        self.started: list[str] = []

    def patch_snapshot_status(
        self, ns: str, name: str, status: dict[str, Any], *, resource_version: str | None = None
    ) -> dict[str, Any]:
        self.started.append(str(status.get("stage")))
        assert self.go.wait(10)
        return super().patch_snapshot_status(ns, name, status, resource_version=resource_version)


def test_progress_is_written_beside_the_save_which_never_waits_for_it() -> None:
    """The stage reached with the pod frozen is not a write the freeze waits for: each stage returns at
    once while the API server is slow; only the latest progress waits; close drops it, waits for the write
    in flight, and nothing is written after it (the outcome comes next)."""
    kube = SlowKube()
    reporter = _StatusReporter(kube, "ns", "s", time.monotonic)
    t = time.monotonic()
    reporter.stage("freeze")
    _wait_for(lambda: kube.started == ["freeze"])
    for stage in ("dump", "upload"):
        reporter.stage(stage)
    assert time.monotonic() - t < 5  # none of them waited for the write in flight
    closing = threading.Thread(target=reporter.close)
    closing.start()
    time.sleep(0.05)
    assert closing.is_alive()  # the write in flight is waited for
    kube.go.set()
    closing.join(10)
    assert not closing.is_alive()
    reporter.stage("stop")  # after close: nothing
    time.sleep(0.1)
    assert kube.started == ["freeze"] and [s["stage"] for s in kube.statuses] == ["freeze"]


def test_progress_that_waited_is_written_once_with_the_latest_stage() -> None:
    kube = SlowKube()
    reporter = _StatusReporter(kube, "ns", "s", time.monotonic)
    reporter.stage("freeze")
    _wait_for(lambda: kube.started == ["freeze"])
    reporter.stage("dump")
    reporter.stage("upload")  # "dump" is never written: "upload" took its place
    kube.go.set()
    _wait_for(lambda: len(kube.statuses) == 2)
    reporter.close()
    assert [s["stage"] for s in kube.statuses] == ["freeze", "upload"]


def _wait_for(cond: Any) -> None:
    deadline = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.005)


class BrokenOnceKube(Kube):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def patch_snapshot_status(
        self, ns: str, name: str, status: dict[str, Any], *, resource_version: str | None = None
    ) -> dict[str, Any]:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("a bug in the client")
        return super().patch_snapshot_status(ns, name, status, resource_version=resource_version)


def test_a_progress_write_that_raises_does_not_stop_the_next_one() -> None:
    kube = BrokenOnceKube()
    reporter = _StatusReporter(kube, "ns", "s", time.monotonic)
    reporter.stage("freeze")
    _wait_for(lambda: kube.calls == 1)
    reporter.stage("dump")
    _wait_for(lambda: len(kube.statuses) == 1)
    reporter.close()
    assert [s["stage"] for s in kube.statuses] == ["dump"]
