"""The node agent installed on the e2e cluster the way a user installs it: the image built by
`hack/build-agent-image.sh` and pushed to the cluster's registry, then `kubectl snapshot install`.

``agent`` (session scope) gives an ``AgentInstall``; ``plugin`` runs `kubectl-snapshot` with the
cluster's kubeconfig and fails the test on a non-zero exit unless ``check=False``.

Import: ``from tests.support.agent import agent, plugin  # noqa: F401`` (with the cluster fixtures).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.nodesettings import NodeSettings
from shim.criu import config as criu_config
from shim.criu import kdat as criu_kdat
from shim.host import memwork, workfs
from tests.support.cluster import HACK, REPO, Cluster
from tests.support.containerd import tmpfs_large_folios

PLUGIN = str(Path(sys.executable).with_name("kubectl-snapshot"))
NODE_CONFIG_MAP = f"{K.AGENT_NAME}-nodes"
NODE_CONFIG_KEY = "nodes.json"


def _plugin(cluster: Cluster, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [PLUGIN, *args, "--kubeconfig", str(cluster.kubeconfig)], capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"kubectl-snapshot {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc


@dataclass
class AgentInstall:
    cluster: Cluster
    image: str
    node_config: Path

    def reinstall(self) -> None:
        """`kubectl snapshot install` again, as the fixture did (after a test's uninstall)."""
        _install(self.cluster, self.image, self.node_config)

    def agent_pod(self, node: str) -> dict[str, Any] | None:
        pods = self.cluster.get_json(
            "pods", "-n", K.AGENT_NAMESPACE, "-l", "app.kubernetes.io/name=" + K.AGENT_NAME,
            "--field-selector", f"spec.nodeName={node}",
        )["items"]  # fmt: skip
        return pods[0] if pods else None

    def wait_ready(self, node: str, *, not_uid: str | None = None, timeout: float = 180) -> None:
        def ready() -> bool:
            p = self.agent_pod(node)
            if p is None or p["metadata"]["uid"] == not_uid or p["metadata"].get("deletionTimestamp"):
                return False
            return any(
                c.get("type") == "Ready" and c.get("status") == "True" for c in p["status"].get("conditions", [])
            )

        self.cluster.wait_for(f"the agent on {node} to be ready", ready, timeout)

    def restart(self, node: str) -> None:
        old = self.agent_pod(node)
        assert old is not None, f"no agent pod on {node}"
        self.cluster.kubectl("delete", "pod", "-n", K.AGENT_NAMESPACE, old["metadata"]["name"], "--wait=false")
        self.wait_ready(node, not_uid=old["metadata"]["uid"])

    @contextlib.contextmanager
    def node_override(self, node: str, **values: str) -> Iterator[None]:
        """Change one node's entry of the agent's node map (e.g. criuPath) while the block runs."""
        cm = self.cluster.get_json("configmap", NODE_CONFIG_MAP, "-n", K.AGENT_NAMESPACE)
        original = cm["data"][NODE_CONFIG_KEY]
        data = json.loads(original)
        data.setdefault(node, {}).update(values)
        self._set_node_map(json.dumps(data))
        self.restart(node)
        try:
            yield
        finally:
            self._set_node_map(original)
            self.restart(node)

    @contextlib.contextmanager
    def without_agent_on(self, node: str) -> Iterator[None]:
        """Keep the agent DaemonSet off one node while the block runs (a node the agent does not cover)."""
        affinity = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": [node]}]}
                    ]
                }
            }
        }
        self._patch_daemonset({"spec": {"template": {"spec": {"affinity": affinity}}}})
        self.cluster.wait_for(f"the agent to leave {node}", lambda: self.agent_pod(node) is None, 120)
        try:
            yield
        finally:
            self._patch_daemonset({"spec": {"template": {"spec": {"affinity": None}}}})
            self.wait_ready(node)

    def _patch_daemonset(self, patch: dict[str, Any]) -> None:
        self.cluster.kubectl(
            "patch", "daemonset", K.AGENT_NAME, "-n", K.AGENT_NAMESPACE, "--type=merge", "-p", json.dumps(patch)
        )

    def _set_node_map(self, text: str) -> None:
        patch = json.dumps({"data": {NODE_CONFIG_KEY: text}})
        self.cluster.kubectl(
            "patch", "configmap", NODE_CONFIG_MAP, "-n", K.AGENT_NAMESPACE, "--type=merge", "-p", patch
        )


