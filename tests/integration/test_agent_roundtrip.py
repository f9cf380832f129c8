"""The node engine end to end on real components: two containerd instances, runc, CRIU 4.2.1 and a
registry. Everything goes through `ks-agent`, the command a user runs."""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import subprocess
import sys
import tarfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.errors import NotFound
from kubectl_snapshot.core.reference import Reference
from shim.containerd.client import ContainerdClient
from shim.files.archive import sparse_regions
from tests.support.containerd import ContainerdDaemon, containerd_a, containerd_b
from tests.support.images import busybox_image, python_image
from tests.support.registry import RegistryServer, registry
from tests.support.signing import signing_env

pytestmark = pytest.mark.integration

AGENT = str(Path(sys.executable).with_name("ks-agent"))
WRAPPER = str(Path(sys.executable).with_name("ks-runc"))
# The count is replaced atomically (rename), so a reader, or a freeze, never meets a half-written file.
COUNTER = (
    "tok=$(cat /proc/sys/kernel/random/uuid); i=0; "
    'while true; do i=$((i+1)); echo "$tok $i" > /tmp/count.t; mv /tmp/count.t /tmp/count; echo $i; '
    "usleep 50000; done"
)


def agent(
    *args: str,
    check: bool = True,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    sign: bool = True,
    program: str = AGENT,
) -> subprocess.CompletedProcess[str]:
    """The node-level agent CLI, signing with and trusting the session's key (tests.support.signing);
    `program`: another ks-agent (the agent image's launcher in front of this one, test_agent_serve.py)."""
    full_env = {**os.environ, **signing_env(), **(env or {})}
    if not sign:
        full_env.pop("KUBECTL_SNAPSHOT_SIGNING_KEY")
    proc = subprocess.run([program, *args], capture_output=True, text=True, timeout=timeout, check=False, env=full_env)
    if check and proc.returncode != 0:
        pytest.fail(f"ks-agent {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def artifact_layers(ref: str) -> list[bytes]:
    """The decompressed layers of a snapshot, fetched and verified by the project's registry client."""
    import io

    import zstandard

    from kubectl_snapshot.core.oci import parse_manifest

    reg = RegistryClient()
    r = Reference.parse(ref)
    body, _, _ = reg.get_manifest(r)
    out = []
    for layer in parse_manifest(body).layers:
        buf = io.BytesIO()
        reg.fetch_blob(r, layer.digest, buf)
        out.append(zstandard.ZstdDecompressor().decompressobj().decompress(buf.getvalue()))
    return out


def read_member(layer: bytes, inner_tar: str | None, name: str) -> str:
    import io
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(layer)) as t:
        if inner_tar is not None:
            data = t.extractfile(inner_tar).read()  # type: ignore[union-attr]
            with tarfile.open(fileobj=io.BytesIO(data)) as inner:
                return inner.extractfile(name).read().decode().strip()  # type: ignore[union-attr]
        return t.extractfile(name).read().decode().strip()  # type: ignore[union-attr]


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def client(d: ContainerdDaemon) -> ContainerdClient:
    return d.client()


def on(d: ContainerdDaemon) -> list[str]:
    """The agent flags that address this daemon."""
    return ["-a", d.address, "-n", d.namespace]


def restore_on(d: ContainerdDaemon) -> list[str]:
    return ["restore", *on(d), "--runtime-binary", WRAPPER, "--runc-root", d.runc_root]


def task_status(c: ContainerdClient, cid: str) -> str | None:
    task = c.get_task(cid)
    return task.status if task else None


def read_counter(c: ContainerdClient, cid: str, path: str = "/tmp/count") -> tuple[str, int]:
    code, out, err = c.exec_in_task(cid, ["cat", path])
    assert code == 0, err
    tok, value = out.decode().split()
    return tok, int(value)


