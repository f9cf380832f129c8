"""The key broker's decision (core/keyaccess.py): each refusal beside the legitimate request it must let through."""

from __future__ import annotations

import base64
import copy
from typing import Any

import pytest

from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core import keyaccess as KA
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.encryption import SCHEME, WRAPPED_BYTES, EncryptionInfo
from kubectl_snapshot.core.errors import InvalidArgument
from kubectl_snapshot.core.model import ContainerRecord, HostFacts, SnapshotConfig
from kubectl_snapshot.core.oci import Descriptor, build_manifest, sha256_digest
from kubectl_snapshot.core.provenance import Grant
from kubectl_snapshot.core.reference import Reference
from kubectl_snapshot.core.sealing import wrap_aad
from tests.support.snapshotbytes import snapshot_bytes

DIGEST = "sha256:" + "ab" * 32
OTHER = "sha256:" + "cd" * 32
SNAP = f"registry.example:5000/team/app@{DIGEST}"
A = KA.Caller(user=K.AGENT_USER, node="node-a")


def review(*, node: Any = "node-a", user: str = K.AGENT_USER, audiences: Any = None, ok: bool = True) -> dict[str, Any]:
    extra = {KA.NODE_EXTRA: [node]} if isinstance(node, str) else ({KA.NODE_EXTRA: node} if node else {})
    return {
        "status": {
            "authenticated": ok,
            "audiences": [KA.AUDIENCE] if audiences is None else audiences,
            "user": {"username": user, "extra": extra},
        }
    }


def pod(*, node: str = "node-a", phase: str = "Running", uid: str = "u1") -> dict[str, Any]:
    return {
        "metadata": {"namespace": "x", "name": "p", "uid": uid, "annotations": {}},
        "spec": {"nodeName": node},
        "status": {"phase": phase},
    }


def save(op: str = "wrap", **kw: Any) -> KA.KeyRequest:
    return KA.KeyRequest(purpose="save", op=op, namespace="x", pod_name="p", pod_uid="u1", **kw)


def restore(snapshot: str = SNAP, op: str = "unwrap") -> KA.KeyRequest:
    return KA.KeyRequest(purpose="restore", op=op, namespace="x", pod_name="p", pod_uid="u1", snapshot=snapshot)


def restore_pod(source: str = SNAP, *, node: str = "node-a", phase: str = "Pending") -> dict[str, Any]:
    p = pod(node=node, phase=phase)
    p["metadata"]["annotations"] = {K.ANN_RESTORE_FROM: source}
    return p


def resume_pod() -> dict[str, Any]:
    p = pod(phase="Pending")
    p["metadata"]["annotations"] = {K.ANN_RESUME_POLICY: "every-hour"}
    return p


def claimed_save(by: str = "u1", reference: str = SNAP) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "x", "name": "s1", "annotations": {K.ANN_CLAIMED_BY: by}},
        "status": {"reference": reference},
    }


# --- who calls ----------------------------------------------------------------------------------------


def test_an_agent_token_bound_to_a_node_is_that_nodes_caller() -> None:
    assert KA.caller_of(review()) == A


@pytest.mark.parametrize(
    ("changed", "says"),
    [
        ({"ok": False}, "not valid"),
        ({"audiences": ["https://kubernetes.default.svc"]}, "audience"),
        ({"user": "system:serviceaccount:x:default"}, "not the agent's ServiceAccount"),
        ({"node": None}, "not bound to a pod on a node"),
        ({"node": ["node-a", "node-b"]}, "not bound to a pod on a node"),
    ],
)
def test_other_tokens_are_refused(changed: dict[str, Any], says: str) -> None:
    assert isinstance(KA.caller_of(review()), KA.Caller)  # the legitimate token, beside
    verdict = KA.caller_of(review(**changed))
    assert isinstance(verdict, KA.Verdict) and not verdict.allowed and says in verdict.reason


# --- saves --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["key", "wrap", "mac"])
def test_a_save_of_a_pod_running_on_the_callers_node_is_answered(op: str) -> None:
    verdict = KA.decide(A, save(op), pod())
    assert verdict.allowed, verdict.reason


@pytest.mark.parametrize(
    ("the_pod", "says"),
    [
        (None, "does not exist"),
        (pod(node="node-b"), "on node node-b, not on the caller's node node-a"),
        (pod(uid="u2"), "is not the pod u1"),
        (pod(phase="Pending"), "not running"),
        (pod(phase="Succeeded"), "has ended"),
    ],
)
def test_a_save_of_any_other_pod_is_refused(the_pod: dict[str, Any] | None, says: str) -> None:
    assert KA.decide(A, save(), pod()).allowed  # the legitimate one
    verdict = KA.decide(A, save(), the_pod)
    assert not verdict.allowed and says in verdict.reason


