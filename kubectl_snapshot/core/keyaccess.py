"""Who gets which namespace key from the key broker (docs/security.md, "Namespace keys released per node").

Pure: the broker (shim/service/keybroker.py) asks the API server and hands the answers here. An agent
presents its pod's bound service-account token issued for `AUDIENCE`; the TokenReview says whose token
it is and, for a token bound to a pod, the node that pod runs on (the ``extra`` entry `NODE_EXTRA`). A
request names a namespace, one pod of it (name and uid) and what the key is for:

- ``save`` (operations ``key``, ``wrap``, ``mac``; ``key`` may create the namespace's key on first use):
  the pod runs on the caller's node, in that namespace;
- ``restore`` (operations ``key``, ``open``, ``unwrap``): the pod is scheduled on the caller's node, is a
  restore pod (its ``restore-from`` annotation names the snapshot) or a resuming pod (a PodSnapshot of
  its namespace is claimed by it), and the snapshot asked for is exactly that one (registry, repository
  and digest). ``open`` hands the broker that snapshot's manifest and config: they must be the ones its
  digest names (`opened_keys`), and ``unwrap`` then opens only the data keys that config lists, each for
  the blob it names (`may_unwrap`): what a restore pod on a node lets that node open is that snapshot,
  not whatever wrapped keys of the namespace the node sends. A restore into another namespace (the
  pod's, `pod_namespace`) of a snapshot sealed for this one is answered only where a SnapshotGrant of
  the sealing namespace lets the pod's namespace restore that repository (as the agent checks it:
  core/provenance.check_namespace).

So a stolen agent token opens the keys of the namespaces with a pod on its node only, only for that
pod's own save or restore, and only while the pod is there. Everything else is refused with a reason.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import InvalidArgument, PermissionDenied, SnapshotError
from kubectl_snapshot.core.model import parse_config
from kubectl_snapshot.core.oci import parse_manifest, sha256_digest
from kubectl_snapshot.core.provenance import Grant, check_namespace
from kubectl_snapshot.core.reference import Reference
from kubectl_snapshot.core.sealing import wrapped_blob

AUDIENCE = K.KEY_BROKER_AUDIENCE
NODE_EXTRA = "authentication.kubernetes.io/node-name"
PURPOSES: Mapping[str, frozenset[str]] = {
    "save": frozenset({"key", "wrap", "mac"}),
    "restore": frozenset({"key", "open", "unwrap"}),
}
MAX_MACS = 256  # one `mac` request's list
MAX_ITEMS = 128  # one `wrap` or `unwrap` request's list of items (each ~300 bytes of JSON)
FINISHED = ("Succeeded", "Failed")


@dataclass(frozen=True)
class Caller:
    """An agent, as the TokenReview says: its user and the node its pod is bound to."""

    user: str
    node: str


@dataclass(frozen=True)
class KeyRequest:
    purpose: str  # save | restore
    op: str  # key | wrap | unwrap | mac
    namespace: str  # the key's
    pod_name: str
    pod_uid: str
    snapshot: str = ""  # restore: REGISTRY/REPOSITORY@sha256:... being opened
    create: bool = False  # op key, purpose save: make the namespace's key on first use
    pod_namespace: str = ""  # the pod's, when not the key's (a granted restore into another namespace)

    @property
    def pod_ns(self) -> str:
        return self.pod_namespace or self.namespace


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    reason: str


def _refuse(reason: str) -> Verdict:
    return Verdict(False, reason)


def caller_of(review: Mapping[str, Any], *, agent_user: str = K.AGENT_USER) -> Caller | Verdict:
    """The caller a TokenReview's answer names, or the refusal (not authenticated, another audience,
    not the agent's ServiceAccount, a token bound to no node)."""
    status = review.get("status") or {}
    if not status.get("authenticated"):
        return _refuse(f"the token is not valid: {status.get('error') or 'not authenticated'}")
    if AUDIENCE not in (status.get("audiences") or []):
        return _refuse(f"the token was not issued for audience {AUDIENCE}")
    user = status.get("user") or {}
    name = str(user.get("username") or "")
    if name != agent_user:
        return _refuse(f"{name or 'the caller'} is not the agent's ServiceAccount ({agent_user})")
    nodes = (user.get("extra") or {}).get(NODE_EXTRA) or []
    if not isinstance(nodes, list) or len(nodes) != 1 or not str(nodes[0]):
        return _refuse("the token is not bound to a pod on a node (use the agent pod's projected token)")
    return Caller(user=name, node=str(nodes[0]))


