"""Provenance: who made a snapshot, where, and whether that claim verifies (cosign's format).

A snapshot is signed by the agent that took it with its node's own ECDSA P-256 key; a key listed
with a node (trust ConfigMap: ``<key id>.node``) vouches only for origins on that node, and one
listed with a namespace (``<key id>.namespace``: an importer's key) only for origins in that
namespace. The
signature is stored the way cosign stores one, so that `cosign verify --key` accepts it:

* the payload is a "simple signing" JSON document naming the manifest digest
  (``critical.image.docker-manifest-digest``) plus our origin claims in ``optional``;
* the signature is ECDSA over SHA-256 of the payload bytes, DER-encoded, base64 in the layer
  annotation ``dev.cosignproject.cosign/signature``;
* the payload is the one layer (media type ``application/vnd.dev.cosign.simplesigning.v1+json``) of
  an OCI image manifest tagged ``sha256-<hex>.sig`` in the snapshot's repository (works on
  registries without the referrers API).

Everything read back is untrusted: the payload is parsed only after its signature verified with a
trusted key, and then must name exactly the digest being restored (no replay onto another digest)
and agree with the snapshot config it vouches for. Pure: cryptography computes, nothing does I/O.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric import ec

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import timestamps
from kubectl_snapshot.core.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from kubectl_snapshot.core.oci import Descriptor, Manifest, canonical_json, is_digest, sha256_digest

SIMPLE_SIGNING_MEDIA_TYPE: Final = "application/vnd.dev.cosign.simplesigning.v1+json"
ANN_COSIGN_SIGNATURE: Final = "dev.cosignproject.cosign/signature"
COSIGN_TYPE: Final = "cosign container image signature"
OCI_IMAGE_CONFIG: Final = "application/vnd.oci.image.config.v1+json"
MAX_PAYLOAD_BYTES: Final = 64 << 10
MAX_SIGNATURES: Final = 16  # layers of one .sig manifest looked at (re-signing appends)

# keys of the payload's "optional" object (flat strings, so `cosign verify -a namespace=NS` works)
OPT_CLUSTER: Final = "io.kubectl-snapshot.cluster"
OPT_NAMESPACE: Final = "io.kubectl-snapshot.namespace"
OPT_POD: Final = "io.kubectl-snapshot.pod"
OPT_POD_UID: Final = "io.kubectl-snapshot.pod-uid"
OPT_NODE: Final = "io.kubectl-snapshot.node"
OPT_CREATED: Final = "io.kubectl-snapshot.created"
OPT_FORMAT: Final = "io.kubectl-snapshot.format-version"
OPT_KEY_ID: Final = "io.kubectl-snapshot.key-id"
OPT_IMPORTED: Final = "io.kubectl-snapshot.imported"  # "true": an importer's checkpoint, never an agent's save

# Files of the trust ConfigMap / directory (the agent mounts the ConfigMap; node-level use points at a dir)
TRUST_CLUSTER_FILE: Final = "cluster-id"
TRUST_ALLOW_UNVERIFIED_FILE: Final = "allow-unverified-snapshots"
TRUST_KEY_SUFFIX: Final = ".pub"
TRUST_NODE_SUFFIX: Final = ".node"  # `<key id>.node`: the node whose agent holds that key
TRUST_NAMESPACE_SUFFIX: Final = ".namespace"  # `<key id>.namespace`: the one namespace an importer's key vouches for
# `<key id>.not-after`: RFC 3339 time at which the key was retired: it vouches only for what it signed up to then
TRUST_NOT_AFTER_SUFFIX: Final = ".not-after"
SIGNING_KEY_FILE: Final = "signing.key"  # in the signing-key Secret (PKCS#8 PEM)

_UNTRUSTED_HINT = (
    "restore only snapshots this cluster's agents signed; an administrator can trust another key "
    "(kubectl snapshot install --trust-key PUB.pem) or, knowingly, unverified snapshots "
    "(kubectl snapshot install --allow-unverified-snapshots)"
)

_EXPIRED_HINT = (
    "its key was retired before it signed this snapshot: restore a snapshot signed while the key was in service, "
    f"or by a key in service; a key retired by mistake: correct its `<key id>{TRUST_NOT_AFTER_SUFFIX}` entry in "
    f"ConfigMap {K.AGENT_NAMESPACE}/{K.TRUST_CONFIG_MAP}"
)


@dataclass(frozen=True)
class Origin:
    """Where a snapshot was taken, as the signing agent states it."""

    cluster: str = ""  # the cluster's identity (uid of its kube-system namespace)
    namespace: str = ""  # Kubernetes namespace (or containerd namespace for node-level snapshots)
    pod: str = ""
    pod_uid: str = ""
    node: str = ""
    created: str = ""  # RFC 3339
    format_version: int = 0
    imported: bool = False  # a checkpoint archive of another tool, signed by its importer (docs/security.md)

    def to_optional(self, key_id: str) -> dict[str, str]:
        imported = {OPT_IMPORTED: "true"} if self.imported else {}
        return imported | {
            OPT_CLUSTER: self.cluster,
            OPT_NAMESPACE: self.namespace,
            OPT_POD: self.pod,
            OPT_POD_UID: self.pod_uid,
            OPT_NODE: self.node,
            OPT_CREATED: self.created,
            OPT_FORMAT: str(self.format_version),
            OPT_KEY_ID: key_id,
        }

    @classmethod
    def from_optional(cls, d: Mapping[str, Any]) -> Origin:
        def s(key: str) -> str:
            v = d.get(key, "")
            return v if isinstance(v, str) else ""

        fv = s(OPT_FORMAT)
        return cls(
            cluster=s(OPT_CLUSTER),
            namespace=s(OPT_NAMESPACE),
            pod=s(OPT_POD),
            pod_uid=s(OPT_POD_UID),
            node=s(OPT_NODE),
            created=s(OPT_CREATED),
            format_version=int(fv) if fv.isdigit() and len(fv) < 6 else 0,
            imported=s(OPT_IMPORTED) == "true",
        )


# --- keys ------------------------------------------------------------------------------------------


def _crypto() -> types.SimpleNamespace:
    """The cryptography modules, imported when a key is first used: the node agent always has them; the
    krew zipapp (pure Python, one file for every OS) may not, and the plugin's commands that use no key
    go without their import (docs/lazy-restore.md: the plugin's start is on a restore's path)."""
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
    except ImportError as e:  # pragma: no cover - exercised by the krew zipapp test
        raise FailedPrecondition(
            "signing and verifying snapshots needs the Python package 'cryptography', which is not installed",
            hint="pip install cryptography (the krew build of the plugin cannot bundle it), "
            "or install kubectl-snapshot with pip",
        ) from e
    return types.SimpleNamespace(InvalidSignature=InvalidSignature, hashes=hashes, serialization=serialization, ec=ec)


def key_id(public: ec.EllipticCurvePublicKey) -> str:
    """A short, stable name for a public key: sha256 of its DER SubjectPublicKeyInfo, 16 hex digits."""
    ser = _crypto().serialization
    der = public.public_bytes(ser.Encoding.DER, ser.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()[:16]


@dataclass(frozen=True)
class PublicKey:
    key: ec.EllipticCurvePublicKey
    id: str

    @classmethod
    def from_pem(cls, pem: bytes, *, where: str = "public key") -> PublicKey:
        c = _crypto()
        try:
            key = c.serialization.load_pem_public_key(pem)
        except (ValueError, TypeError) as e:
            raise InvalidArgument(f"{where} is not a PEM public key: {e}") from e
        if not isinstance(key, c.ec.EllipticCurvePublicKey) or not isinstance(key.curve, c.ec.SECP256R1):
            raise InvalidArgument(f"{where} is not an ECDSA P-256 public key", hint="snapshot keys are ECDSA P-256")
        return cls(key, key_id(key))

    def to_pem(self) -> bytes:
        ser = _crypto().serialization
        return self.key.public_bytes(ser.Encoding.PEM, ser.PublicFormat.SubjectPublicKeyInfo)

    def verifies(self, payload: bytes, signature: bytes) -> bool:
        c = _crypto()
        try:
            self.key.verify(signature, payload, c.ec.ECDSA(c.hashes.SHA256()))
        except c.InvalidSignature:
            return False
        return True


@dataclass(frozen=True)
class SigningKey:
    key: ec.EllipticCurvePrivateKey

    @classmethod
    def generate(cls) -> SigningKey:
        ec_ = _crypto().ec
        return cls(ec_.generate_private_key(ec_.SECP256R1()))

    @classmethod
    def from_pem(cls, pem: bytes, *, where: str = "signing key") -> SigningKey:
        c = _crypto()
        try:
            key = c.serialization.load_pem_private_key(pem, password=None)
        except (ValueError, TypeError) as e:
            raise InvalidArgument(f"{where} is not an unencrypted PEM private key: {e}") from e
        if not isinstance(key, c.ec.EllipticCurvePrivateKey) or not isinstance(key.curve, c.ec.SECP256R1):
            raise InvalidArgument(f"{where} is not an ECDSA P-256 private key")
        return cls(key)

    def to_pem(self) -> bytes:
        ser = _crypto().serialization
        return self.key.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8, ser.NoEncryption())

    @property
    def public(self) -> PublicKey:
        pub = self.key.public_key()
        return PublicKey(pub, key_id(pub))

    def sign(self, payload: bytes) -> bytes:
        """DER-encoded ECDSA-SHA256 signature (what cosign stores, base64, in the annotation)."""
        c = _crypto()
        return bytes(self.key.sign(payload, c.ec.ECDSA(c.hashes.SHA256())))


# --- the signed document ---------------------------------------------------------------------------


def signature_tag(digest: str) -> str:
    """cosign's tag for the signatures of `digest`: sha256:abc... -> sha256-abc....sig"""
    if not is_digest(digest):
        raise InvalidArgument(f"not a sha256 digest: {digest!r}")
    return digest.replace(":", "-") + ".sig"


