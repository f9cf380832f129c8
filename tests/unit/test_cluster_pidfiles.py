"""The local cluster's pid files (hack/cluster/lib.sh) stop exactly the daemons they recorded.

A pid file that outlived its process names whatever holds that number now. CI once booted a machine
from a disk image taken while a cluster ran: `make demo`'s clean-up read the old pid files and sent
SIGTERM to the pids they named, one of which was now `make` itself. Each case that must be refused
sits next to the legitimate one that must still work."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

LIB = Path(__file__).resolve().parents[2] / "hack" / "cluster" / "lib.sh"


def lib(tmp: Path, script: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "KS_CLUSTER_DIR": str(tmp / "state"), "KS_CLUSTER_RUN": str(tmp / "run")}
    return subprocess.run(
        ["bash", "-c", f"set -uo pipefail; . {LIB}; {script}"], env=env, capture_output=True, text=True, timeout=60
    )


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


@pytest.fixture
def bystander(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A process that is not the cluster's: what a stale pid file's number now belongs to."""
    # a name with blanks and parentheses, which /proc/PID/stat shows unescaped
    exe = tmp_path / "not) ours (x"
    shutil.copy("/bin/sleep", exe)
    proc = subprocess.Popen([str(exe), "300"])
    yield proc
    proc.kill()
    proc.wait()


def pidfile(tmp: Path, name: str) -> Path:
    (tmp / "run" / "pids").mkdir(parents=True, exist_ok=True)
    return tmp / "run" / "pids" / f"{name}.pid"


def test_a_daemon_started_by_ks_start_is_found_and_stopped(tmp_path: Path) -> None:
    started = lib(tmp_path, "ks_start root-sleeper sleep 300 && ks_pid_of root-sleeper")
    assert started.returncode == 0, started.stderr
    pid = int(started.stdout)
    try:
        assert alive(pid)
        assert lib(tmp_path, "ks_alive root-sleeper").returncode == 0
        stopped = lib(tmp_path, "ks_stop -t 5 root-sleeper")
        assert stopped.returncode == 0, stopped.stderr
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid)
        assert not pidfile(tmp_path, "root-sleeper").exists()
        assert lib(tmp_path, "ks_alive root-sleeper").returncode != 0
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    "content",
    [
        "{pid}\n",  # the old format: a bare number
        "{pid} {boot} 1\n",  # this boot, another start time: the number was reused
        "{pid} 00000000-0000-0000-0000-000000000000 {start}\n",  # another boot (the disk image's)
        "{pid} gone\n",  # the daemon died before its start was read
    ],
)
def test_a_stale_pid_file_never_reaches_the_process_that_holds_its_number_now(
    tmp_path: Path, bystander: subprocess.Popen[bytes], content: str
) -> None:
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    start = Path(f"/proc/{bystander.pid}/stat").read_text().rsplit(") ", 1)[1].split()[19]
    pidfile(tmp_path, "kube-apiserver").write_text(content.format(pid=bystander.pid, boot=boot, start=start))
    assert lib(tmp_path, "ks_alive kube-apiserver").returncode != 0
    stopped = lib(tmp_path, "ks_stop -t 1 kube-apiserver")
    assert stopped.returncode == 0, stopped.stderr
    time.sleep(0.3)
    assert alive(bystander.pid), "ks_stop signalled a process its pid file did not record"
    assert not pidfile(tmp_path, "kube-apiserver").exists()


def test_the_recorded_identity_of_a_live_process_is_recognised(
    tmp_path: Path, bystander: subprocess.Popen[bytes]
) -> None:
    """The legitimate case of the one above: the same file with the right boot and start time."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    start = Path(f"/proc/{bystander.pid}/stat").read_text().rsplit(") ", 1)[1].split()[19]
    pidfile(tmp_path, "kube-apiserver").write_text(f"{bystander.pid} {boot} {start}\n")
    found = lib(tmp_path, "ks_pid_of kube-apiserver")
    assert found.returncode == 0, found.stderr
    assert int(found.stdout) == bystander.pid
    assert lib(tmp_path, "ks_stop -t 5 kube-apiserver").returncode == 0
    bystander.wait(timeout=10)
