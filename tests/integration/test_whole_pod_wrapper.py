"""The runtime wrapper (the real zipapp on the host's Python) restores a pod whole or not at all, and
holds the pod's network locked from its first container's restore to its last one's.

runc is a fake that records its argv (restore of container id ``fail-*`` exits 1, as a CRIU failure
would); the network namespace is a real one made here (``unshare -n``), locked by the wrapper in-process
(nf_tables, rtnetlink and sock_diag through netlink), so that what the lock does to traffic is checked
for real.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kubectl_snapshot.core import kubenames as K
from shim.engine.staging import READY, StagingGate, StatePaths
from shim.net.podrestore import FAILED_FILE, FRESH_FILE, LOCK_TABLE, RELEASED_FILE, PodRestore
from tests.integration.test_wrapper_pyz import HOST_PYTHON, calls, pyz, run_pyz
from tests.support.nft import nft_tables
from tests.unit.test_criu_guard import bundle as guard_bundle
from tests.unit.test_criu_guard import make_images, write

__all__ = ["pyz"]

pytestmark = pytest.mark.skipif(not HOST_PYTHON.exists(), reason="/usr/bin/python3 (the host's Python) is missing")
UID = "7d1f3a52-whole-pod"


def fake_runc(tmp_path: Path) -> tuple[Path, Path]:
    log = tmp_path / "runc-calls.jsonl"
    runc = tmp_path / "runc"
    runc.write_text(
        f"#!{HOST_PYTHON}\nimport json, sys\nopen({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        "sys.exit(1 if sys.argv[1] == 'restore' and sys.argv[-1].startswith('fail-') else 0)\n"
    )
    runc.chmod(0o755)
    return runc, log


def stage(state: Path, names: list[str], staged: list[str]) -> PodRestore:
    pod = PodRestore(str(state / "staged" / "by-pod" / UID))
    pod.record(names)
    for n in staged:
        # CRIU images that ask for no more than the bundle (the wrapper checks them first)
        make_images(state / "staged" / "by-pod" / UID / n / "checkpoint")
    return pod


def bundle(tmp_path: Path, name: str, netns: str | None = None, *, resume: bool = False) -> Path:
    b = tmp_path / f"bundle-{name}-{time.monotonic_ns()}"
    (b / "rootfs").mkdir(parents=True)
    annotations = {"io.kubernetes.cri.sandbox-uid": UID, "io.kubernetes.cri.container-name": name}
    if resume:  # a workload's replacement, resumed by its policy (containerd passes the pod's annotation)
        annotations[K.ANN_RESUME_POLICY] = "p"
    spec = {**guard_bundle(), "root": {"path": "rootfs"}, "annotations": annotations}
    # the pod's network namespace: a scratch one, or none (never the host's, which the bundle names)
    spec["linux"]["namespaces"] = [
        {"type": "network", "path": netns} if ns["type"] == "network" else ns
        for ns in spec["linux"]["namespaces"]
        if ns["type"] != "network" or netns
    ]
    (b / "config.json").write_text(json.dumps(spec))
    return b


def create(pyz: Path, runc: Path, state: Path, b: Path, cid: str) -> subprocess.CompletedProcess[str]:
    return run_pyz(pyz, runc, state, "create", "--bundle", str(b), "--pid-file", str(b / "pid"), cid)


def test_one_container_failing_fails_the_pod_and_nothing_starts_fresh(pyz: Path, tmp_path: Path) -> None:
    runc, log = fake_runc(tmp_path)
    state = tmp_path / "state"
    pod = stage(state, ["app", "cache"], ["app", "cache"])

    assert create(pyz, runc, state, bundle(tmp_path, "app"), "ok-app").returncode == 0
    proc = create(pyz, runc, state, bundle(tmp_path, "cache"), "fail-cache")
    assert proc.returncode == 1
    assert "container 'cache' could not be restored" in (pod.failed() or "")
    # the kubelet creates both again (a restart): refused, with the reason, and runc never runs `create`
    for name, cid in (("app", "ok-app-1"), ("cache", "ok-cache-1")):
        proc = create(pyz, runc, state, bundle(tmp_path, name), cid)
        assert proc.returncode == 1
        assert "not started from scratch" in proc.stderr and "could not be restored" in proc.stderr
    assert [c[0] for c in calls(log)] == ["restore", "restore"]
    # a container the snapshot does not hold (not restored) is created as usual
    assert create(pyz, runc, state, bundle(tmp_path, "extra"), "ok-extra").returncode == 0
    assert calls(log)[-1][0] == "create"


def answered_gates(state: Path, names: list[str]) -> None:
    """What the agent does for a resuming pod once its save is staged: each container's gate says ready."""
    paths = StatePaths(str(state))
    for n in names:
        os.makedirs(os.path.dirname(paths.pod_gate(UID, n)), exist_ok=True)
        StagingGate(paths.pod_gate(UID, n)).answer(READY)