def simple_signing_payload(docker_reference: str, digest: str, origin: Origin, key: str) -> bytes:
    return canonical_json(
        {
            "critical": {
                "identity": {"docker-reference": docker_reference},
                "image": {"docker-manifest-digest": digest},
                "type": COSIGN_TYPE,
            },
            "optional": origin.to_optional(key),
        }
    )


@dataclass(frozen=True)
class SignatureManifest:
    manifest: Manifest
    config: bytes
    payload: bytes


def signature_manifest(payloads: Sequence[tuple[bytes, bytes]]) -> SignatureManifest:
    """The `.sig` image: one simple-signing layer per (payload, DER signature), cosign's layout."""
    layers = [
        Descriptor(
            SIMPLE_SIGNING_MEDIA_TYPE,
            sha256_digest(payload),
            len(payload),
            {ANN_COSIGN_SIGNATURE: base64.b64encode(sig).decode()},
        )
        for payload, sig in payloads
    ]
    # the config an image tool expects: the uncompressed payloads are their own diff ids
    config = canonical_json(
        {
            "architecture": "",
            "config": {},
            "created": "0001-01-01T00:00:00Z",
            "history": [{"created": "0001-01-01T00:00:00Z"}],
            "os": "",
            "rootfs": {"type": "layers", "diff_ids": [d.digest for d in layers]},
        }
    )
    manifest = Manifest(Descriptor(OCI_IMAGE_CONFIG, sha256_digest(config), len(config)), tuple(layers))
    return SignatureManifest(manifest, config, payloads[0][0] if payloads else b"")


