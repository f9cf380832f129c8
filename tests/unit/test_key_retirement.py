"""Threat C10, "expired": a key listed in the trust ConfigMap with `<key id>.not-after` (its retirement) vouches
only for what it signed up to then. A signature whose signed time is later is refused with the reason and a
hint; a snapshot signed while the key was in service still verifies after the key's retirement. Read through
the real loader (adapters/signatures.trust_from_data), as the agent reads the ConfigMap."""

from __future__ import annotations

import base64
from dataclasses import replace

import pytest

from kubectl_snapshot.adapters.signatures import merge_trust, trust_from_data
from kubectl_snapshot.core.errors import PermissionDenied
from kubectl_snapshot.core.provenance import (
    Origin,
    SignatureCandidate,
    SigningKey,
    TrustPolicy,
    evaluate,
    node_key_entries,
    require_trusted,
    simple_signing_payload,
)

DIGEST = "sha256:" + "a" * 64
RETIRED = "2026-11-30T12:00:00Z"
BEFORE = Origin(namespace="team-a", pod="web", pod_uid="u1", node="n1", created="2026-11-30T11:59:59Z")
AFTER = replace(BEFORE, created="2026-11-30T12:00:01Z")


def signed(key: SigningKey, origin: Origin) -> SignatureCandidate:
    payload = simple_signing_payload("127.0.0.1:5000/snaps", DIGEST, origin, key.public.id)
    return SignatureCandidate(payload, base64.b64encode(key.sign(payload)).decode())


def trust(key: SigningKey, not_after: str | None = RETIRED, *others: SigningKey) -> TrustPolicy:
    data = node_key_entries(key.public, "n1")
    for other in others:
        data.update(node_key_entries(other.public, "n1"))
    if not_after is not None:
        data[f"{key.public.id}.not-after"] = not_after
    return trust_from_data(data)


@pytest.fixture(scope="module")
def key() -> SigningKey:
    return SigningKey.generate()


def test_a_signature_made_after_its_keys_retirement_is_refused_as_expired(key: SigningKey) -> None:
    policy = trust(key)
    v = evaluate([signed(key, AFTER)], DIGEST, policy)
    assert not v.verified and v.expired
    assert f"signed by key {key.public.id} at 2026-11-30T12:00:01Z, after the key was retired at {RETIRED}" in v.reason
    with pytest.raises(PermissionDenied, match=r"\(expired\)") as e:
        require_trusted(v, policy, "127.0.0.1:5000/snaps@" + DIGEST)
    assert e.value.hint and "was retired before it signed this snapshot" in e.value.hint
    assert "kubectl-snapshot-trust" in e.value.hint


def test_a_snapshot_signed_before_its_keys_retirement_still_verifies(key: SigningKey) -> None:
    policy = trust(key)
    for origin in (BEFORE, replace(BEFORE, created=RETIRED), replace(BEFORE, created="2026-11-30T13:00:00+02:00")):
        v = evaluate([signed(key, origin)], DIGEST, policy)
        assert v.verified and not v.expired, origin.created
        assert v.reason == f"signed by trusted key {key.public.id} of node n1 before its retirement at {RETIRED}"
        require_trusted(v, policy, "x")


def test_a_key_without_a_retirement_verifies_whenever_it_signed(key: SigningKey) -> None:
    assert evaluate([signed(key, AFTER)], DIGEST, trust(key, None)).verified


def test_a_retired_keys_signature_without_a_signed_time_is_refused(key: SigningKey) -> None:
    v = evaluate([signed(key, replace(BEFORE, created=""))], DIGEST, trust(key))
    assert not v.verified and "with no signed time" in v.reason


def test_a_malformed_retirement_retires_the_key_altogether_and_no_other(key: SigningKey) -> None:
    other = SigningKey.generate()
    for raw in ("", "yesterday", "2026-11-30T12:00:00"):  # no zone: whose clock?
        policy = trust(key, raw, other)
        v = evaluate([signed(key, BEFORE)], DIGEST, policy)
        assert not v.verified and "vouches for nothing until an administrator corrects it" in v.reason, raw
        assert evaluate([signed(other, AFTER)], DIGEST, policy).verified


def test_a_copy_without_the_retirement_does_not_undo_it(key: SigningKey) -> None:
    """The restore worker merges the mounted ConfigMap with the live one: the earliest retirement stands."""
    merged = merge_trust([trust(key, None), trust(key), trust(key, "2026-12-31T00:00:00Z")])
    assert merged.not_after == {key.public.id: RETIRED}
    assert not evaluate([signed(key, AFTER)], DIGEST, merged).verified
    assert evaluate([signed(key, BEFORE)], DIGEST, merged).verified
