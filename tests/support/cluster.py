"""The local two-node Kubernetes cluster (hack/cluster) as a pytest fixture.

``cluster`` (session scope) reuses a running cluster, or brings one up with
``hack/cluster/up.sh``. Sessions register as users of the cluster; the last one to finish tears a
cluster that a test session started down with ``hack/cluster/down.sh`` (one started by hand with
``hack/cluster-up`` is left running). Several pytest sessions may share the cluster at once:
start, stop and the user list are serialized with the same lock file as the scripts.

It skips with the reason when not root, when the node packages are missing
(``hack/cluster/install-deps.sh``) or when the Kubernetes binaries are not built yet
(``hack/cluster/build.sh``, ~17 min cold here, so never started implicitly by a test run unless
``KUBECTL_SNAPSHOT_E2E_BUILD=1``). ``KUBECTL_SNAPSHOT_E2E=0`` skips it outright.

``namespace`` gives each test a fresh namespace, deleted afterwards.

Import into a test module: ``from tests.support.cluster import cluster, namespace``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
HACK = REPO / "hack" / "cluster"
STATE_DIR = Path(os.environ.get("KS_CLUSTER_DIR", "/var/lib/ks-cluster"))
RUN_DIR = Path(os.environ.get("KS_CLUSTER_RUN", "/run/ks-cluster"))
NEEDED = (
    "/usr/bin/etcd",
    "/usr/lib/cni/bridge",
    "/usr/bin/docker-registry",
    "/usr/local/bin/containerd",
    "/usr/sbin/runc",
    "/usr/sbin/criu",
    "/bin/busybox",
)


@dataclass(frozen=True)
class Cluster:
    """Where the running cluster is and how to talk to it (all loopback)."""

    kubeconfig: Path
    kubectl_bin: Path
    api_host: str  # host-network pods reach the API server here too
    api_port: int
    registry: str  # host:port, plain HTTP
    nodes: tuple[str, ...]
    busybox_image: str
    pause_image: str
    state_dir: Path
    run_dir: Path

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run the cluster's own kubectl (same version as the server) as the admin user."""
        proc = subprocess.run(
            [str(self.kubectl_bin), "--kubeconfig", str(self.kubeconfig), *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def get_json(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", "-o", "json", *args).stdout)

    def log_lines(self, component: str, needle: str, *, last: int = 40) -> str:
        """The last lines of a component's log (kubelet-ks-n2, containerd-ks-n1, ...) that mention
        `needle`: what a failed test prints about one pod."""
        try:
            text = (self.state_dir / "logs" / f"{component}.log").read_text(errors="replace")
        except OSError as e:
            return f"({component}'s log not read: {e})"
        return "\n".join([line[:400] for line in text.splitlines() if needle in line][-last:])

    def apply(self, manifest: dict[str, Any] | list[dict[str, Any]]) -> None:
        items = manifest if isinstance(manifest, list) else [manifest]
        self.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))

    def wait_for(self, what: str, predicate: Callable[[], bool], timeout: float = 120) -> None:
        """Poll until predicate() is true; fail with `what` otherwise."""
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}")
            time.sleep(0.5)

    def containerd_socket(self, node: str) -> Path:
        return self.run_dir / node / "containerd.sock"

    def containerd_dropin_dir(self, node: str) -> Path:
        """Drop-in dir imported by the node's containerd config (files must say `version = 3`)."""
        return self.state_dir / node / "containerd.d"

    def restart_containerd(self, node: str) -> None:
        subprocess.run([str(HACK / "containerd-restart.sh"), node], check=True, capture_output=True, timeout=120)

    def checkpoint_dir(self, node: str) -> Path:
        """Where the node's kubelet writes checkpoint archives."""
        return self.state_dir / node / "kubelet" / "checkpoints"


