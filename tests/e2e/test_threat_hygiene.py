"""What a snapshot and a restore leave behind on the real cluster (threats D7, D10 and A12).

D7/D10: a pod holds a canary string in its memory only (its command line holds two halves; the whole is
made in the shell's memory and proved there by its digest), and the namespace's registry Secret holds a
canary password for a registry that asks for it (htpasswd, on loopback). After a snapshot pushed with that
Secret, a refused push with a Secret of another canary password, and a restore on the other node pulled
with the Secret, neither canary is in the agents' logs, the cluster's Events, the PodSnapshots or the
restored pod, the command lines and environments of the agents' processes, the installed CRIU's and
tar's launch records, or any log the nodes keep (CRIU's among them); the password is in no file of the
nodes' state dirs at all. A12: twenty snapshots of one pod in a loop leave the agent with no more open
files, threads, state-dir entries or mounts than before.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.nodesettings import NodeSettings
from kubectl_snapshot.deploy import rbac
from shim.host import memwork
from tests.e2e.test_snapshot_flows import pod, running
from tests.support.agent import OPT_ROOT, AgentInstall, agent, plugin
from tests.support.cluster import REPO, Cluster, cluster, namespace
from tests.support.registry import RegistryServer, registry_factory

pytestmark = pytest.mark.e2e
__all__ = ["agent", "cluster", "namespace", "plugin", "registry_factory"]

USER = "pusher"
SECRET, BAD_SECRET = "regcred", "wrongcred"
LOG_DIRS = (Path("/var/log/kubectl-snapshot"),)
MAX_READ = 32 << 20  # files larger than this are dumps and layers, not logs or credentials
NETNS = "/run/netns/ks-net"  # the cluster's network namespace (hack/cluster/lib.sh: KS_NETNS)
FORWARD = REPO / "hack" / "cluster" / "forward.py"


@pytest.fixture
def cluster_registry(
    cluster: Cluster, registry_factory: Callable[..., RegistryServer]
) -> Iterator[Callable[[str], RegistryServer]]:
    """A registry with htpasswd auth on the root namespace's loopback, relayed to the same address in the
    cluster's namespace (as hack/cluster/up.sh relays its own registry): the agents reach it too."""
    procs: list[subprocess.Popen[bytes]] = []
    sock_dir = tempfile.mkdtemp(prefix="ks-reg-", dir="/tmp")

    def start(password: str) -> RegistryServer:
        reg = registry_factory(auth="htpasswd", users={USER: password})
        sock = os.path.join(sock_dir, f"{reg.port}.sock")
        procs.append(subprocess.Popen([sys.executable, str(FORWARD), f"unix:{sock}", f"tcp:{reg.host}"]))
        inside = ["nsenter", f"--net={NETNS}", sys.executable, str(FORWARD), f"tcp:{reg.host}", f"unix:{sock}"]
        procs.append(subprocess.Popen(inside))

        def answers() -> bool:
            url = f"http://{reg.host}/v2/"
            probe = ["nsenter", f"--net={NETNS}", "curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", url]
            return subprocess.run(probe, capture_output=True, text=True, check=False).stdout == "401"

        cluster.wait_for(f"the registry {reg.host} in the cluster's network namespace", answers, 30)
        return reg

    try:
        yield start
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
        shutil.rmtree(sock_dir, ignore_errors=True)


def _dockerconfig_json(registry: str, password: str) -> str:
    auth = base64.b64encode(f"{USER}:{password}".encode()).decode()
    return json.dumps({"auths": {registry: {"username": USER, "password": password, "auth": auth}}})


def _dockerconfig(ns: str, name: str, registry: str, password: str) -> dict[str, Any]:
    config = _dockerconfig_json(registry, password)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": ns},
        "type": "kubernetes.io/dockerconfigjson",
        "data": {".dockerconfigjson": base64.b64encode(config.encode()).decode()},
    }


def _canary_pod(name: str, ns: str, image: str, node: str, halves: tuple[str, str]) -> dict[str, Any]:
    """A shell whose variable `c` is the canary: only the halves are in its command line (and the Pod)."""
    script = (
        f'x={halves[0]}; y={halves[1]}; c="$x$y"; '
        'while true; do echo "$c" | md5sum > /tmp/proof.t; mv /tmp/proof.t /tmp/proof; sleep 0.5; done'
    )
    return pod(name, ns, image, {"app": script}, node=node)


def _cat(cluster: Cluster, ns: str, name: str, path: str = "/tmp/proof") -> str:
    return cluster.kubectl("exec", "-n", ns, name, "--", "cat", path, check=False).stdout


