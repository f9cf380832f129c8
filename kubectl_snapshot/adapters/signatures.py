"""Sign a pushed snapshot and verify one, with the signatures where cosign keeps them; keys and trust on disk.

Shared by the agent (signs beside the push, before the tag; verifies before it downloads any layer) and the plugin
(`inspect` shows the verdict). The rules are in `core.provenance`; this module only moves bytes
(the registry is a port; key and trust files are read from the paths given).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core import timestamps
from kubectl_snapshot.core.artifact import Artifact, load_artifact
from kubectl_snapshot.core.errors import FailedPrecondition, InvalidArgument, NotFound, SnapshotError
from kubectl_snapshot.core.model import SnapshotConfig
from kubectl_snapshot.core.oci import parse_manifest
from kubectl_snapshot.core.provenance import (
    ANN_COSIGN_SIGNATURE,
    MAX_PAYLOAD_BYTES,
    MAX_SIGNATURES,
    SIGNING_KEY_FILE,
    SIMPLE_SIGNING_MEDIA_TYPE,
    TRUST_ALLOW_UNVERIFIED_FILE,
    TRUST_CLUSTER_FILE,
    TRUST_KEY_SUFFIX,
    TRUST_NAMESPACE_SUFFIX,
    TRUST_NODE_SUFFIX,
    TRUST_NOT_AFTER_SUFFIX,
    Grant,
    Origin,
    Provenance,
    PublicKey,
    SignatureCandidate,
    SigningKey,
    TrustPolicy,
    Verdict,
    check_claim_matches,
    check_namespace,
    evaluate,
    require_trusted,
    signature_manifest,
    signature_tag,
    simple_signing_payload,
)
from kubectl_snapshot.core.reference import Reference


class SignatureReader(Protocol):
    def get_manifest(self, ref: Reference, *, max_size: int = ...) -> tuple[bytes, str, str]: ...
    def read_blob(self, ref: Reference, digest: str, *, max_size: int = ...) -> bytes: ...


class SignatureWriter(Protocol):
    def push_blob(
        self,
        ref: Reference,
        *,
        digest: str,
        size: int,
        path: str | None = None,
        data: bytes | None = None,
        fresh: bool = False,
    ) -> bool: ...
    def push_manifest(self, ref: Reference, manifest: bytes, media_type: str) -> str: ...


@dataclass(frozen=True)
class PendingSignature:
    """A `.sig` image whose blobs are in the registry and whose tag is not (publish_signature)."""

    tag: Reference
    manifest: bytes


def push_signature_blobs(
    registry: SignatureWriter, ref: Reference, origin: Origin, key: SigningKey
) -> PendingSignature:
    """Sign `ref` (pinned by digest: its manifest need not be pushed yet) and upload the `.sig` image's two
    blobs side by side; nothing is tagged. A checkpoint does this beside its own config, before its tag."""
    if not ref.digest:
        raise InvalidArgument(f"{ref}: only a snapshot pinned by digest can be signed")
    payload = simple_signing_payload(ref.name, ref.digest, origin, key.public.id)
    sig = signature_manifest([(payload, key.sign(payload))])
    tag = Reference(ref.registry, ref.repository, tag=signature_tag(ref.digest))
    # both name this digest (the payload; the config lists the payload's): nothing sent them before (at worst
    # one is sent again), so no lookups
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="sig-config") as pool:
        config = pool.submit(
            registry.push_blob,
            tag,
            digest=sig.manifest.config.digest,
            size=len(sig.config),
            data=sig.config,
            fresh=True,
        )
        registry.push_blob(tag, digest=sig.manifest.layers[0].digest, size=len(payload), data=payload, fresh=True)
        config.result()
    return PendingSignature(tag, sig.manifest.to_bytes())


def publish_signature(registry: SignatureWriter, pending: PendingSignature) -> Reference:
    """Tag the `.sig` image (its blobs pushed by push_signature_blobs); returns the tag's reference."""
    registry.push_manifest(pending.tag, pending.manifest, C.OCI_MANIFEST)
    return pending.tag


def sign_snapshot(registry: SignatureWriter, ref: Reference, origin: Origin, key: SigningKey) -> Reference:
    """Push the `.sig` image for ref (pinned by digest); returns the signature's tag reference."""
    return publish_signature(registry, push_signature_blobs(registry, ref, origin, key))


