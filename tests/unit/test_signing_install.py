"""`kubectl snapshot install`'s trust ConfigMap beside the nodes' own keys (real keys; the shared fake API server)."""

from __future__ import annotations

import base64
import copy
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from kubectl_snapshot.adapters.signatures import load_trust, trust_from_data
from kubectl_snapshot.app.install import trust_objects
from kubectl_snapshot.cli import main as cli_main
from kubectl_snapshot.cli.snapshot import memory_notice
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import InvalidArgument
from kubectl_snapshot.core.provenance import SigningKey, node_key_entries
from tests.support.fakeplugin import FakeKube


def cluster() -> FakeKube:
    kube = FakeKube()
    kube_system = kube.get("Namespace", "", "kube-system")
    assert kube_system is not None
    kube_system["metadata"]["uid"] = "cluster-uid-1"  # what the trust ConfigMap names the cluster by
    kube.add({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": K.AGENT_NAMESPACE}})
    return kube


def install(api: FakeKube, **kw: Any) -> dict[str, str]:
    objs = trust_objects(api, **kw)
    api.apply(objs)
    [cm] = objs
    assert (cm["kind"], cm["metadata"]["namespace"]) == ("ConfigMap", K.AGENT_NAMESPACE)
    return dict(cm["data"])


def register(api: FakeKube, key: SigningKey, node: str) -> None:
    """What an agent's patch adds (shim/controller/signing.py)."""
    live = api.get("ConfigMap", K.AGENT_NAMESPACE, K.TRUST_CONFIG_MAP)
    assert live is not None
    live["data"].update(node_key_entries(key.public, node))


def test_install_makes_no_signing_key_and_keeps_every_key_trusted_across_installs() -> None:
    api = cluster()
    data = install(api)
    assert data == {"cluster-id": "cluster-uid-1", "allow-unverified-snapshots": "false"}
    assert api.get("Secret", K.AGENT_NAMESPACE, K.SIGNING_KEY_SECRET) is None  # no private key leaves a node
    node_a, node_b = SigningKey.generate(), SigningKey.generate()
    register(api, node_a, "n1")
    register(api, node_b, "n2")
    trust = trust_from_data(install(api))  # a re-install keeps the nodes' keys, bound to their nodes
    assert trust.nodes == {node_a.public.id: "n1", node_b.public.id: "n2"}
    assert not trust.allow_unverified and trust.cluster == "cluster-uid-1"


def test_a_reinstall_keeps_the_old_cluster_key_trusted_and_its_secret_as_it_is() -> None:
    """Snapshots the agents signed with the cluster key (before they had their own) keep restoring."""
    api = cluster()
    old = SigningKey.generate()
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": K.SIGNING_KEY_SECRET, "namespace": K.AGENT_NAMESPACE},
        "data": {"signing.key": base64.b64encode(old.to_pem()).decode()},
    }
    api.add(secret)
    api.add(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": K.TRUST_CONFIG_MAP, "namespace": K.AGENT_NAMESPACE},
            "data": {f"{old.public.id}.pub": old.public.to_pem().decode(), "allow-unverified-snapshots": "false"},
        }
    )
    before = copy.deepcopy(secret)
    trust = trust_from_data(install(api))
    assert [k.id for k in trust.keys] == [old.public.id] and trust.node_of(old.public.id) == ""
    assert api.get("Secret", K.AGENT_NAMESPACE, K.SIGNING_KEY_SECRET) == before


def test_install_trusts_extra_keys_and_keeps_the_policy() -> None:
    api = cluster()
    other = SigningKey.generate()
    data = install(api, trust_keys=[other.public.to_pem()], allow_unverified=True)
    assert f"{other.public.id}.pub" in data and data["allow-unverified-snapshots"] == "true"
    data = install(api)  # not given: kept
    assert trust_from_data(data).allow_unverified


def test_install_trusts_an_importers_key_for_its_namespace_only() -> None:
    api = cluster()
    importer = SigningKey.generate()
    data = install(api, importer_keys=[("team-a", importer.public.to_pem())])
    assert data[f"{importer.public.id}.namespace"] == "team-a"
    trust = trust_from_data(install(api))  # kept across installs, still bound
    assert trust.namespace_of(importer.public.id) == "team-a" and trust.node_of(importer.public.id) == ""


def test_a_nodes_key_cannot_be_listed_as_an_importers() -> None:
    api = cluster()
    install(api)
    node_a = SigningKey.generate()
    register(api, node_a, "n1")
    with pytest.raises(InvalidArgument, match="is node n1's signing key, not an importer's"):
        trust_objects(api, importer_keys=[("team-a", node_a.public.to_pem())])


def test_importer_key_needs_a_namespace_and_a_file(tmp_path: Path) -> None:
    for bad in ("team-a", "=pub.pem", "team-a="):
        result = CliRunner().invoke(cli_main.cli, ["install", "--importer-key", bad])
        assert result.exit_code == 2 and "NAMESPACE=PUB.pem" in result.output, (bad, result.output)


def test_rotating_the_cluster_signing_key_is_refused_with_what_to_do_instead() -> None:
    result = CliRunner().invoke(cli_main.cli, ["install", "--rotate-signing-key"])
    assert result.exit_code == 2, result.output
    assert "each node's agent signs with its own key" in result.output
    assert "signing/node.key" in result.output and ".node" in result.output


def test_agent_reads_the_mounted_files(tmp_path: Path) -> None:
    api = cluster()
    install(api)
    node_a = SigningKey.generate()
    register(api, node_a, "n1")
    live = api.get("ConfigMap", K.AGENT_NAMESPACE, K.TRUST_CONFIG_MAP)
    assert live is not None
    trust_dir = tmp_path / "trust"
    trust_dir.mkdir()
    for name, value in live["data"].items():
        (trust_dir / name).write_text(value)
    (trust_dir / "..data").mkdir()  # a mounted ConfigMap's bookkeeping is skipped
    trust = load_trust([str(trust_dir)])
    assert [k.id for k in trust.keys] == [node_a.public.id] and trust.cluster == "cluster-uid-1"
    assert trust.node_of(node_a.public.id) == "n1"


def test_memory_notice_is_said_once(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    runner = CliRunner()
    first = runner.invoke(_notice_cmd)
    second = runner.invoke(_notice_cmd)
    assert "holds the pod's memory" in first.output and "secret" in first.output
    assert second.output == ""


@click.command()
def _notice_cmd() -> None:
    memory_notice()
