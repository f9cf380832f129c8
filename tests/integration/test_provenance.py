"""Signed snapshots against the real loopback registry: cosign accepts ours, restore refuses the rest.

Real pieces: snapshots taken by the agent CLI (containerd, runc, CRIU), the docker-registry on
loopback, a cosign binary built from the Go module proxy (hack/install-cosign.sh, cached), and the
agent CLI's restore. Every refusal happens before a layer is downloaded (the registry's access log
shows no GET of a layer blob).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.oci import parse_manifest
from kubectl_snapshot.core.provenance import (
    ANN_COSIGN_SIGNATURE,
    OPT_KEY_ID,
    OPT_NAMESPACE,
    OPT_NODE,
    node_key_entries,
    signature_tag,
)
from kubectl_snapshot.core.reference import Reference
from shim.containerd.client import ContainerdClient
from shim.service import nodekey
from tests.integration.test_agent_roundtrip import (
    agent,
    cleanup,
    client,
    on,
    read_counter,
    restore_on,
    start_counter,
    unique,
)
from tests.support.containerd import ContainerdDaemon, containerd_a
from tests.support.images import busybox_image
from tests.support.registry import RegistryServer, registry
from tests.support.signing import session_key, write_key

pytestmark = pytest.mark.integration
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Snap:
    ref: Reference  # repository@digest
    layers: tuple[str, ...]


def take(d: ContainerdDaemon, registry: RegistryServer, repo: str, cid: str, *, sign: bool = True) -> Snap:
    out = agent("checkpoint", *on(d), "--to", registry.ref(repo, unique("t")), cid, sign=sign).stdout.strip()
    ref = Reference.parse(out)
    body, _, _ = RegistryClient().get_manifest(ref)
    return Snap(ref, tuple(layer.digest for layer in parse_manifest(body).layers))


@pytest.fixture(scope="module")
def repo() -> str:
    return unique("prov")


@pytest.fixture
def running(containerd_a: ContainerdDaemon, cleanup: Callable[[ContainerdClient, str], None]) -> str:
    a = client(containerd_a)
    cid = unique("prov")
    cleanup(a, cid)
    start_counter(a, containerd_a, cid, busybox_image(containerd_a))
    return cid


def refused(d: ContainerdDaemon, snap: Snap, registry: RegistryServer, **kw: object) -> str:
    """Restore must fail, before any of the snapshot's layers is fetched; returns stderr."""
    before = registry.log_tail(100000)
    proc = agent(*restore_on(d), str(snap.ref), unique("never"), check=False, **kw)  # type: ignore[arg-type]
    assert proc.returncode != 0, proc.stdout
    fetched = registry.log_tail(100000)[len(before) :]
    # the log records each request (it shows the signature lookup), and no layer was among them
    assert f"/v2/{snap.ref.repository}/manifests/{signature_tag(snap.ref.digest or '')}" in fetched, fetched[-2000:]
    for layer in snap.layers:
        assert f"/v2/{snap.ref.repository}/blobs/{layer}" not in fetched, "a layer was downloaded"
    return proc.stderr


def cosign() -> str:
    proc = subprocess.run(
        [str(REPO_ROOT / "hack" / "install-cosign.sh")], capture_output=True, text=True, timeout=1200, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def cosign_verify(ref: Reference, pub: Path, tmp_path: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(tmp_path),  # no user config, no TUF cache: nothing leaves the machine
        "SIGSTORE_NO_CACHE": "1",
        "TUF_ROOT": str(tmp_path / "tuf"),
    }
    args = [
        cosign(), "verify", "--key", str(pub),
        "--insecure-ignore-tlog=true", "--insecure-ignore-sct=true",
        "--allow-insecure-registry", "--allow-http-registry", "--offline=true",
        *extra, str(ref),
    ]  # fmt: skip
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=False, env=env)


def test_cosign_verify_accepts_the_agents_signature(  # type: ignore[no-untyped-def]
    containerd_a, registry, running, repo, tmp_path
):
    snap = take(containerd_a, registry, repo, running)
    ok = cosign_verify(snap.ref, session_key().public, tmp_path, "-a", f"{OPT_NAMESPACE}={containerd_a.namespace}")
    assert ok.returncode == 0, ok.stderr
    [claim] = json.loads(ok.stdout)
    assert claim["critical"]["image"]["docker-manifest-digest"] == snap.ref.digest
    assert claim["critical"]["identity"]["docker-reference"] == snap.ref.name
    # the same check fails with another key, or an origin that is not the signed one
    other = write_key(tmp_path / "keys", "other")
    assert cosign_verify(snap.ref, other.public, tmp_path).returncode != 0
    assert cosign_verify(snap.ref, session_key().public, tmp_path, "-a", f"{OPT_NAMESPACE}=elsewhere").returncode != 0


def test_cosign_verify_accepts_a_signature_by_a_nodes_own_key(  # type: ignore[no-untyped-def]
    containerd_a, registry, running, repo, tmp_path
):
    """What a node's agent signs with (the key made in its state dir, shim/service/nodekey.py) and publishes (its
    `<key id>.pub` entry of the trust ConfigMap): cosign verifies with that entry, the signed node as well."""
    key = nodekey.load_or_create(str(tmp_path / "state"))
    node = os.uname().nodename  # the origin the node-level agent records
    entries = node_key_entries(key.public, node)
    pub = tmp_path / f"{key.public.id}.pub"
    pub.write_text(entries[pub.name])
    env = {"KUBECTL_SNAPSHOT_SIGNING_KEY": nodekey.key_path(str(tmp_path / "state"))}
    out = agent("checkpoint", *on(containerd_a), "--to", registry.ref(repo, unique("n")), running, env=env)
    ref = Reference.parse(out.stdout.strip())
    ok = cosign_verify(ref, pub, tmp_path, "-a", f"{OPT_NODE}={node}", "-a", f"{OPT_KEY_ID}={key.public.id}")
    assert ok.returncode == 0, ok.stderr
    [claim] = json.loads(ok.stdout)
    assert claim["critical"]["image"]["docker-manifest-digest"] == ref.digest
    assert cosign_verify(ref, pub, tmp_path, "-a", f"{OPT_NODE}=another-node").returncode != 0
    assert cosign_verify(ref, session_key().public, tmp_path).returncode != 0  # not the session's key


