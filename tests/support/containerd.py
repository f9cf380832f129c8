"""Real containerd daemons for integration tests: private root, state, socket and runc state each.

``ContainerdDaemon(name, base_dir)`` runs /usr/local/bin/containerd with a generated config
(version 3, or 2 for containerd 1.7; CRI and NRI off, since these tests are not Kubernetes) and
everything under `base_dir`: two instances never share metadata, snapshots, shim sockets or runc
state (``runc_options`` points runc's ``--root`` at the instance's own directory; containers must be
created with it). ``binaries=`` runs another release instead (tests.support.containerd_versions: one
built from the Go module proxy); its own runc shim then serves its containers. Each instance also
gets its own containerd namespace, so the cgroups of its containers (``/<namespace>/<id>``) cannot
collide with another instance's or another test session's.

Fixtures (session-scoped): ``containerd_a``, ``containerd_b`` and their ``runc_root_a``/``runc_root_b``.
They skip when not root or when containerd, its runc shim, runc or CRIU are missing
(hack/install-node-deps.sh installs them).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kubectl_snapshot.core.errors import SnapshotError
from shim.containerd.client import ContainerdClient, RuncOptions
from shim.criu import config as criu_config
from shim.criu import kdat as criu_kdat
from shim.host import memwork, rcu, workfs
from tests.support.containerd_versions import INSTALLED, ContainerdBinaries

CONTAINERD = INSTALLED.containerd
SHIM = INSTALLED.shim
RUNC = "/usr/sbin/runc"
CRIU = "/usr/sbin/criu"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Plugins a non-Kubernetes test daemon does not need (and that would want CNI, NRI sockets, ...).
DISABLED_PLUGINS = (
    "io.containerd.grpc.v1.cri",
    "io.containerd.cri.v1.images",
    "io.containerd.cri.v1.runtime",
    "io.containerd.podsandbox.controller.v1.podsandbox",
    "io.containerd.nri.v1.nri",
    "io.containerd.tracing.processor.v1.otlp",
    "io.containerd.internal.v1.tracing",
)


def missing_requirements(binaries: ContainerdBinaries = INSTALLED) -> str | None:
    """Why real-containerd tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root (containerd, runc and CRIU)"
    for binary in (binaries.containerd, binaries.shim, RUNC, CRIU):
        if not os.access(binary, os.X_OK):
            return f"{binary} is missing (run hack/install-node-deps.sh)"
    return None


def _toml_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


