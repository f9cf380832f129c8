"""The one in-memory fake of the plugin's ports (kubectl_snapshot/app/ports.py), type-checked against them.

`FakeKube` behaves like the API server for what the use cases do: objects stored by (apiVersion, kind,
namespace, name) with uid/resourceVersion/generation, copies returned (never the live object), the
errors `kubectl_snapshot.adapters.kube.KubeClient` raises for the same answers (404 -> NotFound, 409
AlreadyExists -> AlreadyExists, 403 -> PermissionDenied, a missing namespace is a 404 for the objects
in it, a missing RuntimeClass is the RuntimeClass admission plugin's 403), dry runs that admit but
store nothing, CRD and Namespace deletion taking their objects along, and watches that start with an
ADDED event for what exists (as a watch without resourceVersion does) and end after `timeout_s` of a
`Clock` when nothing changes.

What the rest of the cluster does (the agent claiming a PodSnapshot, a controller rolling out a
DaemonSet or replacing a pod, the kubelet running the restored pod) is the test's to script:
`react(kind, fn)` runs after each stored create/apply of that kind, and `script(kind, ns, name, ...)`
queues the changes the next watches of that object see. Every write (and every dry-run write) goes to
`journal` in order, shared with `FakeRegistry` when a test wants the order across both.

`FakeRegistry` is an `ArtifactStore` holding manifests and blobs by digest (and tags); `push_pod_snapshot`
puts a real, parseable kubectl-snapshot artifact in it. Pass `registry.store` where a `StoreFactory` is
expected.
"""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from kubectl_snapshot.app.policy import PolicyKube
from kubectl_snapshot.app.ports import ArtifactStore, Kube, Obj, StoreFactory
from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    SnapshotError,
)
from kubectl_snapshot.core.model import ContainerRecord, HostFacts, PodRecord, SnapshotConfig
from kubectl_snapshot.core.oci import Descriptor, build_manifest, sha256_digest
from kubectl_snapshot.core.reference import Reference

Key = tuple[str, str, str, str]  # (apiVersion, kind, namespace or "", name)
Reaction = Callable[["FakeKube", Obj], None]
Step = Mapping[str, Any] | Callable[[Obj], None] | None  # a merge patch, a change, or None: deleted

CLUSTER_SCOPED: Final = frozenset(
    {
        "Namespace",
        "Node",
        "CustomResourceDefinition",
        "RuntimeClass",
        "ClusterRole",
        "ClusterRoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "MutatingAdmissionPolicy",
        "MutatingAdmissionPolicyBinding",
    }
)
PLURALS: Final = {K.KIND: K.PLURAL, K.POLICY_KIND: K.POLICY_PLURAL}
MAX_WATCHES: Final = 500  # a wait loop that never converges fails the test instead of hanging it
RBAC_HINT: Final = "ask a cluster admin for the RBAC permission named above (kubectl auth can-i ...)"


