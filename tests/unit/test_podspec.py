"""The pure builders behind `kubectl snapshot`: names, the PodSnapshot, the restore Pod, states."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import FailedPrecondition, InvalidArgument, SourcePodReplaced
from kubectl_snapshot.core.model import PodRecord
from kubectl_snapshot.core.podspec import (
    GATE_SCRIPT,
    RestoreState,
    check_pod_running,
    check_snapshot_source,
    destination,
    gate_needed,
    holds_restore_pods,
    parse_pod_arg,
    restore_pod,
    restore_state,
    restored_name,
    snapshot_name,
    snapshot_object,
)
from kubectl_snapshot.core.reference import Reference

NOW = datetime.datetime(2026, 11, 29, 16, 0, 5, tzinfo=datetime.UTC)
DIGEST = "sha256:" + "a" * 64
IMG = "127.0.0.1:5005/kubectl-snapshot/busybox@sha256:" + "b" * 64


@pytest.mark.parametrize("arg", ["web", "pod/web", "pods/web", "po/web", "Pod/web"])
def test_pod_arg_forms(arg: str) -> None:
    assert parse_pod_arg(arg) == "web"


@pytest.mark.parametrize("arg", ["svc/web", "deploy/web", "pod/", "pod/Web", "pod/a_b", ""])
def test_pod_arg_rejects(arg: str) -> None:
    with pytest.raises(InvalidArgument) as e:
        parse_pod_arg(arg)
    assert e.value.hint


def test_snapshot_name_is_pod_plus_utc_timestamp() -> None:
    assert snapshot_name("counter", NOW) == "counter-20261129-160005"
    local = NOW.astimezone(datetime.timezone(datetime.timedelta(hours=5)))
    assert snapshot_name("counter", local) == "counter-20261129-160005"
    long = snapshot_name("a" * 300, NOW)
    assert len(long) == 253 and long.endswith("-20261129-160005")


def test_restored_name_stays_a_dns_label() -> None:
    assert restored_name("web") == "web-restored"
    assert len(restored_name("x" * 80)) == 63


def test_destination_default_tag_and_digest_refused() -> None:
    assert str(destination("127.0.0.1:5005/snaps/web", "20261129-160005")) == "127.0.0.1:5005/snaps/web:20261129-160005"
    assert str(destination("127.0.0.1:5005/snaps/web:v1", "x")) == "127.0.0.1:5005/snaps/web:v1"
    with pytest.raises(InvalidArgument):
        destination("127.0.0.1:5005/snaps/web@" + DIGEST, "x")
    with pytest.raises(InvalidArgument):
        destination("http://127.0.0.1:5005/snaps/web", "x")


def test_snapshot_object_matches_the_contract() -> None:
    obj = snapshot_object(
        name="web-20261129-160005",
        namespace="team-a",
        pod="web",
        target=Reference.parse("127.0.0.1:5005/snaps/web:t1"),
        registry_secret="regcred",
        stop=True,
        include_volumes=False,
    )
    assert obj["apiVersion"] == "kubectl-snapshot.io/v1alpha1" and obj["kind"] == "PodSnapshot"
    assert obj["metadata"] == {
        "name": "web-20261129-160005",
        "namespace": "team-a",
        "labels": {"kubectl-snapshot.io/pod": "web"},
    }
    assert obj["spec"] == {
        "podName": "web",
        "podNamespace": "team-a",
        "destination": "127.0.0.1:5005/snaps/web:t1",
        "registrySecret": "regcred",
        "insecure": False,
        "stop": True,
        "includeVolumes": False,
    }
    ignoring = snapshot_object(
        name="w", namespace="a", pod="web", target=Reference.parse("127.0.0.1:5005/s:t"), ignore_liveness=True
    )
    assert ignoring["spec"]["ignoreLiveness"] is True
    pinned = snapshot_object(
        name="w", namespace="a", pod="web", target=Reference.parse("127.0.0.1:5005/s:t"), pod_uid="u-1"
    )
    assert pinned["spec"]["podUID"] == "u-1"


def _source(uid: str) -> dict[str, Any]:
    return {"metadata": {"name": "web", "namespace": "team-a", "uid": uid}, "spec": {"nodeName": "n1"}}


def test_the_pod_a_snapshot_was_requested_for_passes_and_one_without_a_uid_too() -> None:
    check_snapshot_source({"podName": "web", "podUID": "u-1"}, _source("u-1"))
    check_snapshot_source({"podName": "web"}, _source("u-2"))  # an older plugin recorded no uid: as before
    check_snapshot_source({"podName": "web", "podUID": ""}, _source("u-2"))


def test_a_pod_replaced_under_the_same_name_is_refused_for_that_reason() -> None:
    with pytest.raises(SourcePodReplaced) as e:
        check_snapshot_source({"podName": "web", "podUID": "u-1"}, _source("u-2"))
    assert isinstance(e.value, FailedPrecondition) and type(e.value).__name__ == "SourcePodReplaced"
    assert "team-a/web" in e.value.message and "replaced" in e.value.message
    assert "u-1" in e.value.message and "u-2" in e.value.message
    assert "kubectl snapshot pod/web" in (e.value.hint or "")


def _pod(phase: str, **status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "web", "namespace": "team-a"},
        "spec": {"nodeName": "n1"} if phase == "Running" else {},
        "status": {"phase": phase, **status},
    }


def test_running_pod_passes() -> None:
    check_pod_running(_pod("Running", containerStatuses=[{"name": "c", "state": {"running": {}}}]))


def test_a_pod_being_deleted_is_refused() -> None:
    pod = _pod("Running", containerStatuses=[{"name": "c", "state": {"running": {}}}])
    pod["metadata"]["deletionTimestamp"] = "2026-11-29T16:00:00Z"
    with pytest.raises(FailedPrecondition) as e:
        check_pod_running(pod)
    assert "team-a/web is being deleted" in e.value.message


def test_pending_pod_says_why() -> None:
    pod = _pod(
        "Pending",
        conditions=[
            {"type": "PodScheduled", "status": "False", "message": "0/2 nodes are available: node(s) didn't match"}
        ],
    )
    with pytest.raises(FailedPrecondition) as e:
        check_pod_running(pod)
    assert "not Running" in e.value.message and "0/2 nodes are available" in e.value.message
    assert "kubectl describe pod web" in (e.value.hint or "")


def test_running_pod_with_a_waiting_container_is_refused() -> None:
    pod = _pod("Running", containerStatuses=[{"name": "c", "state": {"waiting": {"reason": "CrashLoopBackOff"}}}])
    with pytest.raises(FailedPrecondition, match="CrashLoopBackOff"):
        check_pod_running(pod)


def _record(**spec: Any) -> PodRecord:
    base = {
        "containers": [{"name": "app", "image": IMG, "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
        "volumes": [{"name": "data", "emptyDir": {}}],
        "metadata": {
            "labels": {"app": "web", "pod-template-hash": "abc", "controller-revision-hash": "x"},
            "annotations": {"secret": "not copied"},
        },
    }
    base.update(spec)
    return PodRecord(name="web", namespace="team-a", uid="u1", node="n1", spec=base)


def test_restore_pod_follows_the_contract() -> None:
    ref = Reference.parse("127.0.0.1:5005/snaps/web:t1").with_digest(DIGEST)
    pod = restore_pod(
        _record(initContainers=[{"name": "init", "image": IMG}], nodeName="n1"),
        reference=ref,
        namespace="team-b",
        gate_image="agent:1",
        node="n2",
        registry_secret="regcred",
    )
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == "web-restored" and meta["namespace"] == "team-b"
    assert meta["labels"] == {"app": "web", K.LABEL_RESTORED_FROM: "web"}
    assert meta["annotations"] == {
        K.ANN_RESTORE_FROM: "127.0.0.1:5005/snaps/web@" + DIGEST,  # by digest, never by tag
        K.ANN_REGISTRY_SECRET: "regcred",
    }
    assert "metadata" not in spec and "nodeName" not in spec
    assert spec["runtimeClassName"] == "kubectl-snapshot"
    assert spec["nodeSelector"] == {"kubernetes.io/hostname": "n2"}
    assert spec["volumes"] == [{"name": "data", "emptyDir": {}}, {"name": K.GATE_VOLUME, "emptyDir": {}}]
    (gate,) = spec["initContainers"]  # the recorded init containers already ran: dropped
    assert gate["name"] == K.GATE_CONTAINER and gate["image"] == "agent:1"
    assert gate["volumeMounts"] == [{"name": K.GATE_VOLUME, "mountPath": "/gate"}]
    assert spec["containers"][0]["image"] == IMG


def test_restore_pod_without_node_lets_the_scheduler_pick_and_keeps_affinity() -> None:
    aff: dict[str, Any] = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}}
    }
    ref = Reference.parse("r.example/s/web@" + DIGEST)
    pod = restore_pod(_record(affinity=aff), reference=ref, namespace="a", gate_image="g", name="copy")
    assert pod["metadata"]["name"] == "copy" and "nodeSelector" not in pod["spec"] and pod["spec"]["affinity"] == aff
    pinned = restore_pod(_record(affinity=aff), reference=ref, namespace="a", gate_image="g", node="n2")
    assert "affinity" not in pinned["spec"]  # it may contradict --node


def test_a_lazy_restore_pod_says_so_and_an_eager_one_carries_no_mode() -> None:
    """docs/lazy-restore.md: the agent reads the restore-mode annotation (shim/controller/restores.py);
    without --lazy the pod is as it always was, every page staged before it runs."""
    ref = Reference.parse("r.example/s/web@" + DIGEST)
    lazy = restore_pod(_record(), reference=ref, namespace="a", gate_image="g", lazy=True)
    assert lazy["metadata"]["annotations"] == {
        K.ANN_RESTORE_FROM: "r.example/s/web@" + DIGEST,
        K.ANN_RESTORE_MODE: K.RESTORE_MODE_LAZY,
    }
    eager = restore_pod(_record(), reference=ref, namespace="a", gate_image="g")
    assert K.ANN_RESTORE_MODE not in eager["metadata"]["annotations"]
    assert {**eager, "metadata": {}} == {**lazy, "metadata": {}}  # nothing else differs


def test_a_restore_pod_without_the_gate_keeps_its_sidecars_and_volumes_and_nothing_of_the_gate() -> None:
    ref = Reference.parse("r.example/s/web@" + DIGEST)
    side = {"name": "proxy", "image": IMG, "restartPolicy": "Always"}
    record = _record(initContainers=[{"name": "init", "image": IMG}, side], volumes=[{"name": "d", "emptyDir": {}}])
    gated = restore_pod(record, reference=ref, namespace="a", gate_image="g", lazy=True)
    bare = restore_pod(record, reference=ref, namespace="a", gate_image="", lazy=True, gate=False)
    assert [c["name"] for c in gated["spec"]["initContainers"]] == [K.GATE_CONTAINER, "proxy"]
    assert bare["spec"]["initContainers"] == [side] and bare["spec"]["volumes"] == [{"name": "d", "emptyDir": {}}]
    assert bare["metadata"] == gated["metadata"]  # the restore-from annotation: the wrapper holds its containers
    plain = restore_pod(_record(volumes=[]), reference=ref, namespace="a", gate_image="", lazy=True, gate=False)
    assert "initContainers" not in plain["spec"] and "volumes" not in plain["spec"]


@pytest.mark.parametrize(
    ("spec", "hold", "why"),
    [
        ({"restartPolicy": "Never"}, True, "restartPolicy Never"),
        ({}, False, "does not pass the restore annotation"),
        ({}, True, None),  # the legitimate case: a pod restarted on failure, on nodes that hold its containers
        ({"restartPolicy": "OnFailure"}, True, None),
    ],
)
def test_a_restore_pod_keeps_its_gate_unless_restartable_and_held(
    spec: dict[str, Any], hold: bool, why: str | None
) -> None:
    got = gate_needed(spec, nodes_hold=hold)
    assert got is None if why is None else (got is not None and why in got)


def test_node_facts_say_whether_containerd_passes_the_restore_annotation() -> None:
    assert holds_restore_pods({"node": {"containerd": {"podAnnotations": [K.ANN_RESTORE_FROM]}}})
    for facts in ({}, {"node": {"error": "x"}}, {"node": {"containerd": {"podAnnotations": [K.ANN_RESUME_POLICY]}}}):
        assert not holds_restore_pods(facts)


def test_a_gateless_restore_pod_runs_only_once_the_agent_said_it_staged_it() -> None:
    """Without a gate, running containers alone do not show a restore (a container its runtime did not
    hold would run from its image): the agent's Staged annotation must be there too."""
    running = {
        "phase": "Running",
        "containerStatuses": [{"name": "app", "state": {"running": {}}}],
    }
    ann = {K.ANN_RESTORE_FROM: "r.example/s/web@" + DIGEST}
    pod = {"metadata": {"annotations": ann}, "spec": {"containers": [{"name": "app"}]}, "status": running}
    assert restore_state(pod).state == "waiting"
    pod["metadata"] = {"annotations": {**ann, K.ANN_RESTORE_STATUS: K.RESTORE_STAGED}}
    assert restore_state(pod) == RestoreState("running")
    gate_pod = {"metadata": {"annotations": ann}, "spec": {"initContainers": [{"name": K.GATE_CONTAINER}]}}
    assert restore_state({**gate_pod, "status": running}) == RestoreState("running")  # its gate said so


