"""Bad input and faults against the real node engine: each gives a clear error and loses nothing."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
from pathlib import Path

import pytest
import zstandard

from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.errors import NotFound
from kubectl_snapshot.core.model import ContainerRecord, SnapshotConfig
from kubectl_snapshot.core.oci import Descriptor, build_manifest, sha256_digest
from kubectl_snapshot.core.reference import Reference
from shim.containerd.client import ContainerdClient
from shim.engine.staging import StatePaths
from shim.host import facts as hostfacts
from shim.host import memwork
from tests.integration.test_agent_roundtrip import (
    AGENT,
    agent,
    cleanup,
    client,
    on,
    read_counter,
    restore_on,
    start_counter,
    unique,
    wait_for,
)
from tests.support.containerd import containerd_a, containerd_b
from tests.support.faulty_proxy import FaultyProxy
from tests.support.images import busybox_image, python_image
from tests.support.registry import registry
from tests.support.signing import sign, signing_env
from tests.support.tarcraft import craft_tar, dev, reg, sym

pytestmark = pytest.mark.integration


@pytest.fixture
def running_counter(containerd_a, cleanup):  # type: ignore[no-untyped-def]
    a = client(containerd_a)
    cid = unique("fault")
    cleanup(a, cid)
    start_counter(a, containerd_a, cid, busybox_image(containerd_a))
    return a, containerd_a, cid


def assert_still_running(a: ContainerdClient, cid: str) -> None:
    task = a.get_task(cid)
    assert task is not None and task.status == "running"
    _, v = read_counter(a, cid)
    wait_for(lambda: read_counter(a, cid)[1] > v + 2, what="the counter to keep counting")


def test_unknown_container_is_a_clear_error(containerd_a, registry):  # type: ignore[no-untyped-def]
    proc = agent("checkpoint", *on(containerd_a), "--to", registry.ref("x", "v1"), "no-such-ctr", check=False)
    assert proc.returncode == 1
    assert "error:" in proc.stderr and "no-such-ctr" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_reference_is_a_usage_error(containerd_a):  # type: ignore[no-untyped-def]
    proc = agent("checkpoint", *on(containerd_a), "--to", "UPPER CASE/?", "c", check=False)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error:")


def test_registry_down_leaves_the_container_running(running_counter):  # type: ignore[no-untyped-def]
    a, daemon, cid = running_counter
    with socket.socket() as s:  # a loopback port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = agent("checkpoint", *on(daemon), "--stop", "--to", f"127.0.0.1:{port}/down:v1", cid, check=False)
    assert proc.returncode == 1
    assert "error:" in proc.stderr and f"127.0.0.1:{port}" in proc.stderr
    assert "hint:" in proc.stderr
    assert_still_running(a, cid)


def test_registry_failing_mid_push_leaves_no_tag_and_the_container_running(running_counter, registry):  # type: ignore[no-untyped-def]
    a, daemon, cid = running_counter
    host, port = registry.host.rsplit(":", 1)
    with FaultyProxy(host, int(port), fail_after_bytes=1024) as proxy:
        proc = agent("checkpoint", *on(daemon), "--stop", "--to", f"{proxy.host}/midpush:v1", cid, check=False)
    assert proc.returncode == 1, proc.stdout
    assert "error:" in proc.stderr
    assert_still_running(a, cid)  # --stop did not stop it: the snapshot never reached the registry
    with pytest.raises(NotFound):
        RegistryClient().get_manifest(Reference.parse(registry.ref("midpush", "v1")))


def test_criu_dump_failure_shows_the_log_and_leaves_the_container_running(containerd_a, registry, cleanup, tmp_path):  # type: ignore[no-untyped-def]
    """A process connected to a unix socket outside its container cannot be dumped by CRIU."""
    a = client(containerd_a)
    image = python_image(containerd_a)
    sockdir = tmp_path / "sock"
    sockdir.mkdir()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(sockdir / "s"))
    server.listen(1)
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(server.accept()[0]), daemon=True).start()
    cid = unique("extsock")
    cleanup(a, cid)
    code = (
        "import os,socket,time\n"
        "s=socket.socket(socket.AF_UNIX); s.connect('/sock/s')\n"
        "i=0\n"
        "while True:\n"
        "    i+=1; open('/tmp/c.t','w').write('t %d' % i); os.replace('/tmp/c.t', '/tmp/count'); time.sleep(0.05)\n"
    )
    mount = {"destination": "/sock", "type": "bind", "source": str(sockdir), "options": ["rbind", "rw"]}
    a.run_container(
        cid, image=image, args=["python3", "-c", code], mounts=[mount], runc_options=containerd_a.runc_options
    )
    wait_for(lambda: read_counter(a, cid)[1] > 5, what="the client to run")
    proc = agent("checkpoint", *on(containerd_a), "--to", registry.ref("extsock", "v1"), cid, check=False)
    server.close()
    assert proc.returncode == 1
    assert "error:" in proc.stderr
    # the tail of CRIU's dump.log is part of the error
    assert "Error" in proc.stderr or "error (" in proc.stderr.lower(), proc.stderr
    assert_still_running(a, cid)


def test_restore_whose_mount_source_is_gone_says_why(containerd_a, containerd_b, registry, cleanup, tmp_path):  # type: ignore[no-untyped-def]
    """runc fails before CRIU runs (a bind mount's host directory is gone): runc's reason is in the error."""
    a, b = client(containerd_a), client(containerd_b)
    data = tmp_path / "data"
    data.mkdir()
    cid, new = unique("gone"), unique("gone-r")
    cleanup(a, cid)
    cleanup(b, new)
    mount = {"destination": "/data", "type": "bind", "source": str(data), "options": ["rbind", "rw"]}
    start_counter(a, containerd_a, cid, busybox_image(containerd_a), mounts=[mount])
    ref = json.loads(
        agent("checkpoint", *on(containerd_a), "-o", "json", "--to", registry.ref("gone", "v1"), cid).stdout
    )
    busybox_image(containerd_b)
    data.rmdir()
    proc = agent(*restore_on(containerd_b), ref["reference"], new, check=False)
    assert proc.returncode == 1
    assert "before CRIU ran" in proc.stderr and str(data) in proc.stderr, proc.stderr
    assert_still_running(a, cid)


# --- restore-side bad input -------------------------------------------------------------------


def _push_artifact(registry, name: str, layer_tar: bytes) -> str:  # type: ignore[no-untyped-def]
    """Push a well-formed artifact (valid digests, valid config) whose layer holds `layer_tar`."""
    reg_client = RegistryClient()
    ref = Reference.parse(registry.ref(name, "v1"))
    layer = zstandard.ZstdCompressor().compress(layer_tar)
    rec = ContainerRecord(name="c", id="c", image="", image_digest="", layer_digest=sha256_digest(layer), spec={})
    cfg = SnapshotConfig(
        group="g",
        namespace="test",
        created="2026-01-01T00:00:00Z",
        containers=(rec,),
        host=hostfacts.gather(),
    )
    cfg_bytes = cfg.to_bytes()
    reg_client.push_blob(ref, digest=sha256_digest(layer), size=len(layer), data=layer)
    reg_client.push_blob(ref, digest=sha256_digest(cfg_bytes), size=len(cfg_bytes), data=cfg_bytes)
    manifest = build_manifest(
        config=Descriptor(C.CONFIG_MEDIA_TYPE, sha256_digest(cfg_bytes), len(cfg_bytes)),
        layers=[Descriptor(C.CHECKPOINT_LAYER_MEDIA_TYPE, sha256_digest(layer), len(layer))],
        artifact_type=C.ARTIFACT_TYPE,
        annotations={},
    )
    digest = reg_client.push_manifest(ref, manifest.to_bytes(), C.OCI_MANIFEST)
    pinned = f"{ref.registry}/{ref.repository}@{digest}"
    sign(pinned, cfg.namespace)  # signed like an agent's: the restore gets to the layer under test
    return pinned


@pytest.mark.parametrize(
    "entries, why",
    [
        ([reg("checkpoint/inventory.img", b"x"), reg("../../escaped-by-dotdot", b"pwned")], ".."),
        ([sym("checkpoint", "/tmp"), reg("checkpoint/escaped-by-symlink", b"pwned")], "symlink"),
        ([reg("checkpoint/inventory.img", b"x"), dev("checkpoint/null")], "device"),
    ],
)
def test_malicious_layers_are_refused_and_nothing_escapes(containerd_b, registry, entries, why, tmp_path):  # type: ignore[no-untyped-def]
    ref = _push_artifact(registry, f"evil-{why.strip('.') or 'dotdot'}", craft_tar(entries))
    name = unique("evil")
    proc = agent(*restore_on(containerd_b), ref, name, check=False)
    assert proc.returncode == 1, proc.stdout
    assert "error:" in proc.stderr and "refusing to restore" not in proc.stderr  # past provenance
    state = Path(os.environ.get(C.ENV_STATE_DIR, C.DEFAULT_STATE_DIR))
    assert not Path("/tmp/escaped-by-symlink").exists()
    assert not (state / "escaped-by-dotdot").exists() and not (state.parent / "escaped-by-dotdot").exists()
    assert not (state / C.STAGING_SUBDIR / "by-id" / name).exists()  # staging removed after refusal
    with pytest.raises(NotFound):
        client(containerd_b).get_container(name)


def test_tampered_blob_is_refused_before_extraction(containerd_a, containerd_b, registry, cleanup):  # type: ignore[no-untyped-def]
    a = client(containerd_a)
    cid = unique("tamper")
    cleanup(a, cid)
    start_counter(a, containerd_a, cid, busybox_image(containerd_a))
    busybox_image(containerd_b)
    ref = agent("checkpoint", *on(containerd_a), "--to", registry.ref("tamper", "v1"), cid).stdout.strip()
    body, _, _ = RegistryClient().get_manifest(Reference.parse(ref))
    layer_digest = json.loads(body)["layers"][0]["digest"]
    blob = registry.blob_path(layer_digest)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    name = unique("tampered")
    proc = agent(*restore_on(containerd_b), ref, name, check=False)
    assert proc.returncode == 1
    assert "digest" in proc.stderr.lower()
    state = Path(os.environ.get(C.ENV_STATE_DIR, C.DEFAULT_STATE_DIR))
    assert not (state / C.STAGING_SUBDIR / "by-id" / name).exists()
    # the container created while the data downloaded was refused by its hook and removed; no gate is left
    assert not (state / C.STAGING_SUBDIR / "gates" / name).exists()
    with pytest.raises(NotFound):
        client(containerd_b).get_container(name)


def test_a_new_name_already_taken_is_refused_and_its_container_kept(containerd_a, registry, cleanup):  # type: ignore[no-untyped-def]
    a = client(containerd_a)
    cid = unique("taken")
    cleanup(a, cid)
    start_counter(a, containerd_a, cid, busybox_image(containerd_a))
    ref = agent("checkpoint", *on(containerd_a), "--to", registry.ref("taken", "v1"), cid).stdout.strip()
    proc = agent(*restore_on(containerd_a), ref, cid, check=False)
    assert proc.returncode == 1, proc.stdout
    assert f"a container named {cid!r} already exists" in proc.stderr and "hint:" in proc.stderr
    task = a.get_task(cid)
    assert task is not None and task.status == "running"


def test_unknown_reference_and_wrong_name_count(containerd_b, registry):  # type: ignore[no-untyped-def]
    proc = agent(*restore_on(containerd_b), registry.ref("does-not-exist", "v1"), "x", check=False)
    assert proc.returncode == 1 and "error:" in proc.stderr
    proc = agent("inspect", registry.ref("does-not-exist", "v1"), check=False)
    assert proc.returncode == 1 and "error:" in proc.stderr


def test_recover_thaws_what_a_killed_checkpoint_left_frozen(running_counter):  # type: ignore[no-untyped-def]
    """The agent died between freezing and resuming: `recover` (run by the DaemonSet at start) thaws."""
    from shim.engine.checkpoint import FROZEN_FILE
    from shim.engine.staging import StatePaths

    a, daemon, cid = running_counter
    work = Path(StatePaths.from_env().work_dir(unique("killed")))
    work.mkdir(parents=True)
    (work / FROZEN_FILE).write_text(json.dumps([cid]))
    a.pause_task(cid)
    assert a.get_task(cid).status == "paused"
    out = agent("recover", *on(daemon)).stdout
    assert f"{cid}\tthawed" in out
    assert not work.exists()
    assert_still_running(a, cid)


def test_direct_freezer_on_a_real_container_and_recover(running_counter):  # type: ignore[no-untyped-def]
    """The cgroup freezer the agent writes directly: the container stops counting while frozen, runc calls it
    paused, containerd still "running"; `recover` finds it through the freezer and thaws it."""
    from shim.engine.checkpoint import FROZEN_FILE
    from shim.engine.staging import StatePaths
    from shim.host import freezer

    a, daemon, cid = running_counter
    fz = freezer.lookup(a.get_task(cid).pid)
    assert fz is not None, "the task's freezer should be placeable on this machine"
    fz.freeze()
    try:
        assert fz.frozen()
        state = subprocess.run(
            ["runc", "--root", str(next(Path(daemon.runc_root).iterdir())), "state", cid],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert json.loads(state)["status"] == "paused"
        work = Path(StatePaths.from_env().work_dir(unique("killed-direct")))
        work.mkdir(parents=True)
        (work / FROZEN_FILE).write_text(json.dumps([cid]))
        out = agent("recover", *on(daemon)).stdout
        assert f"{cid}\tthawed" in out and not work.exists()
        assert not fz.frozen()
    finally:
        fz.thaw()
    assert_still_running(a, cid)


@pytest.fixture
def tiny_tmpfs(tmp_path):  # type: ignore[no-untyped-def]
    """A tmpfs with room for bytes but for only a few files (inodes): a dump into it passes the free-space
    reservation (bytes) and then really runs out of space in the middle, at CRIU's first files."""
    where = tmp_path / "tiny"
    where.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m,nr_inodes=8,mode=0700", "ks-tiny", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_filesystem_that_fills_up_mid_dump_fails_the_snapshot_and_leaves_the_container_running(  # type: ignore[no-untyped-def]
    running_counter, registry, tiny_tmpfs
):
    """Threat A13: the dump's work area runs out of space while CRIU writes (ENOSPC): a typed error with
    the tail of CRIU's log, the container resumed and counting, no snapshot in the registry, nothing left
    in the work area. The legitimate case beside it: the same container snapshots into the node's work
    area as usual."""
    a, daemon, cid = running_counter
    env = {"KUBECTL_SNAPSHOT_MEMORY_WORK_DIR": str(tiny_tmpfs)}
    proc = agent("checkpoint", *on(daemon), "--to", registry.ref("enospc", "v1"), cid, check=False, env=env)
    assert proc.returncode == 1, proc.stdout
    assert "error:" in proc.stderr and "No space left on device" in proc.stderr, proc.stderr
    assert_still_running(a, cid)
    with pytest.raises(NotFound):
        RegistryClient().get_manifest(Reference.parse(registry.ref("enospc", "v1")))
    wait_for(lambda: not any(p.is_file() for p in tiny_tmpfs.rglob("*")), what="the work area to be emptied")
    ok = agent("checkpoint", *on(daemon), "--to", registry.ref("enospc", "v2"), cid, check=False)
    assert ok.returncode == 0, ok.stderr
    assert_still_running(a, cid)