def read_signatures(registry: SignatureReader, ref: Reference) -> list[SignatureCandidate]:
    """The simple-signing layers of ref's `.sig` manifest (none: unsigned). Payloads digest-verified."""
    if not ref.digest:
        raise InvalidArgument(f"{ref}: signatures are looked up by digest")
    tag = Reference(ref.registry, ref.repository, tag=signature_tag(ref.digest))
    try:
        body, _mt, _d = registry.get_manifest(tag, max_size=256 << 10)
    except NotFound:
        return []
    manifest = parse_manifest(body)
    out = []
    for layer in manifest.layers[:MAX_SIGNATURES]:
        sig = layer.annotations.get(ANN_COSIGN_SIGNATURE)
        if layer.media_type != SIMPLE_SIGNING_MEDIA_TYPE or not sig or layer.size > MAX_PAYLOAD_BYTES:
            continue
        payload = registry.read_blob(tag, layer.digest, max_size=MAX_PAYLOAD_BYTES)
        out.append(SignatureCandidate(payload, sig))
    return out


def load_signed(registry: SignatureReader, ref: Reference) -> tuple[Artifact, list[SignatureCandidate]]:
    """The artifact (core.artifact.load_artifact) and its signatures, read while the config downloads:
    a restore's round trips before its first layer are the manifest's, then the config's and the
    signature's side by side. Nothing is trusted here: verify_for_restore judges them."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="signatures") as pool:
        pending: list[Future[list[SignatureCandidate]]] = []

        def look_up(pinned: Reference) -> None:
            pending.append(pool.submit(read_signatures, registry, pinned))

        artifact = load_artifact(registry, ref, on_pinned=look_up)
        return artifact, pending[0].result()


def verify_snapshot(
    registry: SignatureReader,
    ref: Reference,
    policy: TrustPolicy,
    signatures: Sequence[SignatureCandidate] | None = None,
) -> Verdict:
    """Whether a trusted key signed exactly ref's digest (never raises for an untrusted signature);
    `signatures`: ref's, already read (load_signed), else they are read here."""
    found = read_signatures(registry, ref) if signatures is None else list(signatures)
    return evaluate(found, ref.digest or "", policy)


# --- keys on disk (the agent's mounted trust ConfigMap, or a node operator's files) ------------------


def load_signing_key(path: str) -> SigningKey:
    """The signing key in `path` (a file, or a directory holding signing.key)."""
    file = os.path.join(path, SIGNING_KEY_FILE) if os.path.isdir(path) else path
    try:
        with open(file, "rb") as f:
            return SigningKey.from_pem(f.read(), where=file)
    except FileNotFoundError:
        raise FailedPrecondition(
            f"no snapshot signing key at {file}",
            hint="give an ECDSA P-256 private key in PEM (a node agent's own is <state root>/NODE/signing/node.key)",
        ) from None


def load_trust(paths: list[str], *, allow_unverified: bool = False) -> TrustPolicy:
    """Trusted public keys from PEM files, or directories of `*.pub` (+ the ConfigMap's settings)."""
    policies = []
    for p in paths:
        if os.path.isdir(p):
            policies.append(trust_from_data(_read_dir(p), where=p))
        elif os.path.exists(p):
            with open(p, "rb") as f:
                policies.append(TrustPolicy((PublicKey.from_pem(f.read(), where=p),)))
        else:
            raise FailedPrecondition(f"trusted key {p} does not exist")
    return merge_trust(policies, allow_unverified=allow_unverified)


def trust_from_data(data: Mapping[str, str], *, where: str = "the trust ConfigMap") -> TrustPolicy:
    """The trust ConfigMap's data (or its mounted files): `<id>.pub` keys, each bound to the node named
    by `<id>.node` or the namespace named by `<id>.namespace` when there is one, cluster-id, the policy.

    A `.pub` entry whose name is not its own key's id is ignored: the agents may add entries (admission
    lets each add only its own node's), and CEL cannot hash a PEM, so this is where an entry that would
    shadow or rebind another key (another node's PEM under a new name) is dropped; so is a node's entry
    that is no public key at all (an administrator's is an error, said as such)."""
    keys = []
    nodes: dict[str, str] = {}
    namespaces: dict[str, str] = {}
    not_after: dict[str, str] = {}
    for name in sorted(data):
        if not name.endswith(TRUST_KEY_SUFFIX):
            continue
        stem = name.removesuffix(TRUST_KEY_SUFFIX)
        try:
            key = PublicKey.from_pem(data[name].encode(), where=f"{where}: {name}")
        except InvalidArgument:
            if f"{stem}{TRUST_NODE_SUFFIX}" in data:
                continue  # an agent's entry: one node cannot keep the others from reading their trust
            raise
        if stem != key.id:
            continue
        keys.append(key)
        node = data.get(f"{key.id}{TRUST_NODE_SUFFIX}", "").strip()
        if node:
            nodes[key.id] = node
        scope = data.get(f"{key.id}{TRUST_NAMESPACE_SUFFIX}", "").strip()
        if scope:
            namespaces[key.id] = scope
        retired = data.get(f"{key.id}{TRUST_NOT_AFTER_SUFFIX}")
        if retired is not None:  # an empty or malformed one retires the key altogether (provenance.evaluate)
            not_after[key.id] = retired.strip()
    return TrustPolicy(
        tuple(keys),
        allow_unverified=data.get(TRUST_ALLOW_UNVERIFIED_FILE, "").strip().lower() == "true",
        cluster=data.get(TRUST_CLUSTER_FILE, "").strip(),
        nodes=nodes,
        namespaces=namespaces,
        not_after=not_after,
    )