@dataclass(frozen=True)
class SignatureCandidate:
    """One layer of a `.sig` manifest, as read from the registry (not yet trusted)."""

    payload: bytes
    signature_b64: str


@dataclass(frozen=True)
class Claim:
    docker_reference: str
    digest: str
    origin: Origin
    key_id: str


def parse_payload(body: bytes) -> Claim:
    try:
        d = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise FailedPrecondition(f"the signed payload is not JSON: {e}") from e
    crit = d.get("critical") if isinstance(d, dict) else None
    if not isinstance(crit, dict) or crit.get("type") != COSIGN_TYPE:
        raise FailedPrecondition("the signed payload is not a cosign container image signature")
    image = crit.get("image") if isinstance(crit.get("image"), dict) else {}
    identity = crit.get("identity") if isinstance(crit.get("identity"), dict) else {}
    digest = image.get("docker-manifest-digest") if isinstance(image, dict) else None
    if not isinstance(digest, str) or not is_digest(digest):
        raise FailedPrecondition("the signed payload names no valid manifest digest")
    opt = d.get("optional") if isinstance(d.get("optional"), dict) else {}
    ref = identity.get("docker-reference") if isinstance(identity, dict) else ""
    kid = opt.get(OPT_KEY_ID, "")
    return Claim(
        docker_reference=ref if isinstance(ref, str) else "",
        digest=digest,
        origin=Origin.from_optional(opt),
        key_id=kid if isinstance(kid, str) else "",
    )


