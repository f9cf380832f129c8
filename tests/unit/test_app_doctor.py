"""`kubectl snapshot doctor` (app/doctor.py) over the shared fake: the cluster checks, each node's agent
and facts, what blocks a node, and what it reports when the agent is missing or not readable. (How the
agent computes the facts and blockers: tests/unit/test_node_bundle.py.)"""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner

from kubectl_snapshot.app.doctor import UNKNOWN, doctor
from kubectl_snapshot.cli import main as cli_main
from kubectl_snapshot.cli import wiring
from kubectl_snapshot.core import kubenames as K
from tests.support.fakeplugin import FakeKube, agent_pod, install_agent, node

CRD = f"CRD {K.PLURAL}.{K.GROUP}"
DS = f"DaemonSet {K.AGENT_NAMESPACE}/{K.AGENT_NAME}"
RC = f"RuntimeClass {K.RUNTIME_CLASS}"
NOT_PUBLISHED = "the agent has not published node status (an older agent, or not running)"


def facts(*blockers: str, criu: str = "4.2.1") -> dict[str, Any]:
    """The node-facts annotation as the agent publishes it (shim/service/nodecheck.py)."""
    return {
        "criuVersion": criu,
        "containerdVersion": "v2.1.4",
        "runcVersion": "1.2.5",
        "kernel": "6.1.0",
        "runtimeHandler": K.RUNTIME_CLASS,
        "node": {
            "criu": {"path": "/opt/kubectl-snapshot/bin/criu", "version": criu, "from": "bundle"},
            "hook": {"path": "/opt/kubectl-snapshot/bin/kubectl-snapshot-runc", "python": "3.11.2", "from": "bundle"},
            "criuCheck": {"ok": not blockers, "detail": blockers[0] if blockers else ""},
            "cgroup": "v2",
            "containerd": {"config": "/etc/containerd/config.toml", "importsDropin": True, "restartPending": False},
            "blockers": list(blockers),
        },
    }


def healthy(*names: str) -> FakeKube:
    kube = FakeKube()
    for n in names:
        kube.add(node(n, facts=facts()))
    install_agent(kube, nodes=names)
    return kube


def by_node(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n["node"]: n for n in report["nodes"]}


def test_a_healthy_cluster_is_ok_with_each_nodes_agent_and_facts() -> None:
    report = doctor(kube=healthy("n2", "n1"))
    assert report["ok"] is True and "error" not in report
    assert report["checks"] == [
        {"check": CRD, "ok": True, "detail": "present"},
        {"check": DS, "ok": True, "detail": "present"},
        {"check": RC, "ok": True, "detail": "present"},
        {"check": BROKER, "ok": True, "detail": NO_BROKER},
    ]
    assert [n["node"] for n in report["nodes"]] == ["n1", "n2"]  # sorted
    n1 = by_node(report)["n1"]
    assert n1["agentPod"] == f"{K.AGENT_NAME}-n1" and n1["agentReady"] is True
    assert n1["criuVersion"] == "4.2.1" and n1["criuCheck"] == "ok" and n1["blockers"] == []
    assert n1["holdsRestorePods"] is False  # its drop-in's annotations not published (an older agent)


def test_doctor_says_which_nodes_hold_restore_pods_at_create() -> None:
    """Where containerd passes the restore annotation to the runtime wrapper, restore pods go without
    the gate init container (core/podspec.gate_needed): doctor shows it per node."""
    kube = healthy("n1", "n2")
    held = facts()
    held["node"]["containerd"]["podAnnotations"] = [K.ANN_RESUME_POLICY, K.ANN_RESTORE_FROM]
    n1 = kube.get("Node", "", "n1")
    assert n1 is not None
    n1["metadata"]["annotations"][K.ANN_NODE_FACTS] = json.dumps(held)
    report = doctor(kube=kube)
    assert by_node(report)["n1"]["holdsRestorePods"] is True and by_node(report)["n2"]["holdsRestorePods"] is False


def test_without_the_agent_every_node_says_so_and_the_report_is_not_ok() -> None:
    kube = FakeKube()  # the CRDs only: an install that never finished, or an uninstalled agent
    kube.add(node("n1"))
    kube.add(node("n2"))
    report = doctor(kube=kube)
    assert report["ok"] is False
    assert [(c["check"], c["detail"]) for c in report["checks"]] == [
        (CRD, "present"), (DS, "missing"), (RC, "missing"), (BROKER, NO_BROKER)
    ]  # fmt: skip
    for n in report["nodes"]:
        assert n["agentPod"] == "" and n["agentReady"] is False
        assert n["criuVersion"] == UNKNOWN and n["criu"]["path"] == UNKNOWN and n["blockers"] == [NOT_PUBLISHED]


