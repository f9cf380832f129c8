"""Signature verification and namespace binding (real ECDSA P-256 via `cryptography`, no fakes)."""

from __future__ import annotations

import base64
import json
import pathlib
from dataclasses import replace

import pytest

from kubectl_snapshot.adapters.signatures import (
    authorize_restore,
    load_signed,
    merge_trust,
    sign_snapshot,
    trust_from_data,
    verify_for_restore,
)
from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.errors import InvalidArgument, NotFound, PermissionDenied
from kubectl_snapshot.core.model import ContainerRecord, HostFacts, PodRecord, SnapshotConfig
from kubectl_snapshot.core.oci import Descriptor, build_manifest, sha256_digest
from kubectl_snapshot.core.provenance import (
    ANN_COSIGN_SIGNATURE,
    COSIGN_TYPE,
    OPT_NAMESPACE,
    SIMPLE_SIGNING_MEDIA_TYPE,
    Grant,
    Origin,
    PublicKey,
    SignatureCandidate,
    SigningKey,
    TrustPolicy,
    check_claim_matches,
    check_namespace,
    evaluate,
    node_key_entries,
    parse_grant,
    require_trusted,
    signature_manifest,
    signature_tag,
    simple_signing_payload,
)
from kubectl_snapshot.core.reference import Reference

DIGEST = "sha256:" + "a" * 64
OTHER = "sha256:" + "b" * 64
ORIGIN = Origin(
    cluster="c-uid", namespace="team-a", pod="web", pod_uid="u1", node="n1", created="2026-11-30T18:00:00Z",
    format_version=3,
)  # fmt: skip


def signed(key: SigningKey, digest: str = DIGEST, origin: Origin = ORIGIN) -> SignatureCandidate:
    payload = simple_signing_payload("127.0.0.1:5000/snaps", digest, origin, key.public.id)
    return SignatureCandidate(payload, base64.b64encode(key.sign(payload)).decode())


@pytest.fixture(scope="module")
def key() -> SigningKey:
    return SigningKey.generate()


def test_payload_is_cosign_simple_signing(key: SigningKey) -> None:
    d = json.loads(signed(key).payload)
    assert d["critical"] == {
        "identity": {"docker-reference": "127.0.0.1:5000/snaps"},
        "image": {"docker-manifest-digest": DIGEST},
        "type": COSIGN_TYPE,
    }
    assert d["optional"][OPT_NAMESPACE] == "team-a"
    assert all(isinstance(v, str) for v in d["optional"].values())  # cosign verify -a k=v matches strings


def test_signature_manifest_layout(key: SigningKey) -> None:
    cand = signed(key)
    sig = signature_manifest([(cand.payload, base64.b64decode(cand.signature_b64))])
    layer = sig.manifest.layers[0]
    assert layer.media_type == SIMPLE_SIGNING_MEDIA_TYPE
    assert layer.annotations[ANN_COSIGN_SIGNATURE] == cand.signature_b64
    assert json.loads(sig.config)["rootfs"]["diff_ids"] == [layer.digest]
    assert signature_tag(DIGEST) == "sha256-" + "a" * 64 + ".sig"


def test_valid_signature_verifies(key: SigningKey) -> None:
    v = evaluate([signed(key)], DIGEST, TrustPolicy((key.public,)))
    assert v.verified and v.key_id == key.public.id
    assert v.claim is not None and v.claim.origin == ORIGIN


def test_rotated_key_still_verifies_old_snapshots(key: SigningKey) -> None:
    new = SigningKey.generate()
    policy = TrustPolicy((new.public, key.public))
    assert evaluate([signed(key)], DIGEST, policy).verified
    assert evaluate([signed(new)], DIGEST, policy).verified


def test_unsigned_refused() -> None:
    policy = TrustPolicy((SigningKey.generate().public,))
    v = evaluate([], DIGEST, policy)
    assert not v.verified and v.reason == "the snapshot is not signed"
    with pytest.raises(PermissionDenied, match="not signed"):
        require_trusted(v, policy, "x")


def test_wrong_key_refused(key: SigningKey) -> None:
    stranger = SigningKey.generate()
    policy = TrustPolicy((key.public,))
    v = evaluate([signed(stranger)], DIGEST, policy)
    assert not v.verified
    assert f"signed by key {stranger.public.id}, which this cluster does not trust" in v.reason
    with pytest.raises(PermissionDenied, match="does not trust"):
        require_trusted(v, policy, "x")


