"""The installed node bundle works on a host without python3, CRIU or any network tool, and is what runs.

The bundle is built from this machine exactly as the agent image builds it (hack/node_bundle.py) and
installed by install-node's own code. Then, in a private mount namespace where every python3, criu,
shell (sh, dash, bash), nsenter, ip, ss, iptables/ip6tables/xtables/nft, tar and gzip program of the host is
replaced by a tripwire (a script that records that it ran and fails), with PATH an empty directory,

1. a real runc container is checkpointed through the installed runtime wrapper (`kubectl-snapshot-runc
   ... checkpoint`: the bundle's loader runs the bundle's python on the hook, which execs runc with
   `--criu <installed>`) and restored by the hook's real restore path (`create` of a new container
   finds the staged checkpoint, runs `runc restore` with `--criu <installed>` and brings the
   restored namespace's lo up), and keeps counting;
2. a pod of two containers holding a TCP connection over loopback in a shared network namespace is
   dumped under the agent's dump lock (shim/net/dumplock.py) and restored whole by the hook into a new
   namespace: locked from the first container's restore to the last one's, and the connection
   carries on.

Which binaries ran is asserted from the CRIU launcher's record (criu.launches: its args and the
parent's command line: runc checkpoint / runc restore with the installed --criu), from runc's parent
(/proc/PPID/exe: the bundle's loader), and from the tripwires: none of the host's tools ran.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from shim.controller.node_install import install, uninstall
from shim.controller.settings import NodeSettings
from shim.engine.staging import FAILED, READY, StagingGate, StatePaths
from shim.host import memwork, workfs
from shim.host.mounts import current, mount_at
from shim.net import dumplock
from shim.net.podrestore import LOCK_TABLE, RELEASED_FILE, PodRestore
from tests.support.bundle import REPO, real_bundle
from tests.support.containerd import tmpfs_large_folios
from tests.support.nft import nft_tables

BUSYBOX = Path("/bin/busybox")
# Every host program that the agent or the hook ran before issue 17 was done, and the ones it never may.
MASKED_NAMES = ("criu", "nsenter", "ip", "ss", "sh", "dash", "bash", "nft", "tar", "gzip")
MASKED_PREFIXES = ("python3", "iptables", "ip6tables", "xtables")
HOST_BINARIES = sorted(
    {
        os.path.realpath(p)
        for d in ("/usr/bin", "/usr/sbin", "/usr/local/bin", "/usr/local/sbin", "/bin", "/sbin")
        if os.path.isdir(d) and not os.path.islink(d)
        for p in Path(d).glob("*")
        if (p.name in MASKED_NAMES or p.name.startswith(MASKED_PREFIXES)) and not p.name.endswith("-config")
        if os.path.isfile(p)
    }
)
HOST_PY_PACKAGES = ("/usr/lib/python3/dist-packages", "/usr/local/lib/python3.11/dist-packages")
pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (runc, CRIU, mount namespaces)"),
    pytest.mark.skipif(shutil.which("runc") is None, reason="runc is not installed"),
    pytest.mark.skipif(not BUSYBOX.exists(), reason="busybox-static is not installed"),
    pytest.mark.skipif(not os.path.exists("/usr/sbin/criu"), reason="CRIU 4.2.1 (the bundle's source) is missing"),
    pytest.mark.skipif(not os.path.exists("/usr/local/go/bin/go"), reason="Go (for the launcher) is missing"),
]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeSettings]:
    base = tmp_path_factory.mktemp("node")
    bundle = real_bundle(base / "image-bundle")
    s = NodeSettings(
        node="nb1",
        state_root=str(base / "state"),
        opt_root=str(base / "opt"),
        containerd_dropin_dir=str(base / "dropins"),
        criu_config=str(base / "etc-criu" / "runc.conf"),
    )
    install(s, bundle=str(bundle), containerd_version="v2.3.7")
    yield s
    uninstall(s)
    assert not Path(s.wrapper_dir).exists()
    area = memwork.area_dir(s.state_dir)
    assert mount_at(area, current()) is None and not os.path.exists(area)  # the area's tmpfs and dir gone


def test_install_node_puts_the_memory_work_area_on_a_tmpfs_with_large_folios(node: NodeSettings) -> None:
    """shim/host/workfs.py: mounted in the (host's) mount namespace by install-node, before the agent starts."""
    top = mount_at(memwork.area_dir(node.state_dir), current())
    if top is None and not tmpfs_large_folios():
        pytest.skip("this kernel has no huge= for tmpfs")
    assert top is not None and top.source == workfs.SOURCE and "huge=within_size" in top.options, top


@pytest.fixture(scope="module")
def tripwire(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A program that records how it was run (into `tripwire.log` beside it) and fails."""
    d = tmp_path_factory.mktemp("tripwire")
    wire = d / "tripwire"
    wire.write_text(f'#!{BUSYBOX.resolve()} sh\necho "$0 $*" >> {d}/tripwire.log\nexit 97\n')
    wire.chmod(0o755)
    (d / "empty").mkdir()
    return wire


def tripped(wire: Path) -> list[str]:
    log = wire.parent / "tripwire.log"
    return log.read_text().splitlines() if log.exists() else []


def masked(wire: Path, script: str, *, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run `script` (busybox sh: the test's driver) in a mount namespace where every host program of
    HOST_BINARIES is the tripwire. The programs under test run with `$NOPATH` (an empty directory) as PATH."""
    argv, env = masked_command(wire, script)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)


def masked_command(wire: Path, script: str) -> tuple[list[str], dict[str, str]]:
    masks = "".join(f"mount --bind {wire} {p} && " for p in HOST_BINARIES)
    # and the host's Python packages (Debian's pycriu and protobuf): the hook brings its own
    masks += "".join(f"mount --bind {wire.parent / 'empty'} {d} && " for d in HOST_PY_PACKAGES if os.path.isdir(d))
    return (
        ["unshare", "-m", "--propagation", "private", str(BUSYBOX.resolve()), "sh", "-c", masks + script],
        {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "NOPATH": str(wire.parent / "empty")},
    )


def make_bundle(path: Path, counter: Path) -> None:
    rootfs = path / "rootfs"
    (rootfs / "bin").mkdir(parents=True)
    shutil.copy(BUSYBOX, rootfs / "bin" / "busybox")
    for name in ("sh", "sleep", "echo"):
        (rootfs / "bin" / name).symlink_to("busybox")
    (rootfs / "data").mkdir()
    subprocess.run(["runc", "spec", "--bundle", str(path)], check=True)
    spec = json.loads((path / "config.json").read_text())
    spec["process"]["terminal"] = False
    spec["process"]["args"] = ["sh", "-c", "i=0; while :; do i=$((i+1)); echo $i > /data/n; sleep 0.1; done"]
    spec["root"]["readonly"] = False
    spec["mounts"].append({"destination": "/data", "type": "bind", "source": str(counter), "options": ["rbind"]})
    # CRIU's network lock as install-node configures it on a node (runc.conf), whatever the host's
    # /etc/criu/runc.conf says right now (its default, iptables, would run the host's iptables-restore)
    conf = path / "criu.conf"
    conf.write_text("network-lock nftables\n")
    spec["annotations"] = {"org.criu.config": str(conf)}
    (path / "config.json").write_text(json.dumps(spec))


def launches(s: NodeSettings) -> list[dict[str, Any]]:
    path = Path(s.wrapper_dir, "criu.launches")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_host_tools_are_out_of_reach_in_the_test_namespace(tripwire: Path) -> None:
    names = {Path(p).name for p in HOST_BINARIES}
    assert {"criu", "nsenter", "ip", "ss", "dash", "bash", "xtables-nft-multi", "tar", "gzip"} <= names, names
    assert any(n.startswith("python3") for n in names), names
    before = len(tripped(tripwire))
    # absolute paths: the driver's busybox sh would run its own applets (nsenter, ip) for bare names
    probes = ("/usr/sbin/criu --version", "/usr/bin/python3 -c 1", "/usr/bin/nsenter --version", "/usr/bin/ip link",
              "/usr/bin/ss -K", "/usr/sbin/iptables-restore --version", "/usr/sbin/ip6tables -S",
              "/usr/sbin/iptables-legacy -S", "/bin/sh -c true", "/usr/bin/bash -c true")  # fmt: skip
    proc = masked(tripwire, "; ".join(f"{p}; echo rc=$?" for p in probes))
    assert proc.stdout.count("rc=97") == len(probes), proc
    assert len(tripped(tripwire)) - before == len(probes)
    tripwire.parent.joinpath("tripwire.log").unlink()


def test_installed_hook_and_criu_run_without_host_tools(node: NodeSettings, tripwire: Path) -> None:
    hook, criu = node.wrapper_launcher, node.criu
    proc = masked(
        tripwire, f"PATH=$NOPATH {hook} --version && PATH=$NOPATH {criu} --version && PATH=$NOPATH {criu} check"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "runc version" in proc.stdout and "Version: 4.2.1" in proc.stdout and "Looks good" in proc.stdout
    assert tripped(tripwire) == []


def test_the_hook_launcher_passes_plain_runc_calls_on_without_python(node: NodeSettings, tmp_path: Path) -> None:
    """The installed launcher, with the installed .launch but its hook and runc swapped for recorders:
    create reaches the hook; every other call goes straight to runc, with the installed CRIU, and no
    Python starts; the start of a restored container is done by the launcher (its marker used once)."""
    record = tmp_path / "ran"
    for name in ("hook", "runc"):
        rec = tmp_path / name
        rec.write_text(f'#!{BUSYBOX.resolve()} sh\necho "{name} $*" >> {record}\n')
        rec.chmod(0o755)
    launcher = tmp_path / "kubectl-snapshot-runc"
    shutil.copy(node.wrapper_launcher, launcher)
    config = json.loads(Path(node.wrapper_launcher + ".launch").read_text())
    assert config["runcHook"] is True and config["argv"][-1].endswith(".pyz")
    config["argv"] = [str(tmp_path / "hook")]
    config["env"]["KUBECTL_SNAPSHOT_RUNC"] = str(tmp_path / "runc")
    Path(f"{launcher}.launch").write_text(json.dumps(config))
    restored = Path(config["env"]["KUBECTL_SNAPSHOT_STATE_DIR"], "restored", "was-restored")
    restored.parent.mkdir(parents=True, exist_ok=True)
    restored.write_text("x")
    g = "--root /run/x --log /tmp/l.json --log-format json"
    calls = [
        *(f"{g} {c}" for c in ("state c1", "start c1", "delete --force c1", "kill c1 9")),
        "--criu /usr/sbin/criu exec c1 ls",
        *(f"{g} {c}" for c in ("create --bundle /b c2", "start was-restored", "start was-restored")),
        "--version",
    ]
    try:
        for call in calls:
            subprocess.run([str(launcher), *call.split()], check=True, env={"PATH": "/nonexistent"})
        assert not restored.exists()
    finally:
        restored.unlink(missing_ok=True)
    crit = f"--criu {node.criu}"
    assert record.read_text().splitlines() == [
        f"runc {crit} {g} state c1",
        f"runc {crit} {g} start c1",
        f"runc {crit} {g} delete --force c1",
        f"runc {crit} {g} kill c1 9",
        f"runc {crit} exec c1 ls",
        f"hook {g} create --bundle /b c2",
        f"runc {crit} {g} start was-restored",  # the second start: the container was re-created
        "hook --version",
    ]


def count(counter: Path, *, stopped: bool = False) -> int:
    """The counter's value (the container rewrites the file every 0.1 s: an empty read is retried).
    A counter the checkpoint `stopped` may have been frozen between the shell's truncation of the file
    and its write: the file then stays empty (0) until the restored process writes it."""
    for _ in range(50):
        text = (counter / "n").read_text().strip()
        if text:
            return int(text)
        time.sleep(0.01)
    if stopped:
        return 0
    raise AssertionError(f"{counter / 'n'} stayed empty")


def counter_bundle(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(the counter's directory, its bundle, a runc root) for a busybox loop that counts into it."""
    counter = tmp_path / "counter"
    counter.mkdir()
    bundle = tmp_path / "bundle"
    make_bundle(bundle, counter)
    return counter, bundle, tmp_path / "runc-root"


def run_and_checkpoint(wire: Path, hook: str, bundle: Path, tmp_path: Path, old: str, staged: Path) -> None:
    """Run the counter as `old` through `hook`, then checkpoint it (stopped) into staged/checkpoint."""
    proc = masked(
        wire,
        f"{hook} run -d --bundle {bundle} --pid-file {tmp_path}/old.pid {old} </dev/null >/dev/null 2>&1 && "
        f"sleep 1 && {hook} checkpoint --image-path {staged}/checkpoint --work-path {staged} {old} && "
        f"while [ -e /proc/$(cat {tmp_path}/old.pid) ]; do sleep 0.1; done",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr + _log(staged / "dump.log")


def create_and_start(wire: Path, hook: str, bundle: Path, tmp_path: Path, new: str) -> subprocess.CompletedProcess[str]:
    """Create (the restore) and start `new` through `hook`; prints the restored process's name."""
    return masked(
        wire,
        f"{hook} create --bundle {bundle} --pid-file {tmp_path}/new.pid {new} </dev/null >/dev/null 2>&1 && "
        f"{hook} start {new} && cat /proc/$(cat {tmp_path}/new.pid)/comm",
    )


def test_checkpoint_and_restore_through_the_installed_hook(node: NodeSettings, tripwire: Path, tmp_path: Path) -> None:
    counter, bundle, root = counter_bundle(tmp_path)
    old, new = f"nb-old-{os.getpid()}", f"nb-new-{os.getpid()}"
    staged = StatePaths(node.state_dir).staged_by_id(new)
    image = Path(staged) / "checkpoint"
    image.mkdir(parents=True)
    # runc as the hook runs it, recording who ran it: /proc/PPID/exe and cmdline (the hook, when it is
    # the parent: its `create` runs `runc restore` as a child; pass-through calls exec runc in place)
    seen = tmp_path / "seen"
    runc = tmp_path / "runc"
    runc.write_text(
        f"#!{BUSYBOX.resolve()} sh\n"
        f"{{ readlink /proc/$PPID/exe; tr '\\0' ' ' </proc/$PPID/cmdline; echo; }} >> {seen}\n"
        f'exec {shutil.which("runc")} "$@"\n'
    )
    runc.chmod(0o755)
    hook = f"PATH=$NOPATH KUBECTL_SNAPSHOT_RUNC={runc} {node.wrapper_launcher} --root {root}"
    before = len(launches(node))
    try:
        run_and_checkpoint(tripwire, hook, bundle, tmp_path, old, Path(staged))
        value = count(counter, stopped=True)
        proc = create_and_start(tripwire, hook, bundle, tmp_path, new)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.strip() == "sh"  # the restored loop, not a fresh container
        # the restored container owns its network namespace: the hook brought its lo up (in-process)
        pid = (tmp_path / "new.pid").read_text().strip()
        assert "UP" in _host_sh(f"nsenter --net=/proc/{pid}/ns/net ip -o link show lo")
        time.sleep(1)
        assert count(counter) > value  # it kept counting from where it was
        assert not Path(staged).exists()  # the hook used the staged checkpoint once
    finally:
        subprocess.run(["runc", "--root", str(root), "delete", "--force", new], capture_output=True, check=False)
        subprocess.run(["runc", "--root", str(root), "delete", "--force", old], capture_output=True, check=False)
    lines = seen.read_text().splitlines()
    bundle = json.loads(Path(node.wrapper_dir, "install.json").read_text())["bundle"]
    i = lines.index(f"{bundle}/lib/ld-linux-x86-64.so.2")  # the hook ran on the bundle's own loader ...
    assert f"{bundle}/libexec/python3" in lines[i + 1] and f"{bundle}/kubectl-snapshot-runc.pyz" in lines[i + 1]
    assert not any(line.startswith(("/usr/bin/python", "/lib", "/usr/lib")) for line in lines)  # ... no host one
    runs = launches(node)[before:]
    parents = [" ".join(str(a) for a in r["parent"]) for r in runs]
    assert runs and all(r["args"][0] == "swrk" for r in runs), runs
    # runc runs CRIU (swrk) for its version check and then for the dump / the restore
    assert any(" checkpoint " in p for p in parents) and any(" restore " in p for p in parents), parents
    assert all(f"--criu {node.criu}" in p for p in parents), parents  # runc was handed the installed CRIU
    assert tripped(tripwire) == []  # no host tool ran (python3, criu, sh, nsenter, ip, ss, iptables, ...)
    # CRIU dumped and restored the container's tmpfs mounts (/dev) with the bundle's tar, through its
    # launcher (its record; CRIU runs it from a helper in the container's pid namespace, so the record's
    # "parent" is not CRIU's command line)
    tars = [json.loads(line) for line in Path(node.wrapper_dir, "tar.launches").read_text().splitlines()]
    assert any("--create" in r["args"] for r in tars) and any("--extract" in r["args"] for r in tars), tars


def test_the_containers_tmpfs_mounts_go_without_gnu_tar(node: NodeSettings, tripwire: Path, tmp_path: Path) -> None:
    """CRIU's tar calls for a container's tmpfs mounts (/dev, /dev/shm, the masked /proc and /sys
    directories) are done by the tar launcher itself (launcher/tmpfstar.go): with the bundle's GNU
    tar replaced by the tripwire, the container is still checkpointed and restored, and the tripwire
    never ran."""
    counter, bundle, root = counter_bundle(tmp_path)
    old, new = f"nt-old-{os.getpid()}", f"nt-new-{os.getpid()}"
    staged = StatePaths(node.state_dir).staged_by_id(new)
    (Path(staged) / "checkpoint").mkdir(parents=True)
    launch = Path(node.wrapper_dir, "bin", "tar.launch")
    saved = launch.read_text()
    launch.write_text(json.dumps({**json.loads(saved), "argv": [str(tripwire)]}))
    tar_log = Path(node.wrapper_dir, "tar.launches")
    before = len(tar_log.read_text().splitlines()) if tar_log.exists() else 0
    hook = f"PATH=$NOPATH {node.wrapper_launcher} --root {root}"
    try:
        run_and_checkpoint(tripwire, hook, bundle, tmp_path, old, Path(staged))
        value = count(counter, stopped=True)
        proc = create_and_start(tripwire, hook, bundle, tmp_path, new)
        assert proc.returncode == 0, proc.stdout + proc.stderr + "\n".join(tripped(tripwire))
        assert proc.stdout.strip() == "sh"
        time.sleep(1)
        assert count(counter) > value
    finally:
        launch.write_text(saved)
        subprocess.run(["runc", "--root", str(root), "delete", "--force", new], capture_output=True, check=False)
        subprocess.run(["runc", "--root", str(root), "delete", "--force", old], capture_output=True, check=False)
    calls = [json.loads(line)["args"] for line in tar_log.read_text().splitlines()[before:]]
    dumps, restores = sum("--create" in a for a in calls), sum("--extract" in a for a in calls)
    assert dumps >= 2 and restores == dumps, calls  # /dev and the masked directories, each both ways
    assert tripped(tripwire) == []  # GNU tar (the tripwire now) never ran


@pytest.mark.parametrize("answer", [READY, FAILED])
def test_runc_restore_starts_before_the_page_files_and_criu_waits_for_them(
    node: NodeSettings, tripwire: Path, tmp_path: Path, answer: str
) -> None:
    """A two-phase staging gate (shim/engine/staging.py): the agent announces the CRIU images while the
    page files are still missing. The installed hook starts `runc restore` at once; CRIU restores the
    container's namespaces and mounts and then waits for runc's answer to its "post-setup-namespaces"
    notification, which the launcher (runc's CRIU, relaying runc's RPC socket to the bundle's CRIU) holds
    at the pages gate. Pages in place and "ready": the restore goes on and the counter continues;
    "failed": CRIU aborts, nothing of the container runs, and the hook reports the agent's reason. CRIU
    runs no action script (no process per step)."""
    counter, bundle, root = counter_bundle(tmp_path)
    old, new = f"nb-po-{os.getpid()}", f"nb-pn-{os.getpid()}"
    paths = StatePaths(node.state_dir)
    staged = Path(paths.staged_by_id(new))
    image = staged / "checkpoint"
    image.mkdir(parents=True)
    hook = f"PATH=$NOPATH {node.wrapper_launcher} --root {root}"
    aside = tmp_path / "pages"
    aside.mkdir()
    gate = StagingGate(paths.staging_gate(new), two_phase=True)
    try:
        run_and_checkpoint(tripwire, hook, bundle, tmp_path, old, staged)
        value = count(counter, stopped=True)
        pages = sorted(image.glob("pages-*.img"))
        assert pages
        for f in pages:
            f.rename(aside / f.name)  # still downloading
        gate.answer_images()
        argv, env = masked_command(
            tripwire,
            f"{hook} create --bundle {bundle} --pid-file {tmp_path}/new.pid {new} </dev/null >/dev/null "
            f"2>{tmp_path}/create.err",
        )
        create = subprocess.Popen(argv, env=env)
        try:
            log = staged / "restore.log"
            deadline = time.monotonic() + 60
            while "Running post-setup-namespaces scripts" not in (log.read_text() if log.exists() else ""):
                assert create.poll() is None, (tmp_path / "create.err").read_text()
                assert time.monotonic() < deadline, "CRIU did not reach the container's namespaces"
                time.sleep(0.05)
            time.sleep(0.5)
            # CRIU waits at the pages gate: the hook's create has not returned, no page was read
            assert create.poll() is None
            assert "Running post-restore scripts" not in log.read_text()
            # runc was told, through the relay; no action script ran for this or the steps before it
            text = log.read_text()
            assert re.search(r"Running post-setup-namespaces scripts\n\(\S+\)\s+RPC\n?$", text) and "\t[" not in text
            if answer == READY:
                for f in pages:
                    (aside / f.name).rename(f)
                gate.answer(READY)
            else:
                gate.answer(FAILED, "DigestMismatch: chunk sha256:ab did not match")
            rc = create.wait(timeout=60)
        finally:
            if create.poll() is None:
                create.kill()
        err = (tmp_path / "create.err").read_text()
        if answer == READY:
            assert rc == 0, err + _log(log)
            proc = masked(tripwire, f"{hook} start {new} && cat /proc/$(cat {tmp_path}/new.pid)/comm")
            assert proc.returncode == 0 and proc.stdout.strip() == "sh", proc.stdout + proc.stderr
            time.sleep(1)
            assert count(counter) > value  # it kept counting from where it was
        else:
            assert rc != 0
            assert "refusing to restore" in err and "DigestMismatch: chunk sha256:ab did not match" in err, err
            state = subprocess.run(["runc", "--root", str(root), "state", new], capture_output=True, text=True)
            assert state.returncode != 0 or '"running"' not in state.stdout, state.stdout  # nothing of it runs
            time.sleep(0.5)
            assert count(counter, stopped=True) == value  # and nothing counts
        assert tripped(tripwire) == []  # runc's CRIU was the bundle's launcher and CRIU: no host tool ran
    finally:
        gate.close()
        shutil.rmtree(staged, ignore_errors=True)
        subprocess.run(["runc", "--root", str(root), "delete", "--force", new], capture_output=True, check=False)
        subprocess.run(["runc", "--root", str(root), "delete", "--force", old], capture_output=True, check=False)


def _log(path: Path) -> str:
    try:
        return "\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:])
    except OSError:
        return ""


def _host_sh(script: str) -> str:
    """The test's own observations, outside the masked namespace (the host's tools are fine here)."""
    r = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30)
    return r.stdout + r.stderr


class Netns:
    """A network namespace with lo up, held by a sleeping process (a pod sandbox's)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(["unshare", "-n", "sh", "-c", "ip link set lo up && exec sleep 600"])
        self.path = f"/proc/{self.proc.pid}/ns/net"
        deadline = time.monotonic() + 5
        while "UP" not in self.sh("ip -o link show lo") or os.readlink(self.path) == os.readlink("/proc/self/ns/net"):
            assert time.monotonic() < deadline, "the namespace did not come up"
            time.sleep(0.05)

    def sh(self, script: str) -> str:
        return _host_sh(f"nsenter --net={self.path} sh -c {shlex.quote(script)}")

    def blocked(self) -> bool:
        """Whether a loopback connection in the namespace fails (the lock drops every packet)."""
        probe = (
            "import socket\ns = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen()\n"
            "try:\n    socket.create_connection(s.getsockname(), timeout=1); print('open')\n"
            "except OSError as e:\n    print('blocked', e)\n"
        )
        out = self.sh(f"/usr/bin/python3 -c {shlex.quote(probe)}")
        assert out.startswith(("open", "blocked")), out
        return out.startswith("blocked")

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


SERVER = "sleep 1000000 | nc -l -p 7000 > /data/got"  # busybox nc ends the connection when its stdin does
CLIENT = "i=0; while :; do i=$((i+1)); echo $i; usleep 50000; done | nc 127.0.0.1 7000"


def pod_bundle(path: Path, *, name: str, uid: str, netns: str, args: str, data: Path, criu_conf: Path) -> Path:
    """An OCI bundle as containerd's CRI plugin writes one for a pod's container (its annotations,
    the pod's network namespace), with CRIU's nftables network lock (runc's org.criu.config)."""
    rootfs = path / "rootfs"
    (rootfs / "bin").mkdir(parents=True)
    shutil.copy(BUSYBOX, rootfs / "bin" / "busybox")
    for applet in ("sh", "nc", "usleep", "echo", "sleep"):
        (rootfs / "bin" / applet).symlink_to("busybox")
    (rootfs / "data").mkdir()
    subprocess.run(["runc", "spec", "--bundle", str(path)], check=True)
    spec = json.loads((path / "config.json").read_text())
    spec["process"]["terminal"] = False
    spec["process"]["args"] = ["sh", "-c", args]
    spec["root"]["readonly"] = False
    spec["mounts"].append({"destination": "/data", "type": "bind", "source": str(data), "options": ["rbind"]})
    spec["linux"]["namespaces"] = [
        {"type": "network", "path": netns} if ns["type"] == "network" else ns for ns in spec["linux"]["namespaces"]
    ]
    spec["annotations"] = {
        "io.kubernetes.cri.sandbox-uid": uid,
        "io.kubernetes.cri.container-name": name,
        "io.kubernetes.cri.container-type": "container",
        "org.criu.config": str(criu_conf),
    }
    (path / "config.json").write_text(json.dumps(spec))
    return path


DUMP_UNDER_LOCK = """
import json, os, socket, subprocess, sys
from shim.net import dumplock, netns
pids, commands = json.loads(sys.argv[1]), json.loads(sys.argv[2])

def probe():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
    try:
        socket.create_connection(s.getsockname(), timeout=1)
        return "open"
    except OSError as e:
        return f"blocked ({e})"

with dumplock.pod_network_locked(pids):
    print("traffic while locked:", netns.run_in(f"/proc/{pids[0]}/ns/net", probe))
    for argv in commands:
        proc = subprocess.run(argv, env={"PATH": os.environ["NOPATH"]}, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"{argv} failed: {proc.stdout}{proc.stderr}")
    print("locked dump done")
"""


def test_whole_pod_dump_lock_and_restore_without_host_tools(node: NodeSettings, tripwire: Path, tmp_path: Path) -> None:
    """The agent's dump lock and the hook's whole-pod restore (lock, restore both, release) with no
    host tool: a loopback TCP connection between the pod's two containers carries on."""
    uid = f"nb-pod-{os.getpid()}"
    criu_conf = tmp_path / "criu.conf"
    criu_conf.write_text("network-lock nftables\n")  # as install-node writes /etc/criu/runc.conf
    root = tmp_path / "runc-root"
    seen, runc = tmp_path / "seen", tmp_path / "runc"
    runc.write_text(
        f'#!{BUSYBOX.resolve()} sh\n{{ readlink /proc/$PPID/exe; echo; }} >> {seen}\nexec {shutil.which("runc")} "$@"\n'
    )
    runc.chmod(0o755)
    hook = [str(node.wrapper_launcher), "--root", str(root)]
    env_hook = f"PATH=$NOPATH KUBECTL_SNAPSHOT_RUNC={runc} {' '.join(hook)}"
    paths = StatePaths(node.state_dir)
    data = {n: tmp_path / f"data-{n}" for n in ("server", "client")}
    for d in data.values():
        d.mkdir()
    old_ns, new_ns = Netns(), Netns()
    old = {n: f"nb-{n}-old-{os.getpid()}" for n in data}
    new = {n: f"nb-{n}-new-{os.getpid()}" for n in data}
    args = {"server": SERVER, "client": CLIENT}
    before = len(launches(node))
    try:
        for n in ("server", "client"):
            b = pod_bundle(tmp_path / f"old-{n}", name=n, uid=uid, netns=old_ns.path, args=args[n], data=data[n],
                           criu_conf=criu_conf)  # fmt: skip
            subprocess.run(["runc", "--root", str(root), "run", "-d", "--bundle", str(b), "--pid-file",
                            str(tmp_path / f"old-{n}.pid"), old[n]], check=True, stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
            time.sleep(1)
        got = data["server"] / "got"
        _wait(lambda: _last(got) > 20, "the client's numbers at the server")
        pids = [int((tmp_path / f"old-{n}.pid").read_text()) for n in ("server", "client")]
        # the agent's part: both dumps under one lock of the pod's network (the venv's Python runs it here)
        commands = []
        for n in ("server", "client"):
            staged = Path(paths.staged_by_pod(uid, n))
            (staged / "checkpoint").mkdir(parents=True)
            commands.append([*hook, "checkpoint", "--image-path", str(staged / "checkpoint"), "--work-path",
                             str(staged), "--tcp-established", old[n]])  # fmt: skip
        env = f"KUBECTL_SNAPSHOT_RUNC={runc} PYTHONPATH={REPO}"
        proc = masked(tripwire, f"{env} {sys.executable} -c {shlex.quote(DUMP_UNDER_LOCK)} "
                                f"{shlex.quote(json.dumps(pids))} {shlex.quote(json.dumps(commands))}")  # fmt: skip
        assert proc.returncode == 0 and "locked dump done" in proc.stdout, proc.stdout + proc.stderr
        at_dump = _last(got)
        assert "blocked" in proc.stdout, proc.stdout  # loopback traffic in the pod's namespace, during the dumps
        # the dump lock is gone again (CRIU's own per-connection tables of the killed tasks stay: not ours)
        assert dumplock.LOCK_TABLE not in nft_tables(old_ns.path) and nft_tables(old_ns.path)
        PodRestore(paths.pod_dir(uid)).record(["server", "client"])  # what the agent stages

        # the kubelet's part: create the pod's containers one by one under the runtime handler
        for i, n in enumerate(("server", "client")):
            b = pod_bundle(tmp_path / f"new-{n}", name=n, uid=uid, netns=new_ns.path, args=args[n], data=data[n],
                           criu_conf=criu_conf)  # fmt: skip
            proc = masked(tripwire, f"{env_hook} create --bundle {b} --pid-file {tmp_path}/new-{n}.pid {new[n]} "
                                    "</dev/null >/dev/null 2>&1")  # fmt: skip
            assert proc.returncode == 0, (
                proc.stdout + proc.stderr + _log(Path(paths.staged_by_pod(uid, n)) / "restore.log")
            )
            if i == 0:  # one end is back, the other not yet: nothing moves in the pod's network
                assert new_ns.blocked() and LOCK_TABLE in nft_tables(new_ns.path)
                assert new_ns.sh("cat /proc/sys/net/ipv4/ip_nonlocal_bind").strip() == "1"
                time.sleep(1)
        assert LOCK_TABLE not in nft_tables(new_ns.path)  # released once the last container was restored
        assert not new_ns.blocked()
        assert new_ns.sh("cat /proc/sys/net/ipv4/ip_nonlocal_bind").strip() == "0"
        proc = masked(tripwire, f"{env_hook} start {new['server']} && {env_hook} start {new['client']}")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        # the restored client goes on counting over the restored connection (a fresh one starts at 1)
        _wait(lambda: _last(got) > at_dump + 20, "the restored client's numbers at the restored server")
        pod = PodRestore(paths.pod_dir(uid))
        assert pod.failed() is None and (Path(pod.directory) / RELEASED_FILE).exists()
    finally:
        for cid in [*old.values(), *new.values()]:
            subprocess.run(["runc", "--root", str(root), "delete", "--force", cid], capture_output=True, check=False)
        old_ns.close()
        new_ns.close()
    assert tripped(tripwire) == []  # no host tool ran: no nsenter, sh, ip, ss, iptables, python3, criu
    bundle = json.loads(Path(node.wrapper_dir, "install.json").read_text())["bundle"]
    assert f"{bundle}/lib/ld-linux-x86-64.so.2" in seen.read_text().splitlines()  # runc's parent: the hook's loader
    parents = [" ".join(str(a) for a in r["parent"]) for r in launches(node)[before:]]
    assert sum(" checkpoint " in p for p in parents) >= 2 and sum(" restore " in p for p in parents) >= 2, parents
    assert all(f"--criu {node.criu}" in p for p in parents), parents  # every CRIU run was the installed one


def _last(path: Path) -> int:
    try:
        lines = path.read_text().split()
    except OSError:
        return 0
    return int(lines[-1]) if lines and lines[-1].isdigit() else (int(lines[-2]) if len(lines) > 1 else 0)


def _wait(ok: Callable[[], bool], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)