def check_request(req: KeyRequest) -> KeyRequest:
    """Raise InvalidArgument for a request no agent sends (unknown purpose or operation, no pod)."""
    ops = PURPOSES.get(req.purpose)
    if ops is None:
        raise InvalidArgument(f"unknown purpose {req.purpose!r} (save or restore)")
    if req.op not in ops:
        raise InvalidArgument(f"operation {req.op!r} is not part of a {req.purpose}")
    if not (req.namespace and req.pod_name and req.pod_uid):
        raise InvalidArgument("a key request names the namespace, name and uid of its pod")
    if req.create and (req.purpose != "save" or req.op != "key"):
        raise InvalidArgument("only a save's key request may create the namespace's key")
    if req.purpose == "save" and req.pod_ns != req.namespace:
        raise InvalidArgument("a save is sealed with its own pod's namespace key")
    if req.purpose == "restore":
        snapshot_of(req.snapshot)
    return req


def snapshot_of(text: str) -> Reference:
    ref = Reference.parse(text, default_tag=None) if text else None
    if ref is None or ref.digest is None:
        raise InvalidArgument(f"a restore's key request names its snapshot by digest, got {text!r}")
    return ref


def decide(
    caller: Caller,
    req: KeyRequest,
    pod: Mapping[str, Any] | None,
    claimed: Iterable[Mapping[str, Any]] = (),
    grants: Iterable[Grant] = (),
) -> Verdict:
    """Whether `caller` may have `req` answered. `pod`: the pod read from the API server by the request's
    pod namespace and name (None: there is none); `claimed`: PodSnapshots of the pod's namespace (only a
    resuming pod's restore reads them); `grants`: the SnapshotGrants of the key's namespace (only a
    restore into another namespace reads them)."""
    where = f"{req.pod_ns}/{req.pod_name}"
    if pod is None:
        return _refuse(f"pod {where} does not exist")
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    if str(meta.get("uid") or "") != req.pod_uid or str(meta.get("namespace") or "") != req.pod_ns:
        return _refuse(f"pod {where} is not the pod {req.pod_uid} the request names (deleted and made again?)")
    node = str(spec.get("nodeName") or "")
    if node != caller.node:
        return _refuse(f"pod {where} is on node {node or '(none yet)'}, not on the caller's node {caller.node}")
    phase = str((pod.get("status") or {}).get("phase") or "")
    if phase in FINISHED:
        return _refuse(f"pod {where} has ended ({phase})")
    if req.purpose == "save":
        if phase != "Running":
            return _refuse(f"pod {where} is not running ({phase or 'no phase'}): there is nothing to save")
        return Verdict(True, f"save of pod {where} on node {caller.node}")
    verdict = _restore(caller, req, meta, claimed)
    if not verdict.allowed or req.pod_ns == req.namespace:
        return verdict
    try:  # a snapshot sealed for the key's namespace, restored into the pod's: granted by the former
        granted = check_namespace(req.namespace, req.pod_ns, snapshot_of(req.snapshot).name, grants)
    except PermissionDenied as e:
        return _refuse(e.message)
    return Verdict(True, f"{verdict.reason} ({granted})")


def _restore(caller: Caller, req: KeyRequest, meta: Mapping[str, Any], claimed: Iterable[Mapping[str, Any]]) -> Verdict:
    where = f"{req.pod_ns}/{req.pod_name}"
    asked = snapshot_of(req.snapshot)
    annotations = meta.get("annotations") or {}
    source = str(annotations.get(K.ANN_RESTORE_FROM) or "")
    if source:
        try:
            named = Reference.parse(source, default_tag=None)
        except InvalidArgument:
            return _refuse(f"pod {where} names no valid snapshot to restore")
        if _same(named, asked):
            return Verdict(True, f"restore of {asked.digest} into pod {where} on node {caller.node}")
        return _refuse(f"pod {where} restores {source}, not {req.snapshot}")
    if annotations.get(K.ANN_RESUME_POLICY):
        for save in claimed:
            smeta = save.get("metadata") or {}
            if (smeta.get("annotations") or {}).get(K.ANN_CLAIMED_BY) != req.pod_uid:
                continue
            if smeta.get("namespace") not in (None, req.pod_ns):
                continue
            ref = str((save.get("status") or {}).get("reference") or "")
            try:
                if ref and _same(Reference.parse(ref, default_tag=None), asked):
                    return Verdict(True, f"resume of pod {where} from {smeta.get('name')} on node {caller.node}")
            except InvalidArgument:
                continue
        return _refuse(f"pod {where} resumes from no save of {req.snapshot} (no PodSnapshot claimed by it names it)")
    return _refuse(f"pod {where} is not a restore: it names no snapshot to restore from")


def _same(named: Reference, asked: Reference) -> bool:
    """The pod's snapshot is the one asked for: same registry and repository, and the digest when the pod
    names one (a tag was resolved by the agent to the digest it asks for)."""
    if (named.registry, named.repository) != (asked.registry, asked.repository):
        return False
    return named.digest is None or named.digest == asked.digest


