"""A tenant gets nothing through the agent that its own rights do not grant, decided by the API server.

On the real cluster, with the policies that `kubectl snapshot install` applied (the `agent` fixture):
a tenant ServiceAccount holding only namespace-scoped create on pods and podsnapshots (impersonated
with ``kubectl --as``) tries what the issue lists, and the API server's admission (the CEL of
deploy/admission.py, evaluated by the real server, nothing reimplemented here) says no; the
controls show the same requests pass once the right is there. Requests are server-side dry runs
where possible (admission runs, nothing is stored, no registry is contacted). The agent's own
privileges are read from the live RBAC objects, and its node-bound token is tried on both nodes.
"""

from __future__ import annotations

import base64
import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubectl_snapshot.adapters.kube import KubeClient
from kubectl_snapshot.adapters.signatures import trust_from_data
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import PermissionDenied
from kubectl_snapshot.core.provenance import SigningKey, node_key_entries
from kubectl_snapshot.deploy import admission, keys, rbac, trust
from kubectl_snapshot.deploy import resume_admission as resume
from tests.e2e.test_plugin_errors import _sa_kubeconfig
from tests.support.agent import AgentInstall, agent
from tests.support.cluster import Cluster, cluster, namespace
from tests.support.plugin_cli import PluginRun, ks_plugin

__all__ = ["agent", "cluster", "ks_plugin", "namespace"]  # fixtures

pytestmark = pytest.mark.e2e

DIGEST = "sha256:" + "0123456789abcdef" * 4
RBAC_API = "rbac.authorization.k8s.io/v1"
SECOND_REGISTRY = "127.0.0.1:5006"  # a name only: dry runs never contact a registry


def _role(ns: str, name: str, rules: list[dict[str, Any]]) -> dict[str, Any]:
    return {"apiVersion": RBAC_API, "kind": "Role", "metadata": {"name": name, "namespace": ns}, "rules": rules}


def _binding(ns: str, name: str, kind: str, role: str, sa: str) -> dict[str, Any]:
    return {
        "apiVersion": RBAC_API,
        "kind": "RoleBinding",
        "metadata": {"name": name, "namespace": ns},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": role},
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}],
    }


def _secret(ns: str, name: str) -> dict[str, Any]:
    config = base64.b64encode(json.dumps({"auths": {}}).encode()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": ns},
        "type": "kubernetes.io/dockerconfigjson",
        "data": {".dockerconfigjson": config},
    }


class Tenant:
    """A ServiceAccount with only create/get/list/watch on pods and podsnapshots in its namespace."""

    def __init__(self, cluster: Cluster, ns: str) -> None:
        self.cluster, self.ns = cluster, ns
        self.user = f"system:serviceaccount:{ns}:tenant"

    def create(self, obj: dict[str, Any], *, as_admin: bool = False) -> subprocess.CompletedProcess[str]:
        who = [] if as_admin else ["--as", self.user]
        return self.cluster.kubectl(
            *who, "create", "--dry-run=server", "-f", "-", "-o", "name", input=json.dumps(obj), check=False
        )

    def snapshot(self, *, as_admin: bool = False, **spec: Any) -> subprocess.CompletedProcess[str]:
        body = {"podName": "web", "destination": f"{self.cluster.registry}/tenant-ok/web:1", **spec}
        obj = {"apiVersion": K.API_VERSION, "kind": K.KIND, "metadata": {"name": "s", "namespace": self.ns}}
        return self.create({**obj, "spec": body}, as_admin=as_admin)

    def restore_pod(self, ref: str | None = None, secret: str | None = None) -> subprocess.CompletedProcess[str]:
        annotations = {K.ANN_RESTORE_FROM: ref or f"{self.cluster.registry}/tenant-ok/web@{DIGEST}"}
        if secret:
            annotations[K.ANN_REGISTRY_SECRET] = secret
        return self.create(_pod(self.ns, "web-restored", self.cluster.busybox_image, annotations=annotations))