def test_a_signature_tag_that_cannot_be_pushed_leaves_no_snapshot_tag(running_counter, registry):  # type: ignore[no-untyped-def]
    """Threat B4: the last steps of a push are the signature's tag and then the snapshot's; the registry
    refusing the signature's tag ends the snapshot with an error and no tag that names an unsigned
    snapshot (one restore would refuse), the container running; `--stop` stops nothing. The legitimate
    case beside it: the same push through the same proxy without the fault is tagged and signed."""
    a, daemon, cid = running_counter
    host, port = registry.host.rsplit(":", 1)
    sig_tag = ("PUT", r"/manifests/sha256-[0-9a-f]{64}\.sig$")
    with FaultyProxy(host, int(port), fail_on=sig_tag, status=400) as proxy:
        proc = agent("checkpoint", *on(daemon), "--stop", "--to", f"{proxy.host}/b4:v1", cid, check=False)
    assert proc.returncode == 1, proc.stdout
    assert "error:" in proc.stderr and ".sig" in proc.stderr, proc.stderr
    assert_still_running(a, cid)
    with pytest.raises(NotFound):
        RegistryClient().get_manifest(Reference.parse(registry.ref("b4", "v1")))
    with FaultyProxy(host, int(port)) as proxy:
        ok = agent("checkpoint", *on(daemon), "--to", f"{proxy.host}/b4:v2", cid, check=False)
    assert ok.returncode == 0, ok.stderr
    digest = RegistryClient().get_manifest(Reference.parse(registry.ref("b4", "v2")))[2]
    RegistryClient().get_manifest(Reference.parse(registry.ref("b4", digest.replace(":", "-") + ".sig")))