def _load(env_file: Path) -> Cluster:
    env: dict[str, str] = {}
    for line in env_file.read_text().splitlines():
        if line.startswith("export ") and "=" in line:
            key, _, value = line[len("export ") :].partition("=")
            env[key] = value.strip('"')
    return Cluster(
        kubeconfig=Path(env["KUBECONFIG"]),
        kubectl_bin=Path(env["KS_KUBECTL"]),
        registry=env["KS_REGISTRY"],
        api_host=env["KS_API_HOST"],
        api_port=int(env["KS_API_PORT"]),
        nodes=tuple(env["KS_NODES"].split()),
        busybox_image=env["KS_BUSYBOX_IMAGE"],
        pause_image=env["KS_PAUSE_IMAGE"],
        state_dir=STATE_DIR,
        run_dir=RUN_DIR,
    )


def _running() -> Cluster | None:
    env_file = STATE_DIR / "cluster.env"
    if not env_file.exists():
        return None
    found = _load(env_file)
    # up.sh decides: it reuses a cluster whose daemons run (waiting out a slow API server).
    ok = found.kubectl("get", "--raw", "/readyz", check=False, timeout=20).returncode == 0
    return found if ok else None


USERS_DIR = RUN_DIR / "pytest-users"
STARTED_MARK = RUN_DIR / "started-by-pytest"


@contextlib.contextmanager
def _cluster_lock() -> Iterator[dict[str, str]]:
    """Hold the scripts' lock; yield the environment that tells them we hold it."""
    RUN_DIR.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{RUN_DIR}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield {**os.environ, "KS_LOCK_HELD": "1"}


def _live_users() -> list[Path]:
    live = []
    for f in USERS_DIR.glob("*"):
        try:
            os.kill(int(f.name), 0)
            live.append(f)
        except (ValueError, ProcessLookupError):
            f.unlink(missing_ok=True)
    return live


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    if os.environ.get("KUBECTL_SNAPSHOT_E2E") == "0":
        pytest.skip("KUBECTL_SNAPSHOT_E2E=0")
    if os.geteuid() != 0:
        pytest.skip("the e2e cluster needs root (cgroups, mounts, containerd)")
    missing = [p for p in NEEDED if not os.access(p, os.X_OK)]
    with _cluster_lock() as env:
        found = _running()
        if found is None:
            if missing:
                pytest.skip(f"missing {', '.join(missing)}: run hack/cluster/install-deps.sh")
            built = subprocess.run([str(HACK / "build.sh"), "--check"], capture_output=True, text=True)
            if built.returncode != 0 and os.environ.get("KUBECTL_SNAPSHOT_E2E_BUILD") != "1":
                pytest.skip(
                    "Kubernetes binaries not built: run hack/cluster/build.sh (or KUBECTL_SNAPSHOT_E2E_BUILD=1)"
                )
            up = subprocess.run([str(HACK / "up.sh")], capture_output=True, text=True, timeout=3600, env=env)
            if up.returncode != 0:
                pytest.fail(f"hack/cluster/up.sh failed ({up.returncode}):\n{up.stderr[-12000:]}")
            if "already running" not in up.stderr:
                STARTED_MARK.touch()
            found = _load(STATE_DIR / "cluster.env")
        USERS_DIR.mkdir(parents=True, exist_ok=True)
        me = USERS_DIR / str(os.getpid())
        me.touch()
    try:
        yield found
    finally:
        with _cluster_lock() as env:
            me.unlink(missing_ok=True)
            if STARTED_MARK.exists() and not _live_users():
                down = subprocess.run([str(HACK / "down.sh")], capture_output=True, text=True, timeout=300, env=env)
                if down.returncode != 0:
                    pytest.fail(f"hack/cluster/down.sh failed ({down.returncode}):\n{down.stderr[-4000:]}")


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    name = f"e2e-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    # Pods need the namespace's default ServiceAccount, made by the controller-manager.
    cluster.wait_for(
        f"serviceaccount default in {name}",
        lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
        timeout=60,
    )
    try:
        yield name
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
