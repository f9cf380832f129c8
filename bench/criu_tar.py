#!/usr/bin/env python3
"""CRIU's `tar` calls for a container's tmpfs mounts: the node bundle's launcher doing them itself
against the same launcher running GNU tar (as before session 22), alternated in one run.

    sudo .venv/bin/python bench/criu_tar.py [--rounds 40] [--containers 20]

CRIU saves and restores each tmpfs mount of a container by running `tar` (criu/mount.c), one process
after the other: inside the freeze on a checkpoint, before the processes come back on a restore. A
container under runc has several (/dev, /dev/shm, /run, the cgroup tmpfs, the masked /proc and /sys
directories: 9 in bench/run.py's containers, counted from CRIU's restore.log). This times each call as
CRIU makes it (a new process; for a dump the mount as fd 0 and the image as stdout; for a restore the
image as stdin into a fresh tmpfs) for three trees: a container's /dev as runc fills it, the cgroup
tmpfs, and an empty mount (a masked path, /dev/shm, /run). The launcher is launcher built here,
the GNU tar behind it the host's (the node bundle's is a copy of the same Debian package, run through
the bundle's loader). Prints the median wall time of each call both ways and the ratio.

Then, with --containers N, whole containers: a busybox container under runc (its /dev, /dev/shm and
runc's masked paths are its tmpfs mounts), `runc checkpoint --leave-running` of it and `runc restore`
of that image into a new container, N times each way alternated, CRIU (the host's) finding the
launcher first in PATH as the node bundle's CRIU does. Prints the medians and ratios of both, and how
far apart CRIU started its tar calls during a checkpoint (the launcher's own records: each call's
start), the call and CRIU's work between two calls.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import launcher

DUMP = ["--create", "--gzip", "--no-unquote", "--no-wildcards", "--one-file-system", "--check-links",
        "--preserve-permissions", "--sparse", "--numeric-owner", "--directory", "/proc/self/fd/0", "."]  # fmt: skip


def _mount_tmpfs(path: Path, mode: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"mode={mode}", "kst-bench", str(path)], check=True)


def _dev(root: Path) -> None:
    """What runc puts in a container's /dev (libcontainer/rootfs_linux.go: default devices and links)."""
    for d in ("pts", "shm", "mqueue"):
        (root / d).mkdir()
    for name, (major, minor) in {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8),
                                 "urandom": (1, 9), "tty": (5, 0)}.items():  # fmt: skip
        os.mknod(root / name, 0o020666, os.makedev(major, minor))
        os.chmod(root / name, 0o666)
    links = {"fd": "/proc/self/fd", "stdin": "/proc/self/fd/0", "stdout": "/proc/self/fd/1",
             "stderr": "/proc/self/fd/2", "ptmx": "pts/ptmx", "core": "/proc/kcore"}  # fmt: skip
    for name, target in links.items():
        os.symlink(target, root / name)


def _cgroup(root: Path) -> None:
    """runc's cgroup v1 tmpfs: a mount point per hierarchy, links for the joined ones."""
    for d in ("blkio", "cpu,cpuacct", "cpuset", "devices", "freezer", "memory", "pids", "systemd", "unified"):
        (root / d).mkdir()
    os.symlink("cpu,cpuacct", root / "cpu")
    os.symlink("cpu,cpuacct", root / "cpuacct")


def _launcher(work: Path) -> Path:
    tar = shutil.which("tar")
    out = work / "bin" / "tar"
    # its record of each call's start (pid, time), what --containers reads
    if tar is None or not launcher.build_tar(out, tar, work / "launches"):
        sys.exit("error: needs Go (to build launcher) and GNU tar")
    return out


def _dump(launcher: Path, root: Path, image: Path, env: dict[str, str]) -> float:
    """One dump call: the mount as fd 0, the image as stdout; its wall time."""
    fd0 = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with open(image, "wb") as out:
            t = time.perf_counter()
            subprocess.run([str(launcher), *DUMP], stdin=fd0, stdout=out, env=env, check=True)
            return time.perf_counter() - t
    finally:
        os.close(fd0)


def _restore(launcher: Path, image: Path, dst: Path, env: dict[str, str]) -> float:
    """One restore call into dst (a fresh tmpfs): the image as stdin; its wall time."""
    args = [str(launcher), "--extract", "--gzip", "--no-unquote", "--no-wildcards", "--directory", str(dst)]
    with open(image, "rb") as inp:
        t = time.perf_counter()
        subprocess.run(args, stdin=inp, env=env, check=True)
        return time.perf_counter() - t


BUSYBOX = Path("/bin/busybox")


def _bundle(work: Path) -> Path:
    """A busybox container that sleeps; CRIU's network lock as install-node configures it."""
    bundle = work / "bundle"
    bindir = bundle / "rootfs" / "bin"
    bindir.mkdir(parents=True)
    shutil.copy(BUSYBOX, bindir / "busybox")
    for name in ("sh", "sleep"):
        (bindir / name).symlink_to("busybox")
    subprocess.run(["runc", "spec", "--bundle", str(bundle)], check=True)
    spec = json.loads((bundle / "config.json").read_text())
    spec["process"].update(terminal=False, args=["sleep", "100000"])
    spec["root"]["readonly"] = False
    (bundle / "criu.conf").write_text("network-lock nftables\n")
    spec["annotations"] = {"org.criu.config": str(bundle / "criu.conf")}
    (bundle / "config.json").write_text(json.dumps(spec))
    return bundle


