"""ContainerdClient against a real containerd 2.3 + runc + CRIU (private daemons, see tests.support.containerd).

Also checks that the project's own .proto files agree field by field with upstream containerd's (when
the upstream API module is in the Go module cache, where hack/install-node-deps.sh's build leaves it).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kubectl_snapshot.core.errors import CriuFailed, FailedPrecondition, NotFound, Unavailable
from shim.containerd.client import ContainerdClient
from shim.containerd.imageconfig import chain_id, select_manifest
from shim.containerd.spec import default_spec
from shim.criu import config as criu_config
from tests.support.containerd import CRIU, ContainerdDaemon, containerd_a, containerd_b, criu_node_config
from tests.support.images import busybox_image, python_image

UPSTREAM_API = Path.home() / "go/pkg/mod/github.com/containerd/containerd/api@v1.11.1"
COUNTER = ["sh", "-c", "i=0; while true; do echo tick $i; i=$((i+1)); sleep 0.2; done"]


def _cid(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


@pytest.fixture
def client(containerd_a: ContainerdDaemon) -> Iterator[ContainerdClient]:
    with containerd_a.client() as c:
        yield c


@pytest.fixture
def counter(containerd_a: ContainerdDaemon, client: ContainerdClient, tmp_path: Path) -> Iterator[str]:
    """A running busybox container printing a counter to tmp_path/counter.log; removed afterwards."""
    cid = _cid("counter")
    client.run_container(
        cid,
        image=busybox_image(containerd_a),
        args=COUNTER,
        log_path=str(tmp_path / "counter.log"),
        runc_options=containerd_a.runc_options,
        labels={"test": "counter"},
    )
    yield cid
    client.remove_container(cid)


def _wait_for(pred: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.1)


# --- pure pieces -------------------------------------------------------------------------------


def test_chain_id_follows_the_oci_definition() -> None:
    a, b, c = (f"sha256:{x * 64}" for x in "abc")
    ab = "sha256:" + hashlib.sha256(f"{a} {b}".encode()).hexdigest()
    assert chain_id([a]) == a
    assert chain_id([a, b]) == ab
    assert chain_id([a, b, c]) == "sha256:" + hashlib.sha256(f"{ab} {c}".encode()).hexdigest()


def test_select_manifest_picks_the_platform_and_explains_a_miss() -> None:
    index = {
        "manifests": [
            {"digest": "sha256:1", "platform": {"os": "linux", "architecture": "arm64"}},
            {"digest": "sha256:2", "platform": {"os": "linux", "architecture": "amd64"}},
        ]
    }
    assert select_manifest(index, arch="amd64")["digest"] == "sha256:2"
    with pytest.raises(NotFound) as e:
        select_manifest(index, arch="s390x")
    assert e.value.hint is not None and "linux/amd64" in e.value.hint


def test_default_spec_namespaces_cgroup_and_mounts() -> None:
    spec = default_spec("c1", namespace="ns", args=["sh"], env=["A=1"])
    assert spec["linux"]["cgroupsPath"] == "/ns/c1"
    assert [n["type"] for n in spec["linux"]["namespaces"]] == ["pid", "ipc", "uts", "mount", "network"]
    assert spec["process"]["env"][0].startswith("PATH=") and "A=1" in spec["process"]["env"]
    assert {m["destination"] for m in spec["mounts"]} >= {"/proc", "/dev", "/dev/pts", "/dev/shm", "/sys"}
    host = default_spec(
        "c1",
        namespace="ns",
        args=["sh"],
        host_network=True,
        mounts=[{"destination": "/dev/shm", "type": "bind", "source": "/x", "options": ["rbind"]}],
    )
    assert "network" not in [n["type"] for n in host["linux"]["namespaces"]]
    shm = [m for m in host["mounts"] if m["destination"] == "/dev/shm"]
    assert shm == [{"destination": "/dev/shm", "type": "bind", "source": "/x", "options": ["rbind"]}]
    with pytest.raises(ValueError):
        default_spec("c1", namespace="ns", args=[])


def test_protos_match_upstream_field_numbers() -> None:
    """Every message and method of the project's protos exists upstream with the same numbers and types."""
    if not UPSTREAM_API.is_dir():
        pytest.skip(f"upstream containerd API sources not found at {UPSTREAM_API}")
    from google.protobuf import descriptor_pb2, descriptor_pool  # generated modules: loaded by the client
    from grpc_tools import protoc  # type: ignore[import-untyped]

    ours_dir = Path(__file__).parents[2] / "shim/containerd/protos/shim/containerd/api"
    files = sorted(str(p.relative_to(ours_dir)) for p in ours_dir.rglob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    with tempfile.NamedTemporaryFile(suffix=".pb") as out:
        rc = protoc.main(["protoc", "-I", str(UPSTREAM_API), "-I", include, f"--descriptor_set_out={out.name}", *files])
        assert rc == 0
        upstream = descriptor_pb2.FileDescriptorSet.FromString(Path(out.name).read_bytes())

    def index(fdp: descriptor_pb2.FileDescriptorProto) -> tuple[dict[str, object], dict[str, object]]:
        msgs: dict[str, object] = {}
        methods: dict[str, object] = {}

        def walk(prefix: str, types: object) -> None:
            for m in types:  # type: ignore[attr-defined]
                name = f"{prefix}.{m.name}"
                msgs[name] = {f.name: (f.number, f.type, f.label, f.type_name) for f in m.field}
                walk(name, m.nested_type)

        walk("." + fdp.package, fdp.message_type)
        for s in fdp.service:
            for m in s.method:
                key = f"{fdp.package}.{s.name}/{m.name}"
                methods[key] = (m.input_type, m.output_type, m.server_streaming)
        return msgs, methods

    up_msgs: dict[str, object] = {}
    up_methods: dict[str, object] = {}
    for fdp in upstream.file:
        m, s = index(fdp)
        up_msgs.update(m)
        up_methods.update(s)
    checked = 0
    for rel in files:
        fdp = descriptor_pb2.FileDescriptorProto()
        descriptor_pool.Default().FindFileByName(f"shim/containerd/api/{rel}").CopyToProto(fdp)
        msgs, methods = index(fdp)
        for name, fields in msgs.items():
            assert name in up_msgs, f"{name} does not exist upstream"
            for fname, value in fields.items():  # type: ignore[attr-defined]
                assert up_msgs[name].get(fname) == value, f"{name}.{fname} differs"  # type: ignore[attr-defined]
            checked += 1
        for key, value in methods.items():
            assert up_methods.get(key) == value, f"method {key} differs from upstream"
    assert checked > 50


# --- against real containerd ---------------------------------------------------------------------


def test_unavailable_for_a_missing_socket(tmp_path: Path) -> None:
    with ContainerdClient(str(tmp_path / "nope.sock"), "default", timeout=3) as c, pytest.raises(Unavailable) as e:
        c.version()
    assert e.value.retryable
    assert e.value.hint is not None and "--address" in e.value.hint
    assert "nope.sock" in e.value.message


def test_version(client: ContainerdClient) -> None:
    version, _revision = client.version()
    assert version.startswith("v2.")


def test_unknown_container_is_not_found(client: ContainerdClient) -> None:
    with pytest.raises(NotFound) as e:
        client.get_container("no-such-container")
    assert "no-such-container" in e.value.message
    assert e.value.hint is not None and "containers ls" in e.value.hint
    assert client.get_task("no-such-container") is None
    with pytest.raises(NotFound):
        client.checkpoint_task("no-such-container", image_path="/tmp/x-img", work_path="/tmp/x-work")


def test_image_chain_id_is_the_unpacked_snapshot(containerd_a: ContainerdDaemon, client: ContainerdClient) -> None:
    image = busybox_image(containerd_a)
    info = client.get_image(image)
    assert info.target.digest.startswith("sha256:")
    parent = client.image_chain_id(image)
    out = subprocess.run(
        ["ctr", "--address", containerd_a.address, "-n", containerd_a.namespace, "snapshots", "ls"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert parent in out
    assert client.read_content(info.target.digest).startswith(b"{")


def test_run_exec_pause_resume(containerd_a: ContainerdDaemon, client: ContainerdClient, counter: str) -> None:
    task = client.get_task(counter)
    assert task is not None and task.status == "running" and task.pid > 0
    info = client.get_container(counter)
    assert info.image == busybox_image(containerd_a)
    assert info.runc_options is not None and info.runc_options.root == containerd_a.runc_root
    assert info.labels == {"test": "counter"}
    assert info.spec["linux"]["cgroupsPath"] == f"/{containerd_a.namespace}/{counter}"
    assert info.snapshot_key == counter and info.snapshotter == "overlayfs"
    assert any(m.type == "overlay" for m in client.snapshot_mounts(info.snapshotter, info.snapshot_key))
    assert (Path(containerd_a.runc_root) / containerd_a.namespace / counter).is_dir()

    status, out, err = client.exec_in_task(counter, ["cat", "/etc/passwd"])
    assert (status, err) == (0, b"")
    assert out.startswith(b"root:x:0:0:")
    status, out, err = client.exec_in_task(counter, ["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (status, out, err) == (3, b"out\n", b"err\n")

    client.pause_task(counter)
    paused = client.get_task(counter)
    assert paused is not None and paused.status == "paused"
    client.resume_task(counter)
    resumed = client.get_task(counter)
    assert resumed is not None and resumed.status == "running"


def test_exec_timeout_kills_the_process(client: ContainerdClient, counter: str) -> None:
    with pytest.raises(FailedPrecondition, match="still running"):
        client.exec_in_task(counter, ["sleep", "30"], timeout=1.0)
    status, _, _ = client.exec_in_task(counter, ["true"])
    assert status == 0


def test_checkpoint_to_image_path_keeps_running(client: ContainerdClient, counter: str, tmp_path: Path) -> None:
    log = tmp_path / "counter.log"
    _wait_for(lambda: log.exists() and log.read_text().count("tick") >= 2)
    image_path, work_path = tmp_path / "img", tmp_path / "work"
    client.checkpoint_task(counter, image_path=str(image_path), work_path=str(work_path))
    names = set(os.listdir(image_path))
    assert {"inventory.img", "pstree.img"} <= names
    assert any(n.startswith("pages-") for n in names)
    assert (work_path / "dump.log").exists()
    task = client.get_task(counter)
    assert task is not None and task.status == "running"
    before = log.read_text().count("tick")
    _wait_for(lambda: log.read_text().count("tick") > before)


def test_checkpoint_with_exit_stops_the_task(client: ContainerdClient, counter: str, tmp_path: Path) -> None:
    client.checkpoint_task(counter, image_path=str(tmp_path / "img"), work_path=str(tmp_path / "work"), exit=True)
    assert (tmp_path / "img" / "inventory.img").exists()
    _wait_for(lambda: (t := client.get_task(counter)) is None or t.status == "stopped")


def test_checkpoint_failure_carries_the_criu_log(
    containerd_a: ContainerdDaemon,
    client: ContainerdClient,
    tmp_path: Path,
) -> None:
    """An established TCP connection without open_tcp makes CRIU refuse the dump, for real."""
    cid = _cid("tcp")
    # busybox nc hangs up when its stdin ends: feed both ends from a long sleep.
    script = "sleep 600 | nc -l -p 7000 >/dev/null & sleep 0.5; sleep 600 | nc 127.0.0.1 7000 >/dev/null"
    client.run_container(
        cid,
        image=busybox_image(containerd_a),
        args=["sh", "-c", script],
        log_path=str(tmp_path / "tcp.log"),
        runc_options=containerd_a.runc_options,
    )
    try:
        _wait_for(lambda: client.exec_in_task(cid, ["sh", "-c", "netstat -tn | grep -q ESTABLISHED"])[0] == 0)
        work = tmp_path / "work"
        with pytest.raises(CriuFailed) as e:
            client.checkpoint_task(cid, image_path=str(tmp_path / "img"), work_path=str(work), open_tcp=False)
        assert cid in e.value.message
        assert e.value.details, "the dump.log tail should be attached"
        assert e.value.details.strip().splitlines()[-1] in (work / "dump.log").read_text()
        assert "Error (" in e.value.details.splitlines()[0], "CRIU's error lines come first"
        assert "tcp" in e.value.details.lower()
        task = client.get_task(cid)
        assert task is not None and task.status == "running", "a failed dump must leave the task running"
    finally:
        client.remove_container(cid)


def test_remove_container_cleans_up(containerd_a: ContainerdDaemon, client: ContainerdClient, tmp_path: Path) -> None:
    cid = _cid("rm")
    client.run_container(
        cid,
        image=busybox_image(containerd_a),
        args=["sleep", "600"],
        log_path=str(tmp_path / "rm.log"),
        runc_options=containerd_a.runc_options,
    )
    client.pause_task(cid)  # removal must also work on a frozen task
    client.remove_container(cid)
    assert client.get_task(cid) is None
    with pytest.raises(NotFound):
        client.get_container(cid)
    with pytest.raises(NotFound):
        client.snapshot_mounts("overlayfs", cid)
    assert not (Path(containerd_a.runc_root) / containerd_a.namespace / cid).exists()
    client.remove_container(cid)  # idempotent


def test_two_daemons_are_independent(
    containerd_a: ContainerdDaemon,
    containerd_b: ContainerdDaemon,
    counter: str,
) -> None:
    assert containerd_a.runc_root != containerd_b.runc_root
    with containerd_b.client() as b:
        assert counter not in {c.id for c in b.list_containers()}
        with pytest.raises(NotFound):
            b.get_container(counter)


def test_python_image_runs_python(containerd_a: ContainerdDaemon, client: ContainerdClient, tmp_path: Path) -> None:
    image = python_image(containerd_a)
    cid = _cid("py")
    log = tmp_path / "py.log"
    client.run_container(
        cid,
        image=image,
        args=["python3", "-c", "import sys, time; print('py', sys.version_info[0], flush=True); time.sleep(600)"],
        log_path=str(log),
        runc_options=containerd_a.runc_options,
    )
    try:
        _wait_for(lambda: log.exists() and "py 3" in log.read_text(), timeout=30)
    finally:
        client.remove_container(cid)


def test_node_criu_config_is_probed_and_used(
    client: ContainerdClient, counter: str, tmp_path: Path, criu_node_config: criu_config.ConfigResult | None
) -> None:
    """install-node's CRIU configuration (nftables network lock): the probe is a real CRIU dump, and
    runc's CRIU reads the file on a real checkpoint of a container in its own network namespace."""
    probe = criu_config.ensure(str(tmp_path / "probe" / "runc.conf"), criu=CRIU)
    assert probe.state == "written", probe.detail
    assert criu_node_config is not None and criu_node_config.state in ("written", "unchanged", "foreign")
    if criu_node_config.state == "foreign":
        pytest.skip(f"{criu_config.RUNC_CONF} belongs to someone else on this machine")
    client.checkpoint_task(counter, image_path=str(tmp_path / "img"), work_path=str(tmp_path / "work"))
    log = (tmp_path / "work" / "dump.log").read_text()
    assert f"Parsing config file {criu_config.RUNC_CONF}" in log
    assert "Dumping finished successfully" in log
    task = client.get_task(counter)
    assert task is not None and task.status == "running"