def test_a_resume_that_cannot_be_restored_starts_the_pod_fresh(pyz: Path, tmp_path: Path) -> None:
    """Issue 41: a workload's replacement whose save the wrapper cannot restore runs from its images,
    every container of it (restored ones are stopped by the agent and come back fresh), with the reason
    kept for the agent's ResumeSkipped Event. A restore a user asked for still fails (the test above)."""
    runc, log = fake_runc(tmp_path)
    state = tmp_path / "state"
    pod = stage(state, ["app", "cache", "late"], ["app", "cache", "late"])
    answered_gates(state, ["app", "cache", "late"])

    assert create(pyz, runc, state, bundle(tmp_path, "app", resume=True), "ok-app").returncode == 0
    proc = create(pyz, runc, state, bundle(tmp_path, "cache", resume=True), "fail-cache")
    assert proc.returncode == 0, proc.stderr
    assert "the pod starts fresh" in proc.stderr
    assert "container 'cache' could not be restored" in (pod.fresh() or "") and pod.failed() is None
    assert pod.restored() == ["app"]  # what the agent stops, to be created again fresh
    # a later container is created from its image too, its staged save unused, and so is the restored
    # one when the kubelet creates it again
    assert create(pyz, runc, state, bundle(tmp_path, "late", resume=True), "ok-late").returncode == 0
    assert create(pyz, runc, state, bundle(tmp_path, "app", resume=True), "ok-app-1").returncode == 0
    assert [c[0] for c in calls(log)] == ["restore", "restore", "create", "create", "create"]
    assert not (state / "staged" / "by-pod" / UID / "late" / "checkpoint").exists()


def test_a_resume_whose_images_grant_more_starts_fresh_with_the_reason(pyz: Path, tmp_path: Path) -> None:
    runc, log = fake_runc(tmp_path)
    state = tmp_path / "state"
    pod = stage(state, ["app"], ["app"])
    answered_gates(state, ["app"])
    b = bundle(tmp_path, "app", resume=True)
    spec = json.loads((b / "config.json").read_text())
    del spec["linux"]["seccomp"]  # the images hold a filter; a bundle without one: they match
    spec["process"]["capabilities"] = {"bounding": [], "effective": [], "permitted": []}
    (b / "config.json").write_text(json.dumps(spec))
    proc = create(pyz, runc, state, b, "ok-app")
    assert proc.returncode == 0, proc.stderr
    assert "refusing to restore: the CRIU images grant more" in (pod.fresh() or "")
    assert [c[0] for c in calls(log)] == ["create"]


def test_a_restored_container_that_dies_at_once_is_not_recreated(pyz: Path, tmp_path: Path) -> None:
    runc, log = fake_runc(tmp_path)
    state = tmp_path / "state"
    pod = stage(state, ["app"], ["app"])
    assert create(pyz, runc, state, bundle(tmp_path, "app"), "ok-app").returncode == 0
    assert (Path(pod.directory) / RELEASED_FILE).exists()
    # its process exited before the kubelet's `start`; the kubelet creates the container again
    proc = create(pyz, runc, state, bundle(tmp_path, "app"), "ok-app-1")
    assert proc.returncode == 1 and "stopped right after it was restored" in proc.stderr
    assert (Path(pod.directory) / FAILED_FILE).exists()
    assert [c[0] for c in calls(log)] == ["restore"]


def test_a_lazily_restored_container_whose_memory_did_not_all_come_waits_for_its_eager_restore(
    pyz: Path, tmp_path: Path
) -> None:
    """Restored lazily, its process died before every page came (the agent serving them was killed): the
    kubelet's create is refused without failing the pod, so the agent's eager restore of the same save
    (staged again into its dir) restores it; the legitimate case beside it: a restored container that dies
    at once (nothing lazy left) fails the pod, as above."""
    runc, log = fake_runc(tmp_path)
    state = tmp_path / "state"
    pod = stage(state, ["app"], ["app"])
    assert create(pyz, runc, state, bundle(tmp_path, "app"), "ok-app").returncode == 0
    used = state / "staged" / "by-pod" / UID / ".lazy-app"  # where the wrapper leaves a lazy restore's dir
    used.mkdir()
    proc = create(pyz, runc, state, bundle(tmp_path, "app"), "ok-app-1")
    assert proc.returncode == 1 and "restores it again, eagerly" in proc.stderr, proc.stderr
    assert not (Path(pod.directory) / FAILED_FILE).exists()
    # a resume given up (the eager staging failed too): its containers start from their images, a lazy dir
    # left or not
    fresh = PodRestore(pod.directory)
    fresh.start_fresh("the eager restore failed")
    assert create(pyz, runc, state, bundle(tmp_path, "app"), "ok-app-fresh").returncode == 0
    os.unlink(os.path.join(pod.directory, FRESH_FILE))
    # the agent ended the lazy phase (dir removed) and staged the save again: restored, eagerly
    used.rmdir()
    stage(state, ["app"], ["app"])
    assert create(pyz, runc, state, bundle(tmp_path, "app"), "ok-app-2").returncode == 0
    assert [c[0] for c in calls(log)] == ["restore", "create", "restore"]