class ContainerdDaemon:
    """One containerd process with all of its state under `base_dir`."""

    def __init__(
        self,
        name: str,
        base_dir: str | os.PathLike[str],
        *,
        namespace: str | None = None,
        binaries: ContainerdBinaries = INSTALLED,
    ) -> None:
        self.name = name
        self.binaries = binaries
        self.base_dir = Path(base_dir)
        self.root = self.base_dir / "root"
        self.state = self.base_dir / "state"
        self.runc_root = str(self.base_dir / "runc")
        self.address = str(self.base_dir / "containerd.sock")
        self.config_path = self.base_dir / "config.toml"
        self.log_path = self.base_dir / "containerd.log"
        self.namespace = namespace or f"kst-{name}-{secrets.token_hex(3)}"
        self._proc: subprocess.Popen[bytes] | None = None
        if len(self.address) > 100:
            raise ValueError(f"socket path too long for a unix socket: {self.address}")

    @property
    def runc_options(self) -> RuncOptions:
        """Runtime options every container of this instance must use (its own runc state dir)."""
        return RuncOptions(root=self.runc_root)

    @property
    def ctr(self) -> str:
        """The ctr of this daemon's release."""
        return self.binaries.ctr

    def client(self, timeout: float = 30.0) -> ContainerdClient:
        return ContainerdClient(self.address, self.namespace, timeout=timeout)

    def config(self) -> str:
        disabled = ", ".join(_toml_str(p) for p in DISABLED_PLUGINS)
        return "\n".join(
            [
                f"version = {self.binaries.config_version}",
                f"root = {_toml_str(str(self.root))}",
                f"state = {_toml_str(str(self.state))}",
                f"disabled_plugins = [{disabled}]",
                "[grpc]",
                f"  address = {_toml_str(self.address)}",
                "[ttrpc]",
                f"  address = {_toml_str(self.address + '.ttrpc')}",
                "[debug]",
                '  level = "info"',
                "",
            ]
        )

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def start(self, timeout: float = 30.0) -> None:
        for d in (self.root, self.state, Path(self.runc_root)):
            d.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(self.config())
        # containerd starts the runc shim found on its PATH: this release's own.
        env = {**os.environ, "PATH": f"{self.binaries.bin_dir}:{PATH}"}
        env.pop("CONTAINERD_ADDRESS", None)
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                [self.binaries.containerd, "--config", str(self.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(f"containerd {self.name} exited ({self._proc.returncode}):\n{self.log_tail()}")
            if os.path.exists(self.address):
                with contextlib.suppress(SnapshotError), self.client(timeout=2.0) as c:
                    c.version()
                    return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"containerd {self.name} did not answer in {timeout}s:\n{self.log_tail()}")
            time.sleep(0.1)

    # --- teardown ---------------------------------------------------------------------------------

    def _remove_containers(self) -> None:
        with contextlib.suppress(SnapshotError), self.client(timeout=10.0) as c:
            for info in c.list_containers():
                with contextlib.suppress(SnapshotError):
                    c.remove_container(info.id)

    def _shim_pids(self) -> list[int]:
        """Shims started by this daemon: their command line names its socket (-address)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and argv[0].endswith(b"containerd-shim-runc-v2") and self.address.encode() in argv:
                pids.append(int(entry.name))
        return pids

    def _kill_leftover_containers(self) -> None:
        root = Path(self.runc_root)
        if not root.is_dir():
            return
        for ns_dir in root.iterdir():
            for state in ns_dir.iterdir() if ns_dir.is_dir() else ():
                subprocess.run(
                    [RUNC, "--root", str(ns_dir), "delete", "--force", state.name],
                    capture_output=True,
                    timeout=30,
                    check=False,
                )

    def _unmount_all(self) -> None:
        base = str(self.base_dir.resolve())
        targets = []
        with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
            for line in f:
                mountpoint = line.split()[4].replace("\\040", " ")
                if mountpoint == base or mountpoint.startswith(base + "/"):
                    targets.append(mountpoint)
        for mp in sorted(targets, key=len, reverse=True):
            subprocess.run(["umount", "-l", mp], capture_output=True, check=False)

    def _remove_namespace_cgroups(self) -> None:
        for cg in Path("/sys/fs/cgroup").glob(f"*/{self.namespace}"):
            with contextlib.suppress(OSError):
                cg.rmdir()
        with contextlib.suppress(OSError):
            Path("/sys/fs/cgroup/unified", self.namespace).rmdir()

    def stop(self) -> None:
        """Remove containers, stop the daemon, kill its leftover shims and containers, unmount."""
        if self._proc is not None and self._proc.poll() is None:
            self._remove_containers()
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
        self._proc = None
        for pid in self._shim_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._kill_leftover_containers()
        self._unmount_all()
        self._remove_namespace_cgroups()

    def __enter__(self) -> ContainerdDaemon:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running_daemon(name: str, base_dir: Path, binaries: ContainerdBinaries = INSTALLED) -> Iterator[ContainerdDaemon]:
    reason = missing_requirements(binaries)
    if reason:
        pytest.skip(reason)
    daemon = ContainerdDaemon(name, base_dir, binaries=binaries)
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()
        remove_in_background(base_dir)


def remove_in_background(path: Path) -> None:
    """Delete a daemon's tree without making the test session wait.

    Freeing the blocks of freshly unpacked snapshots is slow on this VM's disk (ext4 with online
    discard: ~10 s per 100 MB that was written back), and nothing waits for the result.
    """
    trash = path.with_name(path.name + ".trash-" + secrets.token_hex(3))
    try:
        path.rename(trash)
    except OSError:
        return
    subprocess.Popen(
        ["rm", "-rf", "--one-file-system", str(trash)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


@contextlib.contextmanager
def node_criu_config() -> Iterator[criu_config.ConfigResult | None]:
    """This machine's runc CRIU configuration as install-node leaves it on a node (so that tests and the
    bench run the configuration users get); removed afterwards if this wrote it."""
    if missing_requirements():
        yield None
        return
    result = criu_config.ensure(criu_config.RUNC_CONF, criu=CRIU)
    try:
        yield result
    finally:
        if result.state == "written":
            criu_config.remove(criu_config.RUNC_CONF)


@contextlib.contextmanager
def node_kdat_cache() -> Iterator[criu_kdat.KdatResult | None]:
    """CRIU's kernel-feature cache as install-node leaves a node whose /run is not a tmpfs (a tmpfs file
    bound on /run/criu.kdat, shim/criu/kdat.py), so that the bench dumps as a node does; removed
    afterwards if this made it (an installed agent's arrangement is left as it was)."""
    if missing_requirements():
        yield None
        return
    mounts = criu_kdat.parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    had = criu_kdat.mount_at(criu_kdat.KDAT_FILE, mounts) is not None
    result = criu_kdat.ensure(CRIU)
    try:
        yield result
    finally:
        if result.state == "mounted" and not had:
            criu_kdat.remove()


def tmpfs_large_folios() -> bool:
    """Whether this kernel mounts a tmpfs with huge= (shim/host/workfs.py's mount is made only then)."""
    import tempfile

    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        probe = ["mount", "-t", "tmpfs", "-o", "huge=within_size,size=1m", "ks-probe", d]
        ok = subprocess.run(probe, capture_output=True, check=False).returncode == 0
        if ok:
            subprocess.run(["umount", d], check=True)
    return ok


@contextlib.contextmanager
def node_memory_work_fs(state_dir: Path) -> Iterator[workfs.WorkFsResult]:
    """The memory work area of an agent with this state dir on a tmpfs of its own with large folios, as
    install-node leaves a node (shim/host/workfs.py); unmounted and its directory removed afterwards if this
    mounted it (an installed agent's is left as it was)."""
    area = memwork.area_dir(str(state_dir))
    result = workfs.ensure(area, memwork.limit_bytes())
    try:
        yield result
    finally:
        if result.state == "mounted":
            workfs.remove(area)
            for d in (area, os.path.dirname(area)):
                with contextlib.suppress(OSError):
                    os.rmdir(d)


@contextlib.contextmanager
def node_rcu_expedite(state_dir: Path) -> Iterator[str]:
    """RCU grace periods expedited during the product's dumps and restores, as install-node leaves a
    node (shim/host/rcu.py: the directory under the state dir); the directory is removed afterwards if this
    made it, and a switch its holders left on is put back."""
    had = Path(rcu.directory(str(state_dir))).is_dir()
    state = rcu.prepare(str(state_dir), enable=True)
    try:
        yield state
    finally:
        if not had:
            rcu.prepare(str(state_dir), enable=False)


@pytest.fixture(scope="session")
def criu_node_config() -> Iterator[criu_config.ConfigResult | None]:
    with node_criu_config() as result:
        yield result


@pytest.fixture(scope="session")
def memory_work_fs() -> Iterator[workfs.WorkFsResult]:
    """The tests' agents' memory work area as install-node leaves a node (shim/host/workfs.py)."""
    from shim.engine.staging import StatePaths

    with node_memory_work_fs(Path(StatePaths.from_env().root)) as result:
        yield result


@pytest.fixture(scope="session")
def containerd_a(
    tmp_path_factory: pytest.TempPathFactory,
    criu_node_config: criu_config.ConfigResult | None,
    memory_work_fs: workfs.WorkFsResult,
) -> Iterator[ContainerdDaemon]:
    """A private containerd instance ("node A") for the whole test session."""
    with running_daemon("a", tmp_path_factory.mktemp("containerd-a")) as d:
        yield d


@pytest.fixture(scope="session")
def containerd_b(
    tmp_path_factory: pytest.TempPathFactory,
    criu_node_config: criu_config.ConfigResult | None,
    memory_work_fs: workfs.WorkFsResult,
) -> Iterator[ContainerdDaemon]:
    """A second, independent containerd instance ("node B"), e.g. the restore target."""
    with running_daemon("b", tmp_path_factory.mktemp("containerd-b")) as d:
        yield d


@pytest.fixture(scope="session")
def runc_root_a(containerd_a: ContainerdDaemon) -> str:
    return containerd_a.runc_root


@pytest.fixture(scope="session")
def runc_root_b(containerd_b: ContainerdDaemon) -> str:
    return containerd_b.runc_root
