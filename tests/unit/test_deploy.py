"""render(): the objects are what docs/kubernetes.md says, least privilege, and manifests/ matches them.

Pure checks of render()'s output; the same objects are applied to a real API server in
tests/e2e/test_agent_image.py. `kubectl kustomize` (offline, no cluster) checks the overlay when the
cluster's kubectl binary is built.
"""

from __future__ import annotations

import copy
import glob
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import InvalidArgument
from kubectl_snapshot.deploy import keys, render, trust
from kubectl_snapshot.deploy import resume_admission as resume

REPO = Path(__file__).resolve().parents[2]
GEN = REPO / "hack" / "gen-manifests.py"
LOCAL_NODES = {
    n: {
        "containerd_socket": f"/run/ks-cluster/{n}/containerd.sock",
        "kubelet_root": f"/var/lib/ks-cluster/{n}/kubelet",
        "containerd_dropin_dir": f"/var/lib/ks-cluster/{n}/containerd.d",
    }
    for n in ("ks-n1", "ks-n2")
}


def by_kind(objs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def pod_spec(objs: list[dict[str, Any]]) -> dict[str, Any]:
    spec: dict[str, Any] = by_kind(objs)[("DaemonSet", K.AGENT_NAME)]["spec"]["template"]["spec"]
    return spec


def test_apply_order_and_names() -> None:
    objs = render("reg.example/agent@sha256:" + "a" * 64)
    kinds = [o["kind"] for o in objs]
    assert kinds[:3] == ["CustomResourceDefinition"] * 3 and kinds[3] == "Namespace" and kinds[-1] == "DaemonSet"
    assert kinds.index("ServiceAccount") < kinds.index("ClusterRoleBinding") < kinds.index("DaemonSet")
    assert "ConfigMap" not in kinds  # only with per_node_paths
    for o in objs:
        if o["kind"] in ("ServiceAccount", "DaemonSet", "ConfigMap"):
            assert o["metadata"]["namespace"] == K.AGENT_NAMESPACE
    assert by_kind(objs)[("RuntimeClass", K.RUNTIME_CLASS)]["handler"] == K.RUNTIME_CLASS


def test_crd_schema() -> None:
    crd = by_kind(render("img"))[("CustomResourceDefinition", f"{K.PLURAL}.{K.GROUP}")]
    spec = crd["spec"]
    assert spec["group"] == K.GROUP and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == K.KIND and spec["names"]["shortNames"] == [K.SHORT_NAME]
    [version] = spec["versions"]
    assert version["name"] == K.VERSION and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Pod", "Phase", "Node", "Size", "Reference", "Age", "Stage", "Reason"]
    schema = version["schema"]["openAPIV3Schema"]
    s, st = schema["properties"]["spec"], schema["properties"]["status"]
    assert set(s["required"]) == {"podName", "destination"}
    assert set(s["properties"]) == {
        "podName", "podNamespace", "podUID", "destination", "registrySecret", "insecure", "stop", "includeVolumes",
        "ignoreLiveness",
    }  # fmt: skip
    assert s["properties"]["ignoreLiveness"]["default"] is False
    assert {"expectedFreezeSeconds", "freezeDeadlineSeconds"} <= set(st["properties"])
    assert s["properties"]["includeVolumes"]["default"] is True and s["properties"]["stop"]["default"] is False
    assert st["properties"]["phase"]["enum"] == [K.PHASE_PENDING, K.PHASE_RUNNING, K.PHASE_SUCCEEDED, K.PHASE_FAILED]
    assert {"bytesDone", "bytesTotal", "timings", "reference", "tag", "size", "message", "conditions"} <= set(
        st["properties"]
    )
    assert set(st["properties"]["timings"]["properties"]) == {
        "preflightMs", "freezeMs", "dumpMs", "packageMs", "uploadMs", "stopMs", "totalMs"
    }  # fmt: skip

    def structural(node: dict[str, Any], where: str) -> None:
        """Every node has a type (apiextensions rejects non-structural schemas)."""
        assert "type" in node, where
        for name, child in node.get("properties", {}).items():
            structural(child, f"{where}.{name}")
        if "items" in node:
            structural(node["items"], f"{where}[]")

    structural(schema, "root")


def rules(obj: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (g, r, v) for rule in obj["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]
    }


def test_agent_rbac_is_exactly_least_privilege() -> None:
    objs = by_kind(render("img"))
    role = objs[("ClusterRole", K.AGENT_NAME)]
    expected = {
        *((K.GROUP, "podsnapshots", v) for v in ("get", "list", "watch")),
        *((K.GROUP, "podsnapshots/status", v) for v in ("get", "update", "patch")),
        *(("", "pods", v) for v in ("get", "list", "watch", "delete")),
        ("", "pods/status", "patch"),
        *(("", "events", v) for v in ("create", "patch")),
        *(("", "nodes", v) for v in ("get", "patch")),
        ("authentication.k8s.io", "tokenreviews", "create"),
        ("authorization.k8s.io", "subjectaccessreviews", "create"),
        *((K.GROUP, "snapshotgrants", v) for v in ("get", "list")),  # may A's snapshot go to B?
        # autosave: policies read, this node's status entries applied, saves created and pruned
        *((K.GROUP, "snapshotpolicies", v) for v in ("get", "list", "watch")),
        (K.GROUP, "snapshotpolicies/status", "patch"),
        *((K.GROUP, "podsnapshots", v) for v in ("create", "delete")),
        ("apps", "replicasets", "get"),  # a Deployment's pods: their ReplicaSet's owner
    }
    assert rules(role) == expected
    # secrets only through a per-namespace RoleBinding that nothing in render() creates
    assert rules(objs[("ClusterRole", K.AGENT_SECRETS_ROLE)]) == {("", "secrets", "get")}
    bound = {o["roleRef"]["name"] for o in objs.values() if o["kind"] in ("ClusterRoleBinding", "RoleBinding")}
    # and the one Secret of encryption keys in the agent's own namespace, by name (tests/unit/test_keystore.py),
    # and the trust ConfigMap its node's key is registered in (tests/unit/test_trust_admission.py)
    assert bound == {K.AGENT_NAME, keys.ROLE, resume.AGENT_RESUME_ROLE, trust.ROLE}
    assert rules(objs[("Role", trust.ROLE)]) == {("", "configmaps", "get"), ("", "configmaps", "patch")}
    # resume (autosave): provenance labels and claims (admission narrows the patch), policies, ReplicaSets
    assert rules(objs[("ClusterRole", resume.AGENT_RESUME_ROLE)]) == {
        (K.GROUP, "podsnapshots", "patch"),
        (K.GROUP, "snapshotpolicies", "get"),
        ("apps", "replicasets", "get"),
    }
    assert not any("*" in (g, r, v) for g, r, v in rules(role))
    binding = objs[("ClusterRoleBinding", K.AGENT_NAME)]
    assert binding["roleRef"]["name"] == K.AGENT_NAME
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": K.AGENT_NAME, "namespace": K.AGENT_NAMESPACE}]
    assert pod_spec(list(objs.values()))["serviceAccountName"] == K.AGENT_NAME


def test_the_agent_may_create_no_secret_anywhere() -> None:
    """Every role render() binds to the agent's ServiceAccount (or lets a namespace admin bind to it):
    no `create` on secrets, so a stolen agent token cannot mint a token Secret that outlives the node
    (the key Secret is created by install: tests/unit/test_keystore.py). `get` stays, by name or per
    namespace; the per-namespace Secrets role never includes create either."""
    objs = by_kind(render("img"))
    agent = {"kind": "ServiceAccount", "name": K.AGENT_NAME, "namespace": K.AGENT_NAMESPACE}
    bound = {
        (o["roleRef"]["kind"], o["roleRef"]["name"])
        for o in objs.values()
        if o["kind"] in ("ClusterRoleBinding", "RoleBinding") and agent in o["subjects"]
    }
    roles = [objs[b] for b in sorted(bound)] + [objs[("ClusterRole", K.AGENT_SECRETS_ROLE)]]
    assert len(roles) == 5  # the base role, the key Secret's, the trust ConfigMap's, resume's, and the one a
    # namespace admin binds
    granted = set().union(*(rules(r) for r in roles))
    assert ("", "secrets", "get") in granted  # (so the line below looks where it should)
    assert {(g, r, v) for g, r, v in granted if r == "secrets"} == {("", "secrets", "get"), ("", "secrets", "update")}
    assert not any(r in ("secrets", "*") and v in ("create", "*") for _g, r, v in granted)


def test_user_roles_aggregate_to_builtin_roles() -> None:
    objs = by_kind(render("img"))
    edit, view = objs[("ClusterRole", "kubectl-snapshot-edit")], objs[("ClusterRole", "kubectl-snapshot-view")]
    agg = "rbac.authorization.k8s.io/aggregate-to-"
    assert edit["metadata"]["labels"][agg + "edit"] == "true" and edit["metadata"]["labels"][agg + "admin"] == "true"
    assert view["metadata"]["labels"][agg + "view"] == "true" and agg + "edit" not in view["metadata"]["labels"]
    assert rules(edit) == {(K.GROUP, "podsnapshots", v) for v in ("create", "get", "list", "watch", "delete")}
    reader = objs[("ClusterRole", "kubectl-snapshot-metrics-reader")]
    assert reader["rules"] == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
    assert not any(k.startswith(agg) for k in reader["metadata"]["labels"])  # bound by hand, to the scraper
    assert rules(view) == {(K.GROUP, "podsnapshots", v) for v in ("get", "list", "watch")}
    restore = objs[("ClusterRole", "kubectl-snapshot-restore")]
    assert rules(restore) == {(K.GROUP, "podsnapshots", K.RESTORE_VERB)}
    assert restore["metadata"]["labels"][agg + "edit"] == "true" and agg + "view" not in restore["metadata"]["labels"]


def node_side(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The containers that run the agent's command line (every one but the freeze guard)."""
    return [c for c in spec["containers"] + spec["initContainers"] if c["name"] != "guard"]


def test_provenance_mounts_and_grants() -> None:
    """The agent reads the trust settings from the ConfigMap install makes (not manifests); it signs with its
    node's own key, so no pod of the agent mounts a signing key."""
    objs = render("img")
    assert not any(o["kind"] == "Secret" for o in objs)  # a private key never lands in manifests/
    m = mounts(pod_spec(objs))
    assert m[K.TRUST_DIR]["configMap"] == {"name": K.TRUST_CONFIG_MAP, "optional": True}
    assert K.TRUST_DIR not in mounts(pod_spec(objs), "install-node")
    for volume in pod_spec(objs)["volumes"]:
        assert (volume.get("secret") or {}).get("secretName") != K.SIGNING_KEY_SECRET, volume
    grant = by_kind(objs)[("ClusterRole", "kubectl-snapshot-grant")]
    labels = grant["metadata"]["labels"]
    assert labels["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
    assert "rbac.authorization.k8s.io/aggregate-to-edit" not in labels  # giving memory away is an admin's call
    crd = by_kind(objs)[("CustomResourceDefinition", f"snapshotgrants.{K.GROUP}")]
    assert crd["spec"]["scope"] == "Namespaced" and crd["spec"]["names"]["kind"] == "SnapshotGrant"


def mounts(spec: dict[str, Any], container: str = "agent") -> dict[str, dict[str, Any]]:
    [c] = [c for c in spec["containers"] + spec["initContainers"] if c["name"] == container]
    vols = {v["name"]: v for v in spec["volumes"]}
    return {m["mountPath"]: vols[m["name"]] for m in c["volumeMounts"]}


def test_daemonset_defaults() -> None:
    spec = pod_spec(render("reg.example/agent:1"))
    assert spec["hostPID"] and not spec["hostNetwork"] and spec["dnsPolicy"] == "ClusterFirst"
    host = pod_spec(render("reg.example/agent:1", host_network=True))
    assert host["hostNetwork"] and host["dnsPolicy"] == "ClusterFirstWithHostNet"
    for c in node_side(spec):
        assert c["securityContext"] == {"privileged": True}
        assert c["imagePullPolicy"] == "Always"  # a tag can move; digests use IfNotPresent
        env = {e["name"]: e for e in c["env"]}
        assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
        assert env["KUBECTL_SNAPSHOT_STATE_DIR"]["value"] == "/var/lib/kubectl-snapshot/$(NODE_NAME)"
        assert "KUBERNETES_SERVICE_HOST" not in env
        m = {p: v for p, v in mounts(spec, c["name"]).items() if "hostPath" in v}
        # containerd refuses HostToContainer when the host's / is a private mount (hosts without systemd)
        assert all("mountPropagation" not in vm for vm in c["volumeMounts"])
        # host paths at the same path inside; directories, never the socket file (containerd restarts)
        # the agent alone writes dumps that fit in memory to the host's tmpfs (shim/host/memwork.py)
        memory_work = {"/dev/shm/kubectl-snapshot": "/dev/shm/kubectl-snapshot"} if c["name"] == "agent" else {}
        assert {p: v["hostPath"]["path"] for p, v in m.items() if "hostPath" in v} == {
            "/var/lib/kubectl-snapshot": "/var/lib/kubectl-snapshot",
            "/opt/kubectl-snapshot": "/opt/kubectl-snapshot",
            "/var/lib/kubelet": "/var/lib/kubelet",
            "/run/containerd": "/run/containerd",
            "/etc/containerd/conf.d": "/etc/containerd/conf.d",
        } | memory_work
        assert m["/run/containerd"]["hostPath"]["type"] == "Directory"
        assert m["/var/lib/kubectl-snapshot"]["hostPath"]["type"] == "DirectoryOrCreate"
    [init] = spec["initContainers"]
    assert init["args"][0] == "install-node" and "--wrapper=/opt/kubectl-snapshot-runc.pyz" in init["args"]
    assert not any(a.startswith("--restart-command") for a in init["args"])
    [agent, guard] = spec["containers"]
    assert agent["args"][0] == "run" and f"--ready-file={K.READY_FILE}" in agent["args"]
    # the freeze guard: its own container of the same image, sharing only the socket's emptyDir
    assert guard["name"] == "guard" and guard["image"] == agent["image"]
    assert guard["command"] == ["python3", "-m", "shim.guard"] and guard["securityContext"] == {"privileged": True}
    [socket_arg] = [a for a in agent["args"] if a.startswith("--guard-socket=")]
    assert f"--socket={socket_arg.split('=', 1)[1]}" in guard["args"]
    assert mounts(spec, "guard") == {"/run/kubectl-snapshot-guard": {"name": "guard", "emptyDir": {}}}
    assert mounts(spec)["/run/kubectl-snapshot-guard"] == {"name": "guard", "emptyDir": {}}
    assert agent["readinessProbe"]["exec"]["command"] == ["test", "-f", K.READY_FILE]
    assert not any(a.startswith("--node-config") for a in agent["args"])
    for c in (init, agent):
        assert "--state-root=/var/lib/kubectl-snapshot" in c["args"] and "--opt-root=/opt/kubectl-snapshot" in c["args"]


def test_daemonset_for_two_nodes_on_one_machine() -> None:
    objs = render(
        "127.0.0.1:5005/agent@sha256:" + "b" * 64,
        api_server="https://127.0.0.1:6443",
        restart_command="restart-containerd {node}",
        per_node_paths=LOCAL_NODES,
    )
    cm = by_kind(objs)[("ConfigMap", "kubectl-snapshot-agent-nodes")]
    assert json.loads(cm["data"]["nodes.json"]) == LOCAL_NODES
    spec = pod_spec(objs)
    m = mounts(spec)
    # the parents shared by both nodes' paths, and none of the defaults every node overrides
    assert set(m) == {
        "/var/lib/kubectl-snapshot",
        "/opt/kubectl-snapshot",
        "/run/ks-cluster",
        "/var/lib/ks-cluster",
        "/etc/kubectl-snapshot/nodes",
        "/run/kubectl-snapshot-guard",
        "/dev/shm/kubectl-snapshot",  # one per machine: each node's agent keys its own directory in it
        K.TRUST_DIR,
    }
    assert m["/etc/kubectl-snapshot/nodes"] == {"name": "node-config", "configMap": {"name": cm["metadata"]["name"]}}
    for node_paths in LOCAL_NODES.values():
        for path in node_paths.values():
            assert any(path.startswith(d + "/") for d in m), path
    for c in spec["containers"] + spec["initContainers"]:
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["KUBERNETES_SERVICE_HOST"] == "127.0.0.1" and env["KUBERNETES_SERVICE_PORT"] == "6443"
        assert c["imagePullPolicy"] == "IfNotPresent"
    for c in node_side(spec):
        assert "--node-config=/etc/kubectl-snapshot/nodes/nodes.json" in c["args"]
        assert c["imagePullPolicy"] == "IfNotPresent"
    assert "--restart-command=restart-containerd {node}" in spec["initContainers"][0]["args"]


def test_no_host_mount_hides_the_image_contents() -> None:
    """The image's venv and wrapper must not sit under a hostPath mount (it would shadow them)."""
    spec = importlib.util.spec_from_file_location("agent_image", REPO / "hack" / "agent_image.py")
    assert spec and spec.loader
    image = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(image)
    for objs in (render("img"), render("img", per_node_paths=LOCAL_NODES)):
        for c in pod_spec(objs)["containers"] + pod_spec(objs)["initContainers"]:
            for m in c["volumeMounts"]:
                for path in (image.VENV, image.WRAPPER):
                    assert not (path + "/").startswith(m["mountPath"].rstrip("/") + "/"), (path, m)


def test_containers_do_not_share_dicts() -> None:
    """render()'s output may be edited by callers (and YAML dumpers must not write aliases)."""
    spec = pod_spec(render("img"))
    spec["containers"][0]["env"].append({"name": "X", "value": "1"})
    assert all(e["name"] != "X" for e in spec["initContainers"][0]["env"])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"api_server": "http://127.0.0.1:6443"},
        {"api_server": "https://127.0.0.1:notaport"},
        {"state_root": "relative/dir"},
        {"kubelet_root": "/var/lib/../kubelet"},
        {"per_node_paths": {"ks-n1": {"containerd_sock": "/run/x.sock"}}},
        {"per_node_paths": {"Bad_Node": {"kubelet_root": "/k"}}},
        {"per_node_paths": {"ks-n1": {"kubelet_root": "k"}}},
    ],
)
def test_bad_settings_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgument):
        render("img", **kwargs)


