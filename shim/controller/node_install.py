"""Install (and remove) what kubectl-snapshot runs on this node: the node bundle, launchers, the drop-in.

Run by the DaemonSet's init container. Nothing of the host's userland is used on the host's side:
the agent image carries a node bundle (hack/node_bundle.py: the image's dynamic loader and libraries,
CRIU 4.2.1, a Python interpreter with its stdlib, the runtime wrapper zipapp and a static launcher), and
this step copies it under the node's own directory:

    /opt/kubectl-snapshot/NODE/bundle-<digest>/     the bundle (verified against its bundle.json)
    /opt/kubectl-snapshot/NODE/kubectl-snapshot-runc   static launcher: the bundle's loader runs its
                                                    python on the hook (`BinaryName` of the handler)
    /opt/kubectl-snapshot/NODE/criu                 static launcher: the bundle's loader runs its CRIU,
                                                    with bin/ first in PATH
    /opt/kubectl-snapshot/NODE/bin/tar              static launcher: the bundle's GNU tar, which CRIU runs
                                                    by name for tmpfs mounts; the launcher does its --gzip
                                                    (GNU tar runs gzip through /bin/sh): no host tar, gzip, sh;
                                                    trees of directories, device nodes, symlinks and empty
                                                    files it archives and extracts itself (tmpfstar.go)
    /opt/kubectl-snapshot/NODE/*.launch             what each launcher execs (JSON)
    /opt/kubectl-snapshot/NODE/install.json         what is installed, where it came from

runc is handed that CRIU explicitly (`runc --criu`): by the hook for everything containerd runs under
the handler (restores), and by the agent for checkpoints (shim/containerd/runc_checkpoint.py), so a
host CRIU, present or not, is never used. The drop-in registers the runtime handler `kubectl-snapshot`
(selected by the RuntimeClass of the same name); containerd reads drop-ins at start, so a changed
drop-in is followed by the configured restart command, run in the host's namespaces. The node's runc
CRIU configuration (shim/criu/config.py) is written too, where it is safe and the installed CRIU
supports it, and CRIU's kernel-feature cache is kept on a small tmpfs where /run is not one
(shim/criu/kdat.py: CRIU then skips its kernel probes, which otherwise fall inside every freeze).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from typing import Any

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import timestamps as T
from kubectl_snapshot.core.errors import FailedPrecondition, InvalidArgument
from shim.containerd.client import ContainerdClient
from shim.controller import dropin
from shim.controller.settings import NodeSettings
from shim.criu import config as criu_config
from shim.criu import kdat as criu_kdat
from shim.criu.guard import PYCRIU_PATH_ENV
from shim.host import memwork, private, rcu, workfs
from shim.host.facts import host_pid

DROPIN_NAME = "kubectl-snapshot.toml"
PYZ_NAME = "kubectl-snapshot-runc.pyz"
BUNDLE_DIR = "/usr/local/lib/kubectl-snapshot/node-bundle"  # in the agent image (hack/agent_image.py)
INSTALL_FACTS = "install.json"
CRIU_LAUNCHES = "criu.launches"  # the CRIU launcher's record of every run (time, args, parent); tar.launches too


@dataclass(frozen=True)
class InstallResult:
    launcher: str
    dropin: str
    changed: bool
    restarted: bool
    criu_config: criu_config.ConfigResult | None = None
    bundle: str = ""
    criu: str = ""
    kdat: criu_kdat.KdatResult | None = None
    rcu: str = ""  # RCU grace periods during dumps and restores (shim/host/rcu.py): what prepare() found
    work_fs: workfs.WorkFsResult | None = None  # the memory work area's tmpfs (shim/host/workfs.py)


@dataclass(frozen=True)
class Bundle:
    """An installed (or to be installed) node bundle: its directory and its bundle.json."""

    path: str
    meta: dict[str, Any]

    @classmethod
    def load(cls, path: str) -> Bundle:
        try:
            with open(os.path.join(path, "bundle.json")) as f:
                meta = json.load(f)
        except (OSError, ValueError) as e:
            raise InvalidArgument(
                f"node bundle {path} is missing or unreadable: {e}",
                hint="the agent image ships it (hack/agent_image.py); pass --bundle DIR for another one",
            ) from None
        if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict) or "loader" not in meta:
            raise InvalidArgument(f"node bundle {path}: bundle.json lacks files/loader")
        return cls(path, meta)

    def file(self, rel: str) -> str:
        return os.path.join(self.path, rel)

    def part(self, name: str) -> dict[str, Any]:
        value = self.meta.get(name)
        return value if isinstance(value, dict) else {}


def tools_dir(settings: NodeSettings) -> str:
    """Launchers of the bundle's tools (tar), first in the installed CRIU's PATH."""
    return os.path.join(settings.wrapper_dir, "bin")


def launch_configs(settings: NodeSettings, bundle: Bundle) -> dict[str, dict[str, Any]]:
    """{launcher path: its .launch content}: the hook's python, CRIU and CRIU's tools, each through the
    bundle's loader."""
    loader = [bundle.file(bundle.meta["loader"]), "--library-path", bundle.file("lib")]
    python = bundle.file(bundle.part("python").get("path", "libexec/python3"))
    criu = bundle.file(bundle.part("criu").get("path", "libexec/criu"))
    hook_env = {"KUBECTL_SNAPSHOT_STATE_DIR": settings.state_dir, "KUBECTL_SNAPSHOT_CRIU": settings.criu}
    site = bundle.part("hookSite").get("path")
    if site:  # pycriu + protobuf for the hook's image check: a node has none of its own
        hook_env[PYCRIU_PATH_ENV] = bundle.file(str(site))
    configs: dict[str, dict[str, Any]] = {
        settings.wrapper_launcher: {
            "argv": [*loader, "--argv0", python, python, "-I", "-S", "-B", bundle.file(PYZ_NAME)],
            "env": hook_env,
            # calls the hook would only pass on go to runc from the launcher: no Python start-up for
            # every `state`, `kill`, `exec` (probes) and `start` (launcher/runchook.go)
            "runcHook": True,
        },
        os.path.join(settings.wrapper_dir, "criu"): {
            "argv": [*loader, "--argv0", "criu", criu],
            "env": {},
            "pathPrepend": [tools_dir(settings)],
            "log": os.path.join(settings.wrapper_dir, CRIU_LAUNCHES),
        },
    }
    for name, tool in sorted(bundle.part("tools").items()):
        path = bundle.file(str(tool.get("path") or f"libexec/{name}"))
        configs[os.path.join(tools_dir(settings), name)] = {
            "argv": [*loader, "--argv0", name, path],
            "env": {},
            "gzipFilter": name == "tar",  # the launcher compresses: tar's own --gzip needs /bin/sh and gzip
            "log": os.path.join(settings.wrapper_dir, f"{name}.launches"),  # evidence: CRIU ran the bundle's
        }
    return configs


