"""The agent's pure rules: which containers, which emptyDirs, what the recorded pod spec keeps."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import FailedPrecondition
from shim.controller.node_install import dropin_toml, install, uninstall
from shim.controller.podinfo import empty_dirs, record_pod, running_containers
from shim.controller.restores import _Clock, wants_restore
from shim.controller.settings import NodeSettings, apply_node_map
from tests.support.bundle import fake_bundle
from tests.support.fakekube import EventRecorder, RecordedEvent

POD: dict[str, Any] = {
    "metadata": {
        "name": "counter",
        "namespace": "team-a",
        "uid": "1234-abcd",
        "labels": {"app": "counter", "pod-template-hash": "x"},
        "annotations": {"note": "keep", "kubectl-snapshot.io/restore-status": "drop"},
    },
    "spec": {
        "nodeName": "ks-n1",
        "initContainers": [{"name": "init", "image": "busybox"}],
        "containers": [
            {
                "name": "app",
                "image": "127.0.0.1:5005/busybox:1.37",
                "volumeMounts": [
                    {"name": "data", "mountPath": "/data"},
                    {"name": "kube-api-access-abcde", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"},
                ],
            },
            {"name": "side", "image": "127.0.0.1:5005/busybox@sha256:" + "b" * 64},
        ],
        "volumes": [
            {"name": "data", "emptyDir": {}},
            {"name": "cfg", "configMap": {"name": "c"}},
            {"name": "kube-api-access-abcde", "projected": {"sources": []}},
        ],
    },
    "status": {
        "phase": "Running",
        "containerStatuses": [
            {
                "name": "side",
                "containerID": "containerd://bbb",
                "state": {"running": {}},
                "imageID": "127.0.0.1:5005/busybox@sha256:" + "b" * 64,
            },
            {
                "name": "app",
                "containerID": "containerd://aaa",
                "state": {"running": {}},
                "imageID": "127.0.0.1:5005/busybox@sha256:" + "a" * 64,
            },
        ],
    },
}


def test_running_containers_in_spec_order() -> None:
    c = running_containers(POD)
    assert c.ids == ["aaa", "bbb"] and c.names == ["app", "side"]


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda p: p["status"].update(phase="Pending"), "Pending, not Running"),
        (lambda p: p["status"]["containerStatuses"][1].update(state={"waiting": {}}), "not running"),
        (lambda p: p["status"]["containerStatuses"][0].update(containerID="cri-o://x"), "not containerd"),
    ],
)
def test_running_containers_refuses(mutate, match) -> None:  # type: ignore[no-untyped-def]
    pod = copy.deepcopy(POD)
    mutate(pod)
    with pytest.raises(FailedPrecondition, match=match):
        running_containers(pod)


def test_empty_dirs_are_the_kubelet_paths() -> None:
    assert empty_dirs(POD, "/var/lib/kubelet") == {
        "data": "/var/lib/kubelet/pods/1234-abcd/volumes/kubernetes.io~empty-dir/data"
    }


def test_record_pod_sanitizes_and_pins_images() -> None:
    rec = record_pod(POD, "ks-n1")
    spec = rec.spec
    assert rec.name == "counter" and rec.namespace == "team-a" and rec.uid == "1234-abcd" and rec.node == "ks-n1"
    assert "nodeName" not in spec and "initContainers" not in spec
    assert [v["name"] for v in spec["volumes"]] == ["data", "cfg"]
    assert spec["containers"][0]["volumeMounts"] == [{"name": "data", "mountPath": "/data"}]
    assert spec["containers"][0]["image"] == "127.0.0.1:5005/busybox@sha256:" + "a" * 64
    assert spec["containers"][1]["image"] == "127.0.0.1:5005/busybox@sha256:" + "b" * 64
    assert spec["metadata"]["annotations"] == {"note": "keep"}
    assert POD["spec"]["nodeName"] == "ks-n1"  # the input is not modified


def test_record_pod_keeps_native_sidecars_pinned_and_drops_completed_init_containers() -> None:
    pod = copy.deepcopy(POD)
    pod["spec"]["initContainers"] = [
        {"name": "setup", "image": "127.0.0.1:5005/busybox:1"},
        {"name": "proxy", "image": "127.0.0.1:5005/busybox:1", "restartPolicy": "Always"},
    ]
    pod["status"]["initContainerStatuses"] = [
        {"name": "proxy", "imageID": "127.0.0.1:5005/busybox@sha256:" + "c" * 64, "state": {"running": {}}}
    ]
    spec = record_pod(pod, "ks-n1").spec
    assert spec["initContainers"] == [
        {"name": "proxy", "image": "127.0.0.1:5005/busybox@sha256:" + "c" * 64, "restartPolicy": "Always"}
    ]


def test_wants_restore() -> None:
    pod = copy.deepcopy(POD)
    assert not wants_restore(pod, "ks-n1")
    pod["metadata"]["annotations"] = {K.ANN_RESTORE_FROM: "r/x@sha256:" + "a" * 64}
    assert wants_restore(pod, "ks-n1")
    assert not wants_restore(pod, "ks-n2")
    pod["metadata"]["annotations"][K.ANN_RESTORE_STATUS] = K.RESTORE_STAGED
    assert not wants_restore(pod, "ks-n1")


def test_node_map_overrides_only_known_keys(tmp_path: Path) -> None:
    f = tmp_path / "nodes.yaml"
    f.write_text("ks-n1:\n  kubeletRoot: /k1\n  containerdSocket: /c1.sock\n  bogus: x\nks-n2:\n  kubeletRoot: /k2\n")
    s = apply_node_map(NodeSettings(node="ks-n1"), str(f))
    assert (s.kubelet_root, s.containerd_socket) == ("/k1", "/c1.sock")
    assert s.state_dir == "/var/lib/kubectl-snapshot/ks-n1"
    assert apply_node_map(NodeSettings(node="other"), str(f)) == NodeSettings(node="other")


def test_install_and_uninstall_node(tmp_path: Path) -> None:
    s = NodeSettings(
        node="n1",
        state_root=str(tmp_path / "state"),
        opt_root=str(tmp_path / "opt"),
        containerd_dropin_dir=str(tmp_path / "dropins"),
        restart_command=f"touch {tmp_path / 'restarted'}",
        criu_path=str(tmp_path / "no-criu"),
        criu_config=str(tmp_path / "criu" / "runc.conf"),
        criu_kdat="",  # never the host's /run in a unit test (tests/integration/test_criu_kdat.py)
        memory_work_fs=False,  # nor a tmpfs (tests/integration/test_workfs.py)
    )
    pyz = tmp_path / "w.pyz"
    pyz.write_bytes(b"PK")
    bundle = fake_bundle(tmp_path / "bundle")
    r = install(s, wrapper_pyz=str(pyz), bundle=str(bundle), containerd_version="v2.3.7")
    assert r.changed and r.restarted and (tmp_path / "restarted").exists()
    # this node's "CRIU" cannot run the nftables probe: no configuration is written
    assert r.criu_config is not None and r.criu_config.state == "unsupported"
    assert not Path(s.criu_config).exists()
    assert Path(s.wrapper_launcher).read_bytes() == (bundle / "launcher").read_bytes()
    assert f"BinaryName = '{s.wrapper_launcher}'" in dropin_toml(s, "v2.3.7")
    assert Path(r.dropin).read_text() == dropin_toml(s, "v2.3.7")
    (tmp_path / "restarted").unlink()
    again = install(s, wrapper_pyz=str(pyz), bundle=str(bundle), containerd_version="v2.3.7")
    assert not again.changed and not again.restarted and not (tmp_path / "restarted").exists()
    uninstall(s)
    assert not Path(r.dropin).exists() and not Path(s.wrapper_dir).exists()
    assert (tmp_path / "restarted").exists()


class _AnnotatingKube(EventRecorder):
    """The restore worker's Kube in these tests: pod annotation patches and Events, recorded."""

    def __init__(self) -> None:
        self.patches: list[dict[str, Any]] = []
        self.events: list[RecordedEvent] = []

    def patch_pod_annotations(
        self, ns: str, name: str, annotations: dict[str, str | None], *, status: bool = False
    ) -> dict[str, Any]:
        self.patches.append(annotations)
        return {}


