"""install-node keeps CRIU's kernel-feature cache on a tmpfs where /run is not one; uninstall-node undoes it.

On the real host (these VMs: /run is a plain directory of the root file system), with the real node
bundle installed by install-node's own code: afterwards /run/criu.kdat is a read-only bind of a file
on a small tmpfs, a dump by the installed CRIU (the bundle's, through its launcher) works and loads
the cache instead of probing the kernel; after uninstall-node no mount, placeholder or directory is
left and the same dump probes again. Runs under the shared lock (it changes the host's /run briefly):

    flock /run/ks-e2e.lock .venv/bin/pytest -q tests/integration/test_criu_kdat.py
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shim.controller.node_install import install, uninstall
from shim.controller.settings import NodeSettings
from shim.criu import kdat as criu_kdat
from tests.support.bundle import real_bundle

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mounts, CRIU)"),
    pytest.mark.skipif(not os.path.exists("/usr/sbin/criu"), reason="CRIU 4.2.1 (the bundle's source) is missing"),
    pytest.mark.skipif(not os.path.exists("/usr/local/go/bin/go"), reason="Go (for the launcher) is missing"),
]
KDAT = criu_kdat.KDAT_FILE


def mounts() -> list[criu_kdat.Mount]:
    return criu_kdat.parse_mountinfo(Path("/proc/self/mountinfo").read_text())


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(real_bundle(tmp_path_factory.mktemp("kdatbundle") / "image-bundle"))


@pytest.fixture
def settings(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeSettings]:
    if criu_kdat.decide(KDAT, mounts()) == "native":
        pytest.skip("/run is a tmpfs on this machine: CRIU caches by itself (nothing to arrange)")
    if criu_kdat.decide(KDAT, mounts()) == "foreign":
        pytest.skip(f"{KDAT} has a mount of someone else's on this machine")
    base = tmp_path_factory.mktemp("kdatnode")
    s = NodeSettings(
        node="kd1",
        state_root=str(base / "state"),
        opt_root=str(base / "opt"),
        containerd_dropin_dir=str(base / "dropins"),
        criu_config=str(base / "etc-criu" / "runc.conf"),
    )
    yield s
    uninstall(s)  # idempotent: the test uninstalls itself too


def dump_log(criu: str, work: Path) -> str:
    """`criu dump --leave-running` of a throwaway host process by `criu`; its dump.log (raises on failure)."""
    proc = subprocess.Popen(
        ["sleep", "60"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True
    )
    try:
        time.sleep(0.2)
        d = work / f"img-{time.monotonic_ns()}"
        d.mkdir()
        run = subprocess.run(
            [criu, "dump", "-t", str(proc.pid), "-D", str(d), "--leave-running", "-v4", "-o", "dump.log"],
            capture_output=True,
            text=True,
            check=False,
        )
        log = (d / "dump.log").read_text(errors="replace")
        assert run.returncode == 0, log[-2000:]
        shutil.rmtree(d)
        return log
    finally:
        proc.kill()
        proc.wait()


def test_install_node_mounts_the_cache_and_uninstall_node_removes_it(
    settings: NodeSettings, bundle: str, tmp_path: Path
) -> None:
    r = install(settings, bundle=bundle, containerd_version="v2.3.7")
    assert r.kdat is not None and r.kdat.state == "mounted", r.kdat
    cache_dir = criu_kdat.cache_dir(KDAT)
    bound, tmpfs = criu_kdat.mount_at(KDAT, mounts()), criu_kdat.mount_at(cache_dir, mounts())
    assert tmpfs is not None and tmpfs.fstype == "tmpfs" and tmpfs.source == criu_kdat.SOURCE
    assert bound is not None and bound.fstype == "tmpfs" and bound.root == "/criu.kdat"
    assert os.path.getsize(KDAT) > 0
    with pytest.raises(OSError):  # read-only: nothing writes the cache through /run/criu.kdat
        os.close(os.open(KDAT, os.O_WRONLY))
    # the installed CRIU (the bundle's, through its launcher) loads the cache: no probing, and dumps fine
    log = dump_log(settings.criu, tmp_path)
    assert f"Loaded kdat cache from {KDAT}" in log

    # install-node again (an agent restart, a new bundle): the cache is made afresh, still one mount
    again = install(settings, bundle=bundle, containerd_version="v2.3.7")
    assert again.kdat is not None and again.kdat.state == "mounted"
    assert sum(m.mount_point == KDAT for m in mounts()) == 1
    assert f"Loaded kdat cache from {KDAT}" in dump_log(settings.criu, tmp_path)

    uninstall(settings)
    assert criu_kdat.mount_at(KDAT, mounts()) is None and criu_kdat.mount_at(cache_dir, mounts()) is None
    assert not os.path.exists(cache_dir)
    assert not os.path.exists(KDAT) or os.path.getsize(KDAT) > 0  # no empty placeholder left behind
    # without it, this non-tmpfs /run gives CRIU no cache: it probes again, and still dumps
    install_free = dump_log("/usr/sbin/criu", tmp_path)
    assert "Loaded kdat cache" not in install_free


def test_a_node_whose_run_is_a_tmpfs_is_left_to_criu() -> None:
    """A systemd node's /run is a tmpfs: CRIU keeps the cache there itself, install-node mounts nothing
    (checked in a private mount namespace with a tmpfs on /run)."""
    script = (
        "mount -t tmpfs systemd-like-run /run && "
        f"{sys.executable} -m shim.criu.kdat ensure --criu /usr/sbin/criu && grep -c kubectl-snapshot-kdat "
        "/proc/self/mountinfo || true"
    )
    proc = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script], capture_output=True, text=True, check=True
    )
    result, count = proc.stdout.strip().splitlines()
    assert json.loads(result)["state"] == "native", proc.stdout
    assert count == "0"


def test_install_nodes_sharing_run_take_turns(settings: NodeSettings) -> None:
    """Nodes of one host share /run (the e2e cluster's two nodes; every agent restarted at once runs
    install-node on both together). Each ensure waits for the flock on /run: none unmounts another's
    bind mid-way (the one that failed used to remove the cache for all), and the cache is there after."""
    del settings  # for its skips and its uninstall afterwards
    fd = os.open(os.path.dirname(KDAT), os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another install-node at work
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            waiting = ex.submit(criu_kdat.ensure, "/usr/sbin/criu")
            time.sleep(1.5)  # an unserialised ensure (a `criu check`) is done well within this
            assert not waiting.done() and criu_kdat.mount_at(KDAT, mounts()) is None
            fcntl.flock(fd, fcntl.LOCK_UN)
            assert waiting.result(timeout=120).state == "mounted"
    finally:
        os.close(fd)
    for _ in range(4):  # three at once, a few times over: every one mounts, one bind stays
        with concurrent.futures.ThreadPoolExecutor(3) as ex:
            states = [r.state for r in ex.map(lambda _: criu_kdat.ensure("/usr/sbin/criu"), range(3))]
        assert states == ["mounted"] * 3, states
        assert sum(m.mount_point == KDAT for m in mounts()) == 1
    assert criu_kdat.remove().state == "removed"
    assert criu_kdat.mount_at(KDAT, mounts()) is None and not os.path.exists(criu_kdat.cache_dir(KDAT))
