"""`kubectl snapshot install|uninstall`: apply the agent's manifests (kubectl_snapshot.deploy) in order,
then wait until the CRD is Established and the DaemonSet rolled out; remove them in reverse order,
keeping the keys (`kept_key_objects`) unless asked to purge them.
"""

from __future__ import annotations

import base64
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kubectl_snapshot.app.ports import Kube, Obj
from kubectl_snapshot.core import keysecret
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import FailedPrecondition, InvalidArgument, Unavailable
from kubectl_snapshot.core.provenance import (
    TRUST_ALLOW_UNVERIFIED_FILE,
    TRUST_CLUSTER_FILE,
    TRUST_KEY_SUFFIX,
    TRUST_NAMESPACE_SUFFIX,
    TRUST_NODE_SUFFIX,
    PublicKey,
)

StepFn = Callable[[str, int, int], None]  # (what, done, total)


def render(image: str | None, settings: Mapping[str, Any]) -> list[Obj]:
    """The objects to apply, in order; `image` None means the release's default agent image."""
    try:
        from kubectl_snapshot import deploy
    except ImportError as e:
        raise FailedPrecondition(
            "this build of kubectl-snapshot has no deploy manifests (kubectl_snapshot.deploy)",
            hint="reinstall kubectl-snapshot from a release",
        ) from e
    render_fn: Callable[..., list[Obj]] = deploy.render  # type: ignore[attr-defined,unused-ignore]
    return render_fn(image or str(getattr(deploy, "DEFAULT_IMAGE", "")), **settings)


@dataclass(frozen=True)
class DryRun:
    checked: list[Obj]  # as the API server would have them (validation and admission ran)
    unchecked: list[Obj]  # as rendered: their namespace is created by this install and does not exist yet


def server_dry_run(objects: list[Obj], *, kube: Kube) -> DryRun:
    """`install --dry-run=server`: every object through the API server's validation and admission,
    none stored. The API server refuses a dry run in a namespace that does not exist (kubernetes#83562),
    and the install's own namespace exists only after a real install: on a fresh cluster the objects
    inside it are returned unchecked, said as such, rather than failing the whole dry run."""
    new_namespaces = {
        str(o["metadata"]["name"]) for o in objects if o.get("kind") == "Namespace" and kube.get_object(o) is None
    }
    inside = [o for o in objects if (o.get("metadata") or {}).get("namespace") in new_namespaces]
    checked = kube.apply([o for o in objects if o not in inside], dry_run=True)
    return DryRun(checked=checked, unchecked=inside)