def _pod(
    ns: str, name: str, image: str, *, annotations: dict[str, str] | None = None, node: str | None = None
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [{"name": "c", "image": image, "command": ["sleep", "3600"]}],
        "terminationGracePeriodSeconds": 1,
    }
    if node:
        spec["nodeName"] = node
    meta: dict[str, Any] = {"name": name, "namespace": ns, "annotations": annotations or {}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def denied(proc: subprocess.CompletedProcess[str], policy: str, *words: str) -> None:
    assert proc.returncode != 0, proc.stdout
    assert f"ValidatingAdmissionPolicy '{policy}'" in proc.stderr, proc.stderr
    for w in words:
        assert w in proc.stderr, (w, proc.stderr)


def admitted(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, proc.stderr


@pytest.fixture
def tenant(cluster: Cluster, namespace: str, agent: AgentInstall) -> Tenant:
    ns = namespace
    cluster.kubectl(
        "annotate", "namespace", ns, "--overwrite",
        f"{K.ANN_ALLOWED_DESTINATIONS}={cluster.registry}/tenant-ok, {SECOND_REGISTRY}/team",
        f"{K.ANN_INSECURE_REGISTRIES}={cluster.registry}",
    )  # fmt: skip
    rules = [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["create", "get", "list", "watch"]},
        {"apiGroups": [K.GROUP], "resources": [K.PLURAL], "verbs": ["create", "get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["mine"], "verbs": ["get"]},
    ]
    cluster.apply(
        [
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "tenant", "namespace": ns}},
            _role(ns, "tenant", rules),
            _binding(ns, "tenant", "Role", "tenant", "tenant"),
            _secret(ns, "creds"),  # the tenant cannot read this one
            _secret(ns, "mine"),
        ]
    )
    return Tenant(cluster, ns)


def test_snapshot_destinations_insecure_and_secrets(tenant: Tenant, cluster: Cluster) -> None:
    reg, policy = cluster.registry, admission.SNAPSHOT_POLICY
    admitted(tenant.snapshot())  # control: on the list, nothing else asked
    admitted(tenant.snapshot(destination=f"{SECOND_REGISTRY}/team/sub/web"))
    denied(tenant.snapshot(destination=f"{reg}/other/web:1"), policy, "is not allowed in namespace", "tenant-ok")
    denied(tenant.snapshot(destination=f"{reg}/tenant-ok-evil/web:1"), policy, "is not allowed")  # not a prefix
    denied(tenant.snapshot(destination=f"{reg}:443/tenant-ok/web"), policy)  # not a registry either
    denied(tenant.snapshot(destination="tenant-ok/web"), policy, "explicit")  # docker.io implied
    # insecure only for a listed registry
    admitted(tenant.snapshot(insecure=True))
    denied(
        tenant.snapshot(destination=f"{SECOND_REGISTRY}/team/web", insecure=True),
        policy,
        f"insecure (plain HTTP) to {SECOND_REGISTRY} is not allowed",
    )
    # a Secret the tenant cannot read is refused, one it can read passes
    denied(tenant.snapshot(registrySecret="creds"), policy, "you cannot get secret creds")
    admitted(tenant.snapshot(registrySecret="mine"))
    # stop deletes the pod: only for those who may delete it; another namespace's pod: never
    denied(tenant.snapshot(stop=True), policy, "you need permission to delete it")
    denied(tenant.snapshot(podNamespace="kube-system"), policy, "spec.podNamespace")
    # who may rewrite the namespace's lists is not bound by them (the cluster admin here)
    admitted(tenant.snapshot(destination=f"{reg}/other/web:1", insecure=True, stop=True, as_admin=True))


def test_only_the_agent_writes_the_keys_resume_selects_saves_by(tenant: Tenant, cluster: Cluster) -> None:
    """A save labelled as another workload's (or pre-claimed) would steer an automatic resume: nobody
    but the agent may create a PodSnapshot carrying those keys, not even a cluster admin."""
    policy = admission.SNAPSHOT_POLICY

    def snap(labels: dict[str, str], annotations: dict[str, str], as_admin: bool = False) -> Any:
        meta = {"name": "s", "namespace": tenant.ns, "labels": labels, "annotations": annotations}
        body = {"podName": "web", "destination": f"{cluster.registry}/tenant-ok/web:1"}
        return tenant.create(
            {"apiVersion": K.API_VERSION, "kind": K.KIND, "metadata": meta, "spec": body}, as_admin=as_admin
        )

    admitted(snap({K.LABEL_POD: "web", "team": "a"}, {"note": "x"}))  # what the plugin writes, plus the user's own
    denied(snap({K.LABEL_POD: "other"}, {}), policy, "must name spec.podName")
    for key in (
        K.LABEL_WORKLOAD_KIND,
        K.LABEL_WORKLOAD_NAME,
        K.LABEL_POD_UID,
        K.LABEL_POLICY,
        K.LABEL_COMPLETION_INDEX,
    ):
        denied(snap({key: "x"}, {}), policy, "written by the node agent only")
    for key in (K.ANN_CLAIMED_BY, K.ANN_POD_IMAGES):
        denied(snap({}, {key: "x"}), policy, "written by the node agent only")
    denied(snap({K.LABEL_WORKLOAD_NAME: "x"}, {}, as_admin=True), policy, "written by the node agent only")


def test_plugin_says_what_admission_refused_and_what_to_do(
    tenant: Tenant, cluster: Cluster, ks_plugin: PluginRun, tmp_path: Path
) -> None:
    web = _pod(tenant.ns, "web", cluster.busybox_image)
    cluster.apply(web)
    cluster.kubectl("wait", "--for=condition=Ready", "pod/web", "-n", tenant.ns, "--timeout=120s")
    kubeconfig = _sa_kubeconfig(cluster, tenant.ns, "tenant", tmp_path / "tenant.kubeconfig")
    proc = ks_plugin("pod/web", "--to", f"{cluster.registry}/other/web", kubeconfig=kubeconfig)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("error: ") and "is not allowed in namespace" in proc.stderr, proc.stderr
    assert "hint: use a registry/repository the namespace allows" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert cluster.get_json(K.PLURAL, "-n", tenant.ns)["items"] == []  # nothing reached the agent


def test_restore_needs_its_own_verb_a_listed_source_and_a_readable_secret(tenant: Tenant, cluster: Cluster) -> None:
    reg, policy, ns = cluster.registry, admission.RESTORE_POLICY, tenant.ns
    # create pods is not enough to restore
    denied(tenant.restore_pod(), policy, f"needs the {K.RESTORE_VERB} verb", "kubectl-snapshot-restore")
    plain = _pod(ns, "plain", cluster.busybox_image)
    admitted(tenant.create(plain))  # control: ordinary pods are not this policy's business
    cluster.apply(_binding(ns, "restore", "ClusterRole", rbac.RESTORE_ROLE, "tenant"))
    cluster.wait_for("the restore verb", lambda: tenant.restore_pod().returncode == 0, timeout=30)
    denied(tenant.restore_pod(f"{reg}/other/web@{DIGEST}"), policy, "restore source", "is not allowed")
    denied(tenant.restore_pod(f"{reg}/tenant-ok/web:latest"), policy, "@sha256:DIGEST")
    denied(tenant.restore_pod(secret="creds"), policy, "you cannot get secret creds")
    admitted(tenant.restore_pod(secret="mine"))


def test_restore_annotations_cannot_be_added_later(tenant: Tenant, cluster: Cluster) -> None:
    ns, name = tenant.ns, f"later-{uuid.uuid4().hex[:6]}"
    body = _pod(ns, name, cluster.busybox_image)
    body["spec"]["nodeSelector"] = {"kubectl-snapshot.io/e2e-nowhere": "true"}  # stays Pending, never runs
    cluster.apply(body)
    ref = f"{cluster.registry}/tenant-ok/web@{DIGEST}"
    for what in (K.ANN_RESTORE_FROM, K.ANN_REGISTRY_SECRET):
        value = ref if what == K.ANN_RESTORE_FROM else "mine"
        # not even the cluster admin: the agent would act on a pod the restore checks never saw
        proc = cluster.kubectl("annotate", "pod", name, "-n", ns, f"{what}={value}", "--dry-run=server", check=False)
        denied(proc, admission.RESTORE_POLICY, "cannot be added or changed later")


# --- the agent --------------------------------------------------------------------------------------


def _agent_bindings(cluster: Cluster) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    def binds_agent(b: dict[str, Any]) -> bool:
        return any(
            s.get("kind") == "ServiceAccount"
            and s.get("name") == K.AGENT_NAME
            and s.get("namespace") == K.AGENT_NAMESPACE
            for s in b.get("subjects") or []
        )

    crbs = [b for b in cluster.get_json("clusterrolebindings")["items"] if binds_agent(b)]
    rbs = [b for b in cluster.get_json("rolebindings", "--all-namespaces")["items"] if binds_agent(b)]
    return crbs, rbs


def _rules(cluster: Cluster, ref: dict[str, Any], ns: str | None) -> list[dict[str, Any]]:
    if ref["kind"] == "ClusterRole":
        return list(cluster.get_json("clusterrole", ref["name"]).get("rules") or [])
    return list(cluster.get_json("role", ref["name"], "-n", str(ns)).get("rules") or [])


def _grants(rules: list[dict[str, Any]], resource: str, verb: str) -> bool:
    return any(
        ("*" in r.get("resources", []) or resource in r.get("resources", []))
        and ("*" in r.get("verbs", []) or verb in r.get("verbs", []))
        and ("*" in r.get("apiGroups", []) or "" in r.get("apiGroups", []))
        for r in rules
    )


def test_agent_rbac_has_no_cluster_wide_secrets_or_pod_patch(cluster: Cluster, agent: AgentInstall) -> None:
    """Read from the live objects: every ClusterRoleBinding of the agent and the rules it grants."""
    crbs, rbs = _agent_bindings(cluster)
    assert sorted(b["metadata"]["name"] for b in crbs) == sorted([K.AGENT_NAME, resume.AGENT_RESUME_ROLE])
    for b in crbs:
        rules = _rules(cluster, b["roleRef"], None)
        assert rules, b
        for resource, verb in (
            ("secrets", "get"), ("secrets", "list"), ("secrets", "watch"),
            ("pods", "patch"), ("pods", "update"), ("pods", "create"), ("pods/exec", "create"),
            ("nodes", "update"), ("nodes", "delete"), ("nodes/proxy", "get"), ("nodes/status", "patch"),
        ):  # fmt: skip
            assert not _grants(rules, resource, verb), (b["metadata"]["name"], resource, verb)
    # the only namespaced grants are the per-namespace registry-Secret bindings, each get on secrets only,
    # and (encryption at rest) the one key Secret in the agent's own namespace, by name
    for b in rbs:
        if b["roleRef"]["name"] == keys.ROLE:
            assert b["metadata"]["namespace"] == K.AGENT_NAMESPACE and b["roleRef"]["kind"] == "Role"
            assert _rules(cluster, b["roleRef"], K.AGENT_NAMESPACE) == keys.key_role({})["rules"]
            continue
        if b["roleRef"]["name"] == trust.ROLE:  # get and patch on the trust ConfigMap alone, by name
            assert b["metadata"]["namespace"] == K.AGENT_NAMESPACE and b["roleRef"]["kind"] == "Role"
            assert _rules(cluster, b["roleRef"], K.AGENT_NAMESPACE) == trust.trust_role({})["rules"]
            continue
        assert b["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": K.AGENT_SECRETS_ROLE,
        }
    role = cluster.get_json("clusterrole", K.AGENT_SECRETS_ROLE)
    assert role["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]
    # and the authorizer agrees
    for verb, resource in (("get", "secrets"), ("patch", "pods"), ("update", "pods")):
        proc = cluster.kubectl("auth", "can-i", verb, resource, "--all-namespaces", "--as", K.AGENT_USER, check=False)
        assert proc.stdout.strip() == "no", (verb, resource, proc.stdout)


def test_agent_reads_secrets_only_where_a_namespace_admin_bound_it(
    cluster: Cluster, namespace: str, agent: AgentInstall
) -> None:
    def can(ns: str) -> bool:
        proc = cluster.kubectl("auth", "can-i", "get", "secrets", "-n", ns, "--as", K.AGENT_USER, check=False)
        return proc.stdout.strip() == "yes"

    assert not can(namespace)
    cluster.apply(rbac.agent_secrets_binding(namespace))
    cluster.wait_for("the RoleBinding to take effect", lambda: can(namespace), timeout=30)
    assert not can("default") and not can(K.AGENT_NAMESPACE)


@pytest.fixture
def agent_token(cluster: Cluster, agent: AgentInstall, tmp_path: Path) -> Iterator[tuple[str, Path, Path]]:
    """A kubeconfig with a token of the agent's ServiceAccount bound to its pod on the first node
    (what the kubelet gives the agent), and one with an unbound token of the same ServiceAccount."""
    node = cluster.nodes[0]
    pod = agent.agent_pod(node)
    assert pod is not None
    bound = cluster.kubectl(
        "create", "token", K.AGENT_NAME, "-n", K.AGENT_NAMESPACE, "--duration=10m",
        "--bound-object-kind=Pod", f"--bound-object-name={pod['metadata']['name']}",
        f"--bound-object-uid={pod['metadata']['uid']}",
    ).stdout.strip()  # fmt: skip
    unbound = cluster.kubectl("create", "token", K.AGENT_NAME, "-n", K.AGENT_NAMESPACE, "--duration=10m").stdout.strip()
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    server = admin["clusters"][0]["cluster"]
    ca = server.get("certificate-authority-data")
    if ca is None:
        ca = base64.b64encode(Path(server["certificate-authority"]).read_bytes()).decode()

    def kubeconfig(token: str, path: Path) -> Path:
        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "e2e", "cluster": {"server": server["server"], "certificate-authority-data": ca}}],
            "users": [{"name": "agent", "user": {"token": token}}],
            "contexts": [{"name": "agent", "context": {"cluster": "e2e", "user": "agent"}}],
            "current-context": "agent",
        }
        path.write_text(json.dumps(cfg))
        return path

    yield node, kubeconfig(bound, tmp_path / "bound"), kubeconfig(unbound, tmp_path / "unbound")


