"""`kubectl snapshot install`'s signing key and trust ConfigMap (real keys; the shared fake API server)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import click
from click.testing import CliRunner

from kubectl_snapshot.adapters.signatures import load_signing_key, load_trust, trust_from_data
from kubectl_snapshot.app.install import signing_objects
from kubectl_snapshot.cli import main as cli_main
from kubectl_snapshot.core import kube as K
from kubectl_snapshot.core.provenance import SigningKey
from tests.support.fakeplugin import FakeKube


def cluster() -> FakeKube:
    kube = FakeKube()
    kube_system = kube.get("Namespace", "", "kube-system")
    assert kube_system is not None
    kube_system["metadata"]["uid"] = "cluster-uid-1"  # what the trust ConfigMap names the cluster by
    kube.add({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": K.AGENT_NAMESPACE}})
    return kube


def install(api: FakeKube, **kw: Any) -> tuple[SigningKey, dict[str, str]]:
    objs, key_id = signing_objects(api, **kw)
    api.apply(objs)
    secret, cm = objs
    assert secret["metadata"]["namespace"] == cm["metadata"]["namespace"] == K.AGENT_NAMESPACE
    key = SigningKey.from_pem(base64.b64decode(secret["data"]["signing.key"]))
    assert key.public.id == key_id
    return key, cm["data"]


def test_install_makes_a_key_once_and_rotation_keeps_old_public_keys() -> None:
    api = cluster()
    first, data = install(api)
    assert data["cluster-id"] == "cluster-uid-1" and data["allow-unverified-snapshots"] == "false"
    again, _ = install(api)
    assert again.public.id == first.public.id  # reinstall keeps the key
    rotated, data = install(api, rotate=True)
    assert rotated.public.id != first.public.id
    trust = trust_from_data(data)
    assert {k.id for k in trust.keys} == {first.public.id, rotated.public.id}
    assert not trust.allow_unverified and trust.cluster == "cluster-uid-1"


def test_install_trusts_extra_keys_and_keeps_the_policy() -> None:
    api = cluster()
    other = SigningKey.generate()
    _, data = install(api, trust_keys=[other.public.to_pem()], allow_unverified=True)
    assert f"{other.public.id}.pub" in data and data["allow-unverified-snapshots"] == "true"
    _, data = install(api)  # not given: kept
    assert trust_from_data(data).allow_unverified


def test_agent_reads_the_mounted_files(tmp_path: Path) -> None:
    api = cluster()
    key, data = install(api)
    trust_dir, key_dir = tmp_path / "trust", tmp_path / "signing"
    trust_dir.mkdir()
    key_dir.mkdir()
    for name, value in data.items():
        (trust_dir / name).write_text(value)
    (trust_dir / "..data").mkdir()  # a mounted ConfigMap's bookkeeping is skipped
    secret = api.get("Secret", K.AGENT_NAMESPACE, K.SIGNING_KEY_SECRET)
    assert secret is not None
    (key_dir / "signing.key").write_bytes(base64.b64decode(secret["data"]["signing.key"]))
    assert load_signing_key(str(key_dir)).public.id == key.public.id
    trust = load_trust([str(trust_dir)])
    assert [k.id for k in trust.keys] == [key.public.id] and trust.cluster == "cluster-uid-1"


def test_memory_notice_is_said_once(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    runner = CliRunner()
    first = runner.invoke(_notice_cmd)
    second = runner.invoke(_notice_cmd)
    assert "holds the pod's memory" in first.output and "secret" in first.output
    assert second.output == ""


@click.command()
def _notice_cmd() -> None:
    cli_main.memory_notice()