def _restore_worker(tmp_path: Path) -> tuple[_AnnotatingKube, Any]:
    from kubectl_snapshot.core.model import HostFacts
    from shim.controller.restores import RestoreWorker

    kube = _AnnotatingKube()
    return kube, RestoreWorker(
        kube=kube, settings=NodeSettings(node="ks-n2", state_root=str(tmp_path)), facts=HostFacts()
    )


def test_restore_worker_reports_a_pod_the_wrapper_could_not_restore_whole(tmp_path: Path) -> None:
    from kubectl_snapshot.core import kubenames as K
    from kubectl_snapshot.core.model import HostFacts
    from shim.controller.restores import RestoreWorker
    from shim.net.podrestore import PodRestore

    kube, worker = _restore_worker(tmp_path)
    stopped: list[str] = []

    def stop_containers(uid: str, only: list[str] | None = None) -> list[str]:
        stopped.append(uid)
        return ["app"]

    worker._stop_containers = stop_containers
    pod = {
        "metadata": {
            "name": "p",
            "namespace": "ns",
            "uid": "u-1",
            "annotations": {K.ANN_RESTORE_FROM: "r/x@sha256:" + "0" * 64, K.ANN_RESTORE_STATUS: K.RESTORE_STAGED},
        },
        "spec": {"nodeName": "ks-n2"},
    }
    state = PodRestore(worker.paths.pod_dir("u-1"))
    state.record(["app", "db"])
    worker.consider(pod)
    assert kube.patches == [] and stopped == []  # nothing failed: nothing to report
    state.fail("container 'db' could not be restored: criu restore failed")
    worker.consider(pod)
    worker.consider(pod)  # reported once
    assert stopped == ["u-1"]
    [ann] = kube.patches
    assert ann[K.ANN_RESTORE_STATUS].startswith("Failed: the pod could not be restored whole: container 'db'")
    assert [(e.reason, e.type) for e in kube.events] == [(K.EVENT_RESTORE_FAILED, "Warning")]