def opened_keys(asked: Reference, namespace: str, manifest: bytes, config: bytes) -> dict[str, str]:
    """The wrapped data keys (blob digest -> base64) of the snapshot `asked` names by digest, from its
    manifest and config as an agent sends them with ``open``: the manifest must be the one that digest
    names, the config the one the manifest names, sealed with `namespace`'s key (InvalidArgument otherwise)."""
    if asked.digest is None or sha256_digest(manifest) != asked.digest:
        raise InvalidArgument(f"the manifest sent is not the one {asked} names")
    try:
        named = parse_manifest(manifest).config.digest
        if sha256_digest(config) != named:
            raise InvalidArgument(f"the config sent is not the one the manifest of {asked} names ({named})")
        encryption = parse_config(config).encryption
    except InvalidArgument:
        raise
    except SnapshotError as e:  # its digest matched: a snapshot this build cannot read
        raise InvalidArgument(f"{asked}: {e.message}") from None
    if encryption is None:
        raise InvalidArgument(f"{asked} is not sealed: it has no data keys to open")
    if encryption.namespace != namespace:
        raise InvalidArgument(f"{asked} is sealed for namespace {encryption.namespace!r}, not {namespace!r}")
    return dict(encryption.keys)


def items_of(body: Mapping[str, Any], fields: tuple[str, str]) -> list[tuple[bytes, bytes]] | None:
    """A ``wrap`` or ``unwrap`` request's list of items (`fields`: ("dek", "aad") or ("wrapped", "aad")),
    decoded; None for a request of one (the fields at the top). InvalidArgument when malformed."""
    items = body.get("items")
    if items is None:
        return None
    if not isinstance(items, list) or not 0 < len(items) <= MAX_ITEMS:
        raise InvalidArgument(f"items is a list of 1 to {MAX_ITEMS} objects")
    out: list[tuple[bytes, bytes]] = []
    for item in items:
        if not isinstance(item, dict) or not all(isinstance(item.get(f), str) for f in fields):
            raise InvalidArgument(f"each item has {' and '.join(fields)} as base64 strings")
        try:
            out.append(
                (base64.b64decode(item[fields[0]], validate=True), base64.b64decode(item[fields[1]], validate=True))
            )
        except ValueError:
            raise InvalidArgument(f"an item's {' or '.join(fields)} is not base64") from None
    return out


def may_unwrap(keys: Mapping[str, str], namespace: str, wrapped_b64: str, aad: bytes) -> Verdict:
    """Whether an ``unwrap`` of `wrapped_b64` with `aad` is one of the opened snapshot's own (`keys`): the
    AAD names a blob of `namespace` that the snapshot lists, with exactly that wrapped key."""
    blob = wrapped_blob(aad)
    if blob is None or blob[0] != namespace:
        return _refuse(f"the unwrap names no blob of namespace {namespace}")
    if keys.get(blob[1]) != wrapped_b64:
        return _refuse(f"blob {blob[1]} with this wrapped key is not in the snapshot opened for this restore")
    return Verdict(True, f"the data key of blob {blob[1]}")


# --- the wire format (one JSON object each way; bytes in base64) ---------------------------------------

PATH = "/v1/keys"
MAX_REQUEST_BYTES = 64 * 1024  # a mac list of MAX_MACS seeds of ~60 bytes, in base64, fits many times
# an ``open`` (a snapshot's manifest and config, base64): read only once its token is known to be an agent's
MAX_OPEN_BYTES = 24 << 20


def request_body(req: KeyRequest, **payload: Any) -> dict[str, Any]:
    """The JSON an agent sends: the request and the operation's payload (keyId, dek, aad, wrapped, data)."""
    return {
        "purpose": req.purpose,
        "op": req.op,
        "namespace": req.namespace,
        "pod": {"name": req.pod_name, "uid": req.pod_uid, **_pod_namespace(req)},
        "snapshot": req.snapshot,
        "create": req.create,
        **payload,
    }


def _pod_namespace(req: KeyRequest) -> dict[str, str]:
    return {"namespace": req.pod_namespace} if req.pod_namespace else {}


def parse_request(body: Any) -> KeyRequest:
    """The request in a JSON body, checked (InvalidArgument otherwise)."""
    if not isinstance(body, dict) or not isinstance(body.get("pod"), dict):
        raise InvalidArgument("a key request is a JSON object with a pod")
    fields = {k: body.get(k) for k in ("purpose", "op", "namespace", "snapshot")}
    pod = body["pod"]
    values = [*fields.values(), pod.get("name"), pod.get("uid"), pod.get("namespace")]
    if not all(v is None or isinstance(v, str) for v in values) or not isinstance(body.get("create", False), bool):
        raise InvalidArgument("a key request's fields are strings (create: a boolean)")
    return check_request(
        KeyRequest(
            purpose=fields["purpose"] or "",
            op=fields["op"] or "",
            namespace=fields["namespace"] or "",
            pod_name=str(pod.get("name") or ""),
            pod_uid=str(pod.get("uid") or ""),
            snapshot=fields["snapshot"] or "",
            create=bool(body.get("create", False)),
            pod_namespace=str(pod.get("namespace") or ""),
        )
    )
