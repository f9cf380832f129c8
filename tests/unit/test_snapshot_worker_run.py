"""SnapshotWorker.run end to end over fakes of its ports: Kubernetes (tests/support/fakekube), the
registry and containerd (tests/support/fakenode), no freeze guard process. What the agent writes
where, in which order, for a save that works and one whose upload fails.

(The same flow on a real API server, containerd, CRIU and registry: tests/e2e/test_snapshot_flows.py.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from kubectl_snapshot.core import kube as K
from kubectl_snapshot.core.model import HostFacts, parse_config
from kubectl_snapshot.core.oci import parse_manifest
from shim.controller.settings import NodeSettings
from shim.controller.snapshots import SnapshotWorker
from tests.support.fakekube import EventRecorder, RecordedEvent
from tests.support.fakenode import FakeContainerd, FakeRegistry
from tests.support.signing import write_key

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


def worker(kube: Kube, cd: FakeContainerd, reg: FakeRegistry, tmp_path: Path) -> Worker:
    write_key(tmp_path / "signing", "signing")  # the agent signs every save (signing.key in its key dir)
    settings = NodeSettings(
        node="n1",
        state_root=str(tmp_path / "state"),
        kubelet_root=str(tmp_path / "kubelet"),
        signing_key_dir=str(tmp_path / "signing"),
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
    # progress through stages, then the outcome: reference, size and timings
    stages = [s.get("stage") for s in kube.statuses if s.get("stage")]
    assert "dump" in stages and "upload" in stages, stages
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