def wait_for(pred: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if pred():
                return
        except Exception:
            pass
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture
def cleanup() -> Iterator[Callable[[ContainerdClient, str], None]]:
    todo: list[tuple[ContainerdClient, str]] = []

    def add(c: ContainerdClient, cid: str) -> None:
        todo.append((c, cid))

    yield add
    for c, cid in todo:
        with contextlib.suppress(Exception):
            c.remove_container(cid)


def start_counter(c: ContainerdClient, d: ContainerdDaemon, cid: str, image: str, **kw: object) -> None:
    c.run_container(cid, image=image, args=["sh", "-c", COUNTER], runc_options=d.runc_options, **kw)  # type: ignore[arg-type]
    wait_for(lambda: read_counter(c, cid)[1] >= 20, what="the counter to reach 20")


def test_counter_continues_on_a_second_containerd(containerd_a, containerd_b, registry, cleanup):  # type: ignore[no-untyped-def]
    a, b = client(containerd_a), client(containerd_b)
    image_a, image_b = busybox_image(containerd_a), busybox_image(containerd_b)
    assert image_a == image_b
    cid, new = unique("counter"), unique("restored")
    cleanup(a, cid)
    cleanup(b, new)
    start_counter(a, containerd_a, cid, image_a)
    tok_before, v_before = read_counter(a, cid)

    out = agent("checkpoint", *on(containerd_a), "--stop", "--to", registry.ref("counter", "v1"), cid)
    ref = out.stdout.strip()
    assert re.fullmatch(rf"{re.escape(registry.host)}/counter@sha256:[0-9a-f]{{64}}", ref), ref
    # --stop: the original is stopped once the snapshot is in the registry
    task = a.get_task(cid)
    assert task is None or task.status == "stopped"
    a.remove_container(cid)

    restored = agent(*restore_on(containerd_b), "-o", "json", ref, new)
    info = json.loads(restored.stdout)
    assert info["containers"][0]["name"] == new
    # created while its data downloaded: the hook's create waited at the staging gate until it was complete
    assert info["timingsMs"]["created_during_download"] == 1, info["timingsMs"]
    assert info["provenance"].startswith("signed by trusted key ")  # verified before any layer was fetched
    assert task_status(b, new) == "running"
    tok_after, v_after = read_counter(b, new)
    # same process memory (the token was generated once, at the first start) and the count went on
    assert tok_after == tok_before
    assert v_after >= v_before
    wait_for(lambda: read_counter(b, new)[1] > v_after + 5, what="the restored counter to advance")
    # kill and delete behave like for any container
    b.kill_task(new, 9)
    assert b.wait_task(new, timeout=20) == 137
    b.remove_container(new)
    with pytest.raises(NotFound):
        b.get_container(new)


def test_snapshot_without_stop_leaves_the_original_running(containerd_a, registry, cleanup):  # type: ignore[no-untyped-def]
    a = client(containerd_a)
    image = busybox_image(containerd_a)
    cid = unique("keep")
    cleanup(a, cid)
    start_counter(a, containerd_a, cid, image)
    agent("checkpoint", *on(containerd_a), "--to", registry.ref("keep", "v1"), cid)
    assert task_status(a, cid) == "running"
    _, v1 = read_counter(a, cid)
    wait_for(lambda: read_counter(a, cid)[1] > v1 + 3, what="the original counter to advance")

    inspected = json.loads(agent("inspect", registry.ref("keep", "v1"), "-o", "json").stdout)
    c = inspected["containers"][0]
    assert c["processCount"] >= 2  # sh and its usleep child (or at least the shell and one more)
    assert c["pagesWritten"] > 0 and c["memoryBytes"] == c["pagesWritten"] * 4096
    assert any(p["comm"] == "sh" for p in c["processes"])
    assert inspected["host"]["criuVersion"].startswith("4.2")
    text = agent("inspect", registry.ref("keep", "v1")).stdout
    assert "process(es)" in text and "pages" in text


def test_a_small_dump_goes_through_memory_and_one_the_node_keeps_on_disk_too(  # type: ignore[no-untyped-def]
    containerd_a, containerd_b, registry, cleanup
):
    """A dump that clearly fits goes to the node's memory work area (shim/host/memwork.py), restores like any
    other, and leaves nothing there; with KUBECTL_SNAPSHOT_MEMORY_WORK_MIB=0 it goes to the state dir."""
    from shim.engine.staging import StatePaths
    from shim.host import memwork

    a, b, image, cid, new = pair(containerd_a, containerd_b, cleanup, "inmem", busybox_image)
    start_counter(a, containerd_a, cid, image)
    tok_before, _ = read_counter(a, cid)
    area = memwork.area_dir(StatePaths.from_env().root)
    on_disk = agent(
        "checkpoint", *on(containerd_a), "-o", "json", "--to", registry.ref("inmem", "disk"), cid,
        env={memwork.ENV_MIB: "0"},
    )  # fmt: skip
    assert json.loads(on_disk.stdout)["dumpedTo"] == "disk"
    to = registry.ref("inmem", "v1")
    out = json.loads(agent("checkpoint", *on(containerd_a), "-o", "json", "--to", to, cid).stdout)
    assert out["dumpedTo"] == "memory", out
    # nothing left in the area (install-node's tmpfs, shim/host/workfs.py, stays as a mount point)
    assert not os.path.exists(area) or os.listdir(area) == []
    agent(*restore_on(containerd_b), out["reference"], new)
    tok_after, _ = read_counter(b, new)
    assert tok_after == tok_before


SPARSE_OFFSET = 3_000_000_000


def first_layer_rootfs_members(ref: str) -> tuple[int, dict[str, tarfile.TarInfo]]:
    """(bytes of rootfs-diff.tar in the container's layer, the diff's members), read as streams."""
    import io

    import zstandard

    from kubectl_snapshot.core.oci import parse_manifest

    reg = RegistryClient()
    r = Reference.parse(ref)
    body, _, _ = reg.get_manifest(r)
    buf = io.BytesIO()
    reg.fetch_blob(r, parse_manifest(body).layers[0].digest, buf)
    buf.seek(0)
    with zstandard.ZstdDecompressor().stream_reader(buf) as z, tarfile.open(fileobj=z, mode="r|") as outer:
        for m in outer:
            if m.name == "rootfs-diff.tar":
                with tarfile.open(fileobj=outer.extractfile(m), mode="r|") as inner:
                    return m.size, {i.name: i for i in inner}
    raise AssertionError("no rootfs-diff.tar in the container's layer")


def test_a_sparse_file_in_the_writable_layer_keeps_its_holes(containerd_a, containerd_b, registry, cleanup):  # type: ignore[no-untyped-def]
    """A 4 GiB file holding 6 bytes: captured as its data (not 4 GiB written while the pod is frozen),
    the dump still in memory (its size is what the files hold), restored with its holes."""
    a, b, image, cid, new = pair(containerd_a, containerd_b, cleanup, "sparse", busybox_image)
    make = (
        f"truncate -s 4G /sparse.img && printf marker | dd of=/sparse.img bs=1 seek={SPARSE_OFFSET} conv=notrunc "
        "2>/dev/null && "
    )
    a.run_container(cid, image=image, args=["sh", "-c", make + COUNTER], runc_options=containerd_a.runc_options)
    wait_for(lambda: read_counter(a, cid)[1] >= 5, what="the counter to start")
    to = registry.ref("sparse", "v1")
    out = json.loads(agent("checkpoint", *on(containerd_a), "-o", "json", "--to", to, cid).stdout)
    assert out["dumpedTo"] == "memory", out  # sized by what the layer holds, not its 4 GiB of holes
    diff_bytes, members = first_layer_rootfs_members(out["reference"])
    assert diff_bytes < 1 << 20, diff_bytes
    img = members["sparse.img"]
    regions = sparse_regions(img)
    assert img.size == 4 << 30 and regions is not None and sum(n for _, n in regions) <= 8192, regions
    agent(*restore_on(containerd_b), out["reference"], new)
    code, stat_out, err = b.exec_in_task(new, ["stat", "-c", "%s %b", "/sparse.img"])
    assert code == 0, err
    size, blocks = map(int, stat_out.split())
    assert size == 4 << 30 and blocks <= 64, (size, blocks)  # a few KiB on disk, not 4 GiB
    code, data, err = b.exec_in_task(new, ["dd", "if=/sparse.img", "bs=1", f"skip={SPARSE_OFFSET}", "count=6"])
    assert code == 0 and data == b"marker", (data, err)


Cleanup = Callable[[ContainerdClient, str], None]


def pair(
    da: ContainerdDaemon,
    db: ContainerdDaemon,
    cleanup: Cleanup,
    prefix: str,
    image_of: Callable[[ContainerdDaemon], str],
) -> tuple[ContainerdClient, ContainerdClient, str, str, str]:
    """(client a, client b, the image both have, a container name on a, one for its restore on b); both
    containers are removed after the test."""
    a, b = client(da), client(db)
    image = image_of(da)
    assert image_of(db) == image
    cid, new = unique(prefix), unique(f"{prefix}-restored")
    cleanup(a, cid)
    cleanup(b, new)
    return a, b, image, cid, new


def python_pair(
    da: ContainerdDaemon, db: ContainerdDaemon, cleanup: Cleanup, prefix: str, script: str
) -> tuple[ContainerdClient, ContainerdClient, str, str]:
    """pair(), with `python3 -c script` running on a once it wrote /tmp/ready."""
    a, b, image, cid, new = pair(da, db, cleanup, prefix, python_image)
    a.run_container(cid, image=image, args=["python3", "-c", script], runc_options=da.runc_options)
    wait_for(lambda: a.exec_in_task(cid, ["cat", "/tmp/ready"])[0] == 0, timeout=60, what=f"the {prefix} workload")
    return a, b, cid, new


XATTR_WORKLOAD = r"""
import os, struct, time
with open("/tmp/tool", "wb") as f:
    f.write(b"#!/bin/sh\n")
os.chmod("/tmp/tool", 0o755)
# cap_net_bind_service, permitted and effective (struct vfs_cap_data, revision 2), as `setcap` writes it
os.setxattr("/tmp/tool", "security.capability", struct.pack("<IIIII", 0x02000001, 1 << 10, 0, 0, 0))
os.setxattr("/tmp/tool", "user.note", b"kept")
os.utime("/tmp/tool", ns=(1796300000123456789, 1796300000123456789))  # a fraction of a second comes back too
open("/tmp/ready", "w").write("1")
while True:
    time.sleep(0.05)
"""
READ_XATTRS = (
    "import os; print(os.getxattr('/tmp/tool', 'security.capability').hex(), "
    "os.getxattr('/tmp/tool', 'user.note').decode(), os.stat('/tmp/tool').st_mtime_ns)"
)


def test_file_capabilities_and_user_attributes_in_the_writable_layer_come_back(  # type: ignore[no-untyped-def]
    containerd_a, containerd_b, registry, cleanup
):
    """`setcap` on a file the workload wrote: without its capabilities the restored program could no
    longer bind its port. Its mtime comes back to the nanosecond."""
    a, b, cid, new = python_pair(containerd_a, containerd_b, cleanup, "xattr", XATTR_WORKLOAD)
    code, before, err = a.exec_in_task(cid, ["python3", "-c", READ_XATTRS])
    assert code == 0, err
    ref = agent("checkpoint", *on(containerd_a), "--to", registry.ref("xattr", "v1"), cid).stdout.strip()
    agent(*restore_on(containerd_b), ref, new)
    code, after, err = b.exec_in_task(new, ["python3", "-c", READ_XATTRS])
    assert code == 0, err
    assert after == before and after.split()[1:] == [b"kept", b"1796300000123456789"], (before, after)


HEAP_SERVER = r"""
import hashlib, os, socket
heap = bytearray(os.urandom(200 << 20))
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 8080)); srv.listen(8)
open("/tmp/ready", "w").write("1")
while True:
    conn, _ = srv.accept()
    conn.sendall((hashlib.sha256(heap).hexdigest() + " %d\n" % os.getpid()).encode()); conn.close()
"""
ASK = "import socket; s=socket.create_connection(('127.0.0.1', 8080), timeout=10); print(s.recv(200).decode())"


def test_python_heap_and_listening_socket_survive(containerd_a, containerd_b, registry, cleanup):  # type: ignore[no-untyped-def]
    a, b, cid, new = python_pair(containerd_a, containerd_b, cleanup, "heap", HEAP_SERVER)
    code, out, err = a.exec_in_task(cid, ["python3", "-c", ASK])
    assert code == 0, err
    checksum, pid = out.decode().split()

    ref = agent("checkpoint", *on(containerd_a), "--stop", "--to", registry.ref("heap", "v1"), cid).stdout.strip()
    inspected = json.loads(agent("inspect", ref, "-o", "json").stdout)
    assert inspected["containers"][0]["memoryBytes"] >= 200 << 20
    a.remove_container(cid)

    agent(*restore_on(containerd_b), ref, new)
    code, out, err = b.exec_in_task(new, ["python3", "-c", ASK])
    assert code == 0, err
    assert out.decode().split() == [checksum, pid]


def test_a_zombie_child_comes_back(containerd_a, containerd_b, registry, cleanup):  # type: ignore[no-untyped-def]
    """CRIU writes garbage for a zombie's thread id in pstree.img (4.2.1): the wrapper's image check
    must read the zombie's own core, not look that id up (it used to refuse about 1 restore in 5 of
    shells that fork in a loop). `true &` then exec: sleep inherits a child it never waits for."""
    a, b = client(containerd_a), client(containerd_b)
    image = busybox_image(containerd_a)
    busybox_image(containerd_b)
    cid, new = unique("zombie"), unique("zombie2")
    cleanup(a, cid)
    cleanup(b, new)
    a.run_container(
        cid, image=image, args=["sh", "-c", "true & exec sleep 3600"], runc_options=containerd_a.runc_options
    )

    def has_zombie() -> bool:
        code, out, _ = a.exec_in_task(cid, ["sh", "-c", "grep -l '^State:.*Z' /proc/[0-9]*/status"])
        return code == 0 and bool(out.strip())

    wait_for(has_zombie, what="the zombie child")
    ref = agent("checkpoint", *on(containerd_a), "--stop", "--to", registry.ref("zombie", "v1"), cid).stdout.strip()
    a.remove_container(cid)
    agent(*restore_on(containerd_b), ref, new)
    assert task_status(b, new) == "running"
    code, out, _ = b.exec_in_task(new, ["sh", "-c", "grep -l '^State:.*Z' /proc/[0-9]*/status"])
    assert code == 0 and out.strip(), "the zombie came back as a zombie"


WRITER = (
    "i=0; while true; do i=$((i+1)); echo $i > /tmp/mine.t; mv /tmp/mine.t /tmp/mine; "
    "echo $i > /vol/seq.t; mv /vol/seq.t /vol/seq; done"
)
READER = "while true; do v=$(cat /vol/seq 2>/dev/null) && echo ${v:-0} > /tmp/seen.t && mv /tmp/seen.t /tmp/seen; done"


def test_group_freeze_is_consistent_and_volume_comes_back(containerd_a, containerd_b, registry, cleanup, tmp_path):  # type: ignore[no-untyped-def]
    a, b = client(containerd_a), client(containerd_b)
    image = busybox_image(containerd_a)
    busybox_image(containerd_b)
    vol, newvol = tmp_path / "vol", tmp_path / "newvol"
    vol.mkdir()
    newvol.mkdir()
    os.chmod(vol, 0o2770)  # the volume's own directory, set up by the workload (fsGroup, say)
    os.chown(vol, 0, 4321)
    w, r = unique("writer"), unique("reader")
    w2, r2 = unique("writer2"), unique("reader2")
    for c, cid in ((a, w), (a, r), (b, w2), (b, r2)):
        cleanup(c, cid)
    mount = {"destination": "/vol", "type": "bind", "source": str(vol), "options": ["rbind", "rw"]}
    a.run_container(w, image=image, args=["sh", "-c", WRITER], mounts=[mount], runc_options=containerd_a.runc_options)
    a.run_container(r, image=image, args=["sh", "-c", READER], mounts=[mount], runc_options=containerd_a.runc_options)
    wait_for(lambda: (vol / "seq").exists() and int((vol / "seq").read_text()) > 1000, what="the writer")

    ref = agent(
        "checkpoint",
        *on(containerd_a),
        "--stop",
        "--volume",
        str(vol),
        "--to",
        registry.ref("group", "v1"),
        w,
        r,
    ).stdout.strip()
    for cid in (w, r):
        a.remove_container(cid)
    # In the artifact: what the reader had seen <= the shared file <= what the writer had written.
    layers = artifact_layers(ref)
    mine = int(read_member(layers[0], "rootfs-diff.tar", "tmp/mine"))
    seen = int(read_member(layers[1], "rootfs-diff.tar", "tmp/seen"))
    seq = int(read_member(layers[2], None, "vol-0/seq"))
    assert seen <= seq <= mine, (seen, seq, mine)

    agent(*restore_on(containerd_b), "--volume", str(newvol), ref, w2, r2)
    # the directory contents came back into the new host dir, and the directory's own owner and mode
    assert (newvol / "seq").exists()
    st = os.stat(newvol)
    assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o2770, 4321)
    for _ in range(20):
        # read the reader first, then the writer: with a consistent freeze the reader is never ahead
        code, seen_out, _ = b.exec_in_task(r2, ["cat", "/tmp/seen"])
        assert code == 0
        code, seq_out, _ = b.exec_in_task(w2, ["cat", "/vol/seq"])
        assert code == 0
        assert int(seen_out.decode() or 0) <= int(seq_out.decode())
    assert int((newvol / "seq").read_text()) > 1000