# --- trust -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrustPolicy:
    """What the cluster (or a node-level operator) trusts: public keys, and whether to accept snapshots
    that no trusted key signed (an administrator's explicit choice; off by default)."""

    keys: tuple[PublicKey, ...] = ()
    allow_unverified: bool = False
    cluster: str = ""  # this cluster's identity, for display ("signed here" vs elsewhere)
    # key id -> the node whose agent holds it: such a key verifies only origins on that node. Keys not
    # listed (an install's cluster key, another cluster's --trust-key) vouch for any origin.
    nodes: Mapping[str, str] = field(default_factory=dict)
    # key id -> the one namespace whose origins that key may vouch for (an importer's key, listed by an
    # administrator: docs/security.md, "Imported checkpoints")
    namespaces: Mapping[str, str] = field(default_factory=dict)
    # key id -> the time (RFC 3339, as an administrator wrote it) the key was retired: a signature whose signed
    # time is later does not verify; what it signed before still does (docs/security.md, "Retiring a key")
    not_after: Mapping[str, str] = field(default_factory=dict)

    def key(self, kid: str) -> PublicKey | None:
        return next((k for k in self.keys if k.id == kid), None)

    def node_of(self, kid: str) -> str:
        return self.nodes.get(kid, "")

    def namespace_of(self, kid: str) -> str:
        return self.namespaces.get(kid, "")


def node_key_entries(public: PublicKey, node: str) -> dict[str, str]:
    """The trust ConfigMap entries that register a node's key: its PEM, and the node it is bound to."""
    if not node:
        raise InvalidArgument("a node's signing key must name its node")
    return {f"{public.id}{TRUST_KEY_SUFFIX}": public.to_pem().decode(), f"{public.id}{TRUST_NODE_SUFFIX}": node}


@dataclass(frozen=True)
class Verdict:
    verified: bool
    reason: str  # why it verified or why not, one line
    claim: Claim | None = None
    key_id: str = ""
    problems: tuple[str, ...] = field(default_factory=tuple)  # per rejected signature
    key_node: str = ""  # the node the signing key is bound to ('' for a key not bound to a node)
    expired: bool = False  # a trusted key signed it, after that key's retirement (its not-after)