def test_restore_pod_refuses_unpinned_images_and_missing_spec() -> None:
    ref = Reference.parse("r.example/s/web@" + DIGEST)
    with pytest.raises(FailedPrecondition, match="not pinned by digest"):
        restore_pod(
            _record(containers=[{"name": "a", "image": "busybox:1"}]), reference=ref, namespace="a", gate_image="g"
        )
    with pytest.raises(FailedPrecondition, match="records no pod spec"):
        restore_pod(PodRecord(name="x", namespace="a"), reference=ref, namespace="a", gate_image="g")
    with pytest.raises(InvalidArgument):
        restore_pod(_record(), reference=Reference.parse("r.example/s/web:t"), namespace="a", gate_image="g")


def test_gate_script_waits_then_fails_or_passes(tmp_path: Any) -> None:
    import subprocess
    import sys

    script = GATE_SCRIPT.replace(repr(K.GATE_MOUNT), repr(str(tmp_path)))
    (tmp_path / K.GATE_FAILED_FILE).write_text("digest mismatch in layer 2\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=10)
    assert proc.returncode == 1 and "digest mismatch in layer 2" in proc.stdout
    (tmp_path / K.GATE_FAILED_FILE).unlink()
    (tmp_path / K.GATE_STAGED_FILE).write_text("staged\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=10)
    assert proc.returncode == 0


def _rpod(**status: Any) -> dict[str, Any]:
    ann = status.pop("ann", None)
    return {"metadata": {"annotations": {K.ANN_RESTORE_STATUS: ann} if ann else {}}, "status": status}


def test_restore_states() -> None:
    assert restore_state(_rpod(phase="Pending")).state == "waiting"
    assert restore_state(_rpod(ann="Failed: arch mismatch")) == restore_state(_rpod(ann="Failed: arch mismatch"))
    assert restore_state(_rpod(ann="Failed: arch mismatch")).reason == "arch mismatch"
    gate_failed = {"name": K.GATE_CONTAINER, "state": {"terminated": {"exitCode": 1, "message": "criu too old\n"}}}
    st = restore_state(_rpod(phase="Pending", initContainerStatuses=[gate_failed]))
    assert st.state == "failed" and st.reason == "criu too old"
    running = [{"name": "app", "state": {"running": {}}}]
    assert restore_state(_rpod(phase="Running", containerStatuses=running)).state == "running"
    crashed = [{"name": "app", "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off"}}}]
    assert restore_state(_rpod(phase="Running", containerStatuses=crashed)).state == "failed"
    assert restore_state(_rpod(phase="Failed", message="evicted")).reason == "evicted"
    unsched = [{"type": "PodScheduled", "status": "False", "message": "no node"}]
    assert "unschedulable" in restore_state(_rpod(phase="Pending", conditions=unsched)).reason


def test_restore_pod_brings_native_sidecars_back_after_the_gate() -> None:
    """A native sidecar (restartPolicy Always) was snapshotted with the app: it comes back, after the
    gate (it must not run on half-written volumes), with its image pinned; a completed init container
    already ran and is dropped; a sidecar whose image is not pinned is refused like an app container."""
    ref = Reference.parse("127.0.0.1:5005/snaps/web:t1").with_digest(DIGEST)
    side = {"name": "side", "image": IMG, "restartPolicy": "Always"}
    pod = restore_pod(
        _record(initContainers=[{"name": "setup", "image": IMG}, side]),
        reference=ref,
        namespace="b",
        gate_image="agent:1",
    )
    assert [c["name"] for c in pod["spec"]["initContainers"]] == [K.GATE_CONTAINER, "side"]
    assert pod["spec"]["initContainers"][1] == side
    with pytest.raises(FailedPrecondition, match="container 'side' of the snapshot has image"):
        restore_pod(
            _record(initContainers=[{**side, "image": "busybox:1"}]), reference=ref, namespace="b", gate_image="a:1"
        )