def _wide_entries(root: Path) -> tuple[list[str], list[tuple[str, str]]]:
    """(every entry below `root`, those of them a group or others may read, write or enter, with the mode)."""
    seen: list[str] = []
    wide: list[tuple[str, str]] = []
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(d, name)
            st = os.lstat(path)
            seen.append(os.path.relpath(path, root))
            if not stat.S_ISLNK(st.st_mode) and st.st_mode & 0o077:
                wide.append((os.path.relpath(path, root), oct(stat.S_IMODE(st.st_mode))))
    return seen, wide


def test_a_dumps_scratch_is_private_and_removed_after(containerd_a, registry, cleanup, tmp_path):  # type: ignore[no-untyped-def]
    """Threat D8: a dump (memory, writable layer, volume) is root's alone while it is on the node, and gone
    after. The agent runs under the usual umask 022; its state dir is fresh (install-node makes it 0700)."""
    a = client(containerd_a)
    image = busybox_image(containerd_a)
    cid = unique("private")
    cleanup(a, cid)
    vol = tmp_path / "vol"
    vol.mkdir()
    (vol / "data").write_text("volume data\n")
    mount = {"destination": "/vol", "type": "bind", "source": str(vol), "options": ["rbind", "rw"]}
    a.run_container(
        cid, image=image, args=["sh", "-c", COUNTER], mounts=[mount], runc_options=containerd_a.runc_options
    )
    wait_for(lambda: read_counter(a, cid)[1] >= 5, what="the counter")
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    env = {**os.environ, **signing_env(), C.ENV_STATE_DIR: str(state)}

    def checkpoint(tag: str, *extra: str) -> None:
        to = registry.ref("private", tag)
        proc = subprocess.run(
            [AGENT, "checkpoint", *on(containerd_a), "--volume", str(vol), *extra, "--to", to, cid],
            capture_output=True, text=True, timeout=300, env=env, umask=0o022,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr

    checkpoint("kept", "--keep-work")
    [kept] = os.listdir(state / "work")
    seen, wide = _wide_entries(state)
    names = {os.path.basename(p) for p in seen}
    # what the walk saw: runc's and CRIU's files (images, dump.log), the agent's (spec, rootfs diff, volumes)
    assert {C.DUMP_LOG_FILE, "pstree.img", "volumes.tar", C.ROOTFS_DIFF_TAR, C.SPEC_DUMP_FILE} <= names, sorted(names)
    assert wide == [], f"group or other may read these in the agent's state dir: {wide}"

    checkpoint("gone")
    assert os.listdir(state / "work") == [kept], "a dump was left behind in the state dir"
    assert a.get_task(cid) is not None and task_status(a, cid) == "running"