def _kubectl_with(cluster: Cluster, kubeconfig: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(cluster.kubectl_bin), "--kubeconfig", str(kubeconfig), *args], capture_output=True, text=True, timeout=60
    )


def test_agent_writes_only_to_its_own_node(
    cluster: Cluster, namespace: str, agent_token: tuple[str, Path, Path]
) -> None:
    node, bound, unbound = agent_token
    other = next(n for n in cluster.nodes if n != node)
    who = json.loads(_kubectl_with(cluster, bound, "auth", "whoami", "-o", "json").stdout)
    assert who["status"]["userInfo"]["extra"][K.NODE_NAME_EXTRA] == [node]
    policy = admission.AGENT_NODES_POLICY

    def annotate_node(kubeconfig: Path, name: str, key: str) -> subprocess.CompletedProcess[str]:
        return _kubectl_with(
            cluster, kubeconfig, "annotate", "node", name, "--overwrite", f"{key}=e2e", "--dry-run=server"
        )

    admitted(annotate_node(bound, node, K.ANN_NODE_FACTS))  # control: its own node, its annotation
    denied(annotate_node(bound, other, K.ANN_NODE_FACTS), policy, f"bound to node {node}")
    denied(annotate_node(unbound, node, K.ANN_NODE_FACTS), policy, "bound to no node")
    denied(annotate_node(bound, node, "kubectl-snapshot.io/e2e-other"), policy, "may change only")
    label = _kubectl_with(cluster, bound, "label", "node", node, "e2e-label=x", "--dry-run=server")
    denied(label, policy, "may change only")

    # pods: the restore-status annotation through pods/status, delete, only on its own node
    mine, theirs = f"mine-{uuid.uuid4().hex[:6]}", f"theirs-{uuid.uuid4().hex[:6]}"
    cluster.apply(
        [
            _pod(namespace, mine, cluster.busybox_image, node=node),
            _pod(namespace, theirs, cluster.busybox_image, node=other),
        ]
    )
    # the agent's own adapter call (a merge PATCH of pods/status, no GET: the agent may not read pods/status)
    as_agent = KubeClient.from_config(str(bound))
    pods_policy = admission.AGENT_PODS_POLICY
    patched = as_agent.patch_pod_annotations(namespace, mine, {K.ANN_RESTORE_STATUS: "Failed: e2e"}, status=True)
    assert patched["metadata"]["annotations"][K.ANN_RESTORE_STATUS] == "Failed: e2e"
    # autosave: the time of the pod's last good save, the one other annotation it may set
    saved = as_agent.patch_pod_annotations(namespace, mine, {K.ANN_LAST_SAVE: "2026-01-01T00:00:00Z"}, status=True)
    assert saved["metadata"]["annotations"][K.ANN_LAST_SAVE] == "2026-01-01T00:00:00Z"
    with pytest.raises(PermissionDenied) as theirs_err:
        as_agent.patch_pod_annotations(namespace, theirs, {K.ANN_RESTORE_STATUS: "Failed: e2e"}, status=True)
    for words in (f"ValidatingAdmissionPolicy '{pods_policy}'", f"bound to node {node}", f"on node {other}"):
        assert words in theirs_err.value.message, theirs_err.value.message
    with pytest.raises(PermissionDenied) as other_err:
        as_agent.patch_pod_annotations(namespace, mine, {"kubectl-snapshot.io/e2e": "x"}, status=True)
    assert "may change only" in other_err.value.message and "docs/security.md" in (other_err.value.hint or "")
    with pytest.raises(PermissionDenied, match='cannot patch resource "pods"'):
        as_agent.patch_pod_annotations(namespace, mine, {K.ANN_RESTORE_STATUS: "x"})  # no pods patch at all
    admitted(_kubectl_with(cluster, bound, "delete", "pod", mine, "-n", namespace, "--dry-run=server"))
    deleted = _kubectl_with(cluster, bound, "delete", "pod", theirs, "-n", namespace, "--dry-run=server")
    denied(deleted, pods_policy, f"on node {other}")