def evaluate(candidates: Iterable[SignatureCandidate], digest: str, policy: TrustPolicy) -> Verdict:
    """The first signature that verifies with a trusted key and names `digest`, or why none does."""
    problems: list[str] = []
    expired = False
    for i, cand in enumerate(list(candidates)[:MAX_SIGNATURES]):
        where = f"signature {i + 1}"
        try:
            sig = base64.b64decode(cand.signature_b64, validate=True)
        except (binascii.Error, ValueError):
            problems.append(f"{where}: the signature is not base64")
            continue
        signer = None
        for k in policy.keys:
            if k.verifies(cand.payload, sig):
                signer = k
                break
        if signer is None:
            claimed = _claimed_key(cand.payload)
            if claimed and policy.key(claimed) is None:
                problems.append(f"{where}: signed by key {claimed}, which this cluster does not trust")
            elif claimed:
                problems.append(f"{where}: does not verify with trusted key {claimed} (tampered signature or payload)")
            else:
                problems.append(f"{where}: does not verify with any trusted key")
            continue
        try:
            claim = parse_payload(cand.payload)
        except FailedPrecondition as e:
            problems.append(f"{where}: {e.message}")
            continue
        if claim.digest != digest:
            problems.append(
                f"{where}: is a valid signature of {claim.digest}, not of {digest} (a signature replayed onto "
                "another snapshot)"
            )
            continue
        bound = policy.node_of(signer.id)
        if bound and claim.origin.node != bound:
            # a node's key vouches for what ran on its node only: one node's credentials forge nothing elsewhere
            claimed_node = claim.origin.node or "no node"
            problems.append(
                f"{where}: signed by the key of node {bound} (key {signer.id}), but its origin names "
                f"{'node ' if claim.origin.node else ''}{claimed_node}: a node's key vouches only for snapshots "
                "taken on that node"
            )
            continue
        if bound and claim.origin.imported:
            # an agent never signs another tool's checkpoint: its key on one is a forgery or a mistake
            problems.append(
                f"{where}: signed by the key of node {bound} (key {signer.id}), but its origin is marked imported: "
                "an agent's key vouches only for the saves it took"
            )
            continue
        scope = policy.namespace_of(signer.id)
        if scope and claim.origin.namespace != scope:
            problems.append(
                f"{where}: signed by key {signer.id}, which is trusted for namespace {scope} only, but its origin "
                f"names namespace {claim.origin.namespace or '(none)'}"
            )
            continue
        late = _after_retirement(claim, signer.id, policy)
        if late:
            problems.append(f"{where}: {late}")
            expired = True
            continue
        reason = f"signed by trusted key {signer.id}" + (f" of node {bound}" if bound else "")
        reason += f" (trusted for namespace {scope})" if scope else ""
        retired = policy.not_after.get(signer.id, "")
        reason += f" before its retirement at {retired}" if retired else ""
        return Verdict(True, reason, claim, signer.id, key_node=bound)
    if not problems:
        return Verdict(False, "the snapshot is not signed")
    return Verdict(False, "no signature verifies: " + "; ".join(problems), problems=tuple(problems), expired=expired)


def _after_retirement(claim: Claim, kid: str, policy: TrustPolicy) -> str:
    """Why the signature of a retired key does not count ("" when the key is not retired, or signed before).

    The time compared is the one the key signed (the origin's `created`): a snapshot signed while its key was
    in service keeps verifying after the key's retirement. A key whose signatures could have been forged (stolen)
    is removed from the trust ConfigMap instead: its holder can sign any time."""
    raw = policy.not_after.get(kid)
    if raw is None:
        return ""
    retired = timestamps.parse(raw)
    if retired is None or retired.tzinfo is None:
        return (
            f"key {kid} is retired, but its not-after {raw[:64]!r} is not an RFC 3339 time with a zone: the key "
            "vouches for nothing until an administrator corrects it"
        )
    signed = timestamps.parse(claim.origin.created)
    if signed is None or signed.tzinfo is None:
        return f"signed by key {kid}, retired at {raw}, with no signed time: it cannot show it was signed before then"
    if signed > retired:
        return (
            f"signed by key {kid} at {claim.origin.created}, after the key was retired at {raw} (expired): a retired "
            "key vouches only for what it signed before"
        )
    return ""


def _claimed_key(payload: bytes) -> str:
    """The key id an (unverified) payload names, only to explain a failure."""
    try:
        opt = json.loads(payload).get("optional") or {}
        kid = opt.get(OPT_KEY_ID, "")
    except (ValueError, UnicodeDecodeError, AttributeError):
        return ""
    return kid[:64] if isinstance(kid, str) else ""