METRICS_PORT = 9443  # node i of the local cluster serves its metrics on METRICS_PORT + i
OPT_ROOT = Path("/opt/kubectl-snapshot")  # install-node's directory per node (the cluster shares this machine)


def criu_launches(node: str) -> list[dict[str, Any]]:
    """The installed CRIU launcher's record on a node: one JSON line per run (args, parent's argv)."""
    path = OPT_ROOT / node / "criu.launches"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def tar_launches(node: str) -> list[dict[str, Any]]:
    """The bundle's tar launcher's record on a node (CRIU runs tar for tmpfs mounts)."""
    path = OPT_ROOT / node / "tar.launches"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def assert_installed_criu_ran(node: str, operation: str, since: int) -> None:
    """runc ran the CRIU install-node put on `node` (runc --criu /opt/kubectl-snapshot/NODE/criu) for `operation`."""
    runs = [r for r in criu_launches(node)[since:] if r["args"][:1] == ["swrk"]]  # runc's runs (not criu check)
    parents = [" ".join(r["parent"]) for r in runs]
    assert any(f" {operation} " in p for p in parents), (node, operation, parents)
    installed = f"--criu {OPT_ROOT / node / 'criu'}"
    assert all(p.startswith(("/usr/sbin/runc", "runc")) and installed in p for p in parents), parents


@pytest.fixture(scope="session")
def agent(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentInstall]:
    with installed_agent(cluster, tmp_path_factory.mktemp("agent"), fail=pytest.fail) as installed:
        yield installed