def test_the_agent_killed_before_the_manifest_put_leaves_no_tag_and_the_pod_running(running_counter, registry):  # type: ignore[no-untyped-def]
    """Threat B2: the agent is killed (SIGKILL) once every blob is in the registry, while its manifest
    PUT is held in the proxy. With ``--stop`` the container is still frozen then: its freeze guard thaws
    it when the agent dies. No snapshot tag exists afterwards (a signature's tag may, naming a digest
    nothing else names), and the legitimate case beside it: a later save of the same container through
    the same proxy succeeds and is tagged."""
    a, daemon, cid = running_counter
    host, port = registry.host.rsplit(":", 1)
    with FaultyProxy(host, int(port), hold_on=("PUT", r"/b2/manifests/v1$")) as proxy:
        env = {**os.environ, **signing_env()}
        argv = [AGENT, "checkpoint", *on(daemon), "--stop", "--to", f"{proxy.host}/b2:v1", cid]
        killed = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            assert proxy.holding.wait(120), "the manifest PUT never came"
            blobs = [r for r in proxy.requests if r[0] == "PUT" and "/blobs/uploads/" in r[1]]
            assert blobs and all(status == 201 for _, _, status in blobs), proxy.requests
            killed.kill()
            killed.wait(30)
        finally:
            if killed.poll() is None:
                killed.kill()
                killed.wait(30)
        proxy.release()
        assert_still_running(a, cid)  # thawed by the guard, never stopped: --stop needs the pushed tag
        # what the killed save left (its work directory, in the memory work area or on disk) goes when the
        # node's agent starts again (recover_interrupted, as the DaemonSet's agent runs it at start)
        agent("recover", *on(daemon))
        area = memwork.area_dir(StatePaths.from_env().root)
        assert not os.path.exists(area) or os.listdir(area) == [], os.listdir(area)
        tags = RegistryClient().list_tags(Reference.parse(registry.ref("b2", "v1")))
        assert "v1" not in tags and all(t.endswith(".sig") for t in tags), tags
        with pytest.raises(NotFound):
            RegistryClient().get_manifest(Reference.parse(registry.ref("b2", "v1")))
        again = agent("checkpoint", *on(daemon), "--to", f"{proxy.host}/b2:v2", cid, check=False)
    assert again.returncode == 0, again.stderr
    RegistryClient().get_manifest(Reference.parse(registry.ref("b2", "v2")))
    assert_still_running(a, cid)
