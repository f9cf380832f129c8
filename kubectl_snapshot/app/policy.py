"""`kubectl snapshot policy create|list|describe|delete`: SnapshotPolicies (autosave).

A policy is only an object: the agents of the nodes do the saving (shim/controller/policies.py), so
`kubectl apply -f policy.yaml` is exactly `policy create`. `delete --prune` also deletes the policy's
saves, each registry manifest first and its PodSnapshot after (as `kubectl snapshot delete --registry`).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from kubectl_snapshot.app.delete import Deleted, delete_snapshots
from kubectl_snapshot.app.listing import age
from kubectl_snapshot.app.ports import Obj, StoreFactory
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import timestamps as T
from kubectl_snapshot.core.errors import AlreadyExists, FailedPrecondition, NotFound
from kubectl_snapshot.core.policyspec import policy_row


class PolicyKube(Protocol):
    def get_policy(self, ns: str, name: str) -> Obj: ...
    def list_policies(self, ns: str | None, *, label_selector: str | None = None) -> list[Obj]: ...
    def create_policy(self, ns: str, body: Obj, *, dry_run: bool = False) -> Obj: ...
    def delete_policy(self, ns: str, name: str, *, dry_run: bool = False) -> None: ...
    def list_events(self, ns: str, *, field_selector: str | None = None) -> list[Obj]: ...
    def list_snapshots(self, ns: str | None, *, label_selector: str | None = None) -> list[Obj]: ...
    def get_snapshot(self, ns: str, name: str) -> Obj: ...
    def delete_snapshot(self, ns: str, name: str, *, dry_run: bool = False) -> None: ...


def _not_installed(e: NotFound) -> FailedPrecondition:
    return FailedPrecondition(
        f"the SnapshotPolicy resource is not installed in this cluster ({e.message})",
        hint="install (or upgrade) kubectl-snapshot first: kubectl snapshot install",
    )


def create_policy(kube: PolicyKube, body: Obj, *, dry_run: bool = False) -> Obj:
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    try:
        return kube.create_policy(ns, body, dry_run=dry_run)
    except AlreadyExists as e:
        raise AlreadyExists(
            f"snapshotpolicy {name!r} already exists in namespace {ns!r}",
            hint=f"change it with kubectl edit snapshotpolicy {name} -n {ns}, or delete it first",
        ) from e
    except NotFound as e:
        raise _not_installed(e) from e


def list_policies(
    kube: PolicyKube, namespace: str | None, *, label_selector: str | None = None, now: datetime.datetime | None = None
) -> list[tuple[Obj, dict[str, Any]]]:
    now = now or T.now()
    try:
        items = kube.list_policies(namespace, label_selector=label_selector)
    except NotFound as e:
        raise _not_installed(e) from e
    pairs = [(o, policy_row(o, age(str((o.get("metadata") or {}).get("creationTimestamp") or ""), now))) for o in items]
    return sorted(pairs, key=lambda p: (p[1]["namespace"], p[1]["name"]))


def get_policy(kube: PolicyKube, namespace: str, name: str) -> Obj:
    try:
        return kube.get_policy(namespace, name)
    except NotFound as e:
        raise NotFound(
            f"no snapshotpolicy {name!r} in namespace {namespace!r}",
            hint=f"list them with: kubectl snapshot policy list -n {namespace}",
        ) from e


def policy_saves(kube: PolicyKube, namespace: str, name: str) -> list[Obj]:
    saves = kube.list_snapshots(namespace, label_selector=f"{K.LABEL_POLICY}={name}")
    return sorted(saves, key=lambda o: str((o.get("metadata") or {}).get("creationTimestamp") or ""))


@dataclass
class Description:
    policy: Obj
    saves: list[Obj] = field(default_factory=list)
    events: list[Obj] = field(default_factory=list)


def describe_policy(kube: PolicyKube, namespace: str, name: str) -> Description:
    obj = get_policy(kube, namespace, name)
    events = kube.list_events(
        namespace, field_selector=f"involvedObject.kind={K.POLICY_KIND},involvedObject.name={name}"
    )
    events.sort(key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""))
    return Description(policy=obj, saves=policy_saves(kube, namespace, name), events=events[-10:])


def delete_policy(
    kube: PolicyKube,
    namespace: str,
    name: str,
    *,
    prune: bool = False,
    stores: StoreFactory | None = None,
    dry_run: str = "none",
) -> list[Deleted]:
    """Delete the policy (its saves stay unless `prune`: then each save's manifest, then its object)."""
    obj = get_policy(kube, namespace, name)
    pruned: list[Deleted] = []
    if prune:
        names = [str(o["metadata"]["name"]) for o in policy_saves(kube, namespace, name)]
        insecure = bool((obj.get("spec") or {}).get("insecure"))
        pruned = delete_snapshots(
            names,
            namespace=namespace,
            kube=kube,  # type: ignore[arg-type]  # it reads and deletes PodSnapshots only
            stores=stores,
            insecure=insecure,
            dry_run=dry_run,
        )
    if dry_run != "client":
        kube.delete_policy(namespace, name, dry_run=dry_run == "server")
    return pruned


def status_pods(obj: Mapping[str, Any]) -> list[dict[str, Any]]:
    return sorted(((obj.get("status") or {}).get("pods")) or [], key=lambda p: str(p.get("name") or ""))