def require_trusted(verdict: Verdict, policy: TrustPolicy, what: str) -> None:
    """Refuse a snapshot without a trusted signature, unless the policy trusts unverified ones."""
    if verdict.verified or policy.allow_unverified:
        return
    hint = _EXPIRED_HINT if verdict.expired else _UNTRUSTED_HINT
    raise PermissionDenied(f"refusing to restore {what}: {verdict.reason}", hint=hint)


def check_claim_matches(claim: Claim, *, namespace: str, pod_uid: str, what: str) -> None:
    """The signed origin must be the one the snapshot config states (a config cannot move namespaces)."""
    if claim.origin.namespace != namespace:
        raise PermissionDenied(
            f"refusing to restore {what}: it is signed as taken in namespace {claim.origin.namespace!r} "
            f"but its config says {namespace!r}",
            hint="the snapshot was altered after it was signed; do not restore it",
        )
    if pod_uid and claim.origin.pod_uid and claim.origin.pod_uid != pod_uid:
        raise PermissionDenied(
            f"refusing to restore {what}: it is signed for pod uid {claim.origin.pod_uid} but its config says "
            f"{pod_uid}",
            hint="the snapshot was altered after it was signed; do not restore it",
        )


# --- namespace binding -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Grant:
    """A SnapshotGrant in the source namespace: snapshots of that namespace may be restored into
    `target_namespaces` (optionally only those from `repositories`)."""

    name: str
    namespace: str
    target_namespaces: tuple[str, ...]
    repositories: tuple[str, ...] = ()  # REGISTRY/REPO prefixes; empty: any

    def allows(self, target: str, repository: str) -> bool:
        if target not in self.target_namespaces:
            return False
        return not self.repositories or any(
            repository == r or repository.startswith(r.rstrip("/") + "/") for r in self.repositories
        )


def parse_grant(obj: Mapping[str, Any]) -> Grant | None:
    """A SnapshotGrant object (as the API server returns it); None when it is malformed."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    if not isinstance(meta, dict) or not isinstance(spec, dict):
        return None
    targets = spec.get("targetNamespaces")
    repos = spec.get("repositories") or []
    if not isinstance(targets, list) or not isinstance(repos, list):
        return None
    return Grant(
        name=str(meta.get("name", "")),
        namespace=str(meta.get("namespace", "")),
        target_namespaces=tuple(t for t in targets if isinstance(t, str) and t),
        repositories=tuple(r for r in repos if isinstance(r, str) and r),
    )


def check_namespace(source: str, target: str, repository: str, grants: Iterable[Grant]) -> str:
    """Allow a restore into `target` of a snapshot taken in `source`; returns why it is allowed."""
    if source == target:
        return f"same namespace ({target})"
    for g in grants:
        if g.namespace == source and g.allows(target, repository):
            return f"granted by snapshotgrant {source}/{g.name}"
    raise PermissionDenied(
        f"refusing to restore a snapshot of namespace {source!r} into namespace {target!r}: "
        f"no SnapshotGrant in {source!r} grants {target!r}",
        hint=f"someone allowed to in {source!r} can grant it: a SnapshotGrant there whose spec.targetNamespaces "
        f"lists {target!r} (docs/kubernetes.md)",
    )


@dataclass(frozen=True)
class Provenance:
    """What `inspect` shows."""

    verdict: Verdict
    error: str = ""  # when the signatures could not be read at all

    def to_dict(self) -> dict[str, object]:
        v = self.verdict
        d: dict[str, object] = {"verified": v.verified, "reason": self.error or v.reason}
        if v.claim is not None:
            o = v.claim.origin
            d["keyId"] = v.key_id
            if v.key_node:
                d["keyNode"] = v.key_node
            d["origin"] = {
                "cluster": o.cluster,
                "namespace": o.namespace,
                "pod": o.pod,
                "podUID": o.pod_uid,
                "node": o.node,
                "created": o.created,
                "formatVersion": o.format_version,
            }
        return d