def _pod_dir_pids(cluster: Cluster, agent: AgentInstall, node: str, container: str | None = None) -> list[int]:
    """The processes of the agent's pod on `node` (of one of its containers: `container`), found by their
    cgroup (the pod's uid, or the container's id, in its path: cgroup v1 or v2, either driver)."""
    agent_pod = agent.agent_pod(node)
    assert agent_pod is not None, f"no agent on {node}"
    marks: tuple[str, ...]
    if container is None:
        uid = agent_pod["metadata"]["uid"]
        marks = (f"pod{uid}", f"pod{uid.replace('-', '_')}")
    else:
        status = next(s for s in agent_pod["status"]["containerStatuses"] if s["name"] == container)
        marks = (status["containerID"].split("://", 1)[1],)
    pids = [
        int(e) for e in os.listdir("/proc") if e.isdigit() and any(m in _proc_text(int(e), "cgroup") for m in marks)
    ]
    assert pids, f"no process of the agent's pod on {node} ({container or 'all containers'})"
    return sorted(pids)


def _proc_text(pid: int, what: str) -> str:
    try:
        return Path(f"/proc/{pid}/{what}").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""  # gone meanwhile


def _files(top: Path, *, only_logs: bool) -> Iterator[tuple[str, str]]:
    """(path, text) of the regular files below `top` (only `*.log` and `*.launches` with only_logs)."""
    for d, _, files in os.walk(top):
        for name in files:
            path = os.path.join(d, name)
            if only_logs and not name.endswith((".log", ".launches")):
                continue
            try:
                if os.path.islink(path) or os.path.getsize(path) > MAX_READ:
                    continue
                yield path, Path(path).read_bytes().decode(errors="replace")
            except OSError:
                continue


class CriuLogs:
    """CRIU's logs as they are while a dump or restore runs (the agent removes them with the dump and the
    staging dir once it answers): every `*.log` below the nodes' state dirs and memory work areas, read
    every 20 ms on a thread while the block runs."""

    def __init__(self, roots: list[str]) -> None:
        self.roots = roots
        self.seen: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            for root in self.roots:
                for path, text in _files(Path(root), only_logs=True):
                    if len(text) >= len(self.seen.get(path, "")):
                        self.seen[path] = text

    def start(self) -> CriuLogs:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def _where(sources: dict[str, str], needle: str) -> list[str]:
    return sorted(name for name, text in sources.items() if needle in text)


def test_no_credential_or_memory_canary_reaches_logs_events_status_or_process_lists(  # type: ignore[no-untyped-def]
    cluster: Cluster, namespace: str, agent: AgentInstall, plugin, cluster_registry, tmp_path, monkeypatch
) -> None:
    n1, n2 = cluster.nodes[:2]
    tag = uuid.uuid4().hex
    password, wrong = f"pwcanary{tag[:16]}", f"pwwrong{tag[16:]}"
    halves = (f"memcanary{tag[:8]}", tag[8:24])
    canary = "".join(halves)
    reg = cluster_registry(password)
    # the plugin reads the snapshot's config as its user does: with the user's own docker login
    docker = tmp_path / "docker"
    docker.mkdir()
    (docker / "config.json").write_text(_dockerconfig_json(reg.host, password))
    monkeypatch.setenv("DOCKER_CONFIG", str(docker))
    cluster.apply(
        [
            _dockerconfig(namespace, SECRET, reg.host, password),
            _dockerconfig(namespace, BAD_SECRET, reg.host, wrong),
            rbac.agent_secrets_binding(namespace),
        ]
    )
    cluster.apply(_canary_pod("holder", namespace, cluster.busybox_image, n1, halves))
    running(cluster, namespace, "holder")
    proof = hashlib.md5((canary + "\n").encode()).hexdigest()
    cluster.wait_for("the canary in the shell's memory", lambda: proof in _cat(cluster, namespace, "holder"))
    repo = f"{reg.host}/e2e/{namespace}/holder"

    states = [NodeSettings(node=n).state_dir for n in (n1, n2)]
    watch = CriuLogs(states + [memwork.area_dir(d) for d in states]).start()  # a daemon thread
    refused = plugin(
        "snapshot", "pod/holder", "-n", namespace, "--to", repo, "--registry-secret", BAD_SECRET, check=False
    )
    assert refused.returncode != 0, "a push with the wrong password was accepted"
    out = plugin("snapshot", "pod/holder", "-n", namespace, "--to", repo, "--registry-secret", SECRET, "-o", "json")
    ref = str(json.loads(out.stdout)["status"]["reference"])
    restored = plugin(
        "restore", ref, "-n", namespace, "--name", "holder-restored", "--node", n2, "--registry-secret", SECRET,
        check=False,
    )  # fmt: skip
    assert restored.returncode == 0, restored.stdout + restored.stderr
    running(cluster, namespace, "holder-restored")
    # the restored shell holds the canary: it writes its digest again after the file is gone
    cluster.kubectl("exec", "-n", namespace, "holder-restored", "--", "rm", "-f", "/tmp/proof")
    cluster.wait_for(
        "the restored shell's proof of the canary",
        lambda: proof in _cat(cluster, namespace, "holder-restored"),
        60,
    )

    watch.stop()
    sources: dict[str, str] = {f"{path} (while it ran)": text for path, text in watch.seen.items()}
    seen = {os.path.basename(p) for p in watch.seen}
    assert {"dump.log", "restore.log"} <= seen, f"CRIU's logs were not caught while they existed: {sorted(watch.seen)}"
    for node in (n1, n2):
        agent_pod = agent.agent_pod(node)
        assert agent_pod is not None
        name = agent_pod["metadata"]["name"]
        sources[f"logs of {name}"] = cluster.kubectl(
            "logs", "-n", K.AGENT_NAMESPACE, name, "--all-containers", "--prefix", timeout=60
        ).stdout
        for pid in _pod_dir_pids(cluster, agent, node):
            sources[f"/proc/{pid}/cmdline ({node}'s agent pod)"] = _proc_text(pid, "cmdline")
            sources[f"/proc/{pid}/environ ({node}'s agent pod)"] = _proc_text(pid, "environ")
        for path, text in _files(OPT_ROOT / node, only_logs=True):  # criu.launches, tar.launches: argv of each run
            sources[path] = text
        for path, text in _files(Path(NodeSettings(node=node).state_dir), only_logs=True):  # CRIU's logs kept
            sources[path] = text
    for top in LOG_DIRS:
        for path, text in _files(top, only_logs=True):
            sources[path] = text
    sources["Events"] = cluster.kubectl("get", "events", "-A", "-o", "json").stdout
    sources["PodSnapshots"] = cluster.kubectl("get", "podsnapshots", "-n", namespace, "-o", "json").stdout
    sources["restored pod"] = cluster.kubectl("get", "pod", "holder-restored", "-n", namespace, "-o", "json").stdout
    assert sum(1 for s in sources if s.startswith("logs of")) == 2 and any("environ" in s for s in sources)
    assert "Succeeded" in sources["PodSnapshots"] and "Failed" in sources["PodSnapshots"]
    assert any(namespace in t for k, t in sources.items() if k.startswith("logs of")), "the agents logged nothing of it"

    for needle in (password, wrong, canary):
        assert _where(sources, needle) == [], f"{needle[:9]}... found in these"
    # D8 on the real agents after a snapshot and a restore: each node's state dir, and every directory in it,
    # is root's alone (what is below is out of the reach of the node's other users whatever its mode)
    for node in (n1, n2):
        state = Path(NodeSettings(node=node).state_dir)
        wide = [
            f"{p} {oct(p.lstat().st_mode & 0o777)}"
            for p in [state, *state.iterdir()]
            if not p.is_symlink() and p.lstat().st_mode & 0o077
        ]
        assert wide == [], f"group or other may reach these on {node}: {wide}"
    # the password is in no file of the nodes' state dirs, logs or not
    kept = {p: t for n in (n1, n2) for p, t in _files(Path(NodeSettings(node=n).state_dir), only_logs=False)}
    assert kept, "no files read in the state dirs"
    assert _where(kept, password) == [] and _where(kept, wrong) == []