class Clock:
    """Monotonic time that moves only when a watch runs out or the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def _merge(into: dict[str, Any], patch: Mapping[str, Any]) -> None:
    """JSON merge patch (RFC 7386): None removes a key, objects merge, anything else replaces."""
    for k, v in patch.items():
        if v is None:
            into.pop(k, None)
        elif isinstance(v, Mapping) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = copy.deepcopy(v)


def _plural(kind: str) -> str:
    return PLURALS.get(kind, kind.lower() + "s")


def _matches(labels: Mapping[str, Any], selector: str | None) -> bool:
    """Equality-based label selectors (`a=b,c=d`), what the plugin sends."""
    for term in filter(None, (selector or "").split(",")):
        key, sep, value = term.partition("=")
        if not sep:
            raise InvalidArgument(f"unable to parse requirement: {term!r} (the fake knows only key=value)")
        if labels.get(key.strip()) != value.strip():
            return False
    return True


_POD_FIELDS: Final = {
    "metadata.name": lambda p: p["metadata"].get("name"),
    "metadata.namespace": lambda p: p["metadata"].get("namespace"),
    "spec.nodeName": lambda p: (p.get("spec") or {}).get("nodeName", ""),
    "status.phase": lambda p: (p.get("status") or {}).get("phase", ""),
}

_EVENT_FIELDS: Final = {
    f"involvedObject.{key}": (lambda e, key=key: (e.get("involvedObject") or {}).get(key))
    for key in ("kind", "name", "namespace", "uid")
}


def _fields_match(obj: Obj, selector: str | None, supported: Mapping[str, Callable[[Obj], Any]]) -> bool:
    for term in filter(None, (selector or "").split(",")):
        key, _sep, value = term.partition("=")
        if key not in supported:  # the API server answers 400 for a field it cannot select on
            raise InvalidArgument(f'field label not supported: "{key}"')
        if str(supported[key](obj) or "") != value:
            return False
    return True


class FakeKube:
    """An in-memory API server for the plugin's use cases (see the module docstring)."""

    def __init__(
        self,
        *,
        namespace: str = "default",
        crds: bool = True,
        clock: Clock | None = None,
        journal: list[str] | None = None,
    ) -> None:
        self.namespace = namespace
        self.server = "https://fake-apiserver:6443"
        self.clock = clock or Clock()
        self.journal: list[str] = journal if journal is not None else []
        self.objects: dict[Key, Obj] = {}
        self.events: list[Obj] = []
        self.failures: dict[str, SnapshotError] = {}
        self.watches = 0
        self._reactions: dict[str, list[Reaction]] = {}
        self._scripts: dict[Key, list[Step]] = {}
        self._uids = itertools.count(1)
        self._versions = itertools.count(1)
        for ns in ("default", "kube-system", namespace):
            self.add({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        if crds:
            for kind in (K.KIND, K.POLICY_KIND):
                self.add(crd(kind))

    # --- test set-up and inspection ---------------------------------------------------------------

    def add(self, obj: Obj) -> Obj:
        """Store `obj` as if it had been created earlier (its namespace too); returns the live object."""
        meta = obj.setdefault("metadata", {})
        if obj["kind"] not in CLUSTER_SCOPED:
            meta.setdefault("namespace", "default")
            ns_key = ("v1", "Namespace", "", meta["namespace"])
            if ns_key not in self.objects:
                self.add({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": meta["namespace"]}})
        self._stamp(obj)
        self.objects[self._key(obj)] = obj
        return obj

    def get(self, kind: str, ns: str, name: str) -> Obj | None:
        """The live stored object of `kind` (any apiVersion), for assertions."""
        for (_v, k, n, nm), obj in self.objects.items():
            if (k, n, nm) == (kind, ns, name):
                return obj
        return None

    def names(self, kind: str, ns: str = "") -> list[str]:
        return sorted(nm for (_v, k, n, nm) in self.objects if k == kind and (n == ns or not ns))

    def fail(self, method: str, error: SnapshotError) -> None:
        """Make every later call of `method` raise `error` (RBAC refusals, outages)."""
        self.failures[method] = error

    def deny(self, method: str, what: str) -> None:
        """`method` answers 403 as the adapter reports it (`what` is the adapter's description)."""
        self.fail(method, PermissionDenied(f'{what}: forbidden: User "alice" cannot do this', hint=RBAC_HINT))

    def react(self, kind: str, fn: Reaction) -> None:
        """Run `fn(kube, live_object)` after each stored create or apply of `kind` (the cluster's actors)."""
        self._reactions.setdefault(kind, []).append(fn)

    def script(self, kind: str, ns: str, name: str, *steps: Step) -> None:
        """Changes the next watches of this object see, in order (a merge patch, a function, None: deleted)."""
        self._scripts.setdefault(self._key_of(kind, ns, name), []).extend(steps)

    # --- internals --------------------------------------------------------------------------------

    def _key_of(self, kind: str, ns: str, name: str) -> Key:
        version = {
            "Pod": "v1",
            "Node": "v1",
            "Namespace": "v1",
            K.KIND: K.API_VERSION,
            K.POLICY_KIND: K.API_VERSION,
            "DaemonSet": "apps/v1",
            "CustomResourceDefinition": "apiextensions.k8s.io/v1",
            "RuntimeClass": "node.k8s.io/v1",
        }.get(kind)
        if version is None:
            found = [k for k in self.objects if k[1:] == (kind, ns, name)]
            return found[0] if found else ("v1", kind, ns, name)
        return (version, kind, "" if kind in CLUSTER_SCOPED else ns, name)

    def _key(self, obj: Mapping[str, Any]) -> Key:
        meta = obj.get("metadata") or {}
        kind = str(obj.get("kind", ""))
        ns = "" if kind in CLUSTER_SCOPED else str(meta.get("namespace") or "default")
        return (str(obj.get("apiVersion", "")), kind, ns, str(meta.get("name", "")))

    def _stamp(self, obj: Obj, *, new: bool = True) -> None:
        meta = obj.setdefault("metadata", {})
        if new:
            meta.setdefault("uid", f"uid-{next(self._uids)}")
            meta.setdefault("creationTimestamp", "2026-12-01T00:00:00Z")
            meta.setdefault("generation", 1)
        meta["resourceVersion"] = str(next(self._versions))

    def _enter(self, method: str) -> None:
        if method in self.failures:
            raise self.failures[method]

    def _write(self, line: str, dry_run: bool) -> None:
        self.journal.append(line + (" (dry run)" if dry_run else ""))

    def _react(self, obj: Obj) -> None:
        for fn in self._reactions.get(str(obj.get("kind")), []):
            fn(self, obj)

    def _need_namespace(self, ns: str, what: str) -> None:
        if ("v1", "Namespace", "", ns) not in self.objects:
            raise NotFound(f'{what}: namespaces "{ns}" not found')

    def _need_crd(self, kind: str, what: str) -> None:
        name = f"{_plural(kind)}.{K.GROUP}"
        if ("apiextensions.k8s.io/v1", "CustomResourceDefinition", "", name) not in self.objects:
            raise NotFound(f"{what}: the server could not find the requested resource")

    def _read(self, key: Key, what: str) -> Obj:
        obj = self.objects.get(key)
        if obj is None:
            raise NotFound(f'{what}: {_plural(key[1])} "{key[3]}" not found')
        return copy.deepcopy(obj)

    def _create(self, kind: str, ns: str, body: Obj, dry_run: bool, api_version: str) -> Obj:
        name = str((body.get("metadata") or {}).get("name", ""))
        what = f"create {kind.lower()} {ns}/{name}"
        self._need_namespace(ns, what)
        obj = copy.deepcopy(body)
        obj.setdefault("apiVersion", api_version)
        obj.setdefault("kind", kind)
        obj["metadata"]["namespace"] = ns
        if self._key(obj) in self.objects:
            raise AlreadyExists(f'{what}: {_plural(kind)} "{name}" already exists')
        self._stamp(obj)
        self._write(f"create {kind.lower()} {ns}/{name}", dry_run)
        if dry_run:
            return obj
        self.objects[self._key(obj)] = obj
        self._react(obj)
        return copy.deepcopy(obj)

    def _delete(self, key: Key, what: str, dry_run: bool) -> None:
        if key not in self.objects:
            raise NotFound(f'{what}: {_plural(key[1])} "{key[3]}" not found')
        self._write(what, dry_run)
        if dry_run:
            return
        obj = self.objects.pop(key)
        if key[1] == "Namespace":  # the namespace controller empties it
            for k in [k for k in self.objects if k[2] == key[3]]:
                del self.objects[k]
        if key[1] == "CustomResourceDefinition":  # its custom objects go with it
            kind = str(((obj.get("spec") or {}).get("names") or {}).get("kind") or "")
            for k in [k for k in self.objects if k[1] == kind and kind]:
                del self.objects[k]

    def _watch(self, key: Key, timeout_s: int) -> Iterator[tuple[str, Obj]]:
        self.watches += 1
        if self.watches > MAX_WATCHES:
            raise AssertionError(f"{MAX_WATCHES} watches: the wait loop under test does not converge")
        if key in self.objects:
            yield "ADDED", copy.deepcopy(self.objects[key])
        steps = self._scripts.get(key) or []
        while steps and key in self.objects:
            step = steps.pop(0)
            if step is None:
                yield "DELETED", self.objects.pop(key)
                return
            live = self.objects[key]
            if callable(step):
                step(live)
            else:
                _merge(live, step)
            self._stamp(live, new=False)
            yield "MODIFIED", copy.deepcopy(live)
        self.clock.now += timeout_s  # nothing more happened: the watch ran until its timeout

    # --- pods -------------------------------------------------------------------------------------

    def get_pod(self, ns: str, name: str) -> Obj:
        self._enter("get_pod")
        return self._read(("v1", "Pod", ns, name), f"get pod {ns}/{name}")

    def list_pods(
        self, ns: str | None, *, label_selector: str | None = None, field_selector: str | None = None
    ) -> list[Obj]:
        self._enter("list_pods")
        return [
            copy.deepcopy(o)
            for (_v, kind, n, _nm), o in sorted(self.objects.items())
            if kind == "Pod"
            and (ns is None or n == ns)
            and _matches(o["metadata"].get("labels") or {}, label_selector)
            and _fields_match(o, field_selector, _POD_FIELDS)
        ]

    def watch_pods(
        self, *, field_selector: str | None, namespace: str | None = None, timeout_s: int = 300
    ) -> Iterator[tuple[str, Obj]]:
        self._enter("watch_pods")
        key, _sep, name = (field_selector or "").partition("=")
        if key != "metadata.name" or namespace is None:
            raise AssertionError(f"the fake watches one pod by metadata.name, not {field_selector!r}")
        return self._watch(("v1", "Pod", namespace, name), timeout_s)

    def create_pod(self, ns: str, body: Obj, *, dry_run: bool = False) -> Obj:
        self._enter("create_pod")
        name = str(body["metadata"].get("name", ""))
        rc = (body.get("spec") or {}).get("runtimeClassName")
        if rc and ("node.k8s.io/v1", "RuntimeClass", "", rc) not in self.objects:
            # the RuntimeClass admission plugin answers 403 Forbidden, mapped by the adapter like RBAC
            raise PermissionDenied(
                f'create pod {ns}/{name}: pods "{name}" is forbidden: pod rejected: RuntimeClass "{rc}" not found',
                hint=RBAC_HINT,
            )
        return self._create("Pod", ns, body, dry_run, "v1")

    def delete_pod(self, ns: str, name: str) -> None:
        self._enter("delete_pod")
        self._delete(("v1", "Pod", ns, name), f"delete pod {ns}/{name}", False)

    # --- PodSnapshots -----------------------------------------------------------------------------

    def get_snapshot(self, ns: str, name: str) -> Obj:
        self._enter("get_snapshot")
        self._need_crd(K.KIND, f"get podsnapshot {ns}/{name}")
        return self._read((K.API_VERSION, K.KIND, ns, name), f"get podsnapshot {ns}/{name}")

    def create_snapshot(self, ns: str, body: Obj, *, dry_run: bool = False) -> Obj:
        self._enter("create_snapshot")
        self._need_crd(K.KIND, f"create podsnapshot {ns}/{body['metadata'].get('name', '?')}")
        return self._create(K.KIND, ns, body, dry_run, K.API_VERSION)

    def list_snapshots(self, ns: str | None, *, label_selector: str | None = None) -> list[Obj]:
        self._enter("list_snapshots")
        self._need_crd(K.KIND, f"list podsnapshots in {ns or 'all namespaces'}")
        return [
            copy.deepcopy(o)
            for (_v, kind, n, _nm), o in sorted(self.objects.items())
            if kind == K.KIND
            and (ns is None or n == ns)
            and _matches(o["metadata"].get("labels") or {}, label_selector)
        ]

    def delete_snapshot(self, ns: str, name: str, *, dry_run: bool = False) -> None:
        self._enter("delete_snapshot")
        self._need_crd(K.KIND, f"delete podsnapshot {ns}/{name}")
        self._delete((K.API_VERSION, K.KIND, ns, name), f"delete podsnapshot {ns}/{name}", dry_run)

    def watch_snapshots(
        self,
        namespace: str | None,
        timeout_s: int = 300,
        *,
        label_selector: str | None = None,
        resource_version: str | None = None,
    ) -> Iterator[tuple[str, Obj]]:
        raise AssertionError("watch_snapshots (list --watch) is not modelled by the fake")

    def watch_snapshot(self, ns: str, name: str, timeout_s: int = 300) -> Iterator[tuple[str, Obj]]:
        self._enter("watch_snapshot")
        self._need_crd(K.KIND, f"watch podsnapshot {ns}/{name}")
        return self._watch((K.API_VERSION, K.KIND, ns, name), timeout_s)

    # --- SnapshotPolicies (app.policy.PolicyKube) -------------------------------------------------

    def get_policy(self, ns: str, name: str) -> Obj:
        self._enter("get_policy")
        self._need_crd(K.POLICY_KIND, f"get snapshotpolicy {ns}/{name}")
        return self._read((K.API_VERSION, K.POLICY_KIND, ns, name), f"get snapshotpolicy {ns}/{name}")

    def list_policies(self, ns: str | None, *, label_selector: str | None = None) -> list[Obj]:
        self._enter("list_policies")
        self._need_crd(K.POLICY_KIND, f"list snapshotpolicies in {ns or 'all namespaces'}")
        return [
            copy.deepcopy(o)
            for (_v, kind, n, _nm), o in sorted(self.objects.items())
            if kind == K.POLICY_KIND
            and (ns is None or n == ns)
            and _matches(o["metadata"].get("labels") or {}, label_selector)
        ]

    def create_policy(self, ns: str, body: Obj, *, dry_run: bool = False) -> Obj:
        self._enter("create_policy")
        self._need_crd(K.POLICY_KIND, f"create snapshotpolicy {ns}/{body['metadata'].get('name', '?')}")
        return self._create(K.POLICY_KIND, ns, body, dry_run, K.API_VERSION)

    def delete_policy(self, ns: str, name: str, *, dry_run: bool = False) -> None:
        self._enter("delete_policy")
        self._need_crd(K.POLICY_KIND, f"delete snapshotpolicy {ns}/{name}")
        self._delete((K.API_VERSION, K.POLICY_KIND, ns, name), f"delete snapshotpolicy {ns}/{name}", dry_run)

    def list_events(self, ns: str, *, field_selector: str | None = None) -> list[Obj]:
        self._enter("list_events")
        return [
            copy.deepcopy(e)
            for e in self.events
            if (e.get("metadata") or {}).get("namespace", ns) == ns and _fields_match(e, field_selector, _EVENT_FIELDS)
        ]

    # --- namespaces, nodes, installation ----------------------------------------------------------

    def list_namespaces(self) -> list[Obj]:
        self._enter("list_namespaces")
        return [copy.deepcopy(o) for k, o in sorted(self.objects.items()) if k[1] == "Namespace"]

    def get_node(self, name: str) -> Obj:
        self._enter("get_node")
        return self._read(("v1", "Node", "", name), f"get node {name}")

    def list_nodes(self) -> list[Obj]:
        self._enter("list_nodes")
        return [copy.deepcopy(o) for k, o in sorted(self.objects.items()) if k[1] == "Node"]

    def get_daemonset(self, ns: str, name: str) -> Obj | None:
        self._enter("get_daemonset")
        found = self.objects.get(("apps/v1", "DaemonSet", ns, name))
        return copy.deepcopy(found) if found is not None else None

    def get_crd(self, name: str) -> Obj | None:
        self._enter("get_crd")
        found = self.objects.get(("apiextensions.k8s.io/v1", "CustomResourceDefinition", "", name))
        return copy.deepcopy(found) if found is not None else None

    def get_object(self, obj: Mapping[str, Any]) -> Obj | None:
        self._enter("get_object")
        found = self.objects.get(self._key(obj))
        return copy.deepcopy(found) if found is not None else None

    def apply(self, objects: list[Obj], *, dry_run: bool = False) -> list[Obj]:
        """Server-side apply, in order: a namespaced object needs its namespace; a changed spec bumps
        metadata.generation (what a DaemonSet's rollout is measured against)."""
        self._enter("apply")
        applied = []
        for obj in objects:
            key = self._key(obj)
            what = f"apply {key[1]} {key[2] + '/' if key[2] else ''}{key[3]}"
            if key[2]:
                self._need_namespace(key[2], what)
            self._write(what, dry_run)
            live = self.objects.get(key)
            new = copy.deepcopy(obj)
            new.setdefault("metadata", {})
            if live is not None:
                meta = live["metadata"]
                for k in ("uid", "creationTimestamp", "generation"):
                    new["metadata"][k] = meta.get(k)
                if {k: v for k, v in obj.items() if k not in ("metadata", "status")} != {
                    k: v for k, v in live.items() if k not in ("metadata", "status")
                }:
                    new["metadata"]["generation"] = int(meta.get("generation") or 1) + 1
                if "status" in live:
                    new["status"] = live["status"]
            if key[2]:
                new["metadata"]["namespace"] = key[2]
            self._stamp(new, new=live is None)
            if not dry_run:
                self.objects[key] = new
                self._react(new)
            applied.append(copy.deepcopy(new))
        return applied

    def delete_objects(self, objects: list[Obj], *, dry_run: bool = False) -> None:
        """Delete each in order; absent objects are skipped (as the adapter does)."""
        self._enter("delete_objects")
        for obj in objects:
            key = self._key(obj)
            if key in self.objects:
                self._delete(key, f"delete {key[1]} {key[2] + '/' if key[2] else ''}{key[3]}", dry_run)


# --- the registry ------------------------------------------------------------------------------------


@dataclass
class FakeRegistry:
    """Manifests by (repository, digest) and tags, blobs by digest; the `ArtifactStore` of every registry host.

    `store` is the StoreFactory (it records which registry was opened and whether insecurely);
    `failures` makes a method raise (an outage, a refused delete)."""

    journal: list[str] = field(default_factory=list)
    manifests: dict[tuple[str, str], bytes] = field(default_factory=dict)  # (registry/repo, digest) -> body
    tags: dict[tuple[str, str], str] = field(default_factory=dict)  # (registry/repo, tag) -> digest
    blobs: dict[str, bytes] = field(default_factory=dict)
    opened: list[tuple[str, bool]] = field(default_factory=list)
    failures: dict[str, SnapshotError] = field(default_factory=dict)

    def store(self, ref: Reference, insecure: bool) -> ArtifactStore:
        self.opened.append((ref.registry, insecure))
        return self

    def get_manifest(self, ref: Reference, *, max_size: int = 4 << 20) -> tuple[bytes, str, str]:
        if "get_manifest" in self.failures:
            raise self.failures["get_manifest"]
        digest = ref.digest or self.tags.get((ref.name, ref.tag or ""), "")
        body = self.manifests.get((ref.name, digest))
        if body is None:
            raise NotFound(
                f"get manifest {ref}: the registry answered 404: manifest unknown",
                hint="check the reference (registry, repository, tag or digest)",
            )
        if len(body) > max_size:
            raise FailedPrecondition(f"get manifest {ref}: manifest larger than the {max_size}-byte limit")
        return body, C.OCI_MANIFEST, digest

    def read_blob(self, ref: Reference, digest: str, *, max_size: int = 4 << 20) -> bytes:
        if digest not in self.blobs:
            raise NotFound(f"fetch blob {digest} from {ref.name}: the registry answered 404: blob unknown")
        if len(self.blobs[digest]) > max_size:
            raise FailedPrecondition(f"fetch blob {digest} from {ref.name}: blob exceeds the {max_size}-byte limit")
        return self.blobs[digest]

    def delete_manifest(self, ref: Reference, digest: str) -> None:
        if "delete_manifest" in self.failures:
            raise self.failures["delete_manifest"]
        if (ref.name, digest) not in self.manifests:
            raise NotFound(f"delete manifest {ref.name}@{digest}: the registry answered 404: manifest unknown")
        self.journal.append(f"delete manifest {ref.name}@{digest}")
        del self.manifests[(ref.name, digest)]
        for tag in [t for t, d in self.tags.items() if d == digest and t[0] == ref.name]:
            del self.tags[tag]

    def push(self, ref: Reference, config: SnapshotConfig, layers: Mapping[str, bytes]) -> Reference:
        """Store an artifact (config + layers) under ref's tag; the reference pinned by its digest."""
        body = config.to_bytes()
        self.blobs[sha256_digest(body)] = body
        self.blobs.update(layers)
        manifest = build_manifest(
            config=Descriptor(C.CONFIG_MEDIA_TYPE, sha256_digest(body), len(body)),
            layers=[Descriptor(C.CHECKPOINT_LAYER_MEDIA_TYPE, d, len(b)) for d, b in layers.items()],
            artifact_type=C.ARTIFACT_TYPE,
            annotations={},
        )
        raw = manifest.to_bytes()
        digest = sha256_digest(raw)
        self.manifests[(ref.name, digest)] = raw
        if ref.tag:
            self.tags[(ref.name, ref.tag)] = digest
        return Reference(ref.registry, ref.repository, tag=ref.tag, digest=digest)


# --- objects as the API server and the agent would have them ------------------------------------------

IMAGE: Final = "registry.example/app@sha256:" + "1" * 64
AGENT_IMAGE: Final = "registry.example/kubectl-snapshot-agent:v1"


def crd(kind: str, *, established: bool = True) -> Obj:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{_plural(kind)}.{K.GROUP}"},
        "spec": {"group": K.GROUP, "names": {"kind": kind, "plural": _plural(kind)}},
        "status": {"conditions": [{"type": "Established", "status": "True" if established else "False"}]},
    }


def node(name: str, *, ready: bool = True, unschedulable: bool = False, facts: Obj | None = None) -> Obj:
    meta: Obj = {"name": name, "labels": {"kubernetes.io/hostname": name}}
    if facts is not None:
        meta["annotations"] = {K.ANN_NODE_FACTS: json.dumps(facts)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": meta,
        "spec": {"unschedulable": True} if unschedulable else {},
        "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def running_pod(
    name: str,
    ns: str = "default",
    *,
    node_name: str = "n1",
    owner: tuple[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
) -> Obj:
    """A Running pod with every container running; `owner` (kind, name) makes it controller-owned."""
    meta: Obj = {"name": name, "namespace": ns, "labels": dict(labels or {}), "annotations": dict(annotations or {})}
    if owner is not None:
        meta["ownerReferences"] = [
            {"apiVersion": "apps/v1", "kind": owner[0], "name": owner[1], "uid": f"owner-{owner[1]}"}
            | {"controller": True}
        ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"nodeName": node_name, "containers": [{"name": "app", "image": IMAGE}]},
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True"}],
            "containerStatuses": [{"name": "app", "state": {"running": {}}}],
        },
    }


def agent_daemonset(image: str = AGENT_IMAGE) -> Obj:
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": K.AGENT_NAME, "namespace": K.AGENT_NAMESPACE},
        "spec": {
            "selector": {"matchLabels": dict(K.AGENT_LABEL)},
            "template": {
                "metadata": {"labels": dict(K.AGENT_LABEL)},
                "spec": {"containers": [{"name": K.AGENT_NAME, "image": image}]},
            },
        },
    }


def agent_pod(node_name: str, *, ready: bool = True, name: str | None = None) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name or f"{K.AGENT_NAME}-{node_name}",
            "namespace": K.AGENT_NAMESPACE,
            "labels": dict(K.AGENT_LABEL),
        },
        "spec": {"nodeName": node_name, "containers": [{"name": K.AGENT_NAME, "image": AGENT_IMAGE}]},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]},
    }


