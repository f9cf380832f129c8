"""The installed node bundle works on a host without python3 and without CRIU, and is what runs.

The bundle is built from this machine exactly as the agent image builds it (hack/node_bundle.py) and
installed by install-node's own code. Then, in a private mount namespace where every python3 and
criu of the host is masked (bind-mounted over by /dev/null, so exec fails), a real runc container is

1. checkpointed through the installed runtime hook (`kubectl-snapshot-runc ... checkpoint`: the
   bundle's loader runs the bundle's python on the hook, which execs runc with `--criu <installed>`),
2. restored by the hook's real restore path (`create` of a new container finds the staged checkpoint
   and runs `runc restore` with `--criu <installed>`), and keeps counting.

Which binaries ran is asserted from the CRIU launcher's record (criu.launches: its args and the
parent's command line: runc checkpoint / runc restore with the installed --criu), from the
processes' /proc/PID/exe while they run (the bundle's loader), and from the masked host binaries
failing in that namespace (nothing could have used them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shim.controller.node_install import install, uninstall
from shim.controller.settings import NodeSettings
from shim.engine.staging import StatePaths
from tests.support.bundle import real_bundle

BUSYBOX = Path("/bin/busybox")
HOST_BINARIES = [
    p
    for d in ("/usr/bin", "/usr/sbin", "/usr/local/bin", "/usr/local/sbin", "/bin", "/sbin")
    if os.path.isdir(d) and not os.path.islink(d)
    for p in sorted(Path(d).glob("*"))
    if p.name == "criu" or (p.name.startswith("python3") and not p.name.endswith("-config"))
]

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
    install(s, bundle=str(bundle))
    yield s
    uninstall(s)
    assert not Path(s.wrapper_dir).exists()


def masked(script: str, *, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run `script` (host sh: only the test's driver) in a mount namespace without python3 and criu."""
    masks = "".join(f"mount --bind /dev/null {p} && " for p in HOST_BINARIES)
    return subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", masks + script],
        env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
        capture_output=True,
        text=True,
        timeout=timeout,
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
    (path / "config.json").write_text(json.dumps(spec))


def launches(s: NodeSettings) -> list[dict[str, Any]]:
    path = Path(s.wrapper_dir, "criu.launches")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_host_python_and_criu_are_out_of_reach_in_the_test_namespace() -> None:
    assert any(p.name == "criu" for p in HOST_BINARIES) and any(p.name.startswith("python3") for p in HOST_BINARIES)
    proc = masked("criu --version; echo criu=$?; python3 -c 1; echo python=$?; /usr/bin/python3 -c 1; echo abs=$?")
    for name in ("criu", "python", "abs"):
        assert f"{name}=126" in proc.stdout or f"{name}=127" in proc.stdout, proc
    assert proc.stderr.count("Permission denied") == 3, proc


def test_installed_hook_and_criu_run_without_host_python_or_criu(node: NodeSettings, tmp_path: Path) -> None:
    hook, criu = node.wrapper_launcher, node.criu
    proc = masked(f"{hook} --version && {criu} --version && {criu} check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "runc version" in proc.stdout and "Version: 4.2.1" in proc.stdout and "Looks good" in proc.stdout


def test_checkpoint_and_restore_through_the_installed_hook(node: NodeSettings, tmp_path: Path) -> None:
    counter = tmp_path / "counter"
    counter.mkdir()
    bundle = tmp_path / "bundle"
    make_bundle(bundle, counter)
    root = tmp_path / "runc-root"
    old, new = f"nb-old-{os.getpid()}", f"nb-new-{os.getpid()}"
    staged = StatePaths(node.state_dir).staged_by_id(new)
    image = Path(staged) / "checkpoint"
    image.mkdir(parents=True)
    # runc as the hook runs it, recording who ran it: /proc/PPID/exe and cmdline (the hook, when it is
    # the parent: its `create` runs `runc restore` as a child; pass-through calls exec runc in place)
    seen = tmp_path / "seen"
    runc = tmp_path / "runc"
    runc.write_text(
        f"#!/bin/sh\n{{ readlink /proc/$PPID/exe; tr '\\0' ' ' </proc/$PPID/cmdline; echo; }} >> {seen}\n"
        f'exec {shutil.which("runc")} "$@"\n'
    )
    runc.chmod(0o755)
    hook = f"KUBECTL_SNAPSHOT_RUNC={runc} {node.wrapper_launcher} --root {root}"
    before = len(launches(node))
    try:
        proc = masked(
            f"{hook} run -d --bundle {bundle} --pid-file {tmp_path}/old.pid {old} </dev/null >/dev/null 2>&1 && "
            f"sleep 1 && {hook} checkpoint --image-path {image} --work-path {staged} {old} && "
            f"while [ -e /proc/$(cat {tmp_path}/old.pid) ]; do sleep 0.1; done"
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr + _log(Path(staged) / "dump.log")
        value = int((counter / "n").read_text())
        proc = masked(
            f"{hook} create --bundle {bundle} --pid-file {tmp_path}/new.pid {new} </dev/null >/dev/null 2>&1 && "
            f"{hook} start {new} && cat /proc/$(cat {tmp_path}/new.pid)/comm"
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.strip() == "sh"  # the restored loop, not a fresh container
        time.sleep(1)
        assert int((counter / "n").read_text()) > value  # it kept counting from where it was
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


def _log(path: Path) -> str:
    try:
        return "\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:])
    except OSError:
        return ""