def test_inspect_shows_signer_and_origin(containerd_a, registry, running, repo):  # type: ignore[no-untyped-def]
    snap = take(containerd_a, registry, repo, running)
    data = json.loads(agent("inspect", "-o", "json", str(snap.ref)).stdout)
    prov = data["provenance"]
    assert prov["verified"] and prov["keyId"] == session_key().key.public.id
    assert prov["origin"]["namespace"] == containerd_a.namespace and prov["origin"]["formatVersion"] == 3
    text = agent("inspect", str(snap.ref)).stdout
    assert "Signature:  verified" in text and f"namespace {containerd_a.namespace}" in text
    # without the key, inspect says so instead of failing
    data = json.loads(agent("inspect", "-o", "json", str(snap.ref), env={"KUBECTL_SNAPSHOT_TRUSTED_KEYS": ""}).stdout)
    assert not data["provenance"]["verified"]


def test_restore_refuses_wrong_key_unsigned_tampered_and_replayed(  # type: ignore[no-untyped-def]
    containerd_a, registry, running, repo, tmp_path
):
    signed = take(containerd_a, registry, repo, running)
    unsigned = take(containerd_a, registry, repo, running, sign=False)

    other = write_key(tmp_path / "keys", "other")
    err = refused(containerd_a, signed, registry, env={"KUBECTL_SNAPSHOT_TRUSTED_KEYS": str(other.public)})
    assert f"signed by key {session_key().key.public.id}, which this cluster does not trust" in err

    err = refused(containerd_a, unsigned, registry)
    assert "the snapshot is not signed" in err and "hint:" in err

    # tampered: the signature of the signed snapshot with one bit flipped, pushed back under its tag
    reg = RegistryClient()
    sig_ref = Reference(signed.ref.registry, signed.ref.repository, tag=signature_tag(signed.ref.digest or ""))
    body, _, _ = reg.get_manifest(sig_ref)
    manifest = json.loads(body)
    raw = bytearray(base64.b64decode(manifest["layers"][0]["annotations"][ANN_COSIGN_SIGNATURE]))
    raw[-3] ^= 0x10
    manifest["layers"][0]["annotations"][ANN_COSIGN_SIGNATURE] = base64.b64encode(bytes(raw)).decode()
    reg.push_manifest(sig_ref, json.dumps(manifest).encode(), C.OCI_MANIFEST)
    err = refused(containerd_a, signed, registry)
    assert "does not verify with trusted key" in err and "tampered" in err
    reg.push_manifest(sig_ref, body, C.OCI_MANIFEST)  # the original verifies again
    agent("inspect", str(signed.ref))

    # replayed: the signed snapshot's valid signature copied onto the unsigned one's tag
    unsigned_sig = Reference(
        unsigned.ref.registry, unsigned.ref.repository, tag=signature_tag(unsigned.ref.digest or "")
    )
    reg.push_manifest(unsigned_sig, body, C.OCI_MANIFEST)
    err = refused(containerd_a, unsigned, registry)
    assert f"is a valid signature of {signed.ref.digest}, not of {unsigned.ref.digest}" in err


def test_an_administrator_may_trust_unverified_snapshots(containerd_a, registry, running, repo):  # type: ignore[no-untyped-def]
    unsigned = take(containerd_a, registry, repo, running, sign=False)
    # past verification, the restore goes on to its next check (here: one new name for no container)
    proc = agent(*restore_on(containerd_a), "--allow-unverified", str(unsigned.ref), "a", "b", check=False)
    assert proc.returncode != 0 and "new name(s) were given" in proc.stderr, proc.stderr


def test_a_snapshot_signed_after_its_keys_retirement_is_refused_and_one_signed_before_restores(  # type: ignore[no-untyped-def]
    containerd_a, registry, running, repo, tmp_path, cleanup
):
    """C10, "expired": the trust directory (the ConfigMap's layout) retires the signing key with
    `<id>.not-after`. A snapshot it signed after that time is refused before any layer is fetched; the same
    snapshot, with the key retired after it was signed, restores and runs on."""
    snap = take(containerd_a, registry, repo, running)
    key = session_key().key.public

    def trust_retired_at(when: str) -> dict[str, str]:
        d = tmp_path / when.replace(":", "-")
        d.mkdir()
        (d / f"{key.id}.pub").write_bytes(key.to_pem())
        (d / f"{key.id}.not-after").write_text(when)
        return {"KUBECTL_SNAPSHOT_TRUSTED_KEYS": str(d)}

    err = refused(containerd_a, snap, registry, env=trust_retired_at("2020-01-01T00:00:00Z"))
    assert f"signed by key {key.id} at " in err and "after the key was retired at 2020-01-01T00:00:00Z (expired)" in err
    assert "hint: its key was retired before it signed this snapshot" in err

    new = unique("retired-later")
    c = client(containerd_a)
    cleanup(c, new)
    agent(*restore_on(containerd_a), str(snap.ref), new, env=trust_retired_at("2099-01-01T00:00:00Z"))
    assert read_counter(c, new)[1] >= 20
