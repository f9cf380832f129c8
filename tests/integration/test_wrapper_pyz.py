"""The runtime wrapper zipapp runs on a bare host Python: Debian's /usr/bin/python3 with -I -S.

-I -S leaves out the environment, user site and dist-packages, so only the stdlib and the zipapp
itself are importable: exactly a node where nothing but python3 is installed. A pass-through call and
a full restore ``create`` (rootfs diff applied through shim.files.archive, then
``runc restore`` of a fake runc that records its argv) both have to work there.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

from tests.unit.test_criu_guard import bundle as guard_bundle
from tests.unit.test_criu_guard import make_images

REPO = Path(__file__).resolve().parents[2]
HOST_PYTHON = Path("/usr/bin/python3")
BUILD = REPO / "hack" / "build-wrapper-pyz.py"

pytestmark = pytest.mark.skipif(not HOST_PYTHON.exists(), reason="/usr/bin/python3 (the host's Python) is missing")


@pytest.fixture(scope="module")
def pyz(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("pyz") / "kubectl-snapshot-runc.pyz"
    subprocess.run([str(HOST_PYTHON), str(BUILD), str(out)], check=True, capture_output=True, timeout=120)
    return out


def fake_runc(tmp_path: Path) -> tuple[Path, Path]:
    log = tmp_path / "runc-calls.jsonl"
    runc = tmp_path / "runc"
    runc.write_text(
        f"#!{HOST_PYTHON}\nimport json, sys\nopen({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
    )
    runc.chmod(0o755)
    return runc, log


def run_pyz(pyz: Path, runc: Path, state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "KUBECTL_SNAPSHOT_RUNC": str(runc)}
    env["KUBECTL_SNAPSHOT_STATE_DIR"] = str(state)
    return subprocess.run(
        [str(HOST_PYTHON), "-I", "-S", str(pyz), *args], env=env, capture_output=True, text=True, timeout=60
    )


def calls(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def test_host_python_has_no_third_party_packages() -> None:
    """Otherwise the tests below would not prove that the zipapp is self-contained."""
    proc = subprocess.run([str(HOST_PYTHON), "-I", "-S", "-c", "import zstandard"], capture_output=True, timeout=30)
    assert proc.returncode != 0


def test_zipapp_holds_only_the_wrapper_closure(pyz: Path) -> None:
    with zipfile.ZipFile(pyz) as zf:
        names = {n for n in zf.namelist() if n.endswith(".py")}
    assert "__main__.py" in names and "shim/runtime_wrapper.py" in names
    assert "shim/files/archive.py" in names
    assert not any(n.startswith(("shim/containerd", "kubectl_snapshot/cli", "shim/agent")) for n in names), names
    assert pyz.read_bytes().startswith(b"#!/usr/bin/python3")


# Modules whose import takes milliseconds each on a node's bare python3 (`python3 -X importtime` shows
# it): none of them is on the way from a restore's create to `runc restore` and back
# (shim/runtime_wrapper.py, "what it imports at start").
SLOW_IMPORTS = {"typing", "dataclasses", "inspect", "subprocess", "socket", "ipaddress", "hashlib"}
# what a node-level restore's create imports: the hook, the image check, the rootfs diff, lo brought up
RESTORE_PATH = (
    "shim.runtime_wrapper",
    "shim.criu.guard",
    "shim.files.rootfs_diff",
    "shim.net.loopback",
    "shim.net.netns",
    "shim.host.rcu",
)


def test_the_restore_path_imports_no_slow_module(pyz: Path) -> None:
    code = (
        f"import sys; sys.path.insert(0, {str(pyz)!r}); import {', '.join(RESTORE_PATH)}; "
        "print(' '.join(sorted(sys.modules)))"
    )
    proc = subprocess.run([str(HOST_PYTHON), "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert not SLOW_IMPORTS & set(proc.stdout.split())


def test_build_is_reproducible(pyz: Path, tmp_path: Path) -> None:
    again = tmp_path / "again.pyz"
    subprocess.run([str(HOST_PYTHON), str(BUILD), str(again)], check=True, capture_output=True, timeout=120)
    assert again.read_bytes() == pyz.read_bytes()


def test_pass_through_execs_runc_unchanged(pyz: Path, tmp_path: Path) -> None:
    runc, log = fake_runc(tmp_path)
    argv = ["--root", "/run/runc-x", "--log", str(tmp_path / "log.json"), "state", "abc"]
    proc = run_pyz(pyz, runc, tmp_path / "state", *argv)
    assert proc.returncode == 0, proc.stderr
    assert calls(log) == [argv]


def test_create_without_staged_data_is_a_plain_create(pyz: Path, tmp_path: Path) -> None:
    runc, log = fake_runc(tmp_path)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps({"root": {"path": "rootfs"}, "annotations": {}}))
    argv = ["create", "--bundle", str(bundle), "--pid-file", str(tmp_path / "pid"), "c1"]
    proc = run_pyz(pyz, runc, tmp_path / "state", *argv)
    assert proc.returncode == 0, proc.stderr
    assert calls(log) == [argv]


def _diff_tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_create_with_staged_data_applies_diff_and_restores(pyz: Path, tmp_path: Path) -> None:
    runc, log = fake_runc(tmp_path)
    state = tmp_path / "state"
    uid, name = "0b6b1c9e-pod-uid", "main"
    staged = state / "staged" / "by-pod" / uid / name
    # CRIU images that grant no more than the bundle below (the wrapper checks them first, with pycriu
    # found beside the host's python3: Debian's python3-pycriu)
    make_images(staged / "checkpoint")
    (staged / "rootfs-diff.tar").write_bytes(_diff_tar({"etc/written-at-runtime": b"from the snapshot\n"}))
    (staged / "deleted.files").write_text(json.dumps(["/etc/gone"]))
    bundle = tmp_path / "bundle"
    (bundle / "rootfs" / "etc").mkdir(parents=True)
    (bundle / "rootfs" / "etc" / "gone").write_text("deleted in the snapshot")
    annotations = {"io.kubernetes.cri.sandbox-uid": uid, "io.kubernetes.cri.container-name": name}
    config = {**guard_bundle(), "root": {"path": "rootfs"}, "annotations": annotations}
    (bundle / "config.json").write_text(json.dumps(config))

    proc = run_pyz(pyz, runc, state, "create", "--bundle", str(bundle), "--pid-file", str(tmp_path / "pid"), "c1")
    assert proc.returncode == 0, proc.stderr
    assert (bundle / "rootfs" / "etc" / "written-at-runtime").read_bytes() == b"from the snapshot\n"
    assert not (bundle / "rootfs" / "etc" / "gone").exists()
    [restore] = calls(log)
    assert restore[:2] == ["restore", "--detach"] and restore[-1] == "c1"
    assert restore[restore.index("--image-path") + 1] == str(staged / "checkpoint")
    # and the following `start` is swallowed: the restored process already runs
    proc = run_pyz(pyz, runc, state, "start", "c1")
    assert proc.returncode == 0, proc.stderr
    assert len(calls(log)) == 1
    assert os.listdir(state / "restored") == []


def test_create_with_edited_images_is_refused_on_the_bare_host_python(pyz: Path, tmp_path: Path) -> None:
    """The image check runs in the zipapp too (pycriu and protobuf from Debian, beside python3)."""
    from tests.unit.test_criu_guard import ALL, creds

    runc, log = fake_runc(tmp_path)
    state = tmp_path / "state"
    make_images(state / "staged" / "by-id" / "c1" / "checkpoint", creds_by_tid={1: creds(caps=list(ALL))})
    bundle = tmp_path / "bundle"
    (bundle / "rootfs").mkdir(parents=True)
    (bundle / "config.json").write_text(json.dumps({**guard_bundle(caps=[]), "root": {"path": "rootfs"}}))
    wlog = tmp_path / "wrapper.log"
    proc = run_pyz(pyz, runc, state, "--log", str(wlog), "create", "--bundle", str(bundle), "c1")
    assert proc.returncode == 1, proc.stderr
    assert calls(log) == []  # runc restore never ran
    assert "CAP_SYS_ADMIN" in json.loads(wlog.read_text().splitlines()[-1])["msg"]


# --- a restored pod's containers are created while its save downloads (pod gates) -------------------

POD_UID, POD_CONTAINER = "0b6b1c9e-gated-pod", "main"


def _pod_bundle(tmp_path: Path) -> Path:
    bundle = tmp_path / "bundle"
    (bundle / "rootfs").mkdir(parents=True)
    annotations = {"io.kubernetes.cri.sandbox-uid": POD_UID, "io.kubernetes.cri.container-name": POD_CONTAINER}
    (bundle / "config.json").write_text(
        json.dumps({**guard_bundle(), "root": {"path": "rootfs"}, "annotations": annotations})
    )
    return bundle


def test_a_pod_containers_create_waits_for_its_staging_then_restores(pyz: Path, tmp_path: Path) -> None:
    from shim.engine.staging import READY, StagingGate, StatePaths

    runc, log = fake_runc(tmp_path)
    state = tmp_path / "state"
    gate = StagingGate(StatePaths(str(state)).pod_gate(POD_UID, POD_CONTAINER))  # the agent, still downloading
    bundle = _pod_bundle(tmp_path)
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "KUBECTL_SNAPSHOT_RUNC": str(runc)}
    env["KUBECTL_SNAPSHOT_STATE_DIR"] = str(state)
    argv = [str(HOST_PYTHON), "-I", "-S", str(pyz), "create", "--bundle", str(bundle), "c1"]
    with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        time.sleep(1.5)
        assert proc.poll() is None and calls(log) == []  # waiting at the gate; nothing of it ran
        make_images(state / "staged" / "by-pod" / POD_UID / POD_CONTAINER / "checkpoint")
        gate.answer(READY)
        gate.release()
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    [restore] = calls(log)
    assert restore[:2] == ["restore", "--detach"] and restore[-1] == "c1"


def test_a_pod_containers_create_is_refused_when_its_staging_failed(pyz: Path, tmp_path: Path) -> None:
    from shim.engine.staging import FAILED, StagingGate, StatePaths

    runc, log = fake_runc(tmp_path)
    state = tmp_path / "state"
    gate = StagingGate(StatePaths(str(state)).pod_gate(POD_UID, POD_CONTAINER))
    gate.answer(FAILED, "DigestMismatch: blob sha256:ab did not match")
    gate.release()
    wlog = tmp_path / "wrapper.log"
    bundle = _pod_bundle(tmp_path)
    for _ in range(2):  # the kubelet creates it again: refused again, never started from its image
        proc = run_pyz(pyz, runc, state, "--log", str(wlog), "create", "--bundle", str(bundle), "c1")
        assert proc.returncode == 1, proc.stderr
        assert calls(log) == []
        msg = json.loads(wlog.read_text().splitlines()[-1])["msg"]
        assert msg.startswith("refusing to restore") and "DigestMismatch" in msg


def test_a_pod_container_of_a_resume_that_started_fresh_is_a_plain_create(pyz: Path, tmp_path: Path) -> None:
    from shim.engine.staging import READY, StagingGate, StatePaths

    runc, log = fake_runc(tmp_path)
    state = tmp_path / "state"
    gate = StagingGate(StatePaths(str(state)).pod_gate(POD_UID, POD_CONTAINER))
    gate.answer(READY, "no restore: resume from r/x@sha256:ab failed")  # nothing staged
    gate.release()
    argv = ["create", "--bundle", str(_pod_bundle(tmp_path)), "c1"]
    proc = run_pyz(pyz, runc, state, *argv)
    assert proc.returncode == 0, proc.stderr
    assert calls(log) == [argv]


def _kernel_switch() -> str:
    try:
        return Path("/sys/kernel/rcu_expedited").read_text().strip()
    except OSError:
        return ""


def test_runc_restore_runs_with_expedited_grace_periods(pyz: Path, tmp_path: Path) -> None:
    """The hook's `runc restore` runs while the node's RCU switch is on (the real kernel's), which is off
    again afterwards (shim/host/rcu.py); without the node's directory nothing is switched."""
    if os.geteuid() != 0 or _kernel_switch() != "0" or Path("/sys/kernel/rcu_normal").read_text().strip() != "0":
        pytest.skip("needs root and a kernel whose rcu_expedited is 0 and rcu_normal 0")
    log = tmp_path / "seen.jsonl"
    runc = tmp_path / "runc"
    runc.write_text(
        f"#!{HOST_PYTHON}\nimport json, sys\n"
        "v = open('/sys/kernel/rcu_expedited').read().strip()\n"
        f"open({str(log)!r}, 'a').write(json.dumps([v, *sys.argv[1:3]]) + '\\n')\n"
    )
    runc.chmod(0o755)
    state = tmp_path / "state"
    for cid, expedite in (("c1", True), ("c2", False)):
        make_images(state / "staged" / "by-id" / cid / "checkpoint")
        bundle = tmp_path / f"bundle-{cid}"
        (bundle / "rootfs").mkdir(parents=True)
        (bundle / "config.json").write_text(json.dumps({**guard_bundle(), "root": {"path": "rootfs"}}))
        if expedite:
            os.makedirs(state / "rcu-expedite")  # as install-node leaves it
        else:  # KUBECTL_SNAPSHOT_EXPEDITE_RCU=0 at install-node: no directory
            (state / "rcu-expedite").rename(tmp_path / "gone")
        proc = run_pyz(pyz, runc, state, "create", "--bundle", str(bundle), cid)
        assert proc.returncode == 0, proc.stderr
        assert calls(log)[-1] == ["1" if expedite else "0", "restore", "--detach"]
        assert _kernel_switch() == "0"
