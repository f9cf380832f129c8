"""A runc container holding a known pattern, checkpointed with plain ``runc checkpoint`` and restored eagerly
or lazily (``runc restore --lazy-pages`` beside ``criu lazy-pages --page-server`` and the agent's
PageServer). Used by tests/integration/test_lazy_restore.py and bench/lazy_restore.py. Root, real runc
and CRIU; run it under ``flock /run/ks-e2e.lock``."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zstandard

from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.core.chunks import Chunk, PagesFile
from kubectl_snapshot.core.reference import Reference
from shim.criu.lazyimages import ImagePageSource, LazyImages, prepare_lazy_images
from shim.criu.pageproto import PageSource
from shim.criu.pageserver import PageServer

# A pod's program (python3, a Debian image): argv[1] bytes of os.urandom in one bytearray; its SHA-256 in
# /tmp/sum0, and again in /tmp/sum on /tmp/verify; a counter in /tmp/n every 0.1 s (tests/e2e/test_lazy_restore.py,
# bench/lazy_cluster.py)
POD_PATTERN = """
import hashlib, os, sys, time
size = int(sys.argv[1])
buf = bytearray(size)
for off in range(0, size, 1 << 24):
    buf[off:off + (1 << 24)] = os.urandom(min(1 << 24, size - off))
def put(name, text):
    with open(f'/tmp/{name}.t', 'w') as f:
        f.write(text)
    os.rename(f'/tmp/{name}.t', f'/tmp/{name}')
put('sum0', hashlib.sha256(buf).hexdigest())
n = 0
while True:
    n += 1
    put('n', str(n))
    if os.path.exists('/tmp/verify'):
        os.unlink('/tmp/verify')
        put('sum', hashlib.sha256(buf).hexdigest())
    time.sleep(0.1)
"""

# the container's program (two threads): `size` bytes of Random(seed) in one bytearray; a counter it rewrites every
# 50 ms (it stops while the program waits for a page); on /data/verify, the SHA-256 of the bytearray.
# With "child": a forked child shares the pattern copy-on-write but for its last quarter, which it
# rewrites (Random(seed + 1)), and does the same under the names c<name>.
WORKLOAD = textwrap.dedent(
    """
    import hashlib, os, random, sys, threading, time
    size, seed = int(sys.argv[1]), int(sys.argv[2])
    threading.Thread(target=time.sleep, args=(86400,), daemon=True).start()  # a second stack
    r, buf = random.Random(seed), bytearray(size)
    for off in range(0, size, 16 << 20):  # randbytes takes at most 256 MiB at once
        buf[off : off + (16 << 20)] = r.randbytes(min(16 << 20, size - off))
    def put(name, text):
        with open(f"/data/{name}.tmp", "w") as f:
            f.write(text)
        os.replace(f"/data/{name}.tmp", f"/data/{name}")
    prefix = ""
    if sys.argv[3:] == ["child"] and os.fork() == 0:
        prefix, q = "c", size * 3 // 4
        buf[q:] = random.Random(seed + 1).randbytes(size - q)
    put(prefix + "sum0", hashlib.sha256(buf).hexdigest())
    i = 0
    while True:
        i += 1
        put(prefix + "n", str(i))
        if os.path.exists(f"/data/{prefix}verify"):
            os.unlink(f"/data/{prefix}verify")
            put(prefix + "sum", hashlib.sha256(buf).hexdigest())
        time.sleep(0.05)
    """
)


def expected_child_sum(size: int, seed: int) -> str:
    """The SHA-256 of the child's copy: the pattern, its last quarter from Random(seed + 1)."""
    r, h, q = random.Random(seed), hashlib.sha256(), size * 3 // 4
    for off in range(0, q, 16 << 20):
        h.update(r.randbytes(min(16 << 20, size - off))[: q - off])
    h.update(random.Random(seed + 1).randbytes(size - q))
    return h.hexdigest()


def expected_sum(size: int, seed: int) -> str:
    """The SHA-256 of the workload's pattern, computed here (not by the workload)."""
    r, h = random.Random(seed), hashlib.sha256()
    for off in range(0, size, 16 << 20):
        h.update(r.randbytes(min(16 << 20, size - off)))
    return h.hexdigest()


def criu_version() -> str:
    out = subprocess.run(["criu", "--version"], capture_output=True, text=True, check=True).stdout
    return out.split("Version:")[1].split()[0]