def test_restore_worker_reports_a_resume_the_wrapper_started_fresh(tmp_path: Path) -> None:
    """A resume the wrapper could not restore: the agent stops only the containers already restored
    (the kubelet creates them again, fresh), says why in a ResumeSkipped Event, once, and marks nothing
    failed: the workload runs."""
    from kubectl_snapshot.core import kubenames as K
    from kubectl_snapshot.core.model import HostFacts
    from shim.controller.restores import RestoreWorker
    from shim.net.podrestore import PodRestore

    kube, worker = _restore_worker(tmp_path)
    stopped: list[tuple[str, list[str] | None]] = []

    def stop_containers(uid: str, only: list[str] | None = None) -> list[str]:
        stopped.append((uid, only))
        return list(only or [])

    worker._stop_containers = stop_containers
    pod = {
        "metadata": {
            "name": "web-0",
            "namespace": "ns",
            "uid": "u-2",
            "annotations": {K.ANN_RESUME_POLICY: "p", K.ANN_RESTORE_STATUS: K.RESTORE_STAGED},
        },
        "spec": {"nodeName": "ks-n2"},
    }
    state = PodRestore(worker.paths.pod_dir("u-2"))
    state.record(["app", "db"])
    state.mark_restored("app")
    state.start_fresh("container 'db' could not be restored: refusing to restore: seccomp")
    worker.consider(pod)
    worker.consider(pod)  # reported once
    assert stopped == [("u-2", ["app"])]
    [ann] = kube.patches
    assert ann[K.ANN_RESTORE_STATUS].startswith(K.RESTORE_SKIPPED_PREFIX + "container 'db' could not be restored")
    assert [(e.reason, e.type) for e in kube.events] == [(K.EVENT_RESUME_SKIPPED, "Normal")]
    assert "stopped the restored containers app" in kube.events[0].message


def test_a_refusal_of_the_images_is_told_apart_from_a_failure(tmp_path: Path) -> None:
    """The wrapper's image check refusing a restore-from: RestoreRefused with the reason (a failure of CRIU
    stays RestoreFailed, test above)."""
    from kubectl_snapshot.core import kubenames as K
    from kubectl_snapshot.core.model import HostFacts
    from shim.controller.restores import RestoreWorker
    from shim.net.podrestore import PodRestore

    kube, worker = _restore_worker(tmp_path)
    worker._stop_containers = lambda uid, only=None: []
    pod = {
        "metadata": {
            "name": "p",
            "namespace": "ns",
            "uid": "u-3",
            "annotations": {K.ANN_RESTORE_FROM: "r/x@sha256:" + "0" * 64, K.ANN_RESTORE_STATUS: K.RESTORE_STAGED},
        },
        "spec": {"nodeName": "ks-n2"},
    }
    state = PodRestore(worker.paths.pod_dir("u-3"))
    state.record(["app"])
    state.fail("container 'app' could not be restored: refusing to restore: the CRIU images grant more than the spec")
    worker.consider(pod)
    assert [(e.reason, e.type) for e in kube.events] == [(K.EVENT_RESTORE_REFUSED, "Warning")]
    assert "grant more than the spec" in kube.events[0].message


