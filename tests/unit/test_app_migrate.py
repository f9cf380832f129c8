"""`kubectl snapshot migrate` (app/migrate.py) over the shared fakes, with the agent, the scheduler, the
kubelet and the controllers scripted: a bare pod is copied and the original deleted only once the copy
runs; a controller-owned pod is saved with stop and its controller's replacement resumes (or it is
refused before anything is created). The whole flow on a real cluster: tests/e2e."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kubectl_snapshot.app.migrate import MigrateRequest, migrate, migrate_owned
from kubectl_snapshot.app.ports import Obj
from kubectl_snapshot.app.snapshot import SnapshotRequest
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import FailedPrecondition, InvalidArgument, Unavailable
from kubectl_snapshot.core.workload import COMPLETION_INDEX_KEY
from tests.support.fakeplugin import (
    Clock,
    FakeKube,
    FakeRegistry,
    agent_pod,
    failed,
    install_agent,
    node,
    push_pod_snapshot,
    running_pod,
    succeeded,
)

NS = "team"
CLAIMED = {"status": {"phase": "Running", "node": "n1", "stage": "claimed"}}
RUNNING = {"status": {"phase": "Running", "containerStatuses": [{"name": "app", "state": {"running": {}}}]}}


def request(pod: str = "web", *, node_name: str | None = None, name: str | None = None) -> MigrateRequest:
    snap = SnapshotRequest(namespace=NS, pod=pod, repository="registry.example/snaps")
    return MigrateRequest(snapshot=snap, node=node_name, name=name, timeout_s=30, claim_timeout_s=10)


def the_agent(registry: FakeRegistry, *, fails: str | None = None, then: Any = None) -> Any:
    """The agent on the pod's node: claims each new PodSnapshot, pushes the pod, reports (then `then(it)`)."""

    def on_snapshot(kube: FakeKube, snap: Obj) -> None:
        ns, name = snap["metadata"]["namespace"], snap["metadata"]["name"]
        if fails:
            kube.script(K.KIND, ns, name, CLAIMED, failed(fails, hint="see the agent's log"))
            return
        pod = kube.get("Pod", ns, snap["spec"]["podName"])
        assert pod is not None
        ref = push_pod_snapshot(registry, snap["spec"]["destination"], pod)

        def done(live: Obj) -> None:
            live["status"] = succeeded(ref)["status"]
            if then is not None:
                then(live)

        kube.script(K.KIND, ns, name, CLAIMED, done)

    return on_snapshot


def the_kubelet(*, verdict: str | None = None) -> Any:
    """Scheduler + kubelet for the restored pod: placed on its nodeSelector's node, then running (or the
    agent's restore-status verdict)."""

    def on_pod(kube: FakeKube, pod: Obj) -> None:
        meta = pod["metadata"]
        if K.ANN_RESTORE_FROM not in (meta.get("annotations") or {}):
            return
        target = (pod["spec"].get("nodeSelector") or {}).get("kubernetes.io/hostname", "n2")
        last = {"metadata": {"annotations": {K.ANN_RESTORE_STATUS: verdict}}} if verdict else RUNNING
        kube.script("Pod", meta["namespace"], meta["name"], {"spec": {"nodeName": target}}, last)

    return on_pod


def cluster(*, agent_fails: str | None = None, verdict: str | None = None) -> tuple[FakeKube, FakeRegistry]:
    kube, registry = FakeKube(), FakeRegistry()
    install_agent(kube, nodes=("n1", "n2"))
    kube.add(running_pod("web", NS, node_name="n1"))
    kube.react(K.KIND, the_agent(registry, fails=agent_fails))
    kube.react("Pod", the_kubelet(verdict=verdict))
    return kube, registry


# --- a bare pod ---------------------------------------------------------------------------------------


def test_a_bare_pod_is_copied_to_another_node_and_the_original_deleted_only_after_the_copy_runs() -> None:
    kube, registry = cluster()
    steps: list[str] = []
    result = migrate(request(), kube=kube, stores=registry.store, on_step=steps.append)
    assert (result.from_node, result.to_node) == ("n1", "n2")
    assert result.pod["metadata"]["name"] == "web-restored" and result.pod["spec"]["nodeName"] == "n2"
    assert result.snapshot["status"]["phase"] == K.PHASE_SUCCEEDED
    snap_name = result.snapshot["metadata"]["name"]
    assert kube.journal == [
        f"create podsnapshot {NS}/{snap_name}",
        f"create pod {NS}/web-restored",
        f"delete pod {NS}/web",
    ]
    live = kube.get(K.KIND, NS, snap_name)
    assert live is not None and live["spec"]["stop"] is False  # the original keeps running meanwhile
    assert kube.names("Pod", NS) == ["web-restored"]
    assert steps == [f"snapshot {NS}/web on n1", f"restore as {NS}/web-restored on n2", f"delete the original {NS}/web"]