def test_tampered_payload_refused(key: SigningKey) -> None:
    cand = signed(key)
    forged = cand.payload.replace(b"team-a", b"team-b")
    v = evaluate([SignatureCandidate(forged, cand.signature_b64)], DIGEST, TrustPolicy((key.public,)))
    assert not v.verified and "tampered" in v.reason


def test_tampered_signature_refused(key: SigningKey) -> None:
    cand = signed(key)
    raw = bytearray(base64.b64decode(cand.signature_b64))
    raw[-1] ^= 1
    bad = SignatureCandidate(cand.payload, base64.b64encode(bytes(raw)).decode())
    v = evaluate([bad], DIGEST, TrustPolicy((key.public,)))
    assert not v.verified and "tampered" in v.reason
    v = evaluate([SignatureCandidate(cand.payload, "not base64!")], DIGEST, TrustPolicy((key.public,)))
    assert not v.verified and "not base64" in v.reason


def test_replayed_signature_refused(key: SigningKey) -> None:
    """A valid signature of another snapshot copied onto this digest's .sig tag."""
    v = evaluate([signed(key, digest=OTHER)], DIGEST, TrustPolicy((key.public,)))
    assert not v.verified and "replayed" in v.reason and OTHER in v.reason


def test_one_good_signature_among_bad_ones(key: SigningKey) -> None:
    v = evaluate([signed(SigningKey.generate()), signed(key)], DIGEST, TrustPolicy((key.public,)))
    assert v.verified


def test_admin_policy_may_trust_unverified(key: SigningKey) -> None:
    policy = TrustPolicy((key.public,), allow_unverified=True)
    require_trusted(evaluate([], DIGEST, policy), policy, "x")  # no raise


def test_claim_must_match_config(key: SigningKey) -> None:
    claim = evaluate([signed(key)], DIGEST, TrustPolicy((key.public,))).claim
    assert claim is not None
    check_claim_matches(claim, namespace="team-a", pod_uid="u1", what="x")
    with pytest.raises(PermissionDenied, match="signed as taken in namespace 'team-a'"):
        check_claim_matches(claim, namespace="team-b", pod_uid="u1", what="x")
    with pytest.raises(PermissionDenied, match="pod uid"):
        check_claim_matches(claim, namespace="team-a", pod_uid="u2", what="x")


def test_keys_round_trip_pem(key: SigningKey) -> None:
    again = SigningKey.from_pem(key.to_pem())
    assert again.public.id == key.public.id
    assert PublicKey.from_pem(key.public.to_pem()).id == key.public.id


def test_namespace_binding() -> None:
    repo = "127.0.0.1:5000/snaps"
    assert check_namespace("a", "a", repo, []) == "same namespace (a)"
    with pytest.raises(PermissionDenied, match="no SnapshotGrant in 'a' grants 'b'"):
        check_namespace("a", "b", repo, [])
    grant = parse_grant({"metadata": {"name": "g", "namespace": "a"}, "spec": {"targetNamespaces": ["b"]}})
    assert grant is not None
    assert "snapshotgrant a/g" in check_namespace("a", "b", repo, [grant])
    # a grant only counts in the source namespace, and only for the namespaces it lists
    elsewhere = Grant("g", "b", ("b",))
    with pytest.raises(PermissionDenied):
        check_namespace("a", "b", repo, [elsewhere])
    with pytest.raises(PermissionDenied):
        check_namespace("a", "c", repo, [grant])
    # repository-scoped grant
    scoped = Grant("g", "a", ("b",), ("127.0.0.1:5000/other",))
    with pytest.raises(PermissionDenied):
        check_namespace("a", "b", repo, [scoped])
    assert parse_grant({"metadata": {}, "spec": {"targetNamespaces": "b"}}) is None


# --- the whole check as the agent runs it, against an in-memory registry ------------------------------