def test_a_pod_of_another_namespace_with_the_same_name_is_refused() -> None:
    other = pod()
    other["metadata"]["namespace"] = "y"
    assert not KA.decide(A, save(), other).allowed


# --- restores -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["key", "unwrap"])
def test_a_restore_pod_gets_the_key_for_the_snapshot_it_names(op: str) -> None:
    verdict = KA.decide(A, restore(op=op), restore_pod())
    assert verdict.allowed, verdict.reason


def test_a_restore_pod_named_by_tag_gets_the_digest_the_agent_resolved() -> None:
    assert KA.decide(A, restore(), restore_pod("registry.example:5000/team/app:v1")).allowed


@pytest.mark.parametrize(
    ("the_pod", "snapshot", "says"),
    [
        (restore_pod(), f"registry.example:5000/team/app@{OTHER}", "restores"),
        (restore_pod(), f"registry.example:5000/team/other@{DIGEST}", "restores"),
        (restore_pod(node="node-b"), SNAP, "not on the caller's node"),
        (pod(), SNAP, "is not a restore"),
        (restore_pod(phase="Failed"), SNAP, "has ended"),
    ],
)
def test_a_restore_of_another_snapshot_pod_or_node_is_refused(
    the_pod: dict[str, Any], snapshot: str, says: str
) -> None:
    assert KA.decide(A, restore(), restore_pod()).allowed  # the legitimate one
    verdict = KA.decide(A, restore(snapshot), the_pod)
    assert not verdict.allowed and says in verdict.reason


def test_a_resuming_pod_gets_the_key_of_the_save_it_claimed() -> None:
    verdict = KA.decide(A, restore(), resume_pod(), [claimed_save()])
    assert verdict.allowed, verdict.reason


@pytest.mark.parametrize(
    "claimed",
    [[], [claimed_save(by="u2")], [claimed_save(reference=f"registry.example:5000/team/app@{OTHER}")]],
)
def test_a_resuming_pod_gets_no_key_of_a_save_it_did_not_claim(claimed: list[dict[str, Any]]) -> None:
    assert KA.decide(A, restore(), resume_pod(), [claimed_save()]).allowed  # the legitimate one
    verdict = KA.decide(A, restore(), resume_pod(), claimed)
    assert not verdict.allowed and "resumes from no save" in verdict.reason


# --- a granted restore into another namespace ------------------------------------------------------


def granted_restore(op: str = "unwrap") -> KA.KeyRequest:
    """A restore pod of namespace y asks for the key of namespace x (its snapshot is sealed for x)."""
    return KA.KeyRequest(
        purpose="restore", op=op, namespace="x", pod_name="p", pod_uid="u1", snapshot=SNAP, pod_namespace="y"
    )


def pod_in_y(the_pod: dict[str, Any]) -> dict[str, Any]:
    the_pod = copy.deepcopy(the_pod)
    the_pod["metadata"]["namespace"] = "y"
    return the_pod


def grant(targets: tuple[str, ...] = ("y",), repositories: tuple[str, ...] = (), namespace: str = "x") -> Grant:
    return Grant(name="to-y", namespace=namespace, target_namespaces=targets, repositories=repositories)


@pytest.mark.parametrize("op", ["key", "open", "unwrap"])
def test_a_restore_into_a_granted_namespace_gets_the_sealing_namespaces_key(op: str) -> None:
    verdict = KA.decide(A, granted_restore(op), pod_in_y(restore_pod()), grants=[grant()])
    assert verdict.allowed and "granted by snapshotgrant x/to-y" in verdict.reason, verdict.reason
    repo = grant(repositories=("registry.example:5000/team",))  # a grant limited to the repository's prefix
    assert KA.decide(A, granted_restore(op), pod_in_y(restore_pod()), grants=[repo]).allowed


@pytest.mark.parametrize(
    ("grants", "the_pod", "says"),
    [
        ([], pod_in_y(restore_pod()), "no SnapshotGrant in 'x' grants 'y'"),
        ([grant(targets=("z",))], pod_in_y(restore_pod()), "no SnapshotGrant in 'x' grants 'y'"),
        ([grant(repositories=("registry.example:5000/other",))], pod_in_y(restore_pod()), "no SnapshotGrant"),
        ([grant(namespace="y")], pod_in_y(restore_pod()), "no SnapshotGrant"),  # y cannot grant itself x's
        ([grant()], restore_pod(), "is not the pod"),  # the pod named is in x, not in y
        ([grant()], pod_in_y(restore_pod(node="node-b")), "not on the caller's node"),
        ([grant()], pod_in_y(pod()), "is not a restore"),
    ],
)
def test_a_restore_into_another_namespace_without_its_grant_is_refused(
    grants: list[Grant], the_pod: dict[str, Any], says: str
) -> None:
    assert KA.decide(A, granted_restore(), pod_in_y(restore_pod()), grants=[grant()]).allowed  # the legitimate one
    verdict = KA.decide(A, granted_restore(), the_pod, grants=grants)
    assert not verdict.allowed and says in verdict.reason, verdict.reason


