"""`kubectl snapshot policy`: the object it builds (core/policyspec.py), the use cases (app/policy.py)
over an in-memory API, and the text of list/describe. The real commands run in
tests/e2e/test_autosave_policy.py."""

from __future__ import annotations

from typing import Any

import pytest

from kubectl_snapshot.app import policy as P
from kubectl_snapshot.cli.policy import _table, describe_text
from kubectl_snapshot.core import kube as K
from kubectl_snapshot.core.errors import AlreadyExists, InvalidArgument, NotFound
from kubectl_snapshot.core.policyspec import parse_selector, parse_workload, policy_object, policy_row


def test_selector_and_workload_parsing() -> None:
    assert parse_selector("app=web, tier=cache") == {"app": "web", "tier": "cache"}
    assert parse_selector("app.kubernetes.io/name=x") == {"app.kubernetes.io/name": "x"}
    for bad in ("", "app", "app!=web", "a b=c"):
        with pytest.raises(InvalidArgument):
            parse_selector(bad)
    assert parse_workload("statefulset/web") == {"kind": "StatefulSet", "name": "web"}
    assert parse_workload("Deployment/api") == {"kind": "Deployment", "name": "api"}
    for bad in ("web", "daemonset/x", "Job/"):
        with pytest.raises(InvalidArgument):
            parse_workload(bad)


def test_policy_object() -> None:
    obj = policy_object(
        name="p",
        namespace="team",
        selector={"app": "web"},
        workload={"kind": "StatefulSet", "name": "web"},
        interval="5m",
        destination="127.0.0.1:5005/saves/web",
        keep_last=2,
        max_age="24h",
        registry_secret="creds",
        insecure=True,
        resume=False,
        include_volumes=False,
        suspend=True,
    )
    assert obj["apiVersion"] == K.API_VERSION and obj["kind"] == K.POLICY_KIND
    assert obj["metadata"] == {"name": "p", "namespace": "team"}
    assert obj["spec"] == {
        "selector": {"matchLabels": {"app": "web"}},
        "workload": {"kind": "StatefulSet", "name": "web"},
        "interval": "5m",
        "destination": "127.0.0.1:5005/saves/web",
        "retention": {"keepLast": 2, "maxAge": "24h"},
        "registrySecret": "creds",
        "insecure": True,
        "includeVolumes": False,
        "resume": False,
        "suspend": True,
    }
    minimal = policy_object(name="p", namespace="t", selector={"a": "b"}, interval="10s", destination="r.io/x")
    assert "retention" not in minimal["spec"] and minimal["spec"]["resume"] is True


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"interval": "5s"}, "shorter than 10s"),
        ({"interval": "5"}, "not a duration"),
        ({"destination": "r.io/x:latest"}, "names a tag"),
        ({"keep_last": 0}, "at least 1"),
        ({"max_age": "1d"}, "not a duration"),
        ({"name": "Bad_Name"}, "invalid policy name"),
    ],
)
def test_policy_object_refuses(kwargs: dict[str, Any], words: str) -> None:
    args: dict[str, Any] = {
        "name": "p",
        "namespace": "t",
        "selector": {"a": "b"},
        "interval": "10s",
        "destination": "r.io/x",
        **kwargs,
    }
    with pytest.raises(InvalidArgument, match=words) as info:
        policy_object(**args)
    assert info.value.hint