def _starts(log: Path) -> list[float]:
    """The launcher's records: when each call started (POSIX time)."""
    if not log.exists():
        return []
    return [launcher.launch_time(json.loads(line)["time"]) for line in log.read_text().splitlines()]


def _containers(work: Path, n: int, ways: dict[str, dict[str, str]]) -> None:
    if shutil.which("runc") is None or not BUSYBOX.exists():
        sys.exit("error: --containers needs runc and busybox-static")
    bundle, root = _bundle(work), work / "runc-root"
    runc = ["runc", "--root", str(root)]
    base = f"kscriutar-{os.getpid()}"
    subprocess.run([*runc, "run", "-d", "--bundle", str(bundle), base], check=True, stdin=subprocess.DEVNULL,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for r in range(n + 1):  # one warm-up round
            for way in list(ways) if r % 2 == 0 else list(ways)[::-1]:
                image, new = work / f"img-{r}-{way[0]}", f"{base}-{r}-{way[0]}"
                before = len(_starts(work / "launches"))
                t = time.perf_counter()
                subprocess.run([*runc, "checkpoint", "--leave-running", "--image-path", str(image), "--work-path",
                                str(image), base], env=ways[way], check=True)  # fmt: skip
                dumped = time.perf_counter() - t
                starts = _starts(work / "launches")[before:]
                t = time.perf_counter()
                subprocess.run([*runc, "restore", "-d", "--image-path", str(image), "--work-path", str(image),
                                "--bundle", str(bundle), new], env=ways[way], check=True,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)  # fmt: skip
                restored = time.perf_counter() - t
                subprocess.run([*runc, "delete", "--force", new], check=True)
                shutil.rmtree(image)
                if r:
                    times.setdefault(("runc checkpoint", way), []).append(dumped)
                    times.setdefault(("runc restore", way), []).append(restored)
                    times.setdefault(("apart", way), []).extend(b - a for a, b in itertools.pairwise(starts))
    finally:
        subprocess.run([*runc, "delete", "--force", base], check=False)
    print(f"a busybox container under runc, median of {n} each, alternated:")
    for call in ("runc checkpoint", "runc restore"):
        mine, theirs = (statistics.median(times[(call, w)]) * 1000 for w in ways)
        print(f"  {call:16} launcher {mine:6.1f} ms, GNU tar {theirs:6.1f} ms: {mine / theirs:.2f}x")
    calls = len(times[("apart", "launcher")]) // n + 1
    apart = [statistics.median(times[("apart", w)]) * 1000 for w in ways]
    print(
        f"  tar calls in a checkpoint: {calls}, started a median {apart[0]:.1f} ms apart with the launcher doing "
        f"them, {apart[1]:.1f} ms through GNU tar"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--containers", type=int, default=0, help="whole containers under runc, each way")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("error: needs root (tmpfs mounts, device nodes)")
    work = Path(tempfile.mkdtemp(prefix="kscriutar-", dir="/var/tmp"))
    mounts: list[Path] = []
    try:
        tar = _launcher(work)
        trees: dict[str, Path] = {}
        for name, fill in (("/dev", _dev), ("cgroup tmpfs", _cgroup), ("empty", None)):
            root = work / f"src-{len(trees)}"
            _mount_tmpfs(root, "755")
            mounts.append(root)
            if fill is not None:
                fill(root)
            trees[name] = root
        env_of = launcher.NATIVE_TAR_ENV
        ways = {"launcher": {**os.environ, env_of: "1"}, "GNU tar": {**os.environ, env_of: "0"}}
        times: dict[tuple[str, str, str], list[float]] = {}
        dst = work / "dst"
        _mount_tmpfs(dst, "700")
        mounts.append(dst)
        for r in range(a.rounds):
            for way in list(ways) if r % 2 == 0 else list(ways)[::-1]:
                env = ways[way]
                for name, root in trees.items():
                    image = work / "image"
                    times.setdefault((name, "dump", way), []).append(_dump(tar, root, image, env))
                    subprocess.run(["umount", str(dst)], check=True)
                    _mount_tmpfs(dst, "700")
                    times.setdefault((name, "restore", way), []).append(_restore(tar, image, dst, env))
        print(f"median of {a.rounds} calls each, alternated (wall time of the call as CRIU makes it):")
        for name in trees:
            for call in ("dump", "restore"):
                mine = statistics.median(times[(name, call, "launcher")]) * 1000
                theirs = statistics.median(times[(name, call, "GNU tar")]) * 1000
                print(f"  {name:13} {call:8} launcher {mine:6.2f} ms, GNU tar {theirs:6.2f} ms: {mine / theirs:.2f}x")
        if a.containers:
            path = f"{tar.parent}:{os.environ.get('PATH', '')}"
            _containers(work, a.containers, {w: {**e, "PATH": path} for w, e in ways.items()})
    finally:
        for m in reversed(mounts):
            subprocess.run(["umount", "-l", str(m)], check=False)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
