"""`kubectl snapshot delete` (app/delete.py) over the shared fakes: what is deleted, in which order, and
what is left when something fails."""

from __future__ import annotations

import pytest

from kubectl_snapshot.app.delete import Deleted, delete_snapshots
from kubectl_snapshot.core.errors import InvalidArgument, NotFound, PermissionDenied, Unavailable
from kubectl_snapshot.core.reference import Reference
from tests.support.fakeplugin import FakeKube, FakeRegistry, push_pod_snapshot, running_pod, snapshot, succeeded

NS = "team"


def cluster(*names: str, insecure: bool = False) -> tuple[FakeKube, FakeRegistry, dict[str, Reference]]:
    """PodSnapshots `names` in NS, each Succeeded with its own artifact in the registry."""
    journal: list[str] = []
    kube, registry = FakeKube(journal=journal), FakeRegistry(journal=journal)
    refs = {}
    for name in names:
        ref = push_pod_snapshot(registry, f"registry.example/snaps:{name}", running_pod(name, NS))
        kube.add(snapshot(name, NS, pod=name, status=succeeded(ref), insecure=insecure))
        refs[name] = ref
    return kube, registry, refs


def manifest_present(registry: FakeRegistry, ref: Reference) -> bool:
    return (ref.name, str(ref.digest)) in registry.manifests


def test_with_registry_the_manifest_goes_first_then_the_object() -> None:
    kube, registry, refs = cluster("a", "b")
    done = delete_snapshots(["a", "b"], namespace=NS, kube=kube, stores=registry.store)
    assert done == [Deleted("a", str(refs["a"])), Deleted("b", str(refs["b"]))]
    assert kube.journal == [
        f"delete manifest registry.example/snaps@{refs['a'].digest}",
        f"delete podsnapshot {NS}/a",
        f"delete manifest registry.example/snaps@{refs['b'].digest}",
        f"delete podsnapshot {NS}/b",
    ]
    assert kube.names("PodSnapshot") == [] and registry.manifests == {}


def test_a_failed_registry_delete_leaves_the_object_and_its_reference_for_a_retry() -> None:
    kube, registry, refs = cluster("a", "b")
    registry.failures["delete_manifest"] = Unavailable("delete manifest: the registry answered 503")
    with pytest.raises(Unavailable):
        delete_snapshots(["a", "b"], namespace=NS, kube=kube, stores=registry.store)
    assert kube.names("PodSnapshot", NS) == ["a", "b"] and kube.journal == []
    live = kube.get("PodSnapshot", NS, "a")
    assert live is not None and live["status"]["reference"] == str(refs["a"])
    del registry.failures["delete_manifest"]  # the retry the hint promises works
    delete_snapshots(["a"], namespace=NS, kube=kube, stores=registry.store)
    assert kube.names("PodSnapshot", NS) == ["b"] and not manifest_present(registry, refs["a"])


def test_a_manifest_already_gone_does_not_keep_the_object() -> None:
    kube, registry, refs = cluster("a")
    registry.delete_manifest(refs["a"], str(refs["a"].digest))
    registry.journal.clear()
    assert delete_snapshots(["a"], namespace=NS, kube=kube, stores=registry.store) == [Deleted("a", str(refs["a"]))]
    assert kube.names("PodSnapshot") == []


def test_without_registry_the_manifest_stays_and_no_registry_is_opened() -> None:
    kube, registry, refs = cluster("a")
    assert delete_snapshots(["a"], namespace=NS, kube=kube) == [Deleted("a", "")]
    assert kube.names("PodSnapshot") == [] and manifest_present(registry, refs["a"]) and registry.opened == []


def test_the_registry_is_opened_insecurely_when_the_snapshot_or_the_user_says_so() -> None:
    kube, registry, _ = cluster("plain", insecure=True)
    kube2, registry2, _ = cluster("tls")
    delete_snapshots(["plain"], namespace=NS, kube=kube, stores=registry.store)
    delete_snapshots(["tls"], namespace=NS, kube=kube2, stores=registry2.store)
    assert registry.opened == [("registry.example", True)] and registry2.opened == [("registry.example", False)]
    kube3, registry3, _ = cluster("flag")
    delete_snapshots(["flag"], namespace=NS, kube=kube3, stores=registry3.store, insecure=True)
    assert registry3.opened == [("registry.example", True)]


def test_a_snapshot_without_an_image_is_deleted_without_touching_the_registry() -> None:
    kube, registry, _ = cluster()
    kube.add(snapshot("broken", NS, status={"status": {"phase": "Failed", "message": "CRIU failed"}}))
    assert delete_snapshots(["broken"], namespace=NS, kube=kube, stores=registry.store) == [Deleted("broken", "")]
    assert registry.opened == [] and kube.names("PodSnapshot") == []


def test_client_dry_run_only_checks_existence_and_server_dry_run_asks_the_api_server() -> None:
    kube, registry, refs = cluster("a")
    done = delete_snapshots(["a"], namespace=NS, kube=kube, stores=registry.store, dry_run="client")
    assert done == [Deleted("a", str(refs["a"]))]  # what --registry would delete
    assert kube.journal == [] and kube.names("PodSnapshot") == ["a"] and manifest_present(registry, refs["a"])
    done = delete_snapshots(["a"], namespace=NS, kube=kube, stores=registry.store, dry_run="server")
    assert kube.journal == [f"delete podsnapshot {NS}/a (dry run)"]
    assert kube.names("PodSnapshot") == ["a"] and manifest_present(registry, refs["a"]) and registry.opened == []
    # the server dry run is where RBAC answers; the client one never asks
    kube.deny("delete_snapshot", f"delete podsnapshot {NS}/a")
    with pytest.raises(PermissionDenied):
        delete_snapshots(["a"], namespace=NS, kube=kube, dry_run="server")
    assert delete_snapshots(["a"], namespace=NS, kube=kube, dry_run="client") == [Deleted("a", "")]


def test_an_unknown_name_stops_there_with_a_hint_and_later_names_stay() -> None:
    kube, registry, _ = cluster("a", "c")
    with pytest.raises(NotFound) as e:
        delete_snapshots(["a", "b", "c"], namespace=NS, kube=kube, stores=registry.store)
    assert e.value.message == f"no podsnapshot 'b' in namespace '{NS}'"
    assert e.value.hint == f"list them with: kubectl snapshot list -n {NS}"
    assert kube.names("PodSnapshot") == ["c"]
    with pytest.raises(NotFound):  # dry runs check existence too
        delete_snapshots(["b"], namespace=NS, kube=kube, dry_run="client")


def test_an_invalid_name_is_refused_before_any_call() -> None:
    kube, registry, _ = cluster("a")
    kube.deny("get_snapshot", "get podsnapshot")  # would be met if it asked
    with pytest.raises(InvalidArgument):
        delete_snapshots(["Not_A_Name"], namespace=NS, kube=kube, stores=registry.store)
    assert kube.journal == [] and registry.opened == []
