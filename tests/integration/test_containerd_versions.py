"""The essential round trip on every supported containerd release line, not only the installed one.

For each release in tests.support.containerd_versions.OTHER_VERSIONS (built from the Go module proxy by
hack/build-containerd.sh, cached by version) two private daemons of that release run; a counter
snapshotted from the first is restored on the second through the runtime wrapper and counts on. The
installed release (v2.3.x) runs the same test in test_agent_roundtrip.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kubectl_snapshot.core import kubenames as K
from shim.containerd.client import ContainerdClient
from shim.controller import dropin
from tests.integration.test_agent_roundtrip import (
    agent,
    cleanup,
    client,
    on,
    read_counter,
    restore_on,
    start_counter,
    task_status,
    unique,
    wait_for,
)
from tests.support.containerd import ContainerdDaemon, running_daemon
from tests.support.containerd_versions import INSTALLED, INSTALLED_VERSION, OTHER_VERSIONS, REPO, built
from tests.support.images import busybox_image
from tests.support.registry import RegistryServer, registry

pytestmark = pytest.mark.integration

__all__ = ["cleanup", "registry"]


def serving_shim(c: ContainerdClient, cid: str) -> str:
    """The binary of the shim that parents the container's first process."""
    task = c.get_task(cid)
    assert task is not None
    ppid = Path(f"/proc/{task.pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
    return os.readlink(f"/proc/{ppid}/exe")


@pytest.fixture(scope="module", params=OTHER_VERSIONS)
def daemons(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    criu_node_config: object,
    memory_work_fs: object,
) -> Iterator[tuple[ContainerdDaemon, ContainerdDaemon]]:
    """Two daemons ("node A", "node B") of one release."""
    version: str = request.param
    binaries = built(version)
    with (
        running_daemon("a", tmp_path_factory.mktemp(f"containerd-{version}-a"), binaries) as a,
        running_daemon("b", tmp_path_factory.mktemp(f"containerd-{version}-b"), binaries) as b,
    ):
        for d in (a, b):
            served, _ = d.client().version()
            assert served == version, f"{d.binaries.containerd} says it is {served}, not {version}"
        yield a, b


def test_counter_continues_on_a_second_daemon_of_the_same_release(  # type: ignore[no-untyped-def]
    daemons: tuple[ContainerdDaemon, ContainerdDaemon],
    registry: RegistryServer,
    cleanup: Callable[[ContainerdClient, str], None],
):
    da, db = daemons
    a, b = client(da), client(db)
    image = busybox_image(da)
    assert busybox_image(db) == image
    cid, new = unique("counter"), unique("restored")
    cleanup(a, cid)
    cleanup(b, new)
    start_counter(a, da, cid, image)
    assert serving_shim(a, cid) == da.binaries.shim  # not the installed release's shim
    tok_before, v_before = read_counter(a, cid)

    version = da.binaries.version
    ref = agent("checkpoint", *on(da), "--stop", "--to", registry.ref("versions", version), cid).stdout.strip()
    assert re.fullmatch(rf"{re.escape(registry.host)}/versions@sha256:[0-9a-f]{{64}}", ref), ref
    task = a.get_task(cid)
    assert task is None or task.status == "stopped"

    agent(*restore_on(db), ref, new)
    assert task_status(b, new) == "running"
    assert serving_shim(b, new) == db.binaries.shim
    tok_after, v_after = read_counter(b, new)
    assert tok_after == tok_before  # the same process memory, not a fresh start
    assert v_after >= v_before
    wait_for(lambda: read_counter(b, new)[1] > v_after + 5, what="the restored counter to advance")
    b.kill_task(new, 9)
    assert b.wait_task(new, timeout=20) == 137


NODE_CONFIG = {
    # what a node's own configuration says, which the drop-in must leave in force
    1: """version = 2
imports = ["{conf_d}/*.toml"]
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "registry.example/pause:node"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
  SystemdCgroup = true
""",
    2: """version = 3
imports = ["{conf_d}/*.toml"]
[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = "registry.example/pause:node"
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  SystemdCgroup = true
""",
}


@pytest.mark.parametrize("version", [INSTALLED_VERSION, *OTHER_VERSIONS])
def test_the_release_loads_the_drop_in_with_the_handler_and_the_nodes_settings(version: str, tmp_path: Path) -> None:
    """The drop-in install-node writes for this release, as the release itself loads it (`config dump`):
    the handler is registered and the node's own CRI settings are still there."""
    binaries = INSTALLED if version == INSTALLED_VERSION else built(version)
    major = dropin.major_version(version)
    conf_d = tmp_path / "conf.d"
    conf_d.mkdir()
    config = tmp_path / "config.toml"
    config.write_text(NODE_CONFIG[major].format(conf_d=conf_d))
    dropin_file = conf_d / "kubectl-snapshot.toml"
    launcher = "/opt/kubectl-snapshot/n1/kubectl-snapshot-runc"
    node_cri = dropin.node_cri_table(str(config), str(dropin_file)) if major == 1 else None
    dropin_file.write_text(dropin.render(version, launcher, node_cri))

    proc = subprocess.run(
        [binaries.containerd, "--config", str(config), "config", "dump"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    plugins = tomllib.loads(proc.stdout)["plugins"]
    if major == 1:
        runtime = plugins[dropin.CRI_V1]
        assert runtime["sandbox_image"] == "registry.example/pause:node"
    else:
        runtime = plugins[dropin.CRI_RUNTIME_V2]
        assert plugins["io.containerd.cri.v1.images"]["pinned_images"]["sandbox"] == "registry.example/pause:node"
    runtimes = runtime["containerd"]["runtimes"]
    assert runtimes["runc"]["options"]["SystemdCgroup"] is True
    handler = runtimes[K.RUNTIME_CLASS]
    assert handler["runtime_type"] == "io.containerd.runc.v2"
    assert handler["options"]["BinaryName"] == launcher
    assert K.ANN_RESUME_POLICY in handler["pod_annotations"] and K.ANN_RESTORE_FROM in handler["pod_annotations"]


@pytest.mark.parametrize("version", [INSTALLED_VERSION, *OTHER_VERSIONS])
def test_the_local_clusters_node_config_loads_on_the_release(version: str, tmp_path: Path) -> None:
    """hack/cluster/lib.sh with KS_CONTAINERD_VERSION: the node's config in the release's format, with
    the settings the cluster needs, and the release's binaries recorded for every later start."""
    binaries = INSTALLED if version == INSTALLED_VERSION else built(version)
    env = {
        **os.environ,
        "KS_CLUSTER_DIR": str(tmp_path / "cluster"),
        "KS_CLUSTER_RUN": str(tmp_path / "run"),
        "KS_CONTAINERD_VERSION": "" if version == INSTALLED_VERSION else version,
    }
    script = f". {REPO}/hack/cluster/lib.sh && ks_containerd_config ks-n1 && ks_containerd_bin ks-n1"
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == binaries.bin_dir
    config = tmp_path / "cluster" / "ks-n1" / "containerd.toml"
    dump = subprocess.run(
        [binaries.containerd, "--config", str(config), "config", "dump"], capture_output=True, text=True, timeout=60
    )
    assert dump.returncode == 0, dump.stderr[-2000:]
    plugins = tomllib.loads(dump.stdout)["plugins"]
    if dropin.major_version(version) == 1:
        runtime = plugins[dropin.CRI_V1]
        sandbox = runtime["sandbox_image"]
    else:
        runtime = plugins[dropin.CRI_RUNTIME_V2]
        sandbox = plugins["io.containerd.cri.v1.images"]["pinned_images"]["sandbox"]
    assert sandbox.endswith("/kubectl-snapshot/pause:3.10-ks")
    assert runtime["restrict_oom_score_adj"] is True  # the VM lacks CAP_SYS_RESOURCE
    assert runtime["netns_mounts_under_state_dir"] is True
    assert runtime["containerd"]["runtimes"]["runc"]["options"]["BinaryName"] == "/usr/sbin/runc"
    # the CNI plugins where Debian puts them (2.0 and 1.7 name it bin_dir, and ignore an unknown bin_dirs)
    cni = runtime["cni"]
    assert (cni.get("bin_dirs") or [cni.get("bin_dir")]) == ["/usr/lib/cni"], cni