def merge_trust(policies: Iterable[TrustPolicy], *, allow_unverified: bool = False) -> TrustPolicy:
    keys: dict[str, PublicKey] = {}
    nodes: dict[str, str] = {}
    namespaces: dict[str, str] = {}
    not_after: dict[str, str] = {}
    cluster = ""
    for pol in policies:
        keys.update((k.id, k) for k in pol.keys)
        nodes.update(pol.nodes)
        namespaces.update(pol.namespaces)
        for kid, retired in pol.not_after.items():  # the earliest retirement any source states wins
            not_after[kid] = min(retired, not_after.get(kid, retired), key=_retirement_order)
        cluster = cluster or pol.cluster
        allow_unverified = allow_unverified or pol.allow_unverified
    return TrustPolicy(
        tuple(keys.values()),
        allow_unverified=allow_unverified,
        cluster=cluster,
        nodes=nodes,
        namespaces=namespaces,
        not_after=not_after,
    )


def _retirement_order(raw: str) -> float:
    """Malformed first (it retires the key altogether), then the earliest time."""
    parsed = timestamps.parse(raw)
    return float("-inf") if parsed is None or parsed.tzinfo is None else parsed.timestamp()


def _read_dir(path: str) -> Mapping[str, str]:
    out: dict[str, str] = {}
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if name.startswith(".") or not os.path.isfile(full):
            continue  # a mounted ConfigMap's ..data links
        try:
            with open(full) as f:
                out[name] = f.read(MAX_PAYLOAD_BYTES)
        except (OSError, UnicodeDecodeError) as e:
            raise FailedPrecondition(f"cannot read trust setting {full}: {e}") from e
    return out


def provenance_of(registry: SignatureReader, ref: Reference, policy: TrustPolicy) -> Provenance:
    try:
        return Provenance(verify_snapshot(registry, ref, policy))
    except SnapshotError as e:
        return Provenance(Verdict(False, e.message), error=f"signatures unreadable: {e.message}")


def verify_for_restore(
    registry: SignatureReader,
    ref: Reference,
    config_namespace: str,
    pod_uid: str,
    policy: TrustPolicy,
    signatures: Sequence[SignatureCandidate] | None = None,
) -> Verdict:
    """Before any layer is downloaded: a trusted signature of exactly this digest whose signed origin
    is the one the config states; or, where an administrator's policy allows it, an unverified one."""
    verdict = verify_snapshot(registry, ref, policy, signatures)
    require_trusted(verdict, policy, str(ref))
    if verdict.claim is not None:
        check_claim_matches(verdict.claim, namespace=config_namespace, pod_uid=pod_uid, what=str(ref))
    return verdict


@dataclass(frozen=True)
class Authorized:
    source_namespace: str  # the namespace the snapshot is bound to (signed, or as its config states)
    reason: str  # why the restore is allowed, for the log


def authorize_restore(
    registry: SignatureReader,
    ref: Reference,
    config: SnapshotConfig,
    target_namespace: str,
    policy: TrustPolicy,
    grants_of: Callable[[str], Iterable[Grant]],
    signatures: Sequence[SignatureCandidate] | None = None,
) -> Authorized:
    """Signature, origin and namespace binding, in that order, before any layer is downloaded.

    The source namespace is the signed one (the config must agree); a snapshot only a policy lets
    through (unverified) is bound to the namespace its config states. Raises PermissionDenied.
    """
    pod = config.pod
    config_ns = pod.namespace if pod is not None else config.namespace
    verdict = verify_for_restore(registry, ref, config_ns, pod.uid if pod is not None else "", policy, signatures)
    source = verdict.claim.origin.namespace if verdict.claim is not None else config_ns
    grants = [] if source == target_namespace else list(grants_of(source))
    allowed = check_namespace(source, target_namespace, ref.name, grants)
    return Authorized(source, f"{verdict.reason}; {allowed}")