def test_node_and_name_choose_where_and_what_the_copy_is() -> None:
    kube, registry = cluster()
    kube.add(node("n3"))
    kube.add(agent_pod("n3"))
    result = migrate(request(node_name="n3", name="moved"), kube=kube, stores=registry.store)
    assert result.to_node == "n3" and result.pod["metadata"]["name"] == "moved"
    assert result.pod["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "n3"}


def test_lazy_makes_the_copy_a_lazy_restore_and_the_default_stays_eager() -> None:
    kube, registry = cluster()
    result = migrate(replace(request(), lazy=True), kube=kube, stores=registry.store)
    assert result.pod["metadata"]["annotations"][K.ANN_RESTORE_MODE] == K.RESTORE_MODE_LAZY
    kube, registry = cluster()
    result = migrate(request(), kube=kube, stores=registry.store)
    assert K.ANN_RESTORE_MODE not in result.pod["metadata"]["annotations"]


def test_a_failed_restore_leaves_the_original_running_and_the_snapshot_kept() -> None:
    kube, registry = cluster(verdict="Failed: CRIU restore failed: see restore.log")
    with pytest.raises(FailedPrecondition, match="CRIU restore failed"):
        migrate(request(), kube=kube, stores=registry.store)
    assert "web" in kube.names("Pod", NS) and not any(line.startswith("delete") for line in kube.journal)
    assert len(kube.names(K.KIND, NS)) == 1


def test_a_failed_snapshot_creates_nothing_else_and_carries_the_agents_words() -> None:
    kube, registry = cluster(agent_fails="CRIU dump failed: unsupported socket")
    with pytest.raises(FailedPrecondition) as e:
        migrate(request(), kube=kube, stores=registry.store)
    assert "failed on node n1: CRIU dump failed: unsupported socket" in e.value.message
    assert e.value.hint == "see the agent's log"
    assert kube.names("Pod", NS) == ["web"] and [line.split()[1] for line in kube.journal] == ["podsnapshot"]


@pytest.mark.parametrize(
    ("node_name", "error", "words"),
    [
        ("n1", InvalidArgument, "already runs on node n1"),
        ("n9", InvalidArgument, "node 'n9' does not exist"),
    ],
)
def test_a_wrong_node_is_refused_before_anything_is_created(node_name: str, error: type, words: str) -> None:
    kube, registry = cluster()
    with pytest.raises(error, match=words):
        migrate(request(node_name=node_name), kube=kube, stores=registry.store)
    assert kube.journal == []


def test_without_another_ready_schedulable_node_it_refuses_before_anything_is_created() -> None:
    kube, registry = cluster()
    cordoned = kube.get("Node", "", "n2")
    assert cordoned is not None
    cordoned["spec"]["unschedulable"] = True
    kube.add(node("n3", ready=False))
    with pytest.raises(FailedPrecondition, match=r"no other Ready node to migrate to \(the pod runs on n1\)") as e:
        migrate(request(), kube=kube, stores=registry.store)
    assert "uncordon" in (e.value.hint or "") and kube.journal == []
    cordoned["spec"]["unschedulable"] = False  # the first Ready other node, by name
    kube.add(node("n0"))
    kube.add(agent_pod("n0"))
    assert migrate(request(), kube=kube, stores=registry.store).to_node == "n0"


def test_a_target_node_without_a_ready_agent_is_refused_before_the_pod_is_snapshotted() -> None:
    kube, registry = cluster()
    kube.add(node("n3"))
    with pytest.raises(FailedPrecondition, match="no kubectl-snapshot agent is ready on node n3") as e:
        migrate(request(node_name="n3"), kube=kube, stores=registry.store)
    assert "choose another --node" in (e.value.hint or "")
    assert kube.journal == [] and registry.manifests == {}  # not frozen, nothing left behind
    agent = kube.get("Pod", K.AGENT_NAMESPACE, f"{K.AGENT_NAME}-n2")
    assert agent is not None
    agent["status"]["conditions"] = [{"type": "Ready", "status": "False"}]  # the node chosen for you, too
    with pytest.raises(FailedPrecondition, match="no kubectl-snapshot agent is ready on node n2"):
        migrate(request(), kube=kube, stores=registry.store)
    assert kube.journal == []


def test_a_pod_that_does_not_run_is_refused_before_anything_is_created() -> None:
    kube, registry = cluster()
    pod = kube.get("Pod", NS, "web")
    assert pod is not None
    pod["status"] = {"phase": "Pending"}
    with pytest.raises(FailedPrecondition, match="is not Running"):
        migrate(request(), kube=kube, stores=registry.store)
    assert kube.journal == []


# --- a controller-owned pod ---------------------------------------------------------------------------


def owned_cluster(
    kind: str, *, policy: bool = True, replacement: Obj | None = None, index: str | None = None
) -> tuple[FakeKube, FakeRegistry, Obj]:
    """Pod web-0 owned by `kind` web on n1; the agent's stop save deletes it and the controller makes
    `replacement` (uid new-uid on n2) once the save succeeded."""
    kube, registry = FakeKube(), FakeRegistry()
    install_agent(kube)
    annotations = {K.ANN_RESUME_POLICY: "keep"} if policy else {}
    if index is not None:
        annotations[COMPLETION_INDEX_KEY] = index
    pod = kube.add(running_pod("web-0", NS, owner=(kind, "web"), annotations=annotations))
    pod["metadata"]["uid"] = "old-uid"

    def stop_and_replace(save: Obj) -> None:
        del kube.objects[("v1", "Pod", NS, "web-0")]
        if replacement is not None:
            kube.add(replacement)
            kube.script("Pod", NS, replacement["metadata"]["name"], RUNNING)
            if kind == "ReplicaSet":  # the new pod's agent claims the save it resumes from
                save["metadata"].setdefault("annotations", {})[K.ANN_CLAIMED_BY] = replacement["metadata"]["uid"]

    kube.react(K.KIND, the_agent(registry, then=stop_and_replace))
    return kube, registry, pod


def replacement_pod(name: str, kind: str, *, status: str = "Restored", index: str | None = None) -> Obj:
    annotations = {K.ANN_RESUME_POLICY: "keep", K.ANN_RESTORE_STATUS: status}
    if index is not None:
        annotations[COMPLETION_INDEX_KEY] = index
    pod = running_pod(name, NS, node_name="n2", owner=(kind, "web"), annotations=annotations)
    pod["metadata"]["uid"] = "new-uid"
    pod["status"] = {"phase": "Pending"}
    return pod


def test_a_statefulset_pod_is_saved_with_stop_and_its_replacement_resumes() -> None:
    kube, registry, _ = owned_cluster("StatefulSet", replacement=replacement_pod("web-0", "StatefulSet"))
    result = migrate(request("web-0"), kube=kube, stores=registry.store)
    assert (result.from_node, result.to_node) == ("n1", "n2") and result.pod["metadata"]["uid"] == "new-uid"
    snap_name = result.snapshot["metadata"]["name"]
    live = kube.get(K.KIND, NS, snap_name)
    assert live is not None and live["spec"]["stop"] is True
    assert kube.journal == [f"create podsnapshot {NS}/{snap_name}"]  # no copy beside it, no delete by the plugin


def test_a_replicaset_replacement_is_the_pod_that_claimed_the_save_not_a_sibling() -> None:
    kube, registry, _ = owned_cluster("ReplicaSet", replacement=replacement_pod("web-new", "ReplicaSet"))
    sibling = kube.add(running_pod("web-abc", NS, owner=("ReplicaSet", "web")))  # listed first
    sibling["metadata"]["uid"] = "sibling-uid"
    result = migrate(request("web-0"), kube=kube, stores=registry.store)
    assert result.pod["metadata"]["name"] == "web-new"


def test_an_indexed_job_replacement_is_found_by_its_completion_index() -> None:
    kube, registry, _ = owned_cluster("Job", index="1", replacement=replacement_pod("web-1-x", "Job", index="1"))
    other = kube.add(running_pod("web-2-y", NS, owner=("Job", "web"), annotations={COMPLETION_INDEX_KEY: "2"}))
    other["metadata"]["uid"] = "other-uid"
    another_job = kube.add(running_pod("a-1", NS, owner=("Job", "other"), annotations={COMPLETION_INDEX_KEY: "1"}))
    another_job["metadata"]["uid"] = "another-job-uid"  # same index, another Job: listed first, not it
    assert migrate(request("web-0"), kube=kube, stores=registry.store).pod["metadata"]["name"] == "web-1-x"


def test_a_job_pod_without_a_completion_index_is_refused_before_it_is_stopped() -> None:
    """Such pods never resume (core/resume.label_selector): a stop save would lose the pod's progress and
    any other pod of the Job would pass for its replacement."""
    kube, registry, _ = owned_cluster("Job", replacement=replacement_pod("web-x", "Job"))
    with pytest.raises(FailedPrecondition, match="not an indexed Job") as e:
        migrate(request("web-0"), kube=kube, stores=registry.store)
    assert "Indexed" in (e.value.hint or "")
    assert kube.journal == [] and kube.names("Pod", NS) == ["web-0"]


def test_a_replacement_that_started_fresh_is_reported_and_the_save_kept() -> None:
    fresh = replacement_pod("web-0", "StatefulSet", status=K.RESTORE_SKIPPED_PREFIX + "the images differ")
    kube, registry, _ = owned_cluster("StatefulSet", replacement=fresh)
    with pytest.raises(FailedPrecondition, match="started fresh: the images differ") as e:
        migrate(request("web-0"), kube=kube, stores=registry.store)
    assert "the save is kept (PodSnapshot web-0-" in (e.value.hint or "")
    assert len(kube.names(K.KIND, NS)) == 1


def test_no_replacement_in_time_is_reported_with_the_save_kept() -> None:
    kube, _registry, pod = owned_cluster("StatefulSet", replacement=None)
    clock = Clock()
    req = request("web-0")
    owner = pod["metadata"]["ownerReferences"][0]
    with pytest.raises(Unavailable, match=r"no replacement of team/web-0 resumed from web-0-\S+ within 30s") as e:
        migrate_owned(req, kube.get_pod(NS, "web-0"), owner, kube=kube, clock=clock, sleep=clock.sleep)
    assert "the save is kept" in (e.value.hint or "") and 30 <= clock.now <= 31


@pytest.mark.parametrize("kind", ["StatefulSet", "ReplicaSet", "Job"])
def test_without_a_resuming_policy_a_controller_owned_pod_is_refused_before_anything(kind: str) -> None:
    kube, registry, _ = owned_cluster(kind, policy=False, index="0")
    with pytest.raises(FailedPrecondition) as e:
        migrate(request("web-0"), kube=kube, stores=registry.store)
    assert "the controller to start a duplicate" in e.value.message and "SnapshotPolicy" in (e.value.hint or "")
    assert kube.journal == []


def test_a_pod_of_a_controller_that_never_resumes_is_refused_even_with_a_policy() -> None:
    kube, registry, _ = owned_cluster("DaemonSet")
    with pytest.raises(FailedPrecondition, match="owned by DaemonSet web") as e:
        migrate(request("web-0"), kube=kube, stores=registry.store)
    assert "DaemonSet pods cannot be migrated" in (e.value.hint or "") and kube.journal == []


@pytest.mark.parametrize(("node_name", "name"), [("n2", None), (None, "copy")])
def test_node_and_name_do_not_apply_to_a_resuming_workload(node_name: str | None, name: str | None) -> None:
    kube, registry, _ = owned_cluster("StatefulSet")
    with pytest.raises(InvalidArgument, match="--node and --name do not apply"):
        migrate(request("web-0", node_name=node_name, name=name), kube=kube, stores=registry.store)
    assert kube.journal == []


def test_lazy_does_not_apply_to_a_resuming_workload_its_policy_decides() -> None:
    kube, registry, _ = owned_cluster("StatefulSet")
    with pytest.raises(InvalidArgument, match="--lazy does not apply") as e:
        migrate(replace(request("web-0"), lazy=True), kube=kube, stores=registry.store)
    assert "spec.restoreMode: lazy" in (e.value.hint or "") and kube.journal == []


def test_a_copy_whose_processes_may_hold_the_old_pods_token_is_warned_about() -> None:
    kube, registry = cluster()  # the scripted agent's save records the pod's token mount, as a real one does
    (warning,) = migrate(request(), kube=kube, stores=registry.store).warnings
    assert "may hold pod team/web" in warning and "re-read the token file" in warning


def test_a_copy_whose_snapshot_had_no_token_carries_no_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    from kubectl_snapshot.app import migrate as app

    kube, registry = cluster()
    monkeypatch.setattr(app, "cloned_token_warning", lambda config: "")  # core/tokenclone.py's own tests say when
    assert migrate(request(), kube=kube, stores=registry.store).warnings == ()
