"""`kubectl snapshot install|uninstall` (app/install.py, and the CLI's dry runs) over the shared fake API
server, with the rendered manifests (kubectl_snapshot.deploy): the order objects are applied and deleted
in, what is waited for, and what is left when a wait times out."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from click.testing import CliRunner

from kubectl_snapshot.app import install as A
from kubectl_snapshot.app.ports import Obj
from kubectl_snapshot.cli import main as cli_main
from kubectl_snapshot.cli import wiring
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import FailedPrecondition, Unavailable
from kubectl_snapshot.core.provenance import SigningKey, node_key_entries
from kubectl_snapshot.deploy.agent import CLEANUP_NAME
from tests.support.fakeplugin import Clock, FakeKube, snapshot

AGENT = f"DaemonSet {K.AGENT_NAMESPACE}/{K.AGENT_NAME}"
CLEANUP = f"DaemonSet {K.AGENT_NAMESPACE}/{CLEANUP_NAME}"


def deployment_available(obj: Obj) -> dict[str, Any]:
    """The status the Deployment controller gives `obj` once every replica is up."""
    replicas = obj["spec"].get("replicas", 1)
    return {"observedGeneration": obj["metadata"]["generation"], "updatedReplicas": replicas,
            "availableReplicas": replicas}  # fmt: skip


class Controllers:
    """The API server's and the DaemonSet controller's work, done when the installer sleeps: CRDs become
    Established, DaemonSets roll out on `nodes` nodes and Deployments become available (unless told to hang)."""

    def __init__(self, kube: FakeKube, *, nodes: int = 2, crds_hang: bool = False, ds_hang: bool = False) -> None:
        self.kube, self.nodes, self.crds_hang, self.ds_hang = kube, nodes, crds_hang, ds_hang
        self.clock = Clock()

    def sleep(self, seconds: float) -> None:
        self.clock.sleep(seconds)
        self.kube.journal.append("sleep")
        for obj in self.kube.objects.values():
            if obj["kind"] == "CustomResourceDefinition" and not self.crds_hang:
                obj["status"] = {"conditions": [{"type": "Established", "status": "True"}]}
            if obj["kind"] == "DaemonSet" and not self.ds_hang:
                n = self.nodes
                obj["status"] = {
                    "observedGeneration": obj["metadata"]["generation"],
                    "desiredNumberScheduled": n,
                    "updatedNumberScheduled": n,
                    "numberAvailable": n,
                }
            if obj["kind"] == "Deployment" and not self.ds_hang:  # the key broker
                obj["status"] = deployment_available(obj)

    def run(self, fn: Any, objects: list[Obj], **kw: Any) -> list[str]:
        steps: list[str] = []
        fn(
            objects,
            kube=self.kube,
            sleep=self.sleep,
            clock=self.clock,
            on_step=lambda what, _d, _t: steps.append(what),
            **kw,
        )
        return steps


def where(journal: list[str], line: str) -> int:
    return journal.index(line)


def label(obj: Obj) -> str:
    meta = obj["metadata"]
    return f"{obj['kind']} {meta['namespace'] + '/' if meta.get('namespace') else ''}{meta['name']}"


def test_install_applies_in_order_waiting_for_each_crd_then_for_the_rollout() -> None:
    objects = A.render(None, {})
    kube = FakeKube(crds=False)  # a cluster that never had kubectl-snapshot
    ctl = Controllers(kube)
    steps = ctl.run(A.install, objects)
    applies = [line for line in kube.journal if line.startswith("apply ")]
    assert applies == [f"apply {label(o)}" for o in objects]  # in order, namespaces before their objects
    for o in objects:
        if o["kind"] == "CustomResourceDefinition":  # nothing else is applied until the CRD is Established
            at = where(kube.journal, f"apply {label(o)}")
            assert kube.journal[at + 1] == "sleep"
    assert kube.journal[-2:] == [f"apply {AGENT}", "sleep"]  # then the rollout was waited for
    assert all(kube.get_object(o) is not None for o in objects)
    assert steps[-2:] == [f"wait for DaemonSet {K.AGENT_NAME} to roll out", "installed"]


def test_a_crd_that_never_becomes_established_stops_the_install_there() -> None:
    objects = A.render(None, {})
    kube = FakeKube(crds=False)
    ctl = Controllers(kube, crds_hang=True)
    with pytest.raises(Unavailable, match=f"timed out after 60s waiting for CRD {objects[0]['metadata']['name']}"):
        ctl.run(A.install, objects)
    assert [line for line in kube.journal if line != "sleep"] == [f"apply {label(objects[0])}"]


def test_a_daemonset_that_does_not_roll_out_times_out_with_a_hint() -> None:
    objects = A.render(None, {})
    kube = FakeKube(crds=False)
    ctl = Controllers(kube, nodes=0)  # no node to run on: nothing becomes available
    with pytest.raises(Unavailable, match=f"timed out after 120s waiting for {AGENT} rolled out") as e:
        ctl.run(A.install, objects, timeout_s=120)
    assert "kubectl snapshot doctor" in (e.value.hint or "") and not e.value.retryable
    assert 120 < ctl.clock.now < 125


def test_an_upgrade_waits_for_the_new_generation_not_the_old_rollout() -> None:
    kube = FakeKube(crds=False)
    ctl = Controllers(kube)
    ctl.run(A.install, A.render("agent:v1", {}))
    kube.journal.clear()
    ctl.run(A.install, A.render("agent:v2", {}))
    ds = kube.get("DaemonSet", K.AGENT_NAMESPACE, K.AGENT_NAME)
    assert ds is not None and ds["metadata"]["generation"] == 2
    assert kube.journal[-2:] == [f"apply {AGENT}", "sleep"]  # the v1 rollout's status did not count


def test_uninstall_removes_the_hook_from_every_node_first_then_the_objects_in_reverse() -> None:
    objects = A.render(None, {})
    kube = FakeKube(crds=False)
    ctl = Controllers(kube)
    ctl.run(A.install, objects)
    kube.add(snapshot("s1", "team"))
    kube.journal.clear()
    steps = ctl.run(A.uninstall, objects)
    assert kube.journal[:3] == [f"apply {CLEANUP}", "sleep", f"delete {CLEANUP}"]
    assert kube.journal[3:] == [f"delete {label(o)}" for o in reversed(objects)]
    cleanup = kube.get("DaemonSet", K.AGENT_NAMESPACE, CLEANUP_NAME)
    assert cleanup is None and all(kube.get_object(o) is None for o in objects)
    assert kube.names(K.KIND) == []  # PodSnapshots go with their CRD
    assert steps == [
        f"wait for pods of runtime class {K.RUNTIME_CLASS} being deleted",
        "remove the runtime wrapper from every node",
        "delete the objects",
    ]


def _installed() -> tuple[list[Obj], FakeKube, Controllers]:
    """The rendered objects, installed on a fake cluster whose controllers do their work."""
    objects = A.render(None, {})
    kube = FakeKube(crds=False)
    ctl = Controllers(kube)
    ctl.run(A.install, objects)
    return objects, kube, ctl


def _runtime_pod(name: str, ns: str = "team", **meta: Any) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, **meta},
        "spec": {"runtimeClassName": K.RUNTIME_CLASS, "containers": [{"name": "app"}]},
        "status": {"phase": "Running"},
    }


def test_uninstall_refuses_while_pods_run_under_the_runtime_class_and_changes_nothing() -> None:
    """containerd stops those pods' containers through the runtime wrapper: without it they would keep
    running, unkillable, their pods stuck Terminating."""
    objects, kube, ctl = _installed()
    kube.add(_runtime_pod("restored"))
    kube.add({**_runtime_pod("done"), "status": {"phase": "Succeeded"}})  # its containers exited: no hook needed
    kube.add({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "plain", "namespace": "team"}, "spec": {}})
    kube.journal.clear()
    with pytest.raises(FailedPrecondition, match=r"1 pod\(s\) run under the kubectl-snapshot runtime class: team/rest"):
        ctl.run(A.uninstall, objects)
    assert kube.journal == []  # nothing applied, nothing deleted
    assert all(kube.get_object(o) is not None for o in objects)
    # --force: uninstalled all the same, and the pods left behind are said
    left = A.uninstall(objects, kube=kube, sleep=ctl.sleep, clock=ctl.clock, force=True).left
    assert [p["metadata"]["name"] for p in left] == ["restored"]
    assert all(kube.get_object(o) is None for o in objects)


def test_uninstall_waits_for_pods_of_the_runtime_class_being_deleted() -> None:
    objects, kube, ctl = _installed()
    kube.add(_runtime_pod("going", deletionTimestamp="2026-12-01T00:00:00Z"))
    kube.journal.clear()
    gone_after = [3]

    def sleep(seconds: float) -> None:  # the kubelet stops the containers (through the hook) a few seconds later
        ctl.sleep(seconds)
        gone_after[0] -= 1
        if gone_after[0] == 0:
            del kube.objects[("v1", "Pod", "team", "going")]

    # a pod of a namespace being deleted: the namespace controller deletes it next
    kube.add(_runtime_pod("next", ns="old"))
    kube.objects[("v1", "Namespace", "", "old")]["metadata"]["deletionTimestamp"] = "2026-12-01T00:00:00Z"

    def sleep_and_gc(seconds: float) -> None:
        sleep(seconds)
        kube.objects.pop(("v1", "Pod", "old", "next"), None)

    A.uninstall(objects, kube=kube, sleep=sleep_and_gc, clock=ctl.clock)
    assert kube.journal[:3] == ["sleep", "sleep", "sleep"]  # the hook stayed until the pods were gone
    assert kube.journal[3] == f"apply {CLEANUP}"
    assert all(kube.get_object(o) is None for o in objects)


def test_uninstall_gives_up_waiting_for_a_pod_that_is_never_deleted() -> None:
    objects, kube, ctl = _installed()
    kube.add(_runtime_pod("stuck", deletionTimestamp="2026-12-01T00:00:00Z"))
    with pytest.raises(Unavailable, match="to be deleted: team/stuck"):
        ctl.run(A.uninstall, objects, timeout_s=5)
    assert all(kube.get_object(o) is not None for o in objects)  # the agent stays: the pod still needs it


def test_a_node_cleanup_that_does_not_finish_leaves_the_installation_but_not_the_cleanup() -> None:
    objects = A.render(None, {})
    kube = FakeKube(crds=False)
    Controllers(kube).run(A.install, objects)
    kube.journal.clear()
    with pytest.raises(Unavailable, match="the runtime wrapper removed from every node") as e:
        Controllers(kube, ds_hang=True).run(A.uninstall, objects, timeout_s=30)
    assert f"logs ds/{CLEANUP_NAME} -c install-node" in (e.value.hint or "")
    assert kube.get("DaemonSet", K.AGENT_NAMESPACE, CLEANUP_NAME) is None  # deleted all the same
    assert all(kube.get_object(o) is not None for o in objects)  # the agent stays to retry


def test_uninstall_without_an_agent_deletes_what_is_there() -> None:
    objects = A.render(None, {})
    kube = FakeKube()  # only the CRDs the fake starts with
    Controllers(kube).run(A.uninstall, objects)
    assert not any(CLEANUP_NAME in line for line in kube.journal)
    assert kube.journal == [f"delete CustomResourceDefinition {K.POLICY_PLURAL}.{K.GROUP}",
                            f"delete CustomResourceDefinition {K.PLURAL}.{K.GROUP}"]  # fmt: skip


# --- the CLI's dry runs --------------------------------------------------------------------------------


def cli(kube: FakeKube | None, monkeypatch: pytest.MonkeyPatch, *args: str) -> Any:
    def client() -> FakeKube:
        if kube is None:
            raise AssertionError("a client dry run must not talk to the API server")
        return kube

    monkeypatch.setattr(wiring, "kube_client", client)
    return CliRunner().invoke(cli_main.cli, list(args), catch_exceptions=False)


CLI_DEFAULT = {"key_broker": True}  # what `kubectl snapshot install` renders without flags


def installed() -> tuple[FakeKube, list[Obj]]:
    objects = A.render(None, CLI_DEFAULT)
    kube = FakeKube(crds=False)
    Controllers(kube).run(A.install, objects)
    kube.journal.clear()
    return kube, objects


def test_install_client_dry_run_prints_the_objects_without_a_client(monkeypatch: pytest.MonkeyPatch) -> None:
    result = cli(None, monkeypatch, "install", "--dry-run=client", "-o", "name")
    assert result.exit_code == 0, result.output
    assert f"daemonset.apps/{K.AGENT_NAME}" in result.output.split()


def test_install_server_dry_run_sends_every_object_and_stores_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    kube, objects = installed()
    before = {k: v["metadata"]["resourceVersion"] for k, v in kube.objects.items()}
    result = cli(kube, monkeypatch, "install", "--dry-run=server", "--agent-image", "agent:v9", "-o", "name")
    assert result.exit_code == 0, result.output
    assert kube.journal == [f"apply {label(o)} (dry run)" for o in objects]
    assert {k: v["metadata"]["resourceVersion"] for k, v in kube.objects.items()} == before


def test_install_server_dry_run_on_a_fresh_cluster_checks_what_it_can(monkeypatch: pytest.MonkeyPatch) -> None:
    """The API server refuses a dry run inside a namespace that does not exist yet (kubernetes#83562):
    what the install puts in its own namespace is shown unchecked, said so, instead of failing."""
    kube = FakeKube(crds=False)
    objects = A.render(None, CLI_DEFAULT)
    before = dict(kube.objects)
    monkeypatch.setattr(wiring, "kube_client", lambda: kube)
    result = CliRunner().invoke(cli_main.cli, ["install", "--dry-run=server", "-o", "name"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    inside = [o for o in objects if o["metadata"].get("namespace") == K.AGENT_NAMESPACE]
    assert inside and f"note: {len(inside)} objects in namespace {K.AGENT_NAMESPACE} were not checked" in result.output
    assert kube.journal == [f"apply {label(o)} (dry run)" for o in objects if o not in inside]
    assert f"daemonset.apps/{K.AGENT_NAME}" in result.output.split()  # still listed
    assert kube.objects == before  # nothing stored


def test_uninstall_dry_runs_delete_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    kube, objects = installed()
    result = cli(kube, monkeypatch, "uninstall", "--dry-run=server")
    assert result.exit_code == 0, result.output
    assert kube.journal == [f"delete {label(o)} (dry run)" for o in reversed(objects)]
    assert f"DaemonSet/{K.AGENT_NAME} deleted (server dry run)" in result.output
    assert all(kube.get_object(o) is not None for o in objects)
    kube.journal.clear()
    result = cli(None, monkeypatch, "uninstall", "--dry-run=client")
    assert result.exit_code == 0 and kube.journal == []


def test_install_waits_for_its_namespace_still_being_deleted_by_an_uninstall() -> None:
    objects = A.render(None, {})
    [ns] = [o for o in objects if o["kind"] == "Namespace"]
    kube = FakeKube(crds=False)
    kube.add({**ns, "metadata": {**ns["metadata"], "deletionTimestamp": "2026-12-01T00:00:00Z"}})
    ctl = Controllers(kube)
    sleeps = [0]

    def sleep(seconds: float) -> None:  # the namespace controller finishes two seconds later
        ctl.sleep(seconds)
        sleeps[0] += 1
        if sleeps[0] == 2:
            del kube.objects[("v1", "Namespace", "", K.AGENT_NAMESPACE)]

    steps: list[str] = []
    A.install(objects, kube=kube, sleep=sleep, clock=ctl.clock, on_step=lambda w, _d, _t: steps.append(w))
    assert steps[0] == f"wait for namespace {K.AGENT_NAMESPACE} (being deleted) to be gone"
    assert kube.journal[:2] == ["sleep", "sleep"] and kube.journal[2].startswith("apply ")  # nothing before
    assert all(kube.get_object(o) is not None for o in objects)


def test_force_waits_for_no_pod_either_and_names_them_all() -> None:
    """A pod of a node that is down stays Terminating for good: --force does not wait for it."""
    objects, kube, ctl = _installed()
    kube.add(_runtime_pod("stuck", deletionTimestamp="2026-12-01T00:00:00Z"))
    kube.add(_runtime_pod("running"))
    kube.journal.clear()
    left = A.uninstall(objects, kube=kube, sleep=ctl.sleep, clock=ctl.clock, force=True).left
    assert sorted(p["metadata"]["name"] for p in left) == ["running", "stuck"]
    assert kube.journal[0] == f"apply {CLEANUP}"  # no wait before the hook's removal


# --- the keys: kept by uninstall unless --purge-keys -----------------------------------------------


def _rolled_out_at_once(kube: FakeKube) -> None:
    """The controllers of `Controllers`, acting as soon as an object is applied (for the CLI, which sleeps for real)."""

    def established(_kube: FakeKube, obj: Obj) -> None:
        kube.objects[kube._key(obj)]["status"] = {"conditions": [{"type": "Established", "status": "True"}]}

    def rolled_out(_kube: FakeKube, obj: Obj) -> None:
        kube.objects[kube._key(obj)]["status"] = {
            "observedGeneration": obj["metadata"]["generation"],
            "desiredNumberScheduled": 2,
            "updatedNumberScheduled": 2,
            "numberAvailable": 2,
        }

    def available(_kube: FakeKube, obj: Obj) -> None:
        kube.objects[kube._key(obj)]["status"] = deployment_available(obj)

    kube.react("CustomResourceDefinition", established)
    kube.react("DaemonSet", rolled_out)
    kube.react("Deployment", available)


NAMESPACE_KEY = base64.b64encode(b"k" * 32).decode()  # the agent's entry for namespace "team"


def _cli_installed(monkeypatch: pytest.MonkeyPatch) -> FakeKube:
    """`kubectl snapshot install` on a cluster an earlier release had installed (its cluster-wide signing
    key), then a sealed snapshot's key made by the agent and the agent's node key registered."""
    kube = FakeKube(crds=False)
    _rolled_out_at_once(kube)
    old = SigningKey.generate()
    kube.add(
        {**A.kept_key_objects()[1], "type": "Opaque", "data": {"signing.key": base64.b64encode(old.to_pem()).decode()}}
    )
    result = cli(kube, monkeypatch, "install")
    assert result.exit_code == 0, result.output
    kube.add({**A.kept_key_objects()[0], "type": "Opaque", "data": {"team": NAMESPACE_KEY}})
    trust = kube.get("ConfigMap", K.AGENT_NAMESPACE, K.TRUST_CONFIG_MAP)
    assert trust is not None
    trust["data"].update(node_key_entries(SigningKey.generate().public, "n1"))
    return kube


def _key_data(kube: FakeKube) -> list[Any]:
    return [(kube.get_object(o) or {}).get("data") for o in A.kept_key_objects()]


def test_uninstall_keeps_the_keys_in_their_namespace_and_a_reinstall_uses_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Deleting them would make every sealed snapshot unrestorable, and every snapshot signed before the
    last rotation (or by another trusted cluster) unverifiable."""
    kube = _cli_installed(monkeypatch)
    keys = _key_data(kube)
    assert all(keys) and keys[0] == {"team": NAMESPACE_KEY}
    kube.journal.clear()
    result = cli(kube, monkeypatch, "uninstall")
    assert result.exit_code == 0, result.output
    assert _key_data(kube) == keys  # untouched
    assert kube.get_object({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": K.AGENT_NAMESPACE}})
    kept_names = (K.KEY_SECRET, K.SIGNING_KEY_SECRET, K.TRUST_CONFIG_MAP)
    assert not [line for line in kube.journal if any(line.endswith(f"/{name}") for name in kept_names)]
    assert f"delete Namespace {K.AGENT_NAMESPACE}" not in kube.journal
    # everything else is gone: the agent, its RBAC, the key broker, the CRDs, the policies, the RuntimeClass
    rendered = A.render(None, CLI_DEFAULT)
    assert all(kube.get_object(o) is None for o in rendered if o["kind"] != "Namespace")
    assert kube.names("DaemonSet") == [] and kube.names("ServiceAccount") == []
    kept = [f"Secret/{K.KEY_SECRET}", f"Secret/{K.SIGNING_KEY_SECRET}", f"ConfigMap/{K.TRUST_CONFIG_MAP}"]
    assert f"Namespace/{K.AGENT_NAMESPACE} kept" in result.output.splitlines()
    assert all(f"{k} kept" in result.output.splitlines() for k in kept)
    assert "uninstall --purge-keys` deletes them" in result.output  # the note (stderr, mixed in by CliRunner)
    # a re-install keeps the old signing key and the trust (the nodes' keys), and the agent finds its namespace keys
    result = cli(kube, monkeypatch, "install")
    assert result.exit_code == 0, result.output
    assert _key_data(kube) == keys


def test_uninstall_purge_keys_deletes_them_then_their_namespace(monkeypatch: pytest.MonkeyPatch) -> None:
    kube = _cli_installed(monkeypatch)
    kube.journal.clear()
    result = cli(kube, monkeypatch, "uninstall", "--purge-keys", "-o", "json")
    assert result.exit_code == 0, result.output
    assert _key_data(kube) == [None, None, None]
    assert kube.get_object({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": K.AGENT_NAMESPACE}}) is None
    deletes = [line for line in kube.journal if line.startswith("delete ")]
    at = deletes.index(f"delete Namespace {K.AGENT_NAMESPACE}")
    assert deletes[at - 3 : at] == [f"delete {label(o)}" for o in A.kept_key_objects()]  # by name, just before
    out = json.loads(result.stdout)
    assert out["kept"] == [] and f"Secret/{K.KEY_SECRET}" in out["deleted"]
    # a re-install makes no signing key (each agent makes its node's own)
    result = cli(kube, monkeypatch, "install")
    assert result.exit_code == 0, result.output
    assert not _key_data(kube)[0]  # install makes the key Secret anew, empty; the agents fill it on first use
    assert _key_data(kube)[1] is None


def test_uninstall_dry_runs_show_the_keys_kept_or_purged(monkeypatch: pytest.MonkeyPatch) -> None:
    kube = _cli_installed(monkeypatch)
    kube.journal.clear()
    result = cli(kube, monkeypatch, "uninstall", "--dry-run=server", "-o", "json")
    assert result.exit_code == 0, result.output
    kept = (K.KEY_SECRET, K.SIGNING_KEY_SECRET, K.TRUST_CONFIG_MAP)
    assert not any(f"/{name} " in line or line.startswith("delete Namespace") for line in kube.journal for name in kept)
    assert f"Namespace/{K.AGENT_NAMESPACE}" in json.loads(result.stdout)["kept"]
    kube.journal.clear()
    result = cli(kube, monkeypatch, "uninstall", "--dry-run=server", "--purge-keys", "-o", "json")
    assert f"delete Secret {K.AGENT_NAMESPACE}/{K.KEY_SECRET} (dry run)" in kube.journal
    assert f"delete Namespace {K.AGENT_NAMESPACE} (dry run)" in kube.journal
    assert all(_key_data(kube))  # nothing deleted
    result = cli(None, monkeypatch, "uninstall", "--dry-run=client", "-o", "json")  # no API server: as installed
    assert f"Secret/{K.KEY_SECRET}" in json.loads(result.stdout)["kept"]


def test_uninstall_help_says_what_it_keeps(monkeypatch: pytest.MonkeyPatch) -> None:
    result = cli(None, monkeypatch, "uninstall", "--help")
    assert "--purge-keys" in result.output and "Keeps the keys unless --purge-keys" in result.output