@contextlib.contextmanager
def installed_agent(
    cluster: Cluster, workdir: Path, *, fail: Callable[[str], Any] = sys.exit
) -> Iterator[AgentInstall]:
    """The agent image built from this tree, installed with `kubectl snapshot install`; uninstalled
    afterwards (and checked gone from the nodes), or, when the cluster had an install already (`make
    demo`'s), that install put back with its own image. Also for scripts (bench/recovery.py)."""
    build = subprocess.run(
        [str(REPO / "hack" / "build-agent-image.sh"), f"{cluster.registry}/kubectl-snapshot/agent:e2e"],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if build.returncode != 0:
        fail(f"hack/build-agent-image.sh failed ({build.returncode}):\n{build.stderr[-4000:]}")
    image = build.stdout.strip().splitlines()[-1]
    node_config = workdir / "nodes.json"
    node_config.write_text(
        json.dumps(
            {
                node: {
                    "containerd_socket": str(cluster.containerd_socket(node)),
                    "kubelet_root": str(cluster.state_dir / node / "kubelet"),
                    "containerd_dropin_dir": str(cluster.containerd_dropin_dir(node)),
                    # the nodes share the machine's network (--host-network): a metrics port each
                    "metrics_bind_address": f":{METRICS_PORT + i}",
                }
                for i, node in enumerate(cluster.nodes)
            }
        )
    )
    conf = Path(criu_config.RUNC_CONF)
    conf_before = conf.read_text() if conf.exists() else None
    # an install this session did not make (`make demo`'s, say) is put back afterwards, not removed:
    # its restored pods keep their runtime wrapper. One of this very build is an earlier instance's of this
    # fixture (each test module that imports it has its own; pytest keeps them all to the session's end).
    found_image = installed_image(cluster)
    ours = found_image == image

    def install(agent_image: str) -> AgentInstall:
        return _install(cluster, agent_image, node_config)

    installed = install(image)
    # install-node probed CRIU's nftables network lock on the host and wrote runc's CRIU configuration
    foreign = conf_before is not None and not criu_config.is_ours(conf_before)
    assert foreign or criu_config.is_ours(conf.read_text() if conf.exists() else None)
    # where /run is not a tmpfs (these VMs), install-node (in the init container, through the host's
    # mount namespace) put CRIU's kernel-feature cache on a tmpfs bound on /run/criu.kdat (shim/criu/kdat.py)
    kdat_native = criu_kdat.decide(criu_kdat.KDAT_FILE, _host_mounts()) == "native"
    bound = criu_kdat.mount_at(criu_kdat.KDAT_FILE, _host_mounts())
    assert kdat_native or (bound is not None and bound.source == criu_kdat.SOURCE), (
        f"after install, {criu_kdat.KDAT_FILE} is not the kdat cache install-node binds there: {bound}"
    )
    # and each node's memory work area on a tmpfs of its own with large folios (shim/host/workfs.py), seen by
    # the agent's container through its host path mount
    areas = [memwork.area_dir(NodeSettings(node=n).state_dir) for n in cluster.nodes]
    if tmpfs_large_folios():
        for area in areas:
            top = criu_kdat.mount_at(area, _host_mounts())
            if top is None or top.source != workfs.SOURCE:  # seen once, not understood: say what install-node did
                logs = cluster.kubectl(
                    "logs", "-n", K.AGENT_NAMESPACE, "-l", f"app.kubernetes.io/name={K.AGENT_NAME}",
                    "-c", "install-node", "--tail", "40", "--prefix", check=False,
                )  # fmt: skip
                mounts = [line for line in Path("/proc/self/mountinfo").read_text().splitlines() if "/dev/shm" in line]
                raise AssertionError(
                    f"after install, {area} is not our tmpfs: {top}\nmounts under /dev/shm:\n"
                    + "\n".join(mounts)
                    + f"\ninstall-node:\n{logs.stdout[-6000:]}{logs.stderr[-1000:]}"
                )
    try:
        yield installed
        # every CRIU that ran during the session was the installed one, handed to runc with --criu
        for node in cluster.nodes:
            for run in (r for r in criu_launches(node) if r["args"][:1] == ["swrk"]):  # CRIU that runc ran
                assert f"--criu {OPT_ROOT / node / 'criu'}" in " ".join(run["parent"]), (node, run)
        # the tar CRIU ran for tmpfs mounts (every container's /dev) was the bundle's (its launcher's record)
        checkpoints = [r for n in cluster.nodes for r in criu_launches(n) if " checkpoint " in " ".join(r["parent"])]
        tar_dumps = [r for n in cluster.nodes for r in tar_launches(n) if "--create" in r["args"]]
        assert tar_dumps or not checkpoints, "CRIU checkpointed containers but never ran the bundle's tar"
    finally:
        # nothing to undo where the session's cluster went down first (with everything installed in it)
        undo = not ours and cluster.kubectl("get", "--raw", "/readyz", check=False, timeout=20).returncode == 0
        if undo and found_image is not None:
            install(found_image)
        elif undo:
            out = _plugin(cluster, "uninstall", check=False)
            assert out.returncode == 0, f"kubectl-snapshot uninstall failed ({out.returncode}):\n{out.stderr[-4000:]}"
    if not undo or found_image is not None:
        return
    # uninstall is the inverse of install, on the nodes too: no runtime wrapper, no containerd drop-in
    for node in cluster.nodes:
        assert not (cluster.containerd_dropin_dir(node) / "kubectl-snapshot.toml").exists(), node
        assert not Path("/opt/kubectl-snapshot", node).exists(), node
    after = conf.read_text() if conf.exists() else None
    assert after == conf_before if foreign else not criu_config.is_ours(after)
    assert kdat_native or criu_kdat.mount_at(criu_kdat.KDAT_FILE, _host_mounts()) is None
    assert not os.path.exists(criu_kdat.cache_dir(criu_kdat.KDAT_FILE))
    assert all(criu_kdat.mount_at(a, _host_mounts()) is None and not os.path.exists(a) for a in areas), areas


def _install(cluster: Cluster, agent_image: str, node_config: Path) -> AgentInstall:
    _plugin(
        cluster,
        "install",
        "--agent-image", agent_image,
        "--api-server", f"https://{cluster.api_host}:{cluster.api_port}",
        "--node-config", str(node_config),
        "--restart-command", f"{HACK / 'containerd-restart.sh'} {{node}}",
        "--host-network",  # the cluster's registry listens on loopback only
        "--timeout", "5m",
    )  # fmt: skip
    done = AgentInstall(cluster, agent_image, node_config)
    for node in cluster.nodes:
        done.wait_ready(node)
    return done


def installed_image(cluster: Cluster) -> str | None:
    """The agent image of the install on the cluster, if there is one."""
    got = cluster.kubectl("get", "daemonset", K.AGENT_NAME, "-n", K.AGENT_NAMESPACE, "-o", "json", check=False)
    if got.returncode != 0:
        return None
    containers = json.loads(got.stdout)["spec"]["template"]["spec"]["containers"]
    return next((str(c["image"]) for c in containers if c["name"] == "agent"), str(containers[0]["image"]))


def _host_mounts() -> list[criu_kdat.Mount]:
    with open("/proc/self/mountinfo") as f:
        return criu_kdat.parse_mountinfo(f.read())


@pytest.fixture
def plugin(cluster: Cluster) -> Callable[..., subprocess.CompletedProcess[str]]:
    def run(*args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return _plugin(cluster, *args, check=check, timeout=timeout)

    return run