@pytest.fixture
def netns() -> Iterator[str]:
    """A scratch network namespace (with lo up) held by a sleeping process."""
    if os.geteuid() != 0:
        pytest.skip("needs root (a network namespace, nf_tables)")
    proc = subprocess.Popen(["unshare", "-n", "sh", "-c", "ip link set lo up && exec sleep 300"])
    path = f"/proc/{proc.pid}/ns/net"
    deadline = time.monotonic() + 5
    while os.readlink(path) == os.readlink("/proc/self/ns/net") or _netns_sh(path, "ip -o link show lo").find("UP") < 0:
        assert time.monotonic() < deadline, "the namespace did not come up"
        time.sleep(0.05)
    try:
        yield path
    finally:
        proc.kill()
        proc.wait()


def _netns_sh(netns: str, script: str) -> str:
    r = subprocess.run(["nsenter", f"--net={netns}", "sh", "-c", script], capture_output=True, text=True, timeout=30)
    return r.stdout + r.stderr


PROBE = (
    "import socket, sys\n"
    "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
    "try:\n"
    "    socket.create_connection(s.getsockname(), timeout=1); print('open')\n"
    "except OSError as e:\n"
    "    print('blocked', e)\n"
)


def test_the_pod_network_is_locked_from_the_first_restore_to_the_last(pyz: Path, tmp_path: Path, netns: str) -> None:
    runc, _ = fake_runc(tmp_path)
    state = tmp_path / "state"
    pod = stage(state, ["server", "client"], ["server", "client"])
    python = str(HOST_PYTHON)
    assert _netns_sh(netns, f'{python} -c "{PROBE}"').startswith("open")

    assert create(pyz, runc, state, bundle(tmp_path, "server", netns), "ok-server").returncode == 0
    # between the two restores: nothing moves in the pod's network, not even over loopback
    assert LOCK_TABLE in nft_tables(netns)
    assert _netns_sh(netns, f'{python} -c "{PROBE}"').startswith("blocked")
    assert _netns_sh(netns, "cat /proc/sys/net/ipv4/ip_nonlocal_bind").strip() == "1"

    assert create(pyz, runc, state, bundle(tmp_path, "client", netns), "ok-client").returncode == 0
    assert LOCK_TABLE not in nft_tables(netns)
    assert _netns_sh(netns, f'{python} -c "{PROBE}"').startswith("open")
    assert _netns_sh(netns, "cat /proc/sys/net/ipv4/ip_nonlocal_bind").strip() == "0"
    assert (Path(pod.directory) / RELEASED_FILE).exists() and pod.failed() is None


def _away_socket(src: str) -> dict[str, Any]:
    """A files.img entry as CRIU 4.2.1 dumps a TCP connection that left the pod (from `src`)."""
    words = [int.from_bytes(socket.inet_aton(a), "little") for a in (src, "10.244.9.2")]
    isk = {"id": 13, "ino": 2504802, "family": 2, "type": 1, "proto": 6, "state": 1, "src_port": 36844,
           "dst_port": 7001, "flags": 2, "backlog": 0, "src_addr": words[:1], "dst_addr": words[1:],
           "fown": {"uid": 0, "euid": 0, "signum": 0, "pid_type": 0, "pid": 0},
           "opts": {"so_sndbuf": 69120, "so_rcvbuf": 131072, "so_snd_tmo_sec": 0, "so_snd_tmo_usec": 0,
                    "so_rcv_tmo_sec": 0, "so_rcv_tmo_usec": 0}}  # fmt: skip
    return {"type": "INETSK", "id": 13, "isk": isk}