def install(
    objects: list[Obj],
    *,
    kube: Kube,
    timeout_s: float = 300,
    on_step: StepFn | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    step = on_step or (lambda _w, _d, _t: None)
    total = len(objects) + 2
    for ns in (o for o in objects if o.get("kind") == "Namespace"):
        # a namespace still being deleted (an uninstall just before) takes no new objects: wait it out
        live = kube.get_object(ns)
        if live is not None and (live.get("metadata") or {}).get("deletionTimestamp"):
            step(f"wait for namespace {ns['metadata']['name']} (being deleted) to be gone", 0, total)
            _wait(
                f"namespace {ns['metadata']['name']}, being deleted, to be gone",
                functools.partial(_gone, kube, ns),
                timeout_s=timeout_s,
                sleep=sleep,
                clock=clock,
                hint=f"kubectl get namespace {ns['metadata']['name']} -o yaml (its status says what it waits for)",
            )
    for i, obj in enumerate(objects):
        step(f"apply {obj.get('kind')} {obj.get('metadata', {}).get('name')}", i, total)
        kube.apply([obj])
        if obj.get("kind") == "CustomResourceDefinition":
            _wait(
                f"CRD {obj['metadata']['name']} Established",
                functools.partial(_crd_ready, kube, str(obj["metadata"]["name"])),
                timeout_s=60,
                sleep=sleep,
                clock=clock,
            )
    for obj in (o for o in objects if o.get("kind") == "Deployment"):  # the key broker (--key-broker)
        step(f"wait for Deployment {obj['metadata']['name']} to be available", len(objects), total)
        _wait(
            f"Deployment {obj['metadata'].get('namespace')}/{obj['metadata']['name']} available",
            functools.partial(_deployment_ready, kube, obj),
            timeout_s=timeout_s,
            sleep=sleep,
            clock=clock,
            hint=f"kubectl -n {obj['metadata'].get('namespace')} describe deployment {obj['metadata']['name']}",
        )
    for i, obj in enumerate(o for o in objects if o.get("kind") == "DaemonSet"):
        step(f"wait for DaemonSet {obj['metadata']['name']} to roll out", len(objects) + i, total)
        _wait(
            f"DaemonSet {obj['metadata'].get('namespace')}/{obj['metadata']['name']} rolled out",
            functools.partial(_ds_ready, kube, obj),
            timeout_s=timeout_s,
            sleep=sleep,
            clock=clock,
            hint=f"kubectl -n {obj['metadata'].get('namespace')} get pods; kubectl snapshot doctor",
        )
    step("installed", total, total)


def runtime_pods(kube: Kube) -> list[Obj]:
    """Pods of every namespace run by the project's runtime class whose containers may still run
    (restored and resuming pods): containerd stops them through the runtime wrapper. (Pods cannot be
    listed by runtime class on the server side.)"""
    return [
        p
        for p in kube.list_pods(None)
        if (p.get("spec") or {}).get("runtimeClassName") == K.RUNTIME_CLASS
        and (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
    ]


def _namespaces_being_deleted(kube: Kube, names: set[str]) -> set[str]:
    """Those of `names` being deleted (their pods are deleted next, by the namespace controller)."""
    going = set()
    for name in sorted(names):
        ns = kube.get_object({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        if ns is None or (ns.get("metadata") or {}).get("deletionTimestamp"):
            going.add(name)
    return going


def pod_names(pods: Sequence[Obj], limit: int = 10) -> str:
    """`ns/name, ...` of at most `limit` pods, and how many more."""
    names = [f"{p['metadata'].get('namespace')}/{p['metadata'].get('name')}" for p in pods]
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def kept_key_objects() -> list[Obj]:
    """What a sealed or signed snapshot needs to restore, all in the agent's namespace: the namespace keys
    (install creates the Secret, the agents fill it), the cluster-wide signing key of earlier releases (where
    there is one), and the trust ConfigMap (every public key ever used, the nodes' among them, other
    clusters' keys, the unverified policy). Created by the agent or by `install`
    outside the rendered manifests, so re-applying them never replaces a key: a re-install uses these."""
    ns = K.AGENT_NAMESPACE
    return [
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": K.KEY_SECRET, "namespace": ns}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": K.SIGNING_KEY_SECRET, "namespace": ns}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": K.TRUST_CONFIG_MAP, "namespace": ns}},
    ]


@dataclass(frozen=True)
class Removal:
    delete: list[Obj]  # in this order
    keep: list[Obj]  # the key objects there are, and the namespace that holds them


def removal(objects: list[Obj], *, kube: Kube | None, purge_keys: bool) -> Removal:
    """What uninstall deletes and what it keeps. The keys live in the agent's namespace, which the
    objects include: deleting it would delete them, so it stays (holding only the keys and what the
    API server puts in every namespace) while any of them exists. `purge_keys` deletes them by name
    before their namespace, so they are gone even if the namespace's deletion is held up. `kube` None
    (a client dry run) supposes all the keys there, as after any install."""
    ordered = list(reversed(objects))
    keys = [o for o in kept_key_objects() if kube is None or kube.get_object(o) is not None]
    home = [o for o in ordered if o.get("kind") == "Namespace" and o["metadata"]["name"] == K.AGENT_NAMESPACE]
    if purge_keys:
        at = ordered.index(home[0]) if home else len(ordered)
        return Removal(delete=ordered[:at] + keys + ordered[at:], keep=[])
    if not keys:
        return Removal(delete=ordered, keep=[])
    return Removal(delete=[o for o in ordered if o not in home], keep=home + keys)


@dataclass(frozen=True)
class Uninstalled:
    left: list[Obj]  # pods left running under the runtime class (`force` only)
    removal: Removal


def uninstall(
    objects: list[Obj],
    *,
    kube: Kube,
    timeout_s: float = 300,
    on_step: StepFn | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    force: bool = False,
    purge_keys: bool = False,
) -> Uninstalled:
    """Undo the node installation on every node (a one-shot DaemonSet), then delete the objects but
    the keys (`removal`; `purge_keys` deletes them too).

    Not while pods of the project's runtime class may still run: containerd stops, kills and deletes
    their containers through the runtime wrapper, so once it is gone they could not be stopped until the
    agent is installed again (they would keep running, their pods stuck Terminating). Pods already
    being deleted are waited for (within `timeout_s`); others refuse the uninstall. `force` waits for
    none and refuses nothing. Returns the pods left under the runtime class (`force` only) and what
    was deleted and kept."""
    from kubectl_snapshot.deploy.agent import cleanup_daemonset

    step = on_step or (lambda _w, _d, _t: None)
    left: list[Obj] = []
    if kube.get_daemonset(K.AGENT_NAMESPACE, K.AGENT_NAME) is None:
        pass  # no hook on the nodes: nothing to wait for
    elif force:  # none waited for (a pod of a node that is down is never deleted), none refused
        left = runtime_pods(kube)
    else:
        step(f"wait for pods of runtime class {K.RUNTIME_CLASS} being deleted", 0, 3)
        deadline = clock() + timeout_s
        while pods := runtime_pods(kube):
            going_ns = _namespaces_being_deleted(kube, {str(p["metadata"].get("namespace")) for p in pods})
            staying = [
                p
                for p in pods
                if not p["metadata"].get("deletionTimestamp") and p["metadata"].get("namespace") not in going_ns
            ]
            if staying:
                raise FailedPrecondition(
                    f"{len(staying)} pod(s) run under the {K.RUNTIME_CLASS} runtime class: {pod_names(staying)}; "
                    "without the runtime wrapper their containers could not be stopped or deleted",
                    hint="delete them first (for a protected workload: delete the SnapshotPolicy that resumes it "
                    "or set its resume to false, then `kubectl rollout restart` it), "
                    "or pass --force to leave them running",
                )
            if clock() > deadline:
                raise Unavailable(
                    f"timed out after {timeout_s:.0f}s waiting for pods of the {K.RUNTIME_CLASS} runtime class "
                    f"to be deleted: {pod_names(pods)}",
                    hint="kubectl get pods -A -o wide (a pod of a node that is down is never deleted: --force "
                    "uninstalls without waiting); the agent stays installed until they are gone",
                    retryable=False,
                )
            sleep(1.0)
    live = kube.get_daemonset(K.AGENT_NAMESPACE, K.AGENT_NAME)
    if live is not None:
        cleanup = cleanup_daemonset(live)
        step("remove the runtime wrapper from every node", 1, 3)
        kube.apply([cleanup])
        try:
            _wait(
                "the runtime wrapper removed from every node",
                functools.partial(_ds_ready, kube, cleanup),
                timeout_s=timeout_s,
                sleep=sleep,
                clock=clock,
                hint=f"kubectl -n {K.AGENT_NAMESPACE} logs ds/{cleanup['metadata']['name']} -c install-node",
            )
        finally:
            kube.delete_objects([cleanup])
    step("delete the objects", 2, 3)
    plan = removal(objects, kube=kube, purge_keys=purge_keys)
    kube.delete_objects(plan.delete)
    return Uninstalled(left=left, removal=plan)


def _wait(
    what: str,
    ready: Callable[[], bool],
    *,
    timeout_s: float,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
    hint: str | None = None,
) -> None:
    deadline = clock() + timeout_s
    while not ready():
        if clock() > deadline:
            raise Unavailable(f"timed out after {timeout_s:.0f}s waiting for {what}", hint=hint, retryable=False)
        sleep(1.0)


def _gone(kube: Kube, obj: Obj) -> bool:
    return kube.get_object(obj) is None


def _crd_ready(kube: Kube, name: str) -> bool:
    return _crd_established(kube.get_crd(name))


def _ds_ready(kube: Kube, obj: Obj) -> bool:
    return _rolled_out(kube.get_object(obj))


def _deployment_ready(kube: Kube, obj: Obj) -> bool:
    live = kube.get_object(obj) or {}
    meta, spec, st = live.get("metadata") or {}, live.get("spec") or {}, live.get("status") or {}
    if not live or int(st.get("observedGeneration") or 0) < int(meta.get("generation") or 0):
        return False
    want = int(spec.get("replicas", 1))
    return int(st.get("updatedReplicas") or 0) >= want and int(st.get("availableReplicas") or 0) >= want


def _crd_established(crd: Obj | None) -> bool:
    for cond in ((crd or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Established" and cond.get("status") == "True":
            return True
    return False


def _rolled_out(ds: Obj | None) -> bool:
    """Like `kubectl rollout status`: the controller saw this generation and every pod is updated and ready."""
    if not ds:
        return False
    meta, spec, st = ds.get("metadata") or {}, ds.get("spec") or {}, ds.get("status") or {}
    if int(st.get("observedGeneration") or 0) < int(meta.get("generation") or 0):
        return False
    desired = int(st.get("desiredNumberScheduled") or 0)
    strategy = (spec.get("updateStrategy") or {}).get("type", "RollingUpdate")
    updated = int(st.get("updatedNumberScheduled") or 0)
    available = int(st.get("numberAvailable") or 0)
    return desired > 0 and available >= desired and (strategy != "RollingUpdate" or updated >= desired)


def key_objects(kube: Kube) -> list[Obj]:
    """The namespace-key Secret to create: an empty one when it is absent, else nothing (its entries are
    the only copy of every namespace's key; the agents add them and may not create the Secret)."""
    secret = keysecret.key_secret({})
    return [] if kube.get_object(secret) is not None else [secret]


def trust_objects(
    kube: Kube,
    *,
    trust_keys: Sequence[bytes] = (),
    importer_keys: Sequence[tuple[str, bytes]] = (),
    allow_unverified: bool | None = None,
    labels: Mapping[str, str] | None = None,
) -> list[Obj]:
    """The trust ConfigMap to apply: every entry there is kept, so the keys the agents registered for
    their nodes (`<key id>.pub` + `<key id>.node`) stay trusted across installs, and so does the
    cluster-wide key agents signed with before they had their own (its `.pub`; the Secret
    kubectl-snapshot-signing-key holding its private half is neither made nor changed any more, and an
    entry an administrator removed is not put back).

    `trust_keys` adds other clusters' public keys (PEM), not bound to a node; `importer_keys` adds
    (namespace, PEM) pairs: an importer's key, trusted for that namespace's origins only; `allow_unverified`
    (None: keep) is the policy for snapshots no trusted key signed. No private key is made: each agent
    makes its node's own (shim/service/nodekey.py).
    """
    labels = dict(labels or {"app.kubernetes.io/part-of": "kubectl-snapshot"})
    cm_ref: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": K.TRUST_CONFIG_MAP, "namespace": K.AGENT_NAMESPACE},
    }
    live_cm = kube.get_object(cm_ref) or {}
    data = {k: v for k, v in (live_cm.get("data") or {}).items() if isinstance(v, str)}
    for extra in trust_keys:
        pub = PublicKey.from_pem(extra)
        data[f"{pub.id}{TRUST_KEY_SUFFIX}"] = pub.to_pem().decode()
    for namespace, pem in importer_keys:
        pub = PublicKey.from_pem(pem)
        if data.get(f"{pub.id}{TRUST_NODE_SUFFIX}"):
            raise InvalidArgument(
                f"key {pub.id} is node {data[f'{pub.id}{TRUST_NODE_SUFFIX}']}'s signing key, not an importer's",
                hint="an importer signs with a key of its own (ks-agent import --signing-key)",
            )
        data[f"{pub.id}{TRUST_KEY_SUFFIX}"] = pub.to_pem().decode()
        data[f"{pub.id}{TRUST_NAMESPACE_SUFFIX}"] = namespace
    kube_system = kube.get_object({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kube-system"}})
    data[TRUST_CLUSTER_FILE] = str(((kube_system or {}).get("metadata") or {}).get("uid") or "")
    if allow_unverified is not None:
        data[TRUST_ALLOW_UNVERIFIED_FILE] = "true" if allow_unverified else "false"
    data.setdefault(TRUST_ALLOW_UNVERIFIED_FILE, "false")
    return [{**cm_ref, "metadata": {**cm_ref["metadata"], "labels": labels}, "data": data}]


# --- the key broker (install's default but on host-network; kubectl_snapshot/deploy/keybroker.py) ---------

NO_BROKER_NOTE = (
    "note: every node's agent can read every namespace's key (--host-network installs go without the key "
    "broker unless asked: it runs as one replica there, which a node's loss takes away for a while); "
    "--key-broker with --key-broker-url https://127.0.0.1:PORT where Services are not routed keeps them behind "
    'it (docs/security.md, "Namespace keys released per node")'
)


def key_broker_default(asked: bool | None, *, host_network: bool, url: str | None) -> bool:
    """Whether an install keeps the namespace keys behind the key broker: as asked (--key-broker or
    --no-key-broker), else where a URL for it is given or the agents are not on the nodes' network. On a
    host-network install the broker is one replica (a second would find its port taken where nodes share
    a network), so a node's loss would stop every sealed save and restore until it is rescheduled: there
    it is the operator's choice."""
    if asked is not None:
        return asked
    return bool(url) or not host_network


def _ref(kind: str, name: str) -> Obj:
    return {"apiVersion": "v1", "kind": kind, "metadata": {"name": name, "namespace": K.AGENT_NAMESPACE}}


def key_broker_tls_refs() -> list[Obj]:
    """The broker's TLS Secret and the agents' copy of its certificate (made by install, not rendered)."""
    return [_ref("Secret", K.KEY_BROKER_TLS_SECRET), _ref("ConfigMap", K.KEY_BROKER_CA_CONFIG_MAP)]


def key_broker_tls_names() -> list[str]:
    """The names the broker's certificate is valid for: its Service's, and loopback for host-network
    clusters without kube-proxy (`--key-broker-url https://127.0.0.1:PORT`)."""
    svc = f"{K.KEY_BROKER_NAME}.{K.AGENT_NAMESPACE}"
    return [f"{svc}.svc", K.KEY_BROKER_NAME, svc, f"{svc}.svc.cluster.local", "127.0.0.1"]


def key_broker_tls_objects(
    kube: Kube, *, names: Sequence[str] | None = None, labels: Mapping[str, str] | None = None
) -> list[Obj]:
    """The broker's serving certificate: made once (a Secret of type kubernetes.io/tls, which only the
    broker mounts) and its certificate in a ConfigMap the agents mount and pin; a re-install keeps the
    live certificate (the ConfigMap is written again from it)."""
    import datetime

    from kubectl_snapshot.core.servingcert import serving_cert

    labels = dict(labels or {"app.kubernetes.io/part-of": "kubectl-snapshot"})
    secret_ref, cm_ref = key_broker_tls_refs()
    live = kube.get_object(secret_ref)
    out: list[Obj] = []
    cert_b64 = str(((live or {}).get("data") or {}).get("tls.crt") or "")
    if not cert_b64:
        cert, key = serving_cert(names or key_broker_tls_names(), now=datetime.datetime.now(datetime.UTC))
        cert_b64 = base64.b64encode(cert).decode()
        out.append(
            {
                **secret_ref,
                "metadata": {**secret_ref["metadata"], "labels": dict(labels)},
                "type": "kubernetes.io/tls",
                "data": {"tls.crt": cert_b64, "tls.key": base64.b64encode(key).decode()},
            }
        )
    cert_pem = base64.b64decode(cert_b64).decode()
    out.append({**cm_ref, "metadata": {**cm_ref["metadata"], "labels": dict(labels)}, "data": {"ca.crt": cert_pem}})
    return out


def _id(o: Obj) -> tuple[str, str, str]:
    return (str(o.get("kind")), str(o["metadata"].get("namespace") or ""), str(o["metadata"]["name"]))


def other_mode_objects(image: str | None, settings: Mapping[str, Any], *, key_broker: bool) -> list[Obj]:
    """What an install in the other key mode has that this one has not (an install switching modes deletes
    them if there: the broker and its certificate, or the agents' Role on the key Secret)."""
    plain = {k: v for k, v in settings.items() if k not in ("key_broker", "key_broker_url")}
    with_broker = {**plain, "key_broker": True, "key_broker_url": settings.get("key_broker_url")}
    mine = render(image, with_broker if key_broker else plain)
    other = render(image, plain if key_broker else with_broker)
    ids = {_id(o) for o in mine}
    extra = [o for o in other if _id(o) not in ids]
    return extra + ([] if key_broker else key_broker_tls_refs())


def all_mode_objects(image: str | None, settings: Mapping[str, Any]) -> list[Obj]:
    """What uninstall deletes: the objects of either key mode (the broker's before the DaemonSet)."""
    base = render(image, settings)
    extra = other_mode_objects(image, settings, key_broker=False)
    home = [i for i, o in enumerate(base) if o.get("kind") == "Namespace"]
    at = home[0] + 1 if home else 0
    tls = key_broker_tls_refs()
    broker = [o for o in extra if o not in tls]
    return base[:at] + tls + base[at:-1] + broker + base[-1:]