class MemoryRegistry:
    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.tags: dict[str, bytes] = {}

    def push_blob(
        self,
        ref: Reference,
        *,
        digest: str,
        size: int,
        path: str | None = None,
        data: bytes | None = None,
        fresh: bool = False,
    ) -> bool:
        self.blobs[digest] = data or b""
        return True

    def push_manifest(self, ref: Reference, manifest: bytes, media_type: str) -> str:
        self.tags[ref.tag or ""] = manifest
        return sha256_digest(manifest)

    def get_manifest(self, ref: Reference, *, max_size: int = 0) -> tuple[bytes, str, str]:
        if (ref.tag or "") not in self.tags:
            raise NotFound(f"{ref} not found")
        body = self.tags[ref.tag or ""]
        return body, "application/vnd.oci.image.manifest.v1+json", sha256_digest(body)

    def read_blob(self, ref: Reference, digest: str, *, max_size: int = 0) -> bytes:
        return self.blobs[digest]


def pod_config(namespace: str, uid: str = "u1") -> SnapshotConfig:
    rec = ContainerRecord(name="c", id="c", image="i", image_digest="", layer_digest=DIGEST, spec={})
    return SnapshotConfig(
        group="web", namespace=namespace, created="t", containers=(rec,), host=HostFacts(),
        pod=PodRecord(name="web", namespace=namespace, uid=uid),
    )  # fmt: skip


def test_authorize_restore_end_to_end(key: SigningKey) -> None:
    reg = MemoryRegistry()
    ref = Reference("127.0.0.1:5000", "snaps", digest=DIGEST)
    policy = TrustPolicy((key.public,))
    cfg = pod_config("team-a")
    with pytest.raises(PermissionDenied, match="not signed"):
        authorize_restore(reg, ref, cfg, "team-a", policy, lambda ns: [])
    sign_snapshot(reg, ref, Origin(namespace="team-a", pod="web", pod_uid="u1"), key)
    assert "same namespace" in authorize_restore(reg, ref, cfg, "team-a", policy, lambda ns: []).reason
    asked: list[str] = []

    def grants(ns: str) -> list[Grant]:
        asked.append(ns)
        return [Grant("g", "team-a", ("team-b",))]

    granted = authorize_restore(reg, ref, cfg, "team-b", policy, grants)
    assert "snapshotgrant team-a/g" in granted.reason and granted.source_namespace == "team-a"
    assert asked == ["team-a"]  # grants are read in the snapshot's (signed) namespace
    with pytest.raises(PermissionDenied, match="no SnapshotGrant"):
        authorize_restore(reg, ref, cfg, "team-c", policy, grants)
    # a config edited to claim the target namespace no longer matches its signature
    with pytest.raises(PermissionDenied, match="signed as taken in namespace 'team-a'"):
        authorize_restore(reg, ref, pod_config("team-c"), "team-c", policy, lambda ns: [])


def test_load_signed_reads_the_signatures_of_the_pinned_digest(key: SigningKey) -> None:
    """load_signed: the artifact pinned by its manifest's digest, and that digest's signatures (read
    while the config is); an unsigned one has none, and verification still decides."""
    reg = MemoryRegistry()
    cfg = pod_config("team-a")
    body = cfg.to_bytes()
    reg.push_blob(Reference("r", "snaps"), digest=sha256_digest(body), size=len(body), data=body)
    manifest = build_manifest(
        config=Descriptor(C.CONFIG_MEDIA_TYPE, sha256_digest(body), len(body)),
        layers=[Descriptor(C.CHECKPOINT_LAYER_MEDIA_TYPE, DIGEST, 1)],
        artifact_type=C.ARTIFACT_TYPE,
        annotations={},
    ).to_bytes()
    tagged = Reference("127.0.0.1:5000", "snaps", tag="v1")
    pinned_digest = reg.push_manifest(tagged, manifest, C.OCI_MANIFEST)
    artifact, found = load_signed(reg, tagged)
    assert artifact.reference.digest == pinned_digest and artifact.config == cfg
    assert found == []
    sign_snapshot(reg, artifact.reference, Origin(namespace="team-a", pod="web", pod_uid="u1"), key)
    artifact, found = load_signed(reg, tagged)
    assert len(found) == 1
    policy = TrustPolicy((key.public,))
    assert verify_for_restore(reg, artifact.reference, "team-a", "u1", policy, found).verified
    with pytest.raises(PermissionDenied, match="not signed"):  # what was read decides, nothing else
        verify_for_restore(reg, artifact.reference, "team-a", "u1", policy, [])