def test_a_blocked_node_makes_the_report_not_ok_and_only_it_lists_the_blocker() -> None:
    kube = healthy("n1", "n2")
    blocked = kube.get("Node", "", "n2")
    assert blocked is not None
    blocker = "criu check failed: Error (criu/cr-check.c:1): UFFD is not supported"
    blocked["metadata"]["annotations"][K.ANN_NODE_FACTS] = json.dumps(facts(blocker))
    report = doctor(kube=kube)
    assert report["ok"] is False and all(c["ok"] for c in report["checks"])
    assert by_node(report)["n1"]["blockers"] == [] and by_node(report)["n2"]["blockers"] == [blocker]
    assert by_node(report)["n2"]["agentReady"] is True  # the agent runs; the node cannot snapshot


def test_an_agent_that_is_not_ready_makes_the_report_not_ok() -> None:
    kube = healthy("n1", "n2")
    pod = kube.get("Pod", K.AGENT_NAMESPACE, f"{K.AGENT_NAME}-n2")
    assert pod is not None
    pod["status"]["conditions"] = [{"type": "Ready", "status": "False"}]
    report = doctor(kube=kube)
    assert report["ok"] is False
    assert by_node(report)["n1"]["agentReady"] is True and by_node(report)["n2"]["agentReady"] is False


@pytest.mark.parametrize("ready_first", [True, False])
def test_of_two_agent_pods_on_a_node_the_ready_one_is_reported(ready_first: bool) -> None:
    kube = healthy("n1")
    kube.objects.pop(("v1", "Pod", K.AGENT_NAMESPACE, f"{K.AGENT_NAME}-n1"))
    kube.add(agent_pod("n1", name="agent-a", ready=ready_first))  # a rolling update: old and new
    kube.add(agent_pod("n1", name="agent-b", ready=not ready_first))
    kube.add(agent_pod("gone", name="agent-c"))  # a node no longer listed is not reported
    report = doctor(kube=kube)
    assert report["nodes"] == [by_node(report)["n1"]]
    assert by_node(report)["n1"]["agentPod"] == ("agent-a" if ready_first else "agent-b")
    assert report["ok"] is True


def test_a_user_who_cannot_read_the_agents_or_the_crd_is_told_so_not_that_they_are_missing() -> None:
    kube = healthy("n1")
    kube.deny("list_pods", f"list pods in {K.AGENT_NAMESPACE}")
    report = doctor(kube=kube)
    assert report["ok"] is False
    assert report["error"].startswith(f"cannot list agent pods: list pods in {K.AGENT_NAMESPACE}: forbidden")
    assert by_node(report)["n1"]["agentReady"] == UNKNOWN and by_node(report)["n1"]["criuVersion"] == "4.2.1"
    kube.deny("get_object", "get customresourcedefinition")
    check = doctor(kube=kube)["checks"][0]
    assert check["ok"] is False and check["detail"].startswith("cannot read: get customresourcedefinition")


def test_a_user_who_cannot_list_nodes_gets_the_cluster_checks_and_the_reason() -> None:
    kube = healthy("n1")
    kube.deny("list_nodes", "list nodes")
    report = doctor(kube=kube)
    assert report["ok"] is False and report["nodes"] == []
    assert report["error"].startswith("cannot list nodes: list nodes: forbidden")
    assert all(c["ok"] for c in report["checks"])


def test_the_command_exits_1_and_names_what_is_bad(monkeypatch: pytest.MonkeyPatch) -> None:
    kube = FakeKube()
    kube.add(node("n1"))
    monkeypatch.setattr(wiring, "kube_client", lambda: kube)
    result = CliRunner().invoke(cli_main.cli, ["doctor"], catch_exceptions=False)
    assert result.exit_code == 1
    assert f"BAD {DS}: missing" in result.output and f"ok  {CRD}: present" in result.output
    monkeypatch.setattr(wiring, "kube_client", lambda: healthy("n1"))
    assert CliRunner().invoke(cli_main.cli, ["doctor"], catch_exceptions=False).exit_code == 0


BROKER = f"key broker {K.AGENT_NAMESPACE}/{K.KEY_BROKER_NAME}"
NO_BROKER = "not installed: every node's agent reads every namespace's key"


def _broker(replicas: int, available: int) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": K.KEY_BROKER_NAME, "namespace": K.AGENT_NAMESPACE},
        "spec": {"replicas": replicas},
        "status": {"availableReplicas": available},
    }


def test_doctor_says_who_reads_the_namespace_keys_and_whether_the_broker_answers() -> None:
    kube = healthy("n1")
    kube.add(_broker(2, 2))  # the default install's broker, both replicas up
    report = doctor(kube=kube)
    assert report["ok"] is True and report["checks"][-1] == {
        "check": BROKER,
        "ok": True,
        "detail": "2/2 replicas available",
    }
    kube.objects[("apps/v1", "Deployment", K.AGENT_NAMESPACE, K.KEY_BROKER_NAME)]["status"] = {}
    report = doctor(kube=kube)  # none available: every sealed save and restore would fail
    assert report["ok"] is False
    assert report["checks"][-1] == {"check": BROKER, "ok": False, "detail": "0/2 replicas available"}