def _census(cluster: Cluster, agent: AgentInstall, node: str) -> dict[str, int]:
    """What the agent on `node` holds: open fds and threads (its container's processes), the entries of its
    state dir, mounts in its mount namespace and in the host's."""
    pids = _pod_dir_pids(cluster, agent, node, container="agent")
    fds = sum(len(os.listdir(f"/proc/{p}/fd")) for p in pids if os.path.isdir(f"/proc/{p}/fd"))
    threads = sum(len(os.listdir(f"/proc/{p}/task")) for p in pids if os.path.isdir(f"/proc/{p}/task"))
    entries = sum(len(dirs) + len(files) for _, dirs, files in os.walk(NodeSettings(node=node).state_dir))
    return {
        "fds": fds,
        "threads": threads,
        "state entries": entries,
        "agent mounts": len(_proc_text(pids[0], "mountinfo").splitlines()),
        "host mounts": len(Path("/proc/1/mountinfo").read_text().splitlines()),
    }


LOOP = 20
SLACK = {"fds": 4, "threads": 3}  # an idle HTTP connection or a watch thread more or less; a leak per snapshot is 20


def test_twenty_snapshots_of_one_pod_leak_nothing(  # type: ignore[no-untyped-def]
    cluster: Cluster, namespace: str, agent: AgentInstall, plugin
) -> None:
    node = cluster.nodes[0]
    cluster.apply(pod("loop", namespace, cluster.busybox_image, {"app": "while true; do sleep 1; done"}, node=node))
    running(cluster, namespace, "loop")
    repo = f"{cluster.registry}/e2e/{namespace}/loop"

    def snap() -> None:
        plugin("snapshot", "pod/loop", "-n", namespace, "--to", repo)

    for _ in range(2):  # the first saves make what stays: the page index, the node's key use, pools
        snap()
    time.sleep(2)
    before = _census(cluster, agent, node)
    for _ in range(LOOP):
        snap()
    deadline = time.monotonic() + 30  # work dirs are removed after the answer (shim/host/reaper.py)
    while True:
        after = _census(cluster, agent, node)
        grown = {k: (before[k], after[k]) for k in before if after[k] > before[k] + SLACK.get(k, 0)}
        if not grown or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert grown == {}, f"after {LOOP} snapshots of one pod (before, after): {grown}"
    ok = cluster.get_json("podsnapshots", "-n", namespace)["items"]
    assert sum(1 for o in ok if o.get("status", {}).get("phase") == K.PHASE_SUCCEEDED) == LOOP + 2