# --- per-node keys: a node's key vouches for its own node only (issue 42 item 2) --------------------


def node_trust(*pairs: tuple[SigningKey, str], cluster_key: SigningKey | None = None) -> TrustPolicy:
    """The trust ConfigMap as it is after install and the agents registering: read by the real loader."""
    data = {"cluster-id": "c-uid", "allow-unverified-snapshots": "false"}
    for k, node in pairs:
        data.update(node_key_entries(k.public, node))
    if cluster_key is not None:
        data[f"{cluster_key.public.id}.pub"] = cluster_key.public.to_pem().decode()
    return trust_from_data(data)


def test_a_nodes_key_verifies_a_snapshot_of_its_own_node() -> None:
    node_a = SigningKey.generate()
    v = evaluate([signed(node_a, origin=ORIGIN)], DIGEST, node_trust((node_a, "n1")))
    assert v.verified and v.key_id == node_a.public.id and v.key_node == "n1"
    assert v.reason == f"signed by trusted key {node_a.public.id} of node n1"


def test_a_nodes_key_is_refused_for_an_origin_on_another_node() -> None:
    node_a, node_b = SigningKey.generate(), SigningKey.generate()
    policy = node_trust((node_a, "n1"), (node_b, "n2"))
    forged = replace(ORIGIN, node="n2")  # node A claims a pod that ran on node B
    v = evaluate([signed(node_a, origin=forged)], DIGEST, policy)
    assert not v.verified
    assert f"signed by the key of node n1 (key {node_a.public.id}), but its origin names node n2" in v.reason
    with pytest.raises(PermissionDenied, match="origin names node n2"):
        require_trusted(v, policy, "127.0.0.1:5000/snaps@" + DIGEST)
    # ... and an origin naming no node at all is no way around it
    nowhere = replace(ORIGIN, node="")
    assert "its origin names no node" in evaluate([signed(node_a, origin=nowhere)], DIGEST, policy).reason
    # node B's own signature of the same origin is the one that verifies
    assert evaluate([signed(node_b, origin=forged)], DIGEST, policy).verified


def test_old_snapshots_signed_with_the_cluster_key_still_verify_beside_node_keys() -> None:
    cluster_key, node_a = SigningKey.generate(), SigningKey.generate()
    policy = node_trust((node_a, "n1"), cluster_key=cluster_key)
    for node in ("n1", "n2", "a-node-long-gone"):
        old = replace(ORIGIN, node=node)
        v = evaluate([signed(cluster_key, origin=old)], DIGEST, policy)
        assert v.verified and v.key_id == cluster_key.public.id and v.key_node == "", node


def test_the_loader_ignores_entries_whose_name_is_not_their_keys_id() -> None:
    """An agent may add entries, not choose what they mean: another node's key registered again under a
    new name (to bind it to the agent's node, or unbound) is not trusted through that entry."""
    node_a, node_b = SigningKey.generate(), SigningKey.generate()
    data = node_key_entries(node_a.public, "n1")
    data["0123456789abcdef.pub"] = node_b.public.to_pem().decode()  # B's key, named as another id
    data["0123456789abcdef.node"] = "n1"
    policy = trust_from_data(data)
    assert [k.id for k in policy.keys] == [node_a.public.id] and policy.nodes == {node_a.public.id: "n1"}
    # a node's entry that is no key at all is skipped, an administrator's is an error
    junk = {**data, "fedcba9876543210.pub": "not a key", "fedcba9876543210.node": "n1"}
    assert [k.id for k in trust_from_data(junk).keys] == [node_a.public.id]
    with pytest.raises(InvalidArgument, match="not a PEM public key"):
        trust_from_data({**data, "admins.pub": "not a key"})


def test_a_node_binding_survives_merging_with_an_unbound_copy_of_the_key() -> None:
    node_a = SigningKey.generate()
    merged = merge_trust([TrustPolicy((node_a.public,)), node_trust((node_a, "n1"))])
    assert merged.node_of(node_a.public.id) == "n1"
    forged = replace(ORIGIN, node="n2")
    assert not evaluate([signed(node_a, origin=forged)], DIGEST, merged).verified