def test_manifests_are_up_to_date() -> None:
    proc = subprocess.run([sys.executable, str(GEN), "--check"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr


def _load_gen() -> Any:
    spec = importlib.util.spec_from_file_location("gen_manifests", GEN)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _apply_json_patch(doc: Any, ops: list[dict[str, Any]]) -> Any:
    doc = copy.deepcopy(doc)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent = doc
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent[p]
        if op["op"] == "remove":
            del parent[parts[-1]]
        else:
            parent[parts[-1]] = op["value"]
    return doc


def test_overlay_patches_turn_the_base_into_the_local_render() -> None:
    gen = _load_gen()
    base = {gen.key(o): o for o in render(gen.DEFAULT_IMAGE)}
    overlay_dir = REPO / "manifests" / "overlays" / "local-cluster"
    kustomization = yaml.safe_load((overlay_dir / "kustomization.yaml").read_text())
    for patch in kustomization["patches"]:
        t = patch["target"]
        [k] = [k for k in base if k[1] == t["kind"] and k[3] == t["name"]]
        base[k] = _apply_json_patch(base[k], yaml.safe_load((overlay_dir / patch["path"]).read_text()))
    for res in kustomization["resources"][1:]:
        for obj in yaml.safe_load_all((overlay_dir / res).read_text()):
            base[gen.key(obj)] = obj
    assert base == {gen.key(o): o for o in render(**gen.LOCAL_CLUSTER)}


def _kubectl() -> str | None:
    found = sorted(glob.glob("/var/cache/kubectl-snapshot/k8s-v*/bin/kubectl"))
    return shutil.which("kubectl") or (found[-1] if found else None)


@pytest.mark.parametrize("overlay", ["base", "overlays/local-cluster"])
def test_kustomize_builds_the_rendered_objects(overlay: str) -> None:
    kubectl = _kubectl()
    if kubectl is None:
        pytest.skip("no kubectl binary (hack/cluster/build.sh builds one)")
    gen = _load_gen()
    proc = subprocess.run(
        [kubectl, "kustomize", str(REPO / "manifests" / overlay)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    built = {gen.key(o): o for o in yaml.safe_load_all(proc.stdout)}
    params = gen.LOCAL_CLUSTER if overlay != "base" else {"image": gen.DEFAULT_IMAGE}
    assert built == {gen.key(o): o for o in render(**params)}


@pytest.mark.parametrize("per_node", [None, LOCAL_NODES])
def test_agent_cli_accepts_the_rendered_command_lines(per_node: dict[str, Any] | None) -> None:
    """The DaemonSet's args parse with the real agent CLI (click rejects unknown options before --help)."""
    from click.testing import CliRunner

    from shim.agent_cli import cli
    from shim.freeze_guard import parser as guard_parser

    spec = pod_spec(render("img", restart_command="restart {node}", per_node_paths=per_node))
    for c in node_side(spec):
        result = CliRunner().invoke(cli, [*c["args"], "--help"], env={"NODE_NAME": "ks-n1"})
        assert result.exit_code == 0, (c["name"], result.output)
    [guard] = [c for c in spec["containers"] if c["name"] == "guard"]
    args = guard_parser().parse_args(guard["args"])  # argparse exits on an unknown option
    assert args.socket == "/run/kubectl-snapshot-guard/guard.sock" and not args.once
    # the container's command runs the freeze guard (shim/guard.py, the name every image answers to)
    assert guard["command"][:2] == ["python3", "-m"]
    command = [sys.executable, "-m", guard["command"][2], *guard["args"], "--help"]
    ran = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0 and ran.stdout.startswith("usage: kubectl-snapshot-guard"), ran.stdout + ran.stderr


def test_uninstall_cleanup_daemonset_undoes_install_node() -> None:
    from click.testing import CliRunner

    from kubectl_snapshot.deploy.agent import CLEANUP_NAME, cleanup_daemonset
    from shim.agent_cli import cli

    per_node = {"ks-n1": {"containerd_socket": "/run/ks/ks-n1/containerd.sock"}}
    live = next(o for o in render("img@sha256:" + "a" * 64, per_node_paths=per_node) if o["kind"] == "DaemonSet")
    live = {**live, "status": {"numberReady": 1}, "metadata": {**live["metadata"], "resourceVersion": "9"}}
    ds = cleanup_daemonset(live)
    assert ds["metadata"] == {
        "name": CLEANUP_NAME,
        "namespace": K.AGENT_NAMESPACE,
        "labels": ds["spec"]["selector"]["matchLabels"],
    }
    assert "status" not in ds
    pod = ds["spec"]["template"]["spec"]
    init = pod["initContainers"][0]["args"]
    assert init[0] == "uninstall-node" and not any(a.startswith("--wrapper") for a in init)
    assert pod["containers"][0]["command"] == ["sleep", "3600"] and "readinessProbe" not in pod["containers"][0]
    assert any(c.get("ports") for c in live["spec"]["template"]["spec"]["containers"])
    assert not any(c.get("ports") for c in pod["containers"])  # host ports the agent holds: never scheduled
    assert pod["volumes"] == live["spec"]["template"]["spec"]["volumes"]  # same host paths as the agent
    result = CliRunner().invoke(cli, [*init, "--help"], env={"NODE_NAME": "ks-n1"})
    assert result.exit_code == 0, result.output


def test_node_map_may_give_each_node_its_metrics_address() -> None:
    from kubectl_snapshot.deploy.agent import check_per_node_paths

    ok = check_per_node_paths({"n1": {"kubelet_root": "/var/lib/n1/kubelet", "metrics_bind_address": ":9444"}})
    assert ok == {"n1": {"kubelet_root": "/var/lib/n1/kubelet", "metrics_bind_address": ":9444"}}
    for bad in ("9444", ":port", "host:1:2;rm", "x" * 300 + ":1"):
        with pytest.raises(InvalidArgument, match="HOST:PORT"):
            check_per_node_paths({"n1": {"metrics_bind_address": bad}})


def test_a_node_maps_metrics_address_reaches_the_agents_settings(tmp_path: Path) -> None:
    from shim.controller.settings import NodeSettings, apply_node_map

    m = tmp_path / "nodes.json"
    m.write_text('{"n2": {"metrics_bind_address": ":9444"}}')
    assert apply_node_map(NodeSettings(node="n2"), str(m)).metrics_bind_address == ":9444"
    assert apply_node_map(NodeSettings(node="n1"), str(m)).metrics_bind_address == ""


def test_snapshotpolicy_crd_schema_is_the_contract() -> None:
    crd = by_kind(render("reg.example/agent:1"))[("CustomResourceDefinition", f"{K.POLICY_PLURAL}.{K.GROUP}")]
    version = crd["spec"]["versions"][0]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert set(spec["required"]) == {"selector", "interval", "destination"}
    assert spec["properties"]["workload"]["properties"]["kind"]["enum"] == list(K.WORKLOAD_KINDS)
    interval = spec["properties"]["interval"]
    assert f"duration('{K.POLICY_MIN_INTERVAL_S}s')" in interval["x-kubernetes-validations"][0]["rule"]
    mode = spec["properties"]["restoreMode"]  # docs/lazy-restore.md: resumes stay eager unless asked
    assert (mode["enum"], mode["default"]) == (["eager", "lazy"], "eager") and "restoreMode" not in spec["required"]
    pods = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["pods"]
    # each agent owns its own pods' entries (server-side apply merges them by name)
    assert pods["x-kubernetes-list-type"] == "map" and pods["x-kubernetes-list-map-keys"] == ["name"]
    assert version["subresources"] == {"status": {}} and crd["spec"]["names"]["shortNames"] == [K.POLICY_SHORT_NAME]