def test_agent_writes_podsnapshot_status_only_for_its_own_node(
    cluster: Cluster, namespace: str, agent: AgentInstall, agent_token: tuple[str, Path, Path]
) -> None:
    """The agent's PodSnapshot writes are node-bound too: only the status, claiming its own node, of an
    object no other node claimed (the policy cannot look up the pod; the agent checks that itself)."""
    from kubectl_snapshot.core import status as S

    node, bound, unbound = agent_token
    other = next(n for n in cluster.nodes if n != node)
    policy = admission.AGENT_SNAPSHOTS_POLICY
    # a pod no node runs (Pending, no nodeName): no agent claims PodSnapshots of it, so the statuses
    # below are only the ones this test writes
    nowhere = _pod(namespace, "nowhere", cluster.busybox_image)
    nowhere["spec"]["nodeSelector"] = {"kubernetes.io/hostname": "e2e-no-such-node"}
    free, mine, theirs = (f"{n}-{uuid.uuid4().hex[:6]}" for n in ("free", "mine", "theirs"))

    def psnap(name: str) -> dict[str, Any]:
        spec = {"podName": "nowhere", "destination": f"{cluster.registry}/e2e/nowhere"}
        return {"apiVersion": K.API_VERSION, "kind": K.KIND, "metadata": {"name": name, "namespace": namespace},
                "spec": spec}  # fmt: skip

    cluster.apply([nowhere, psnap(free), psnap(mine), psnap(theirs)])

    def patch(kubeconfig: Path | None, name: str, status: dict[str, Any]) -> subprocess.CompletedProcess[str]:
        args = ["patch", K.SINGULAR, name, "-n", namespace, "--subresource=status", "--type=merge"]
        args += ["-p", json.dumps({"status": status})]
        if kubeconfig is None:  # the cluster admin: not the agent, not matched by the policy
            return cluster.kubectl(*args)
        return _kubectl_with(cluster, kubeconfig, *args, "--dry-run=server")

    # claimed earlier (finished: no agent acts on a Failed one) by this node and by the other one
    patch(None, mine, {"phase": K.PHASE_FAILED, "node": node})
    patch(None, theirs, {"phase": K.PHASE_FAILED, "node": other})

    claim = S.claimed(node=node, now="2026-01-01T00:00:00Z", generation=1)
    admitted(patch(bound, free, claim))  # control: an unclaimed object, for its own node
    admitted(patch(bound, mine, {"message": "e2e"}))  # control: its own claim (progress, result)
    denied(patch(bound, free, {**claim, "node": other}), policy, f"bound to node {node}", f"would be {other}")
    denied(patch(bound, free, {"message": "e2e"}), policy, f"bound to node {node}", "would be unset")
    denied(patch(unbound, free, claim), policy, "bound to no node")
    denied(patch(bound, theirs, {"message": "e2e"}), policy, f"claimed by node {other}")
    denied(patch(bound, theirs, {"node": node}), policy, f"claimed by node {other}")  # no taking over
    denied(patch(bound, mine, {"node": other}), policy, f"would be {other}")  # no handing over

    # the agent's own adapter call, stored for real: the claim it makes with the resourceVersion
    as_agent = KubeClient.from_config(str(bound))
    rv = cluster.get_json(K.SINGULAR, free, "-n", namespace)["metadata"]["resourceVersion"]
    done = {**claim, "phase": K.PHASE_FAILED}  # terminal: the real agent leaves it alone
    assert as_agent.patch_snapshot_status(namespace, free, done, resource_version=rv)["status"]["node"] == node
    with pytest.raises(PermissionDenied) as err:
        as_agent.patch_snapshot_status(namespace, theirs, {"message": "e2e"})
    for words in (f"ValidatingAdmissionPolicy '{policy}'", f"bound to node {node}", f"claimed by node {other}"):
        assert words in err.value.message, err.value.message

    # the real agents under the policy: a PodSnapshot of a missing pod is claimed by every agent at
    # once (resourceVersion: the loser gets a 409 before admission runs), exactly one reports it
    cluster.apply(psnap("missing") | {"spec": {"podName": "no-such-pod", "destination": f"{cluster.registry}/e2e/x"}})

    def reported() -> bool:
        st = cluster.get_json(K.SINGULAR, "missing", "-n", namespace).get("status") or {}
        return st.get("phase") == K.PHASE_FAILED

    cluster.wait_for("an agent to claim and fail the PodSnapshot of a missing pod", reported, 60)
    st = cluster.get_json(K.SINGULAR, "missing", "-n", namespace)["status"]
    assert st["node"] in cluster.nodes and "not found" in json.dumps(st), st
    for n in cluster.nodes:
        pod = agent.agent_pod(n)
        assert pod is not None
        logs = cluster.kubectl("logs", "-n", K.AGENT_NAMESPACE, pod["metadata"]["name"], "--since=5m").stdout
        assert policy not in logs, logs[-4000:]  # no agent write was refused by the new policy