def test_the_staging_clock_names_every_step_of_a_staging() -> None:
    """The RestoreStaged Event's timing line is made after the pod's gates were answered: a step it
    could not name once raised there, and the pod resumed without its Event (the node-loss e2e)."""
    clock = _Clock()
    for step in ("choose", "check", "volumes", "download", "image check"):
        clock.lap(step)
    line = str(clock)
    assert line.startswith("in ") and "the image check" in line and "choosing the save" in line
    clock.lap("a step added later")
    assert "a step added later" in str(clock)
    clock.lap("download", of_it="of it the blobs' presence 0.25 s")  # a part named in brackets
    assert "download, verify, extract 0." in str(clock) and "s (of it the blobs' presence 0.25 s)" in str(clock)


class _PodKube(_AnnotatingKube):
    """get_pod answers what the test sets (None: not found)."""

    def __init__(self, live: dict[str, Any] | None) -> None:
        super().__init__()
        self.live = live

    def get_pod(self, ns: str, name: str) -> dict[str, Any]:
        from kubectl_snapshot.core.errors import NotFound

        if self.live is None:
            raise NotFound(f"pod {ns}/{name} not found")
        return self.live


def _waiting_worker(tmp_path: Path, live: dict[str, Any] | None, monkeypatch: pytest.MonkeyPatch) -> Any:
    from kubectl_snapshot.core.model import HostFacts
    from shim.controller import restores

    monkeypatch.setattr(restores, "POD_CHECK_S", 0.0)
    monkeypatch.setattr(restores, "VOLUME_WAIT_S", 5.0)
    return restores.RestoreWorker(
        kube=_PodKube(live), settings=NodeSettings(node="ks-n2", state_root=str(tmp_path)), facts=HostFacts()
    )


_WAITED = {"metadata": {"name": "p-r", "namespace": "ns", "uid": "u-9"}}


def test_the_volume_wait_ends_when_the_kubelet_mounted_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The legitimate case: a pod that is Pending while its volumes appear is waited for, not refused."""
    import threading

    live = {**_WAITED, "status": {"phase": "Pending", "conditions": [{"type": "Ready", "status": "False"}]}}
    worker = _waiting_worker(tmp_path, live, monkeypatch)
    (tmp_path / "kubelet").mkdir()
    later = threading.Timer(0.3, lambda: (tmp_path / "kubelet" / "gate").mkdir())
    later.start()
    worker._wait_for_dirs(str(tmp_path / "kubelet"), ["gate"], _WAITED)
    later.join()


@pytest.mark.parametrize(
    ("live", "match"),
    [
        (
            {**_WAITED, "status": {"phase": "Failed", "reason": "OutOfcpu", "message": "Node didn't have enough cpu"}},
            "the kubelet ended the pod before setting up its volumes: phase Failed; OutOfcpu: Node didn't have",
        ),
        (None, "the pod was deleted before the kubelet set up its volumes"),
        ({"metadata": {**_WAITED["metadata"], "uid": "u-other"}}, "the pod was deleted"),
        ({"metadata": {**_WAITED["metadata"], "deletionTimestamp": "2026-12-06T00:00:00Z"}}, "being deleted"),
    ],
)
def test_the_volume_wait_ends_early_for_a_pod_that_will_never_mount_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, live: dict[str, Any] | None, match: str
) -> None:
    worker = _waiting_worker(tmp_path, live, monkeypatch)
    with pytest.raises(FailedPrecondition, match=match):
        worker._wait_for_dirs(str(tmp_path), ["gate"], _WAITED)


def test_the_volume_wait_says_what_the_pod_status_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shim.controller import restores

    live = {**_WAITED, "status": {"phase": "Pending", "conditions": [{"type": "PodReadyToStartContainers",
                                                                       "status": "False"}]}}  # fmt: skip
    worker = _waiting_worker(tmp_path, live, monkeypatch)
    monkeypatch.setattr(restores, "VOLUME_WAIT_S", 0.2)
    with pytest.raises(
        FailedPrecondition, match=r"did not set up .* \(phase Pending; PodReadyToStartContainers False\)"
    ):
        worker._wait_for_dirs(str(tmp_path), ["gate"], _WAITED)