def log_tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return f"({path} missing)"


@dataclass
class Box:
    """One container's bundle, data dir and runc root under `base`."""

    base: Path
    name: str
    size: int
    seed: int = 44
    child: bool = False

    @property
    def bundle(self) -> Path:
        return self.base / "bundle"

    @property
    def data(self) -> Path:
        return self.base / "data"

    @property
    def root(self) -> Path:
        return self.base / "runc-root"

    @property
    def pid_file(self) -> Path:
        return self.base / "pid"

    def make(self) -> Box:
        rootfs = self.bundle / "rootfs"
        for d in ("usr", "etc", "data", "proc", "dev", "sys", "tmp"):
            (rootfs / d).mkdir(parents=True, exist_ok=True)
        for link in ("bin", "lib", "lib64", "sbin"):
            if os.path.islink(f"/{link}"):
                (rootfs / link).symlink_to(os.readlink(f"/{link}"))
        self.data.mkdir(parents=True, exist_ok=True)
        (self.data / "work.py").write_text(WORKLOAD)
        subprocess.run(["runc", "spec", "--bundle", str(self.bundle)], check=True)
        spec = json.loads((self.bundle / "config.json").read_text())
        spec["process"]["terminal"] = False
        spec["process"]["args"] = ["/usr/bin/python3", "/data/work.py", str(self.size), str(self.seed)]
        if self.child:
            spec["process"]["args"].append("child")
        spec["root"]["readonly"] = False
        for dest, src, opts in (("/usr", "/usr", ["rbind", "ro"]), ("/etc", "/etc", ["rbind", "ro"])):
            spec["mounts"].append({"destination": dest, "type": "bind", "source": src, "options": opts})
        spec["mounts"].append({"destination": "/data", "type": "bind", "source": str(self.data), "options": ["rbind"]})
        conf = self.bundle / "criu.conf"  # what install-node writes, whatever /etc/criu/runc.conf says now
        conf.write_text("network-lock nftables\n")
        spec["annotations"] = {"org.criu.config": str(conf)}
        (self.bundle / "config.json").write_text(json.dumps(spec))
        return self

    def runc(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """runc with the container's stdio on /dev/null (a pipe would be inherited by the container and
        never reach its end; a host file cannot be dumped); runc's own messages (stdout) in its log."""
        log = self.base / "runc.log"
        log.unlink(missing_ok=True)
        proc = subprocess.run(
            ["runc", "--root", str(self.root), "--log", str(log), *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=timeout,
        )
        return subprocess.CompletedProcess(proc.args, proc.returncode, log_tail(log), "")

    def run(self) -> None:
        for f in ("sum0", "sum", "n", "verify"):
            for prefix in ("", "c"):
                (self.data / (prefix + f)).unlink(missing_ok=True)
        res = self.runc("run", "-d", "--bundle", str(self.bundle), "--pid-file", str(self.pid_file), self.name)
        if res.returncode:
            raise AssertionError(f"runc run failed: {res.stdout}")
        self.wait_for(lambda: (self.data / "sum0").exists(), 120, "the workload's pattern")
        if self.child:
            self.wait_for(lambda: (self.data / "csum0").exists(), 120, "the workload child's pattern")

    def pid(self) -> int:
        return int(self.pid_file.read_text().strip())

    def counter(self) -> int:
        try:
            text = (self.data / "n").read_text().strip()
        except FileNotFoundError:  # not written since this restore
            return 0
        return int(text) if text else 0

    def wait_for(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout} s waiting for {what}")
            time.sleep(0.02)

    def verify(self, timeout: float = 120, *, prefix: str = "") -> str:
        """The SHA-256 the running program (prefix "c": its child) computes over its pattern now."""
        (self.data / f"{prefix}sum").unlink(missing_ok=True)
        (self.data / f"{prefix}verify").write_text("")
        self.wait_for(lambda: (self.data / f"{prefix}sum").exists(), timeout, "the workload's checksum")
        return (self.data / f"{prefix}sum").read_text().strip()

    def checkpoint(self, images: Path, work: Path) -> None:
        images.mkdir(parents=True)
        work.mkdir(parents=True, exist_ok=True)
        res = self.runc("checkpoint", "--image-path", str(images), "--work-path", str(work), self.name)
        if res.returncode:
            raise AssertionError(f"runc checkpoint failed: {res.stdout}\n{log_tail(work / 'dump.log')}")

    def restore_eager(self, images: Path, work: Path) -> float:
        """Seconds from `runc restore -d` to its return (the process runs)."""
        work.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        res = self.restore_cmd(images, work)
        took = time.monotonic() - start
        if res.returncode:
            raise AssertionError(f"runc restore failed: {res.stdout}\n{log_tail(work / 'restore.log')}")
        return took

    def restore_cmd(self, images: Path, work: Path, *extra: str) -> subprocess.CompletedProcess[str]:
        self.pid_file.unlink(missing_ok=True)
        return self.runc(
            "restore", "-d", *extra, "--image-path", str(images), "--work-path", str(work),
            "--bundle", str(self.bundle), "--pid-file", str(self.pid_file), self.name,
        )  # fmt: skip

    def kill(self) -> None:
        """SIGKILL the container's process (what the agent's failure handler does) where it still runs."""
        try:
            os.kill(self.pid(), signal.SIGKILL)
        except (OSError, ValueError):
            self.runc("kill", self.name, "KILL")

    def remove(self) -> None:
        self.runc("delete", "--force", self.name, timeout=60)
        # runc restore bind-mounts the rootfs here for CRIU and unmounts it after; a restore that ended
        # half-way (the failure cases) leaves it mounted, and the test's directory could not be removed
        criu_root = self.root / self.name / "criu-root"
        if os.path.ismount(criu_root):
            subprocess.run(["umount", "-l", str(criu_root)], check=False)


@dataclass
class LazyRestore:
    """A lazy restore in flight: its page server, its lazy-pages daemon and their timings."""

    server: PageServer
    daemon: subprocess.Popen[bytes]
    work: Path
    started: float
    running_s: float  # restore start -> runc restore returned (the process runs)
    restore_s: float  # runc restore --lazy-pages alone (the daemon started ahead)
    prepared: LazyImages

    def daemon_log(self) -> str:
        return log_tail(self.work / "lazy-pages.log")

    def wait_resident(self, timeout: float = 300) -> float:
        """Seconds from the restore's start to the daemon's exit (every page copied, or it failed)."""
        try:
            self.daemon.wait(timeout)
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"the lazy-pages daemon still runs after {timeout} s\n{self.daemon_log()}") from e
        return time.monotonic() - self.started

    def close(self) -> None:
        if self.daemon.poll() is None:
            self.daemon.kill()
            self.daemon.wait(30)
        self.server.stop()


def prepare(images: Path, lazy_dir: Path) -> LazyImages:
    lazy_dir.mkdir(parents=True)
    return prepare_lazy_images(str(images), str(lazy_dir))


def restore_lazy(
    box: Box,
    images: Path,
    prepared: LazyImages,
    work: Path,
    *,
    source: PageSource | None = None,
    on_failure: Callable[[str], None] | None = None,
    request_timeout_s: float = 30.0,
    retries: int = 3,
    record: bool = False,
    transport: str = "unix",
) -> LazyRestore:
    """Start the page server and `criu lazy-pages`, then `runc restore -d --lazy-pages`; returns once the
    restore has (the process runs; its pages come on demand and in the background)."""
    work.mkdir(parents=True, exist_ok=True)
    src = source if source is not None else ImagePageSource(str(images), prepared.tasks)
    opts: dict[str, Any] = {
        "criu_version": criu_version(), "on_failure": on_failure, "request_timeout_s": request_timeout_s,
        "retries": retries, "retry_delay_s": 0.1, "record": record,
    }  # fmt: skip
    fds: tuple[int, ...] = ()
    if transport == "unix":  # a socketpair: the daemon's end is its --ps-socket
        server, theirs = PageServer.over_socketpair(src, **opts)
        where, fds = ["--ps-socket", str(theirs.fileno())], (theirs.fileno(),)
    else:
        server, theirs = PageServer(src, **opts), None
        where = ["--address", "127.0.0.1", "--port", str(server.port)]
    server.start()
    started = time.monotonic()
    daemon = subprocess.Popen(
        ["criu", "lazy-pages", "--page-server", *where, "-D", prepared.images_dir, "-W", str(work),
         "-o", "lazy-pages.log", "-v4"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=work, pass_fds=fds,
    )  # fmt: skip
    if theirs is not None:
        theirs.close()
    lazy = LazyRestore(
        server=server, daemon=daemon, work=work, started=started, running_s=0.0, restore_s=0.0, prepared=prepared
    )
    try:
        box.wait_for(
            lambda: (work / "lazy-pages.socket").exists() or daemon.poll() is not None, 30, "criu lazy-pages' socket"
        )
        if daemon.poll() is not None:
            raise AssertionError(f"criu lazy-pages exited {daemon.returncode}\n{lazy.daemon_log()}")
        t = time.monotonic()
        res = box.restore_cmd(Path(prepared.images_dir), work, "--lazy-pages")
        lazy.running_s, lazy.restore_s = time.monotonic() - started, time.monotonic() - t
        if res.returncode:
            raise AssertionError(
                f"runc restore --lazy-pages failed: {res.stdout}\n{log_tail(work / 'restore.log')}\n"
                f"lazy-pages.log:\n{lazy.daemon_log()}"
            )
    except BaseException:
        lazy.close()
        raise
    return lazy


class StallingSource:
    """A PageSource that serves `after_pages` pages from `inner`, then stops answering until `release` is
    set, and from then on raises (a registry that stopped answering, then answers 503). The test sets
    `release` once the restore has returned (the background transfer can reach the stall before that)."""

    def __init__(self, inner: PageSource, after_pages: int) -> None:
        self.inner, self.left = inner, after_pages
        self.release = threading.Event()
        self.stalled_at: float | None = None

    def pages(self, dst_id: int, vaddr: int, nr_pages: int) -> bytes | bytearray | memoryview:
        if self.left <= 0:
            if self.stalled_at is None:
                self.stalled_at = time.monotonic()
            self.release.wait(600)
            raise OSError("registry: 503 Service Unavailable")
        data = self.inner.pages(dst_id, vaddr, min(nr_pages, self.left))
        self.left -= len(data) // 4096
        return data


def cleanup(base: Path) -> None:
    shutil.rmtree(base, ignore_errors=True)


def push_chunks(client: RegistryClient, ref: Reference, path: Path, span: int = 4 << 20) -> PagesFile:
    """A pages image cut into zstd chunks of `span` bytes pushed to `ref`'s repository (as a snapshot
    stores them, without deltas or sealing): the file's PagesFile."""
    chunks = []
    with open(path, "rb") as f:
        offset = 0
        while data := f.read(span):
            z = zstandard.ZstdCompressor(level=1).compress(data)
            digest = "sha256:" + hashlib.sha256(z).hexdigest()
            client.push_blob(ref, digest=digest, size=len(z), data=z)
            chunks.append(Chunk(offset, len(data), digest, len(z)))
            offset += len(data)
    return PagesFile(path.name, offset, tuple(chunks))


def require() -> None:
    """Skip where runc, CRIU or the kernel's non-cooperative userfaultfd are missing."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("runc and CRIU need root")
    for tool in ("runc", "criu"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (hack/install-node-deps.sh)")
    check = subprocess.run(["criu", "check", "--feature", "uffd-noncoop"], capture_output=True, text=True)
    if check.returncode:
        pytest.skip(f"this kernel has no non-cooperative userfaultfd: {check.stdout}{check.stderr}")


def cpu_ticks(pid: int) -> int:
    """The CPU time the process has run (utime + stime, clock ticks); -1 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return -1
    return int(fields[11]) + int(fields[12])


def zombie(pid: int) -> bool:
    """Whether the process is gone or a zombie (its memory no longer runs)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


@contextlib.contextmanager
def dumped(
    base: Path, name: str, size: int, *, check_sum: bool = False, child: bool = False
) -> Iterator[tuple[Box, Path]]:
    """A pattern container (with its child process: `child`) run and checkpointed once (its images in
    base/images); removed at the end."""
    require()
    box = Box(base, name, size=size, child=child).make()
    box.run()
    if check_sum:
        assert (box.data / "sum0").read_text().strip() == expected_sum(size, box.seed)
    box.checkpoint(base / "images", base / "dump-work")
    try:
        yield box, base / "images"
    finally:
        box.kill()
        box.remove()


@contextlib.contextmanager
def fresh(box: Box) -> Iterator[Box]:
    """The dumped container for one restore: the last restore's outputs cleared, killed and removed after."""
    for name in ("sum", "verify", "n"):
        (box.data / name).unlink(missing_ok=True)
    try:
        yield box
    finally:
        box.kill()
        box.remove()