def test_object_count_quota_limits_podsnapshots(tenant: Tenant, cluster: Cluster) -> None:
    """Threat E1: an admin caps a namespace's PodSnapshots with Kubernetes' own object-count quota."""
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "snapshots", "namespace": tenant.ns},
        "spec": {"hard": {f"count/{K.PLURAL}.{K.GROUP}": "1"}},
    }
    cluster.apply(quota)
    cluster.wait_for(
        "the quota to be counted",
        lambda: "hard" in (cluster.get_json("resourcequota", "snapshots", "-n", tenant.ns).get("status") or {}),
        timeout=60,
    )

    def create(name: str) -> subprocess.CompletedProcess[str]:
        body = {"podName": "ghost", "destination": f"{cluster.registry}/tenant-ok/ghost:1"}
        obj = {"apiVersion": K.API_VERSION, "kind": K.KIND, "metadata": {"name": name, "namespace": tenant.ns}}
        return cluster.kubectl(
            "--as", tenant.user, "create", "-f", "-", input=json.dumps({**obj, "spec": body}), check=False
        )

    admitted(create("first"))  # a pod that does not exist: the agent only marks it Failed
    second = create("second")
    assert second.returncode != 0 and "exceeded quota: snapshots" in second.stderr, second.stderr


def test_an_agent_token_adds_only_its_own_nodes_key(
    cluster: Cluster, agent: AgentInstall, agent_token: tuple[str, Path, Path]
) -> None:
    """Issue 42 item 2: a stolen agent token is worth one node. Each running agent has registered its
    node's own signing key (`<key id>.pub` + `<key id>.node`) and mounts no cluster signing key; a token
    bound to node A's agent may add A's key, and the API server refuses a key tagged for node B, any
    change or removal of an entry that is there, a key bound to no node, and a token bound to no node."""
    node, bound, unbound = agent_token
    other = next(n for n in cluster.nodes if n != node)
    policy = admission.AGENT_TRUST_POLICY

    def live() -> dict[str, str]:
        return dict(cluster.get_json("configmap", K.TRUST_CONFIG_MAP, "-n", K.AGENT_NAMESPACE).get("data") or {})

    def registered() -> bool:
        return set(cluster.nodes) <= set(trust_from_data(live()).nodes.values())

    cluster.wait_for("every agent to register its node's key", registered, timeout=120)
    data = live()
    policy_now = trust_from_data(data)
    theirs = next(kid for kid, n in policy_now.nodes.items() if n == other)
    for n in cluster.nodes:
        pod = agent.agent_pod(n)
        assert pod is not None
        secrets = [v["secret"]["secretName"] for v in pod["spec"]["volumes"] if "secret" in v]
        assert K.SIGNING_KEY_SECRET not in secrets, secrets

    def patch(kubeconfig: Path, entries: dict[str, str | None]) -> subprocess.CompletedProcess[str]:
        return _kubectl_with(
            cluster, kubeconfig, "patch", "configmap", K.TRUST_CONFIG_MAP, "-n", K.AGENT_NAMESPACE,
            "--type=merge", "-p", json.dumps({"data": entries}), "--dry-run=server",
        )  # fmt: skip

    def new_key(for_node: str) -> dict[str, str | None]:
        return dict(node_key_entries(SigningKey.generate().public, for_node))

    admitted(patch(bound, new_key(node)))  # control: its own node's key (a re-imaged node adds one)
    denied(patch(bound, new_key(other)), policy, f"bound to node {node}", f"not of node {other}")
    denied(patch(bound, {**new_key(node), f"{theirs}.node": node}), policy, f"change or remove {theirs}.node")
    denied(patch(bound, {**new_key(node), f"{theirs}.pub": None}), policy, f"change or remove {theirs}.pub")
    denied(patch(bound, {"allow-unverified-snapshots": "true"}), policy, "change or remove allow-unverified")
    mine = SigningKey.generate().public
    denied(patch(bound, {f"{mine.id}.pub": mine.to_pem().decode()}), policy, "<key id>.pub and <key id>.node")
    denied(patch(unbound, new_key(node)), policy, "bound to no node")
    deleted = _kubectl_with(
        cluster, bound, "delete", "configmap", K.TRUST_CONFIG_MAP, "-n", K.AGENT_NAMESPACE, "--dry-run=server"
    )
    assert deleted.returncode != 0 and "forbidden" in deleted.stderr.lower(), deleted.stderr  # RBAC: no delete
    assert live() == data  # dry runs all: nothing changed