def test_the_old_pod_address_is_lent_for_the_restore_and_taken_back(pyz: Path, tmp_path: Path, netns: str) -> None:
    """CRIU reconnects a connection that left the pod from its old address: the kernel routes that
    only from a local address, so the wrapper lends it to the namespace while the pod is locked."""
    runc, _ = fake_runc(tmp_path)
    state = tmp_path / "state"
    pod = stage(state, ["away", "app"], ["away", "app"])
    write(Path(pod.directory) / "away" / "checkpoint" / "files.img", "FILES", [_away_socket("10.250.0.7")])
    assert _netns_sh(netns, "ip -o addr show to 10.250.0.7/32").strip() == ""

    assert create(pyz, runc, state, bundle(tmp_path, "away", netns), "ok-away").returncode == 0
    assert "10.250.0.7/32" in _netns_sh(netns, "ip -o addr show dev lo")  # lent, while locked
    assert LOCK_TABLE in nft_tables(netns)

    assert create(pyz, runc, state, bundle(tmp_path, "app", netns), "ok-app").returncode == 0
    assert _netns_sh(netns, "ip -o addr show to 10.250.0.7/32").strip() == ""  # taken back
    assert LOCK_TABLE not in nft_tables(netns)
    assert pod.failed() is None


ABORT_PROBE = """
import socket, subprocess, sys, time
srv = socket.socket(); srv.bind(('127.0.0.1', 0)); srv.listen()
inner = socket.create_connection(srv.getsockname()); peer, _ = srv.accept()
# a connection from an address that the restored pod no longer has (a scratch one in this namespace)
subprocess.run(['ip', 'addr', 'add', '10.250.0.9/32', 'dev', 'lo'], check=True)
srv2 = socket.socket(); srv2.bind(('10.250.0.9', 0)); srv2.listen()
away = socket.create_connection(srv2.getsockname()); far, _ = srv2.accept()
subprocess.run(['ip', 'addr', 'del', '10.250.0.9/32', 'dev', 'lo'], check=True)
print('ready', flush=True)
sys.stdin.readline()
try:
    away.send(b'x'); away.recv(1); print('away open')
except OSError as e:
    print('away closed', e.errno)
inner.settimeout(2); inner.send(b'y'); print('inner', peer.recv(1))
"""


def test_connections_from_the_old_pod_address_are_aborted_loopback_ones_kept(
    pyz: Path, tmp_path: Path, netns: str
) -> None:
    runc, _ = fake_runc(tmp_path)
    state = tmp_path / "state"
    stage(state, ["app"], ["app"])
    script = tmp_path / "probe.py"
    script.write_text(ABORT_PROBE)
    probe = subprocess.Popen(
        ["nsenter", f"--net={netns}", str(HOST_PYTHON), str(script)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert probe.stdout is not None and probe.stdin is not None
        assert probe.stdout.readline().strip() == "ready"
        assert create(pyz, runc, state, bundle(tmp_path, "app", netns), "ok-app").returncode == 0
        probe.stdin.write("go\n")
        probe.stdin.flush()
        out = probe.communicate(timeout=30)[0]
    finally:
        probe.kill()
    assert "away closed" in out, out  # at once (ECONNABORTED), no hang
    assert "inner b'y'" in out, out


def test_a_read_only_root_without_tmp_gets_one_for_criu_and_loses_it_after(pyz: Path, tmp_path: Path) -> None:
    """CRIU pivots through the root's `tmp` or a mkdtemp there, which a read-only root refuses: an image
    of a static binary alone (no /tmp) with readOnlyRootFilesystem failed to restore ("Can't create a
    temporary directory"). The wrapper lends it an empty tmp for the restore; a root with its own tmp,
    or a writable one, is left as it is."""
    runc = tmp_path / "runc"
    seen = tmp_path / "seen.jsonl"
    runc.write_text(
        f"#!{HOST_PYTHON}\nimport json, os, sys\n"
        "b = sys.argv[sys.argv.index('--bundle') + 1] if '--bundle' in sys.argv else ''\n"
        f"open({str(seen)!r}, 'a').write(json.dumps([sys.argv[1], os.path.isdir(b + '/rootfs/tmp')]) + '\\n')\n"
    )
    runc.chmod(0o755)
    state = tmp_path / "state"
    stage(state, ["ro", "rw"], ["ro", "rw"])
    ro = bundle(tmp_path, "ro")
    spec = json.loads((ro / "config.json").read_text())
    spec["root"]["readonly"] = True
    (ro / "config.json").write_text(json.dumps(spec))
    assert create(pyz, runc, state, ro, "ok-ro").returncode == 0
    assert not (ro / "rootfs" / "tmp").exists()  # taken away after
    rw = bundle(tmp_path, "rw")
    assert create(pyz, runc, state, rw, "ok-rw").returncode == 0
    assert [json.loads(line) for line in seen.read_text().splitlines()] == [["restore", True], ["restore", False]]