def test_a_save_is_never_sealed_with_another_namespaces_key() -> None:
    KA.parse_request(KA.request_body(save()))  # the legitimate one
    with pytest.raises(InvalidArgument, match="its own pod's namespace key"):
        KA.parse_request(KA.request_body(save()) | {"pod": {"name": "p", "uid": "u1", "namespace": "y"}})


# --- requests -----------------------------------------------------------------------------------------


def test_the_wire_format_round_trips() -> None:
    for req in (save("key", create=True), save("mac"), restore(), granted_restore()):
        assert KA.parse_request(KA.request_body(req, data=["eA=="])) == req


@pytest.mark.parametrize(
    "body",
    [
        KA.request_body(save("unwrap")),  # a save never unwraps
        KA.request_body(restore(op="wrap")),  # a restore never wraps
        KA.request_body(restore(op="key")) | {"create": True},  # only a save creates the key
        KA.request_body(restore(snapshot="registry.example:5000/team/app:v1")),  # by digest only
        KA.request_body(save()) | {"pod": {"name": "p"}},  # no uid
        KA.request_body(save()) | {"purpose": "export"},
        KA.request_body(save()) | {"namespace": 3},
        [],
    ],
)
def test_requests_no_agent_sends_are_malformed(body: Any) -> None:
    KA.parse_request(copy.deepcopy(KA.request_body(save())))  # the legitimate one
    with pytest.raises(InvalidArgument):
        KA.parse_request(body)


# --- a restore's unwraps bound to its own snapshot (threat D14) ---------------------------------------


def _snapshot(namespace: str = "x", sealed: bool = True) -> tuple[Reference, bytes, bytes, dict[str, str]]:
    layer, vol = "sha256:" + "1" * 64, "sha256:" + "2" * 64
    keys = {
        layer: base64.b64encode(b"1" * WRAPPED_BYTES).decode(),
        vol: base64.b64encode(b"2" * WRAPPED_BYTES).decode(),
    }
    info = EncryptionInfo(SCHEME, namespace, "k" * 16, keys) if sealed else None
    manifest, cfg = snapshot_bytes(namespace, layer, vol, info)
    ref = Reference("registry.example:5000", "team/app", digest=sha256_digest(manifest))
    return ref, manifest, cfg, keys


def test_an_opened_snapshot_gives_its_own_wrapped_keys() -> None:
    ref, manifest, cfg, keys = _snapshot()
    assert KA.opened_keys(ref, "x", manifest, cfg) == keys


def test_an_open_with_bytes_other_than_the_snapshot_named_is_refused() -> None:
    ref, manifest, cfg, _ = _snapshot()
    _, other_manifest, other_cfg, _ = _snapshot(namespace="y")
    with pytest.raises(InvalidArgument, match="manifest sent is not the one"):
        KA.opened_keys(ref, "x", other_manifest, cfg)
    with pytest.raises(InvalidArgument, match="config sent is not the one the manifest"):
        KA.opened_keys(ref, "x", manifest, other_cfg)
    with pytest.raises(InvalidArgument, match="sealed for namespace 'x', not 'y'"):
        KA.opened_keys(ref, "y", manifest, cfg)
    clear_ref, clear_manifest, clear_cfg, _ = _snapshot(sealed=False)
    with pytest.raises(InvalidArgument, match="is not sealed"):
        KA.opened_keys(clear_ref, "x", clear_manifest, clear_cfg)


def test_only_the_opened_snapshots_own_wrapped_keys_may_be_unwrapped() -> None:
    _, _, _, keys = _snapshot()
    (layer, wrapped), (vol, other) = keys.items()
    assert KA.may_unwrap(keys, "x", wrapped, wrap_aad("x", layer)).allowed  # the legitimate one
    assert KA.may_unwrap(keys, "x", other, wrap_aad("x", vol)).allowed
    for w, aad, why in (
        (other, wrap_aad("x", layer), "not in the snapshot opened"),  # another key under its blob's name
        (wrapped, wrap_aad("x", "sha256:" + "3" * 64), "not in the snapshot opened"),  # a blob it does not list
        (wrapped, wrap_aad("y", layer), "no blob of namespace x"),
        (wrapped, b"something else", "no blob of namespace x"),
    ):
        verdict = KA.may_unwrap(keys, "x", w, aad)
        assert not verdict.allowed and why in verdict.reason