def dropin_toml(settings: NodeSettings, containerd_version: str) -> str:
    """The drop-in for the node's containerd release (shim/controller/dropin.py: 1.x and 2.x differ)."""
    node_cri = None
    if dropin.major_version(containerd_version) == 1:
        node_cri = dropin.node_cri_table_of(settings.containerd_socket, dropin_path(settings))
    return dropin.render(containerd_version, settings.wrapper_launcher, node_cri)


def dropin_path(settings: NodeSettings) -> str:
    return os.path.join(settings.containerd_dropin_dir, DROPIN_NAME)


def ask_containerd_version(settings: NodeSettings) -> str:
    with ContainerdClient(settings.containerd_socket, K.CONTAINERD_K8S_NAMESPACE, timeout=10.0) as c:
        return c.version()[0]


def _write_if_changed(path: str, content: str, mode: int) -> bool:
    # Compared as bytes: what is there may be anything (another version's binary launcher, say).
    with contextlib.suppress(OSError), open(path, "rb") as f:
        if f.read() == content.encode():
            os.chmod(path, mode)
            return False
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(content)
    os.chmod(tmp, mode)
    os.rename(tmp, path)
    return True


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _copy_bundle(src: Bundle, wrapper_pyz: str | None, settings: NodeSettings) -> Bundle:
    """Copy the bundle (and the hook zipapp) into the node's directory, verified; an identical copy is reused."""
    pyz_hash = _sha256(wrapper_pyz) if wrapper_pyz else src.meta["files"].get(PYZ_NAME, "")
    key = hashlib.sha256(f"{src.meta.get('digest', '')}:{pyz_hash}".encode()).hexdigest()[:16]
    dest = os.path.join(settings.wrapper_dir, f"bundle-{key}")
    if os.path.exists(os.path.join(dest, ".complete")):
        return Bundle.load(dest)
    tmp = f"{dest}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    files: dict[str, str] = dict(src.meta["files"])
    for rel, digest in sorted(files.items()):
        if os.path.isabs(rel) or ".." in rel.split("/"):
            raise InvalidArgument(f"node bundle {src.path}: bad file name {rel!r} in bundle.json")
        target = os.path.join(tmp, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(src.file(rel), target)
        if rel == PYZ_NAME and wrapper_pyz:
            shutil.copyfile(wrapper_pyz, target)
            files[rel] = digest = pyz_hash
        if _sha256(target) != digest:
            shutil.rmtree(tmp, ignore_errors=True)
            raise FailedPrecondition(
                f"node bundle file {rel} does not match its digest in bundle.json",
                hint="the agent image is damaged: rebuild it (hack/build-agent-image.sh)",
            )
    meta = {**src.meta, "files": files}
    with open(os.path.join(tmp, "bundle.json"), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
    with open(os.path.join(tmp, ".complete"), "w") as f:
        f.write(key + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    os.rename(tmp, dest)
    return Bundle(dest, meta)


def _install_file(src: str, dest: str, mode: int) -> None:
    """Replace `dest` by a copy of `src` atomically (containerd may exec the old one right now)."""
    with contextlib.suppress(OSError):
        if _sha256(src) == _sha256(dest):
            os.chmod(dest, mode)
            return
    tmp = f"{dest}.tmp-{os.getpid()}"
    shutil.copyfile(src, tmp)
    os.chmod(tmp, mode)
    os.rename(tmp, dest)


def current_bundle(settings: NodeSettings) -> str:
    """The installed bundle directory on this node ("" when none)."""
    try:
        with open(os.path.join(settings.wrapper_dir, INSTALL_FACTS)) as f:
            return str(json.load(f).get("bundle") or "")
    except (OSError, ValueError, AttributeError):
        return ""


def install(
    settings: NodeSettings,
    *,
    wrapper_pyz: str | None = None,
    bundle: str = BUNDLE_DIR,
    containerd_version: str | None = None,
) -> InstallResult:
    """`containerd_version`: the node's (the drop-in's format depends on it); None asks containerd."""
    if wrapper_pyz is not None and not os.path.isfile(wrapper_pyz):
        raise InvalidArgument(f"wrapper zipapp {wrapper_pyz} not found", hint="the agent image ships it")
    source = Bundle.load(bundle)
    # before anything is written: a containerd this cannot serve leaves the node as it was
    version = containerd_version if containerd_version is not None else ask_containerd_version(settings)
    content = dropin_toml(settings, version)
    os.makedirs(settings.wrapper_dir, exist_ok=True)
    os.makedirs(settings.state_dir, mode=0o700, exist_ok=True)
    private.restrict_top(settings.state_dir)  # an older agent's staged/ and restored/ were 0755
    installed = _copy_bundle(source, wrapper_pyz, settings)
    os.makedirs(tools_dir(settings), exist_ok=True)
    configs = launch_configs(settings, installed)
    for entry in os.listdir(tools_dir(settings)):  # tools an older bundle had and this one has not
        if os.path.join(tools_dir(settings), entry.removesuffix(".launch")) not in configs:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(tools_dir(settings), entry))
    for launcher, config in configs.items():
        _write_if_changed(f"{launcher}.launch", json.dumps(config, indent=1, sort_keys=True) + "\n", 0o644)
        _install_file(installed.file("launcher"), launcher, 0o755)
    facts = {
        "bundle": installed.path,
        "digest": installed.meta.get("digest", ""),
        "criu": {**installed.part("criu"), "launcher": settings.criu},
        "python": installed.part("python"),
        "libc": installed.meta.get("libc", ""),
        "tools": {
            name: {**tool, "launcher": os.path.join(tools_dir(settings), name)}
            for name, tool in sorted(installed.part("tools").items())
        },
        "network": installed.meta.get("network", ""),
        "hook": {"launcher": settings.wrapper_launcher, "zipapp": installed.file(PYZ_NAME)},
        "from": "agent image " + os.environ.get("KUBECTL_SNAPSHOT_IMAGE", "(unknown)"),
        "installed": T.rfc3339(time.time()),
    }
    _write_if_changed(os.path.join(settings.wrapper_dir, INSTALL_FACTS), json.dumps(facts, indent=1) + "\n", 0o644)
    for entry in os.listdir(settings.wrapper_dir):  # older bundles, and the zipapp of the python3 launcher era
        path = os.path.join(settings.wrapper_dir, entry)
        if (entry.startswith("bundle-") and path != installed.path) or entry == PYZ_NAME:
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
    os.makedirs(settings.containerd_dropin_dir, exist_ok=True)
    dropin_file = dropin_path(settings)
    changed = _write_if_changed(dropin_file, content, 0o644)
    restarted = False
    if changed and settings.restart_command:
        _run_on_host(settings.restart_command.replace("{node}", settings.node))
        restarted = True
    # The probe runs the installed CRIU here (same path inside the agent's container): no host shell.
    conf = criu_config.ensure(_host_path(settings.criu_config), criu=settings.criu)
    # Regenerated on every install (a new CRIU build gets its own cache); runs in the host's mount namespace.
    kdat = criu_kdat.ensure(settings.criu, kdat=settings.criu_kdat, host_pid=host_pid()) if settings.criu_kdat else None
    expedite = rcu.prepare(settings.state_dir, enable=rcu.enabled(os.environ))
    # before the agent's container starts (its host path mount of the area's base includes it)
    work_fs = None
    if settings.memory_work_fs:
        work_fs = workfs.ensure(memwork.area_dir(settings.state_dir), memwork.limit_bytes(), host_pid=host_pid())
    return InstallResult(
        settings.wrapper_launcher, dropin_file, changed, restarted, conf, installed.path, settings.criu, kdat, expedite,
        work_fs,
    )  # fmt: skip


def uninstall(settings: NodeSettings) -> None:
    dropin_file = dropin_path(settings)
    existed = os.path.exists(dropin_file)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(dropin_file)
    shutil.rmtree(settings.wrapper_dir, ignore_errors=True)
    criu_config.remove(_host_path(settings.criu_config))
    with contextlib.suppress(OSError):
        rcu.prepare(settings.state_dir, enable=False)  # a switch our holders left on is put back
    if settings.memory_work_fs:
        workfs.remove(memwork.area_dir(settings.state_dir), host_pid=host_pid())  # the area's tmpfs, then the area
    memwork.remove_area(_host_path(memwork.area_dir(settings.state_dir)))  # dumps in memory (none unless killed)
    if settings.criu_kdat:
        criu_kdat.remove(kdat=settings.criu_kdat, host_pid=host_pid())
    if existed and settings.restart_command:
        _run_on_host(settings.restart_command.replace("{node}", settings.node))


def _host_path(path: str) -> str:
    """A host path as this process reaches it: through the host's mount namespace when in a container."""
    pid = host_pid()
    return f"/proc/{pid}/root{path}" if pid else path


def _in_host_mounts(pid: int | None) -> list[str]:
    """The command prefix that enters the host's mount namespace (nothing when not in a container)."""
    return ["nsenter", "-t", str(pid), "-m", "--"] if pid else []


def _run_on_host(command: str) -> None:
    """Run a shell command in the host's namespaces (the agent runs with hostPID and privileges)."""
    pid = host_pid()
    prefix = _in_host_mounts(pid)
    # Leave this container's cgroups first (join the host process's): whatever the command starts
    # (a new containerd) must not die with the init container when the kubelet cleans it up.
    escape = (
        f'while IFS=: read -r _ ctrl path; do d="/sys/fs/cgroup/${{ctrl#name=}}"; '
        f'[ -z "$ctrl" ] && d=/sys/fs/cgroup/unified; [ -d "$d" ] || d="/sys/fs/cgroup"; '
        f'echo $$ > "$d$path/cgroup.procs" 2>/dev/null || true; done < /proc/{pid}/cgroup; '
        if pid
        else ""
    )
    proc = subprocess.run(
        [*prefix, "sh", "-c", escape + command], capture_output=True, text=True, timeout=300, check=False
    )
    if proc.returncode != 0:
        raise FailedPrecondition(
            f"restarting containerd failed ({proc.returncode}): {proc.stderr.strip()[-500:]}",
            hint="restart the node's containerd by hand to activate the kubectl-snapshot runtime handler",
        )
