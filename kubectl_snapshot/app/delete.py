"""`kubectl snapshot delete SNAPSHOT... [--registry]`.

With --registry the manifest is deleted first and the PodSnapshot only after that succeeded, so a
failed registry delete leaves the object (and its reference) in place for a retry.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from kubectl_snapshot.app.ports import Kube, StoreFactory
from kubectl_snapshot.core.errors import NotFound
from kubectl_snapshot.core.podspec import validate_name
from kubectl_snapshot.core.reference import Reference


@dataclass(frozen=True)
class Deleted:
    name: str
    reference: str  # the manifest deleted from the registry, "" when not asked / none


def delete_snapshots(
    names: list[str],
    *,
    namespace: str,
    kube: Kube,
    stores: StoreFactory | None = None,
    insecure: bool = False,
    dry_run: str = "none",
) -> list[Deleted]:
    """Delete each PodSnapshot (and its manifest when `stores` is given), in order; stops at the first error.

    dry_run "client" only checks that each exists; "server" also has the API server admit the deletes
    (RBAC, admission); neither touches the registry."""
    done: list[Deleted] = []
    for name in names:
        validate_name(name, "snapshot")
        try:
            obj = kube.get_snapshot(namespace, name)
        except NotFound as e:
            raise NotFound(
                f"no podsnapshot {name!r} in namespace {namespace!r}",
                hint=f"list them with: kubectl snapshot list -n {namespace}",
            ) from e
        deleted_ref = ""
        ref_text = str((obj.get("status") or {}).get("reference") or "")
        if dry_run != "none":
            if dry_run == "server":
                kube.delete_snapshot(namespace, name, dry_run=True)
            done.append(Deleted(name=name, reference=ref_text if stores is not None else ""))
            continue
        if stores is not None and ref_text:
            ref = Reference.parse(ref_text)
            if ref.digest:
                store = stores(ref, insecure or bool((obj.get("spec") or {}).get("insecure")))
                with contextlib.suppress(NotFound):  # already gone: deleting is idempotent
                    store.delete_manifest(ref, ref.digest)
                deleted_ref = str(ref)
        kube.delete_snapshot(namespace, name)
        done.append(Deleted(name=name, reference=deleted_ref))
    return done