def policy(name: str = "p", pods: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    obj = policy_object(name=name, namespace="t", selector={"app": "web"}, interval="30s", destination="r.io/x")
    obj["metadata"]["creationTimestamp"] = "2026-11-30T10:00:00Z"
    obj["status"] = {"pods": pods or []}
    return obj


class FakeKube:
    def __init__(self) -> None:
        self.policies: dict[str, dict[str, Any]] = {"p": policy()}
        self.snapshots = {
            "web-0-1": {
                "metadata": {"name": "web-0-1", "creationTimestamp": "2026-11-30T10:00:00Z"},
                "status": {"reference": "r.io/x@sha256:" + "a" * 64},
            }
        }
        self.calls: list[str] = []

    def get_policy(self, ns: str, name: str) -> dict[str, Any]:
        if name not in self.policies:
            raise NotFound(name)
        return self.policies[name]

    def list_policies(self, ns: str | None, *, label_selector: str | None = None) -> list[dict[str, Any]]:
        return list(self.policies.values())

    def create_policy(self, ns: str, body: dict[str, Any], *, dry_run: bool = False) -> dict[str, Any]:
        if body["metadata"]["name"] in self.policies:
            raise AlreadyExists("exists")
        return body

    def delete_policy(self, ns: str, name: str, *, dry_run: bool = False) -> None:
        self.calls.append(f"delete policy {name} dry={dry_run}")

    def list_events(self, ns: str, *, field_selector: str | None = None) -> list[dict[str, Any]]:
        assert field_selector == f"involvedObject.kind={K.POLICY_KIND},involvedObject.name=p"
        return [{"type": "Warning", "reason": "SnapshotFailed", "message": "boom", "lastTimestamp": "t"}]

    def list_snapshots(self, ns: str | None, *, label_selector: str | None = None) -> list[dict[str, Any]]:
        assert label_selector == f"{K.LABEL_POLICY}=p"
        return list(self.snapshots.values())

    def get_snapshot(self, ns: str, name: str) -> dict[str, Any]:
        return self.snapshots[name]

    def delete_snapshot(self, ns: str, name: str, *, dry_run: bool = False) -> None:
        self.calls.append(f"delete podsnapshot {name}")


class Store:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def delete_manifest(self, ref: Any, digest: str) -> None:
        self.calls.append(f"delete manifest {digest[:10]}")


def test_create_conflict_has_a_hint() -> None:
    with pytest.raises(AlreadyExists, match="already exists") as info:
        P.create_policy(FakeKube(), policy())
    assert "kubectl edit snapshotpolicy p" in (info.value.hint or "")


def test_delete_with_prune_deletes_manifests_then_objects_then_the_policy() -> None:
    kube = FakeKube()
    pruned = P.delete_policy(kube, "t", "p", prune=True, stores=lambda ref, insecure: Store(kube.calls))  # type: ignore[arg-type,return-value]
    assert [d.name for d in pruned] == ["web-0-1"]
    assert kube.calls == ["delete manifest sha256:aaa", "delete podsnapshot web-0-1", "delete policy p dry=False"]
    kube.calls.clear()
    P.delete_policy(kube, "t", "p")
    assert kube.calls == ["delete policy p dry=False"]  # the saves stay without --prune
    with pytest.raises(NotFound, match="no snapshotpolicy 'q'") as info:
        P.delete_policy(kube, "t", "q")
    assert "kubectl snapshot policy list" in (info.value.hint or "")


def test_list_and_describe_text() -> None:
    entry = {
        "name": "web-0",
        "node": "ks-n1",
        "lastSaveTime": "2026-11-30T10:05:00Z",
        "lastSnapshot": "web-0-1",
        "lastSize": 2048,
        "lastResult": "Succeeded",
        "consecutiveFailures": 0,
        "nextSaveTime": "2026-11-30T10:05:30Z",
    }
    kube = FakeKube()
    kube.policies["p"] = policy(pods=[entry])
    [(obj, row)] = P.list_policies(kube, "t")
    assert row == policy_row(obj, row["age"])
    table = _table([row], False, False)
    assert table.splitlines()[0].split() == ["NAME", "SELECTOR", "INTERVAL", "KEEP", "PODS", "LAST", "SAVE", "AGE"]
    assert table.splitlines()[1].split()[:6] == ["p", "app=web", "30s", "3", "1", "2026-11-30T10:05:00Z"]
    text = describe_text(P.describe_policy(kube, "t", "p"))
    assert "web-0 on ks-n1: last save 2026-11-30T10:05:00Z (web-0-1, 2.0 KiB), result Succeeded" in text
    assert "Warning  SnapshotFailed  t  boom" in text
    assert "Saves:           1 PodSnapshots" in text