def install_agent(kube: FakeKube, *, nodes: tuple[str, ...] = ("n1", "n2"), image: str = AGENT_IMAGE) -> None:
    """What `kubectl snapshot install` leaves: Ready nodes, the DaemonSet, the RuntimeClass, a Ready agent each."""
    for n in nodes:
        if kube.get("Node", "", n) is None:
            kube.add(node(n))
        kube.add(agent_pod(n))
    kube.add(agent_daemonset(image))
    kube.add({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": K.RUNTIME_CLASS}})


def pod_config(pod: Obj, *, layer: str) -> SnapshotConfig:
    """The config an agent records for `pod` (its spec, as restore replays it)."""
    meta = pod["metadata"]
    spec = {k: v for k, v in pod["spec"].items() if k != "nodeName"}
    spec["metadata"] = {"labels": dict(meta.get("labels") or {})}
    record = ContainerRecord(name="app", id="c1", image=IMAGE, image_digest="", layer_digest=layer, spec={})
    return SnapshotConfig(
        group=meta["name"],
        namespace=meta["namespace"],
        created="2026-12-01T00:00:00Z",
        containers=(record,),
        host=HostFacts(),
        pod=PodRecord(name=meta["name"], namespace=meta["namespace"], uid=str(meta.get("uid", "")), spec=spec),
    )


def push_pod_snapshot(registry: FakeRegistry, destination: str, pod: Obj) -> Reference:
    """Put a real kubectl-snapshot artifact of `pod` in the registry; its reference pinned by digest."""
    layer = b"checkpoint of " + pod["metadata"]["name"].encode()
    cfg = pod_config(pod, layer=sha256_digest(layer))
    return registry.push(Reference.parse(destination), cfg, {sha256_digest(layer): layer})


def succeeded(reference: Reference | str, *, node_name: str = "n1") -> Obj:
    """A PodSnapshot status as the agent leaves it after a verified push."""
    return {
        "status": {
            "phase": K.PHASE_SUCCEEDED,
            "node": node_name,
            "stage": "done",
            "reference": str(reference),
            "message": f"pushed {reference}",
        }
    }


def failed(message: str, *, hint: str | None = None, node_name: str = "n1") -> Obj:
    return {
        "status": {
            "phase": K.PHASE_FAILED,
            "node": node_name,
            "stage": "failed",
            "message": message,
            "hint": hint,
        }
    }


def snapshot(name: str, ns: str = "default", *, pod: str = "web", status: Obj | None = None, **spec: Any) -> Obj:
    obj: Obj = {
        "apiVersion": K.API_VERSION,
        "kind": K.KIND,
        "metadata": {"name": name, "namespace": ns, "labels": {K.LABEL_POD: pod}},
        "spec": {"podName": pod, "podNamespace": ns, "destination": "registry.example/snaps:t", **spec},
    }
    obj.update(copy.deepcopy(status or {}))
    return obj


def _checks() -> None:
    """mypy checks the fakes against the ports here (and wherever a test passes them)."""
    kube: Kube = FakeKube()
    policy_kube: PolicyKube = FakeKube()
    store: ArtifactStore = FakeRegistry()
    stores: StoreFactory = FakeRegistry().store
    del kube, policy_kube, store, stores


__all__ = [
    "AGENT_IMAGE",
    "IMAGE",
    "Clock",
    "FakeKube",
    "FakeRegistry",
    "agent_daemonset",
    "agent_pod",
    "crd",
    "failed",
    "install_agent",
    "node",
    "pod_config",
    "push_pod_snapshot",
    "running_pod",
    "snapshot",
    "succeeded",
]
