"""`kubectl snapshot restore` (app/restore.py) over the shared fakes: which pod it builds from a
PodSnapshot or a reference, what it refuses and with which hint, and how it waits for the restored pod."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
import yaml
from click.testing import CliRunner, Result

from kubectl_snapshot.app.restore import RestoreRequest, build_restore, create_restore_pod, wait_running
from kubectl_snapshot.cli import main as cli_main
from kubectl_snapshot.cli import wiring
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, Unavailable
from kubectl_snapshot.core.model import ContainerRecord, HostFacts, SnapshotConfig
from kubectl_snapshot.core.podspec import RestoreState
from kubectl_snapshot.core.reference import Reference
from tests.support.fakeplugin import (
    AGENT_IMAGE,
    IMAGE,
    Clock,
    FakeKube,
    FakeRegistry,
    agent_pod,
    install_agent,
    node,
    push_pod_snapshot,
    running_pod,
    snapshot,
    succeeded,
)

NS = "team"


def restorable(*, insecure: bool = False) -> tuple[FakeKube, FakeRegistry, Reference]:
    """An installed cluster (nodes n1, n2) with PodSnapshot web-1 of pod web, Succeeded, in NS."""
    kube, registry = FakeKube(), FakeRegistry()
    install_agent(kube)
    ref = push_pod_snapshot(registry, "registry.example/snaps:web-1", running_pod("web", NS, labels={"app": "web"}))
    kube.add(snapshot("web-1", NS, status=succeeded(ref), insecure=insecure))
    return kube, registry, ref


def req(
    source: str = "web-1", *, name: str | None = None, node: str | None = None, agent_image: str | None = None
) -> RestoreRequest:
    return RestoreRequest(source=source, namespace=NS, name=name, node=node, agent_image=agent_image)


# --- which pod ---------------------------------------------------------------------------------------


def test_a_podsnapshot_name_restores_the_recorded_pod_from_its_pinned_image() -> None:
    kube, registry, ref = restorable(insecure=True)
    body, artifact = build_restore(req(), kube=kube, stores=registry.store)
    assert artifact.reference == ref and registry.opened == [("registry.example", True)]
    meta, spec = body["metadata"], body["spec"]
    assert (meta["name"], meta["namespace"]) == ("web-restored", NS)
    assert meta["annotations"][K.ANN_RESTORE_FROM] == f"registry.example/snaps@{ref.digest}"
    assert meta["labels"] == {"app": "web", K.LABEL_RESTORED_FROM: "web"}
    assert spec["containers"] == [{"name": "app", "image": IMAGE}] and "nodeName" not in spec
    assert spec["runtimeClassName"] == K.RUNTIME_CLASS and "nodeSelector" not in spec  # the scheduler picks
    [gate] = spec["initContainers"]
    assert gate["name"] == K.GATE_CONTAINER and gate["image"] == AGENT_IMAGE  # the agent DaemonSet's image
    assert kube.journal == []  # nothing is created yet


def test_a_reference_is_read_from_the_registry_without_asking_for_a_podsnapshot() -> None:
    kube, registry, ref = restorable()
    kube.deny("get_snapshot", "get podsnapshot")
    body, artifact = build_restore(
        req("registry.example/snaps:web-1", name="copy", agent_image="gate:v2"), kube=kube, stores=registry.store
    )
    assert artifact.reference == ref  # the tag resolved and pinned
    assert body["metadata"]["name"] == "copy" and body["spec"]["initContainers"][0]["image"] == "gate:v2"
    assert registry.opened == [("registry.example", False)]


@pytest.mark.parametrize(
    ("status", "hint"),
    [
        ({"phase": "Running", "stage": "upload"}, "wait until it has Succeeded: kubectl snapshot list"),
        ({"phase": "Failed", "message": "CRIU failed: see the node"}, "CRIU failed: see the node"),
        ({}, "wait until it has Succeeded: kubectl snapshot list"),
        # pushed, then failed (e.g. the verification after the push): the image is not to be trusted
        ({"phase": "Failed", "reference": "r.io/x@sha256:" + "e" * 64, "message": "verify failed"}, "verify failed"),
    ],
)
def test_a_podsnapshot_without_an_image_is_refused_with_its_state(status: dict[str, str], hint: str) -> None:
    kube, registry = FakeKube(), FakeRegistry()
    install_agent(kube)
    kube.add(snapshot("web-1", NS, status={"status": status}))
    with pytest.raises(FailedPrecondition, match="has no image to restore") as e:
        build_restore(req(), kube=kube, stores=registry.store)
    assert f"(phase {status.get('phase', 'Pending')})" in e.value.message and e.value.hint == hint
    assert registry.opened == []


def test_an_unknown_podsnapshot_or_image_is_not_found_with_a_hint() -> None:
    kube, registry, _ = restorable()
    with pytest.raises(NotFound, match="no podsnapshot 'web-2'") as e:
        build_restore(req("web-2"), kube=kube, stores=registry.store)
    assert "kubectl snapshot list -n team" in (e.value.hint or "")
    with pytest.raises(NotFound, match="manifest unknown"):
        build_restore(req("registry.example/snaps:gone"), kube=kube, stores=registry.store)
    with pytest.raises(InvalidArgument):
        build_restore(req("Web_1"), kube=kube, stores=registry.store)


def test_a_snapshot_of_bare_containers_is_refused_with_the_node_side_command() -> None:
    kube, registry, _ = restorable()
    layer = "sha256:" + "2" * 64
    record = ContainerRecord(name="c1", id="c1", image=IMAGE, image_digest="", layer_digest=layer, spec={})
    cfg = SnapshotConfig(group="c1", namespace="k8s.io", created="t", containers=(record,), host=HostFacts())
    ref = registry.push(Reference.parse("registry.example/containers:c1"), cfg, {layer: b"x"})
    with pytest.raises(FailedPrecondition, match="a snapshot of containers, not of a Kubernetes pod") as e:
        build_restore(req(str(ref)), kube=kube, stores=registry.store)
    assert "ks-agent restore" in (e.value.hint or "")


# --- --lazy (docs/lazy-restore.md) -------------------------------------------------------------------


def test_lazy_marks_the_pod_for_a_lazy_restore_and_the_default_stays_eager() -> None:
    kube, registry, _ = restorable()
    lazy, _ = build_restore(replace(req(), lazy=True), kube=kube, stores=registry.store)
    assert lazy["metadata"]["annotations"][K.ANN_RESTORE_MODE] == K.RESTORE_MODE_LAZY
    eager, _ = build_restore(req(), kube=kube, stores=registry.store)
    assert K.ANN_RESTORE_MODE not in eager["metadata"]["annotations"]  # no annotation: all memory first


HOLDING: dict[str, Any] = {"node": {"containerd": {"podAnnotations": [K.ANN_RESUME_POLICY, K.ANN_RESTORE_FROM]}}}


def holding_cluster(facts: dict[str, Any] = HOLDING) -> tuple[FakeKube, FakeRegistry]:
    """restorable(), its two nodes publishing `facts` (by default: their containerd passes the restore
    annotation to the runtime wrapper, as `ks-agent install-node`'s drop-in makes it)."""
    kube, registry = FakeKube(), FakeRegistry()
    for n in ("n1", "n2"):
        kube.add(node(n, facts=facts))
    install_agent(kube)
    ref = push_pod_snapshot(registry, "registry.example/snaps:web-1", running_pod("web", NS, labels={"app": "web"}))
    kube.add(snapshot("web-1", NS, status=succeeded(ref)))
    return kube, registry


def gated(body: dict[str, Any]) -> bool:
    spec = body["spec"]
    names = [c["name"] for c in spec.get("initContainers") or []]
    volumes = [v["name"] for v in spec.get("volumes") or []]
    assert (K.GATE_CONTAINER in names) == (K.GATE_VOLUME in volumes)
    return K.GATE_CONTAINER in names


def test_a_restore_goes_without_the_gate_init_container_where_the_nodes_hold_its_containers() -> None:
    """The kubelet notices an init container's exit only at its next relist (up to a second): a restore
    pod is held at its containers' create by the runtime wrapper instead, on nodes whose published facts
    say containerd passes it the annotation; eager and lazy alike."""
    kube, registry = holding_cluster()
    for r in (req(), replace(req(), lazy=True), replace(req(node="n2"), lazy=True), req(node="n1")):
        body, _ = build_restore(r, kube=kube, stores=registry.store)
        assert not gated(body) and body["metadata"]["annotations"][K.ANN_RESTORE_FROM]
        assert (K.ANN_RESTORE_MODE in body["metadata"]["annotations"]) == r.lazy


def test_a_restore_keeps_the_gate_where_a_node_may_not_hold_its_containers() -> None:
    lazy = replace(req(), lazy=True)
    # facts from an agent whose drop-in passes only the resume annotation (or containerd not restarted)
    kube, registry = holding_cluster({"node": {"containerd": {"podAnnotations": [K.ANN_RESUME_POLICY]}}})
    assert gated(build_restore(lazy, kube=kube, stores=registry.store)[0])
    assert gated(build_restore(replace(req(node="n2"), lazy=True), kube=kube, stores=registry.store)[0])
    # one node of two holds: the scheduler may pick the other; pinned to the one that holds, no gate
    kube, registry = holding_cluster()
    kube.add(node("n2", facts={"node": {"containerd": {"podAnnotations": []}}}))
    assert gated(build_restore(lazy, kube=kube, stores=registry.store)[0])
    assert not gated(build_restore(replace(req(node="n1"), lazy=True), kube=kube, stores=registry.store)[0])
    # facts outlive an agent: without a Ready agent (uninstalled, say) they count for nothing
    kube, registry = holding_cluster()
    for n in ("n1", "n2"):
        kube.add(agent_pod(n, ready=False))
    assert gated(build_restore(lazy, kube=kube, stores=registry.store)[0])
    kube.add(agent_pod("n1"))  # one Ready: the scheduler may still pick n2, whose facts hold too
    assert not gated(build_restore(lazy, kube=kube, stores=registry.store)[0])
    kube, registry = holding_cluster()
    kube.deny("list_pods", f"list pods in {K.AGENT_NAMESPACE}")  # the agents cannot be read: the gate
    assert gated(build_restore(lazy, kube=kube, stores=registry.store)[0])
    # a user who may not list nodes: the gate, which works everywhere
    kube, registry = holding_cluster()
    kube.deny("list_nodes", "list nodes")
    assert gated(build_restore(lazy, kube=kube, stores=registry.store)[0])
    # no node has an agent's facts (restorable(): nodes without annotations)
    kube, registry, _ = restorable()
    assert gated(build_restore(lazy, kube=kube, stores=registry.store)[0])


def restore_cli(monkeypatch: pytest.MonkeyPatch, *args: str) -> Result:
    kube, registry, _ = restorable()
    monkeypatch.setattr(wiring, "kube_client", lambda: kube)
    monkeypatch.setattr(wiring, "artifact_store", registry.store)
    result = CliRunner().invoke(cli_main.cli, ["restore", "-n", NS, *args], catch_exceptions=False)
    assert kube.journal == [], kube.journal  # a client dry run creates nothing
    return result


@pytest.mark.parametrize("output", ["json", "yaml"])
def test_the_dry_run_shows_the_restore_mode_in_the_pod(monkeypatch: pytest.MonkeyPatch, output: str) -> None:
    for flags, mode in ((["--lazy"], K.RESTORE_MODE_LAZY), ([], None)):
        result = restore_cli(monkeypatch, *flags, "--dry-run=client", "-o", output, "web-1")
        assert result.exit_code == 0, result.output
        pod = json.loads(result.output) if output == "json" else yaml.safe_load(result.output)
        assert pod["kind"] == "Pod" and pod["metadata"]["annotations"].get(K.ANN_RESTORE_MODE) == mode


@pytest.mark.parametrize("command", ["restore", "migrate"])
def test_the_help_says_what_lazy_risks(command: str) -> None:
    text = " ".join(CliRunner().invoke(cli_main.cli, [command, "--help"]).output.split())
    assert "--lazy" in text and "runs before its memory is back" in text
    assert "the container is killed (a LazyRestoreFailed Event) and starts afresh" in text
    assert "must not be killed mid-" in text and "stay eager (the default)" in text  # click may wrap at the '-'


# --- --node and the agent ----------------------------------------------------------------------------


def test_node_pins_the_pod_there_when_an_agent_is_ready_on_it() -> None:
    kube, registry, _ = restorable()
    body, _ = build_restore(req(node="n2"), kube=kube, stores=registry.store)
    assert body["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "n2"}


def test_node_refusals_name_the_node_and_say_what_to_do() -> None:
    kube, registry, _ = restorable()
    with pytest.raises(NotFound, match='nodes "n9" not found'):
        build_restore(req(node="n9"), kube=kube, stores=registry.store)
    kube.add(node("n3"))  # a node without an agent
    kube.add(agent_pod("n4", ready=False))
    kube.add(node("n4"))  # one whose agent is not ready
    for n in ("n3", "n4"):
        with pytest.raises(FailedPrecondition, match=f"no kubectl-snapshot agent is ready on node {n}") as e:
            build_restore(req(node=n), kube=kube, stores=registry.store)
        assert "kubectl snapshot doctor" in (e.value.hint or "")


def test_a_user_who_cannot_read_the_agents_gets_no_early_refusal() -> None:
    kube, registry, _ = restorable()
    kube.add(node("n3"))
    kube.deny("list_pods", f"list pods in {K.AGENT_NAMESPACE}")
    body, _ = build_restore(req(node="n3"), kube=kube, stores=registry.store)
    assert body["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "n3"}


def test_without_the_agent_daemonset_the_gate_image_must_be_given() -> None:
    kube, registry, _ = restorable()
    kube.delete_objects([{"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": {
        "name": K.AGENT_NAME, "namespace": K.AGENT_NAMESPACE}}])  # fmt: skip
    with pytest.raises(FailedPrecondition, match="cannot find the agent image") as e:
        build_restore(req(), kube=kube, stores=registry.store)
    assert "--agent-image" in (e.value.hint or "")
    kube.deny("get_daemonset", "get daemonset")  # not readable: the same answer, not a 403
    with pytest.raises(FailedPrecondition, match="cannot find the agent image"):
        build_restore(req(), kube=kube, stores=registry.store)
    body, _ = build_restore(req(agent_image="gate:v3"), kube=kube, stores=registry.store)
    assert body["spec"]["initContainers"][0]["image"] == "gate:v3"


def test_the_gate_image_falls_back_to_the_daemonsets_first_container() -> None:
    kube, registry, _ = restorable()
    ds = kube.get("DaemonSet", K.AGENT_NAMESPACE, K.AGENT_NAME)
    assert ds is not None
    ds["spec"]["template"]["spec"]["containers"] = [
        {"name": "agent", "image": "renamed:v1"},
        {"name": "x", "image": "y"},
    ]
    body, _ = build_restore(req(), kube=kube, stores=registry.store)
    assert body["spec"]["initContainers"][0]["image"] == "renamed:v1"


# --- creating the pod --------------------------------------------------------------------------------


def test_create_stores_the_pod_and_server_dry_run_stores_nothing() -> None:
    kube, registry, _ = restorable()
    body, _ = build_restore(req(), kube=kube, stores=registry.store)
    admitted = create_restore_pod(body, kube=kube, dry_run=True)
    assert admitted["metadata"]["name"] == "web-restored" and admitted["metadata"]["uid"]  # the server's view
    assert kube.get("Pod", NS, "web-restored") is None
    assert kube.journal == [f"create pod {NS}/web-restored (dry run)"]
    created = create_restore_pod(body, kube=kube)
    assert kube.get("Pod", NS, "web-restored") is not None and created["spec"] == body["spec"]


def test_a_taken_name_is_refused_with_a_hint_even_in_a_dry_run() -> None:
    kube, registry, _ = restorable()
    body, _ = build_restore(req(), kube=kube, stores=registry.store)
    create_restore_pod(body, kube=kube)
    for dry_run in (True, False):
        with pytest.raises(FailedPrecondition, match=f"pod {NS}/web-restored already exists") as e:
            create_restore_pod(body, kube=kube, dry_run=dry_run)
        assert "--name" in (e.value.hint or "")


def test_a_missing_runtime_class_says_install_not_rbac() -> None:
    """The API server's RuntimeClass admission plugin refuses the pod with 403 Forbidden; the user must
    install kubectl-snapshot, not ask for an RBAC permission."""
    kube, registry, _ = restorable()
    body, _ = build_restore(req(), kube=kube, stores=registry.store)
    kube.delete_objects(
        [{"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": K.RUNTIME_CLASS}}]
    )
    for dry_run in (True, False):
        with pytest.raises(FailedPrecondition, match=f'RuntimeClass "{K.RUNTIME_CLASS}" not found') as e:
            create_restore_pod(body, kube=kube, dry_run=dry_run)
        assert e.value.hint == "install kubectl-snapshot first: kubectl snapshot install"
    kube.deny("create_pod", f'create pod {NS}/web-restored: pods is forbidden: User "alice" cannot create')
    with pytest.raises(PermissionDenied):  # a real RBAC refusal stays one
        create_restore_pod(body, kube=kube)


# --- waiting -----------------------------------------------------------------------------------------


def created(kube: FakeKube, registry: FakeRegistry, name: str = "web-restored") -> None:
    body, _ = build_restore(req(name=name), kube=kube, stores=registry.store)
    create_restore_pod(body, kube=kube)


RUNNING = {"status": {"phase": "Running", "containerStatuses": [{"name": "app", "state": {"running": {}}}]}}


def test_wait_follows_the_pod_until_every_container_runs() -> None:
    kube, registry, _ = restorable()
    created(kube, registry)
    kube.script("Pod", NS, "web-restored", {"status": {"phase": "Pending"}}, {"spec": {"nodeName": "n2"}}, RUNNING)
    seen: list[RestoreState] = []
    pod = wait_running(NS, "web-restored", kube=kube, on_state=seen.append, clock=kube.clock)
    assert pod["spec"]["nodeName"] == "n2" and pod["status"]["phase"] == "Running"
    assert [s.state for s in seen] == ["waiting", "waiting", "waiting", "running"]


def test_the_agents_verdict_fails_the_wait_with_its_reason_and_a_way_out() -> None:
    kube, registry, _ = restorable()
    created(kube, registry)
    verdict = {"metadata": {"annotations": {K.ANN_RESTORE_STATUS: "Failed: the snapshot's signature is not trusted"}}}
    kube.script("Pod", NS, "web-restored", verdict)
    with pytest.raises(FailedPrecondition) as e:
        wait_running(NS, "web-restored", kube=kube, clock=kube.clock)
    assert e.value.message == f"restore of pod {NS}/web-restored failed: the snapshot's signature is not trusted"
    assert f"kubectl delete pod web-restored -n {NS}" in (e.value.hint or "")


def test_a_gate_that_exits_fails_the_wait_with_its_message() -> None:
    kube, registry, _ = restorable()
    created(kube, registry)
    gate = {"name": K.GATE_CONTAINER, "state": {"terminated": {"exitCode": 1, "message": "staging failed: disk full"}}}
    kube.script("Pod", NS, "web-restored", {"status": {"phase": "Pending", "initContainerStatuses": [gate]}})
    with pytest.raises(FailedPrecondition, match="failed: staging failed: disk full"):
        wait_running(NS, "web-restored", kube=kube, clock=kube.clock)


def test_a_pod_deleted_while_starting_is_reported() -> None:
    kube, registry, _ = restorable()
    created(kube, registry)
    kube.script("Pod", NS, "web-restored", {"status": {"phase": "Pending"}}, None)
    with pytest.raises(NotFound, match="was deleted while it was starting"):
        wait_running(NS, "web-restored", kube=kube, clock=kube.clock)


def test_a_pod_that_never_runs_times_out_with_the_last_reason() -> None:
    kube, registry, _ = restorable()
    clock = Clock()
    kube.clock = clock
    created(kube, registry)
    unschedulable = {"type": "PodScheduled", "status": "False", "message": "0/2 nodes are available"}
    kube.script("Pod", NS, "web-restored", {"status": {"phase": "Pending", "conditions": [unschedulable]}})
    with pytest.raises(Unavailable) as e:
        wait_running(NS, "web-restored", kube=kube, timeout_s=60, clock=clock)
    assert e.value.message == (
        f"restored pod {NS}/web-restored is not running after 60s (unschedulable: 0/2 nodes are available)"
    )
    assert "raise --timeout" in (e.value.hint or "") and not e.value.retryable
    assert 60 < clock.now <= 75  # it gave up at the deadline, not long after
