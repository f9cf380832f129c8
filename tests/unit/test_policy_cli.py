"""`kubectl snapshot policy`: the object it builds (core/policyspec.py), the use cases (app/policy.py)
over the shared in-memory API server (tests/support/fakeplugin.py), and the text of list/describe. The
real commands run in tests/e2e/test_autosave_policy.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner, Result

from kubectl_snapshot.app import policy as P
from kubectl_snapshot.cli import main as cli_main
from kubectl_snapshot.cli import wiring
from kubectl_snapshot.cli.policy import _table, describe_text
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from kubectl_snapshot.core.policyspec import parse_selector, parse_workload, policy_object, policy_row
from kubectl_snapshot.core.reference import Reference
from tests.support.fakeplugin import FakeKube, FakeRegistry, push_pod_snapshot, running_pod, snapshot, succeeded


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
        restore_mode="lazy",
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
        "restoreMode": "lazy",
        "suspend": True,
    }
    minimal = policy_object(name="p", namespace="t", selector={"a": "b"}, interval="10s", destination="r.io/x")
    assert "retention" not in minimal["spec"] and minimal["spec"]["resume"] is True
    assert minimal["spec"]["restoreMode"] == "eager"  # resumes stage all memory first unless asked


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"interval": "5s"}, "shorter than 10s"),
        ({"interval": "5"}, "not a duration"),
        ({"destination": "r.io/x:latest"}, "names a tag"),
        ({"keep_last": 0}, "at least 1"),
        ({"max_age": "1d"}, "not a duration"),
        ({"name": "Bad_Name"}, "invalid policy name"),
        ({"restore_mode": "Lazy"}, "not one of eager, lazy"),
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


def cluster() -> tuple[FakeKube, FakeRegistry, Reference]:
    """Policy t/p with one save (a real artifact in the registry), another pod's snapshot beside it and
    one event about the policy (and one about something else)."""
    kube, registry = FakeKube(namespace="t"), FakeRegistry()
    registry.journal = kube.journal
    kube.add(policy())
    ref = push_pod_snapshot(registry, "r.io/x:web-0-1", running_pod("web-0", "t"))
    save = snapshot("web-0-1", "t", pod="web-0", status=succeeded(ref))
    save["metadata"]["labels"][K.LABEL_POLICY] = "p"
    save["metadata"]["creationTimestamp"] = "2026-11-30T10:00:00Z"
    kube.add(save)
    kube.add(snapshot("by-hand", "t", pod="web-0", status=succeeded(ref)))  # not the policy's: never pruned
    for kind, name, message in ((K.POLICY_KIND, "p", "boom"), (K.POLICY_KIND, "q", "other"), ("Pod", "p", "pod")):
        kube.events.append(
            {
                "metadata": {"namespace": "t"},
                "involvedObject": {"kind": kind, "name": name},
                "type": "Warning",
                "reason": "SnapshotFailed",
                "message": message,
                "lastTimestamp": "t",
            }
        )
    return kube, registry, ref


def test_create_conflict_has_a_hint() -> None:
    kube, _registry, _ref = cluster()
    with pytest.raises(AlreadyExists, match="already exists") as info:
        P.create_policy(kube, policy())
    assert "kubectl edit snapshotpolicy p" in (info.value.hint or "")


def test_create_without_the_crd_says_install() -> None:
    kube = FakeKube(namespace="t", crds=False)
    with pytest.raises(FailedPrecondition, match="SnapshotPolicy resource is not installed") as info:
        P.create_policy(kube, policy())
    assert "kubectl snapshot install" in (info.value.hint or "")


def test_delete_with_prune_deletes_manifests_then_objects_then_the_policy() -> None:
    kube, registry, ref = cluster()
    pruned = P.delete_policy(kube, "t", "p", prune=True, stores=registry.store)
    assert [d.name for d in pruned] == ["web-0-1"]
    assert kube.journal == [
        f"delete manifest r.io/x@{ref.digest}",
        "delete podsnapshot t/web-0-1",
        "delete snapshotpolicy t/p",
    ]
    assert kube.names(K.KIND, "t") == ["by-hand"]
    kube, registry, ref = cluster()
    P.delete_policy(kube, "t", "p")
    assert kube.journal == ["delete snapshotpolicy t/p"]  # the saves stay without --prune
    assert kube.names(K.KIND, "t") == ["by-hand", "web-0-1"] and registry.manifests
    with pytest.raises(NotFound, match="no snapshotpolicy 'q'") as info:
        P.delete_policy(kube, "t", "q")
    assert "kubectl snapshot policy list" in (info.value.hint or "")


def test_delete_dry_runs_keep_everything() -> None:
    kube, registry, _ref = cluster()
    P.delete_policy(kube, "t", "p", prune=True, stores=registry.store, dry_run="client")
    assert kube.journal == []
    P.delete_policy(kube, "t", "p", prune=True, stores=registry.store, dry_run="server")
    assert kube.journal == ["delete podsnapshot t/web-0-1 (dry run)", "delete snapshotpolicy t/p (dry run)"]
    assert kube.names(K.POLICY_KIND, "t") == ["p"] and kube.names(K.KIND, "t") == ["by-hand", "web-0-1"]


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
    kube, _registry, _ref = cluster()
    live = kube.get(K.POLICY_KIND, "t", "p")
    assert live is not None
    live["status"] = {"pods": [entry]}
    [(obj, row)] = P.list_policies(kube, "t")
    assert row == policy_row(obj, row["age"])
    table = _table([row], False, False)
    assert table.splitlines()[0].split() == ["NAME", "SELECTOR", "INTERVAL", "KEEP", "PODS", "LAST", "SAVE", "AGE"]
    assert table.splitlines()[1].split()[:6] == ["p", "app=web", "30s", "3", "1", "2026-11-30T10:05:00Z"]
    text = describe_text(P.describe_policy(kube, "t", "p"))
    assert "web-0 on ks-n1: last save 2026-11-30T10:05:00Z (web-0-1, 2.0 KiB), result Succeeded" in text
    assert "Warning  SnapshotFailed  t  boom" in text and "other" not in text and "pod" not in text.split()
    assert "Saves:           1 PodSnapshots" in text
    assert "Restore mode:    eager" in text
    live["spec"]["restoreMode"] = "lazy"
    assert "Restore mode:    lazy" in describe_text(P.describe_policy(kube, "t", "p"))


def create_cli(monkeypatch: pytest.MonkeyPatch, *args: str) -> Result:
    monkeypatch.setattr(wiring, "kube_client", lambda: FakeKube(namespace="t"))
    argv = ["policy", "create", "p", "--selector", "app=web", "--interval", "1m", "--to", "r.io/x", *args]
    return CliRunner().invoke(cli_main.cli, [*argv, "--dry-run=client", "-o", "json"], catch_exceptions=False)


def test_create_sets_the_restore_mode_eager_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    for args, mode in (([], "eager"), (["--restore-mode", "lazy"], "lazy"), (["--restore-mode=eager"], "eager")):
        result = create_cli(monkeypatch, *args)
        assert result.exit_code == 0, result.output
        assert json.loads(result.output)["spec"]["restoreMode"] == mode
    refused = create_cli(monkeypatch, "--restore-mode", "sometimes")
    assert refused.exit_code == 2 and "sometimes" in refused.output
