"""The node bundle's install, the runc hand-over of the installed CRIU, node status and doctor (pure parts)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from kubectl_snapshot.app.doctor import node_facts
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import FailedPrecondition, InvalidArgument
from shim.containerd.model import ContainerInfo, RuncOptions
from shim.containerd.runc_checkpoint import CheckpointArgs, RuncCheckpointer
from shim.controller.node_install import INSTALL_FACTS, install, uninstall
from shim.controller.settings import NodeSettings
from shim.host import facts as hostfacts
from shim.runtime_wrapper import with_criu
from shim.service import nodecheck
from tests.support.bundle import fake_bundle


def settings(tmp_path: Path, **kw: str) -> NodeSettings:
    return NodeSettings(
        node="n1",
        state_root=str(tmp_path / "state"),
        opt_root=str(tmp_path / "opt"),
        containerd_dropin_dir=str(tmp_path / "dropins"),
        criu_config=str(tmp_path / "criu" / "runc.conf"),
        criu_kdat="",  # never the host's /run in a unit test (tests/integration/test_criu_kdat.py)
        memory_work_fs=False,  # nor a tmpfs (tests/integration/test_workfs.py)
        **kw,
    )


def test_install_puts_the_bundle_and_launchers_in_the_nodes_own_directory(tmp_path: Path) -> None:
    s = settings(tmp_path)
    r = install(s, bundle=str(fake_bundle(tmp_path / "b")), containerd_version="v2.3.7")
    node = Path(s.wrapper_dir)
    assert r.bundle.startswith(str(node / "bundle-")) and Path(r.bundle, ".complete").exists()
    assert s.criu == str(node / "criu") == r.criu
    hook = json.loads(Path(s.wrapper_launcher + ".launch").read_text())
    loader = [f"{r.bundle}/lib/ld-linux-x86-64.so.2", "--library-path", f"{r.bundle}/lib"]
    python = f"{r.bundle}/libexec/python3.11"
    assert hook["argv"] == [
        *loader,
        "--argv0",
        python,
        python,
        "-I",
        "-S",
        "-B",
        f"{r.bundle}/kubectl-snapshot-runc.pyz",
    ]
    assert hook["env"] == {"KUBECTL_SNAPSHOT_STATE_DIR": s.state_dir, "KUBECTL_SNAPSHOT_CRIU": s.criu}
    criu = json.loads(Path(s.criu + ".launch").read_text())
    assert criu["argv"] == [*loader, "--argv0", "criu", f"{r.bundle}/libexec/criu"]
    assert criu["log"] == str(node / "criu.launches")
    assert criu["pathPrepend"] == [str(node / "bin")]  # CRIU runs tar and gzip by name: the bundle's first
    tools = {name: json.loads((node / "bin" / f"{name}.launch").read_text()) for name in ("tar",)}
    assert tools["tar"]["argv"] == [*loader, "--argv0", "tar", f"{r.bundle}/libexec/tar"]
    assert tools["tar"]["gzipFilter"] is True  # tar's --gzip would run gzip through the host's /bin/sh
    assert tools["tar"]["log"] == str(node / "tar.launches")
    assert (node / "bin" / "tar").read_bytes() == b"\x7fELF launcher"
    assert sorted(os.listdir(node / "bin")) == ["tar", "tar.launch"]
    # nothing points outside the node's directory: no host python3, no host criu, no host tar
    argvs = [a for c in (hook, criu, *tools.values()) for a in c["argv"]]
    assert all(a.startswith(str(node)) or not a.startswith("/") for a in argvs)
    facts = json.loads((node / INSTALL_FACTS).read_text())
    assert facts["criu"]["version"] == "4.2.1" and facts["criu"]["launcher"] == s.criu
    assert facts["python"]["version"] == "3.11.2" and facts["bundle"] == r.bundle
    assert facts["tools"]["tar"]["launcher"] == str(node / "bin" / "tar")
    assert facts["tools"]["tar"]["from"] == "debian tar 1.34+dfsg-1.2+deb12u1"


def test_a_new_bundle_replaces_the_old_one_and_uninstall_removes_all(tmp_path: Path) -> None:
    s = settings(tmp_path)
    Path(s.wrapper_dir).mkdir(parents=True)
    Path(s.wrapper_dir, "kubectl-snapshot-runc.pyz").write_bytes(b"from the python3-launcher era")
    first = install(s, bundle=str(fake_bundle(tmp_path / "b1")), containerd_version="v2.3.7")
    same = install(s, bundle=str(fake_bundle(tmp_path / "b1")), containerd_version="v2.3.7")
    assert same.bundle == first.bundle and not same.changed
    second = install(s, bundle=str(fake_bundle(tmp_path / "b2", pyz=b"PK-new")), containerd_version="v2.3.7")
    assert second.bundle != first.bundle and not Path(first.bundle).exists()
    assert sorted(os.listdir(s.wrapper_dir)) == sorted(
        [os.path.basename(second.bundle), "bin", "criu", "criu.launch", "install.json", "kubectl-snapshot-runc",
         "kubectl-snapshot-runc.launch"]
    )  # fmt: skip
    uninstall(s)
    assert not Path(s.wrapper_dir).exists() and not Path(second.dropin).exists()


def test_a_damaged_bundle_is_refused(tmp_path: Path) -> None:
    b = fake_bundle(tmp_path / "b")
    (b / "libexec" / "criu").write_bytes(b"tampered")
    with pytest.raises(FailedPrecondition, match="does not match its digest"):
        install(settings(tmp_path), bundle=str(b), containerd_version="v2.3.7")
    assert not any(p.name.startswith("bundle-") for p in Path(settings(tmp_path).wrapper_dir).iterdir())
    with pytest.raises(InvalidArgument, match="node bundle"):
        install(settings(tmp_path), bundle=str(tmp_path / "missing"), containerd_version="v2.3.7")
    meta = json.loads((b / "bundle.json").read_text())
    meta["files"] = {"../../etc/passwd": "0" * 64}
    (b / "bundle.json").write_text(json.dumps(meta))
    with pytest.raises(InvalidArgument, match="bad file name"):
        install(settings(tmp_path), bundle=str(b), containerd_version="v2.3.7")


def test_runc_is_handed_the_installed_criu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBECTL_SNAPSHOT_CRIU", raising=False)
    assert with_criu(["--root", "/r"]) == ["--root", "/r"]
    monkeypatch.setenv("KUBECTL_SNAPSHOT_CRIU", "/opt/kubectl-snapshot/n1/criu")
    assert with_criu(["--root", "/r", "--criu", "/usr/sbin/criu", "--criu=/x"]) == [
        "--criu", "/opt/kubectl-snapshot/n1/criu", "--root", "/r"
    ]  # fmt: skip


def _info(opts: RuncOptions | None) -> ContainerInfo:
    return ContainerInfo("c1", "img", {}, "io.containerd.runc.v2", opts, {}, "overlayfs", "c1")


def test_checkpoint_command_is_the_shims_plus_criu() -> None:
    cp = RuncCheckpointer(criu="/opt/kubectl-snapshot/n1/criu")
    cmd = cp.command("c1", "k8s.io", _info(RuncOptions(binary_name="/usr/sbin/runc")), CheckpointArgs("/i", "/w"))
    assert cmd == [
        "/usr/sbin/runc", "--root", "/run/containerd/runc/k8s.io", "--criu", "/opt/kubectl-snapshot/n1/criu",
        "checkpoint", "--image-path", "/i", "--work-path", "/w", "--tcp-established", "--leave-running", "c1",
    ]  # fmt: skip
    opts = RuncOptions(binary_name="/x/runc", root="/run/r", systemd_cgroup=True)
    args = CheckpointArgs("/i", "/w", exit=True, open_tcp=False, file_locks=True, external_unix_sockets=True)
    cmd = cp.command("c1", "default", _info(opts), args)
    assert cmd[:6] == ["/x/runc", "--root", "/run/r/default", "--criu", cp.criu, "--systemd-cgroup"]
    assert "--leave-running" not in cmd and "--file-locks" in cmd and "--ext-unix-sk" in cmd
    assert RuncCheckpointer(criu="c", runc="/my/runc").runc_binary(_info(None)) == "/my/runc"


def test_pause_command_is_the_shims_runc_pause() -> None:
    """What the client runs when containerd calls a task paused that runc finds running (threat A2)."""
    cp = RuncCheckpointer(criu="c")
    opts = RuncOptions(binary_name="/x/runc", root="/run/r", systemd_cgroup=True)
    assert cp.pause_command("c1", "k8s.io", _info(opts)) == [
        "/x/runc", "--root", "/run/r/k8s.io", "--systemd-cgroup", "pause", "c1",
    ]  # fmt: skip


def test_containerd_config_imports_and_pending_restart(tmp_path: Path) -> None:
    dropin = "/etc/containerd/conf.d/kubectl-snapshot.toml"
    assert nodecheck.imports_dropin(nodecheck.Containerd(1, "/etc/containerd/config.toml", None), dropin)
    assert nodecheck.imports_dropin(nodecheck.Containerd(1, "/etc/containerd/config.toml", {"version": 3}), dropin)
    assert not nodecheck.imports_dropin(nodecheck.Containerd(1, "/etc/c.toml", {"imports": []}), dropin)
    assert nodecheck.imports_dropin(
        nodecheck.Containerd(1, "/etc/containerd/c.toml", {"imports": ["conf.d/*.toml"]}), dropin
    )
    assert nodecheck.config_path_of(["containerd", "--config", "/x.toml"]) == "/x.toml"
    assert nodecheck.config_path_of(["containerd", "-c", "/y.toml"]) == "/y.toml"
    assert nodecheck.config_path_of(["containerd"]) == nodecheck.DEFAULT_CONFIG
    assert nodecheck.socket_of({"grpc": {"address": "unix:///run/x.sock"}}) == "/run/x.sock"
    me = nodecheck.Containerd(os.getpid(), "/c.toml", None)
    started = nodecheck.started_at(os.getpid())
    assert started is not None and abs(started - time.time()) < 24 * 3600 * 365
    f = tmp_path / "d.toml"
    f.write_text("")
    assert nodecheck.restart_pending(me, str(f)) is True  # written after this process started
    os.utime(f, (started - 100, started - 100))
    assert nodecheck.restart_pending(me, str(f)) is False
    assert nodecheck.restart_pending(me, str(tmp_path / "none")) is None


def test_blockers_and_doctor_per_node() -> None:
    status: dict[str, Any] = {
        "criu": {"path": "/opt/kubectl-snapshot/n1/criu", "version": "4.2.1", "from": "debian criu 4.2.1-1"},
        "hook": {"path": "/opt/kubectl-snapshot/n1/kubectl-snapshot-runc", "python": "3.11.2", "from": "debian"},
        "criuCheck": {"ok": False, "detail": "Error (criu/cr-check.c:1): UFFD is not supported"},
        "cgroup": "v2",
        "containerd": {"version": "v1.7.24", "found": True, "config": "/etc/containerd/config.toml",
                       "importsDropin": False, "restartPending": True},
    }  # fmt: skip
    status["tools"] = nodecheck.tools(
        {"tools": {"tar": {"launcher": "/opt/kubectl-snapshot/n1/bin/tar", "version": "1.34", "from": "debian tar"}}},
        "agent image X",
    )
    assert status["tools"]["tar"] == {"path": "/opt/kubectl-snapshot/n1/bin/tar", "version": "1.34",
                                      "from": "debian tar, agent image X"}  # fmt: skip
    lock = status["tools"]["pod network lock"]
    assert lock["path"] == "in-process" and "iptables-restore" in lock["replaces"] and lock["ok"] is True  # this kernel
    assert {t["path"] for n, t in status["tools"].items() if n != "tar"} == {"in-process"}
    status["blockers"] = nodecheck.blockers(status)
    assert len(status["blockers"]) == 4
    assert "UFFD is not supported" in status["blockers"][0] and "containerd 2.x" in status["blockers"][1]
    node = {"metadata": {"name": "n1", "annotations": {K.ANN_NODE_FACTS: json.dumps({"node": status})}}}
    facts = node_facts(node)
    assert facts["criu"] == status["criu"] and facts["hook"]["python"] == "3.11.2"
    assert facts["importsDropin"] is False and facts["restartPending"] is True and facts["cgroup"] == "v2"
    assert facts["blockers"] == status["blockers"]
    fine = {"version": "v2.3.7", "found": True, "importsDropin": True, "restartPending": False}
    ok = {**status, "criuCheck": {"ok": True}, "containerd": fine}
    assert nodecheck.blockers(ok) == []
    no_nft = {**ok, "tools": {"pod network lock": {"ok": False, "detail": "nf_tables is not usable here"}}}
    assert nodecheck.blockers(no_nft) == [
        "pods' network cannot be locked (whole-pod restores, dumps of pods): nf_tables is not usable here"
    ]
    assert facts["tools"]["tar"]["path"] == "/opt/kubectl-snapshot/n1/bin/tar"
    assert facts["tools"]["abort connections from the old address"]["replaces"] == "ss -K"
    assert node_facts({"metadata": {"name": "n2"}})["blockers"]  # an agent that published nothing


def test_the_installed_criu_is_asked_directly_not_through_the_hosts_mount_namespace(tmp_path: Path) -> None:
    criu = tmp_path / "criu"
    criu.write_text("#!/bin/sh\necho 'Version: 4.2.1'\n")
    criu.chmod(0o755)
    probe = hostfacts.HostProbe(exec_prefix=("/nonexistent/nsenter", "--mount=/proc/1/ns/mnt", "--"), criu=str(criu))
    assert hostfacts.criu_version(probe) == "4.2.1"  # the prefix would have failed
