"""`install --key-broker` (deploy/keybroker.py, app/install.py): the rendered objects (the broker alone reads
the key Secret; the agents get a token only the broker accepts), the default install unchanged, the
switch between the two modes and back, and uninstall."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from cryptography import x509

from kubectl_snapshot.app import install as A
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import InvalidArgument
from kubectl_snapshot.deploy import keybroker, keys, render
from tests.support.fakeplugin import FakeKube
from tests.unit.test_app_install import _rolled_out_at_once, cli
from tests.unit.test_deploy import by_kind, pod_spec, rules

BROKER = K.KEY_BROKER_NAME


def agent_container(objs: list[dict[str, Any]]) -> dict[str, Any]:
    return next(c for c in pod_spec(objs)["containers"] if c["name"] == "agent")


def test_the_default_install_is_unchanged_and_has_no_broker() -> None:
    default = render("img")
    assert render("img", key_broker=False) == default
    names = {(o["kind"], o["metadata"]["name"]) for o in default}
    assert not any(BROKER in n for _, n in names)
    assert ("Role", keys.ROLE) in names  # the agents read the key Secret themselves
    env = {e["name"] for e in agent_container(default)["env"]}
    assert K.ENV_KEY_BROKER not in env
    with pytest.raises(InvalidArgument):
        render("img", key_broker_url="https://127.0.0.1:1")


def test_with_the_broker_only_the_broker_reads_the_key_secret() -> None:
    objs = render("img", key_broker=True)
    found = by_kind(objs)
    assert ("Role", keys.ROLE) not in found and ("RoleBinding", keys.ROLE) not in found
    # no Role or ClusterRole bound to the agent names the key Secret
    agent_bound = {
        o["roleRef"]["name"]
        for o in objs
        if o["kind"] in ("RoleBinding", "ClusterRoleBinding")
        and any(s["name"] == K.AGENT_NAME for s in o.get("subjects") or [])
    }
    for kind in ("Role", "ClusterRole"):
        for name in agent_bound:
            role = found.get((kind, name))
            assert role is None or not any(
                "secrets" in r["resources"] and K.KEY_SECRET in (r.get("resourceNames") or []) for r in role["rules"]
            )
    # the broker's: that one Secret by name (get, update), pods get, PodSnapshots and SnapshotGrants list,
    # TokenReviews create
    role = found[("Role", BROKER)]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": [K.KEY_SECRET], "verbs": ["get", "update"]}
    ]
    assert rules(found[("ClusterRole", BROKER)]) == {
        ("", "pods", "get"),
        (K.GROUP, K.PLURAL, "list"),
        (K.GROUP, K.GRANT_PLURAL, "list"),
        ("authentication.k8s.io", "tokenreviews", "create"),
    }
    for kind in ("RoleBinding", "ClusterRoleBinding"):
        assert found[(kind, BROKER)]["subjects"] == [
            {"kind": "ServiceAccount", "name": BROKER, "namespace": K.AGENT_NAMESPACE}
        ]
    # objects of the broker come before the DaemonSet (its agents ask the broker from their start)
    assert [o["kind"] for o in objs][-1] == "DaemonSet"


def test_the_agent_gets_a_token_for_the_broker_its_certificate_and_its_url() -> None:
    objs = render("img", key_broker=True)
    spec = pod_spec(objs)
    token = next(v for v in spec["volumes"] if v["name"] == "key-broker-token")
    assert token["projected"]["sources"] == [
        {"serviceAccountToken": {"audience": K.KEY_BROKER_AUDIENCE, "expirationSeconds": 3600, "path": "token"}}
    ]
    mounts = {m["mountPath"]: m for m in agent_container(objs)["volumeMounts"]}
    assert mounts[K.KEY_BROKER_TOKEN_DIR]["readOnly"] and mounts[K.KEY_BROKER_CA_DIR]["readOnly"]
    env = {e["name"]: e.get("value") for e in agent_container(objs)["env"]}
    assert env[K.ENV_KEY_BROKER] == f"https://{BROKER}.{K.AGENT_NAMESPACE}.svc:{K.KEY_BROKER_PORT}"
    # install-node and the guard get neither
    for c in [*spec["initContainers"], *(c for c in spec["containers"] if c["name"] != "agent")]:
        assert not any("key-broker" in m["name"] for m in c.get("volumeMounts") or [])


def test_the_broker_deployment() -> None:
    objs = render("img", key_broker=True, key_broker_url="https://127.0.0.1:9643", host_network=True)
    dep = by_kind(objs)[("Deployment", BROKER)]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == BROKER and pod["hostNetwork"] is True
    (c,) = pod["containers"]
    assert c["args"][0] == "key-broker" and f"--listen=:{K.KEY_BROKER_PORT}" in c["args"]
    assert c["securityContext"]["allowPrivilegeEscalation"] is False and "privileged" not in c["securityContext"]
    assert {"name": "tls", "secret": {"secretName": K.KEY_BROKER_TLS_SECRET}} in pod["volumes"]
    env = {e["name"]: e.get("value") for e in agent_container(objs)["env"]}
    assert env[K.ENV_KEY_BROKER] == "https://127.0.0.1:9643"
    svc = by_kind(objs)[("Service", BROKER)]
    assert svc["spec"]["selector"] == keybroker.SELECTOR
    assert ("PodDisruptionBudget", BROKER) not in by_kind(objs)  # with one replica it would block every drain


def test_behind_its_service_the_broker_runs_two_replicas_kept_through_drains() -> None:
    """Any replica answers any request (tests/unit/test_keybroker.py::test_any_replica_answers_a_restores_unwrap),
    so the broker behind its Service runs two, apart where nodes allow, rolled one at a time, and a drain
    evicts one only while the other is available."""
    objs = render("img", key_broker=True)
    dep = by_kind(objs)[("Deployment", BROKER)]
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    pod = dep["spec"]["template"]["spec"]
    (apart,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert apart["podAffinityTerm"] == {
        "labelSelector": {"matchLabels": keybroker.SELECTOR},
        "topologyKey": "kubernetes.io/hostname",
    }
    pdb = by_kind(objs)[("PodDisruptionBudget", BROKER)]
    assert pdb["spec"] == {"minAvailable": 1, "selector": {"matchLabels": keybroker.SELECTOR}}
    assert [o["kind"] for o in objs].index("PodDisruptionBudget") > [o["kind"] for o in objs].index("Deployment")


def _with_deployments(kube: FakeKube) -> FakeKube:
    _rolled_out_at_once(kube)  # its controllers make the broker's Deployment available too
    return kube


def _secret_and_cm(kube: FakeKube) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    secret_ref, cm_ref = A.key_broker_tls_refs()
    return kube.get_object(secret_ref), kube.get_object(cm_ref)


def test_install_with_the_broker_then_without_and_uninstall(monkeypatch: pytest.MonkeyPatch) -> None:
    kube = _with_deployments(FakeKube(crds=False))
    result = cli(kube, monkeypatch, "install")  # the default: with the broker
    assert result.exit_code == 0, result.output
    assert "every node's agent can read every namespace's key" not in result.output
    secret, cm = _secret_and_cm(kube)
    assert secret is not None and cm is not None and secret["type"] == "kubernetes.io/tls"
    cert = base64.b64decode(secret["data"]["tls.crt"]).decode()
    assert cm["data"] == {"ca.crt": cert}  # the agents pin the broker's own certificate
    names = x509.load_pem_x509_certificate(cert.encode()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    )
    assert f"{BROKER}.{K.AGENT_NAMESPACE}.svc" in names.value.get_values_for_type(x509.DNSName)
    assert kube.get_object(
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": BROKER, "namespace": K.AGENT_NAMESPACE}}
    )
    assert kube.get_object(keys.key_role({})) is None
    # a re-install keeps the certificate (here with the URL of a host-network cluster)
    result = cli(kube, monkeypatch, "install", "--key-broker", "--key-broker-url", "https://127.0.0.1:9643")
    assert result.exit_code == 0, result.output
    assert _secret_and_cm(kube)[0] == secret
    # without it: the broker and its certificate go, the agents' Role on the key Secret is back
    result = cli(kube, monkeypatch, "install", "--no-key-broker")
    assert result.exit_code == 0, result.output
    assert _secret_and_cm(kube) == (None, None)
    assert not [n for n in kube.names("Deployment") if BROKER in n]
    assert kube.get_object(keys.key_role({})) is not None
    # broker again, then uninstall: all its objects are deleted, the key Secret kept
    assert cli(kube, monkeypatch, "install", "--key-broker").exit_code == 0
    result = cli(kube, monkeypatch, "uninstall")
    assert result.exit_code == 0, result.output
    assert _secret_and_cm(kube) == (None, None)
    broker_objs = [o for o in render("img", key_broker=True) if o["metadata"]["name"] == BROKER]
    assert broker_objs and all(kube.get_object(o) is None for o in broker_objs)
    assert kube.get_object(A.kept_key_objects()[0]) is not None


def test_key_broker_url_does_not_go_with_no_key_broker(monkeypatch: pytest.MonkeyPatch) -> None:
    kube = FakeKube(crds=False)
    result = cli(kube, monkeypatch, "install", "--no-key-broker", "--key-broker-url", "https://127.0.0.1:9643")
    assert result.exit_code == 2 and "--key-broker-url goes with the key broker" in result.output
    assert kube.journal == []  # refused before anything was applied


def _names(monkeypatch: pytest.MonkeyPatch, *flags: str) -> list[str]:
    result = cli(None, monkeypatch, "install", "--dry-run=client", "-o", "name", *flags)
    assert result.exit_code == 0, result.output
    return list(result.stdout.split())


def test_the_broker_is_installed_by_default_and_on_host_network_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    broker = f"deployment.apps/{BROKER}"
    agents_keys = f"role.rbac.authorization.k8s.io/{keys.key_role({})['metadata']['name']}"
    assert broker in _names(monkeypatch) and agents_keys not in _names(monkeypatch)
    without = _names(monkeypatch, "--no-key-broker")
    assert broker not in without and agents_keys in without
    # host-network: one replica, which a node's loss would take away: off unless asked (a URL asks)
    assert broker not in _names(monkeypatch, "--host-network")
    assert broker in _names(monkeypatch, "--host-network", "--key-broker-url", "https://127.0.0.1:9643")
    assert broker in _names(monkeypatch, "--host-network", "--key-broker")


def test_a_host_network_install_without_the_broker_says_what_agents_read(monkeypatch: pytest.MonkeyPatch) -> None:
    kube = _with_deployments(FakeKube(crds=False))
    result = cli(kube, monkeypatch, "install", "--host-network")
    assert result.exit_code == 0, result.output
    assert "note: every node's agent can read every namespace's key" in result.output
    assert "--key-broker" in result.output
    assert not [n for n in kube.names("Deployment") if BROKER in n]
    result = cli(kube, monkeypatch, "install", "--host-network", "--key-broker", "--key-broker-url",
                 "https://127.0.0.1:9643")  # fmt: skip
    assert result.exit_code == 0 and "note: every node's agent" not in result.output, result.output