def test_the_restore_worker_trusts_a_node_key_the_mounted_copy_does_not_have_yet(tmp_path: pathlib.Path) -> None:
    """A node's agent registers its key when it starts; the kubelet brings it to the other agents'
    mounted trust ConfigMap up to a minute later. A save of that node restored elsewhere meanwhile must
    verify: the worker reads the live ConfigMap too. With the API down, the mounted copy alone serves."""
    from kubectl_snapshot.core.errors import Unavailable
    from kubectl_snapshot.core.model import HostFacts
    from kubectl_snapshot.core.nodesettings import NodeSettings
    from kubectl_snapshot.core.provenance import node_key_entries
    from shim.controller.restores import RestoreWorker
    from tests.support.fakekube import StrictKube

    key = SigningKey.generate()
    mounted = tmp_path / "trust"
    mounted.mkdir()
    old = SigningKey.generate()
    (mounted / f"{old.public.id}.pub").write_bytes(old.public.to_pem())

    class Live(StrictKube):
        up = True

        def get_config_map(self, ns: str, name: str) -> dict[str, object]:
            if not self.up:
                raise Unavailable("the API server does not answer")
            return {"data": node_key_entries(key.public, "ks-n1")}

    kube = Live()
    settings = NodeSettings(node="ks-n2", state_root=str(tmp_path), trust_dir=str(mounted))
    worker = RestoreWorker(kube=kube, settings=settings, facts=HostFacts())
    trust = worker._trust()
    assert {k.id for k in trust.keys} == {old.public.id, key.public.id}
    assert trust.nodes == {key.public.id: "ks-n1"}  # bound to its node, as the mounted copy will say
    kube.up = False
    assert {k.id for k in worker._trust().keys} == {old.public.id}


# --- an importer's key: trusted for one namespace (issue 45; docs/security.md, "Imported checkpoints") ----


def importer_trust(importer: SigningKey, namespace: str, *nodes: tuple[SigningKey, str]) -> TrustPolicy:
    """The trust ConfigMap with an importer's key listed for one namespace, read by the real loader."""
    data = {"cluster-id": "c-uid", "allow-unverified-snapshots": "false"}
    for k, node in nodes:
        data.update(node_key_entries(k.public, node))
    data[f"{importer.public.id}.pub"] = importer.public.to_pem().decode()
    data[f"{importer.public.id}.namespace"] = namespace
    return trust_from_data(data)


IMPORTED = replace(ORIGIN, node="", imported=True)


def test_an_importers_key_verifies_an_import_into_its_namespace() -> None:
    importer = SigningKey.generate()
    policy = importer_trust(importer, ORIGIN.namespace)
    assert policy.namespace_of(importer.public.id) == ORIGIN.namespace
    v = evaluate([signed(importer, origin=IMPORTED)], DIGEST, policy)
    assert v.verified and v.key_id == importer.public.id and v.claim is not None and v.claim.origin.imported
    assert v.reason == f"signed by trusted key {importer.public.id} (trusted for namespace {ORIGIN.namespace})"


def test_an_importers_key_is_refused_for_another_namespace() -> None:
    importer = SigningKey.generate()
    policy = importer_trust(importer, "team-b")
    v = evaluate([signed(importer, origin=IMPORTED)], DIGEST, policy)
    assert not v.verified
    assert f"trusted for namespace team-b only, but its origin names namespace {ORIGIN.namespace}" in v.reason
    with pytest.raises(PermissionDenied, match="trusted for namespace team-b only"):
        require_trusted(v, policy, "127.0.0.1:5000/snaps@" + DIGEST)
    # the binding survives a merge with an unbound copy of the key (another source of trust)
    merged = merge_trust([TrustPolicy((importer.public,)), policy])
    assert not evaluate([signed(importer, origin=IMPORTED)], DIGEST, merged).verified


def test_a_nodes_key_never_vouches_for_an_imported_origin() -> None:
    node_a = SigningKey.generate()
    policy = node_trust((node_a, "n1"))
    claimed = replace(ORIGIN, node="n1", imported=True)
    v = evaluate([signed(node_a, origin=claimed)], DIGEST, policy)
    assert not v.verified and "its origin is marked imported" in v.reason
    # the same key's own save of the same pod is verified
    assert evaluate([signed(node_a, origin=replace(ORIGIN, node="n1"))], DIGEST, policy).verified
