#!/usr/bin/env python3
"""Build the node agent's OCI image offline and push it (the engine behind hack/build-agent-image.sh).

No Docker engine and no base image registry exist on the project's machines, so the image is put
together from parts this machine can make (Containerfile is the same recipe for normal tools):

1. base layer: ``debootstrap --variant=minbase bookworm`` + python3, ca-certificates and iproute2, without docs,
   locales, apt lists and logs; cached under /var/cache/kubectl-snapshot/agent-image/ keyed by its
   recipe, so it is built once per machine (a few minutes) and its digest stays the same;
2. app layer: a venv at /usr/local/lib/kubectl-snapshot/venv (the base's python3 3.11) holding the project's
   wheel and its runtime dependencies as cp311 manylinux wheels from PyPI, pinned to the versions of
   the project's .venv (what the tests ran with), Debian's pycriu copied in (it is not on PyPI), the
   entry points, bytecode (unchecked-hash: reproducible, never rewritten at start), and the runtime
   wrapper zipapp at /opt/kubectl-snapshot-runc.pyz (hack/build-wrapper-pyz.py), and the node bundle at
   /usr/local/lib/kubectl-snapshot/node-bundle (hack/node_bundle.py: CRIU 4.2.1, GNU tar and a Python with their
   own dynamic loader and libraries, the hook zipapp, the static launcher built from launcher),
   which `install-node` copies to each node so that nothing of the host's userland is used there;
   CRIU and Python come from this machine (CRIU 4.2.1 from Debian sid, as hack/install-node-deps.sh
   installs it), the launcher is built with the Go toolchain (CGO_ENABLED=0, static);
3. config ``Entrypoint ["ks-agent"]``, PATH with the venv's bin; layers zstd-compressed. ``bin/ks-agent`` is
   the static launcher in front of the Python program (``libexec/ks-agent``): it sends a `checkpoint` or
   `restore` to the node's warm agent itself, without an interpreter (launcher/agentclient.go).

Layers are reproducible (sorted entries, mtime 0), and the whole image is cached by a key over the
recipe, the base, the pinned requirements and the project's sources: nothing is rebuilt unless one
of them changed. Pushing skips blobs the registry has; it prints ``REF@sha256:...``.

Usage (root): hack/agent_image.py IMAGE_REF [--layout DIR] [--no-push]
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import zstandard  # noqa: E402

from kubectl_snapshot.adapters.registry import CredentialStore, RegistryClient  # noqa: E402
from kubectl_snapshot.core.errors import SnapshotError  # noqa: E402
from kubectl_snapshot.core.reference import Reference  # noqa: E402

RECIPE = "1"
CACHE = Path(os.environ.get("KUBECTL_SNAPSHOT_CACHE", "/var/cache/kubectl-snapshot")) / "agent-image"
MIRROR = os.environ.get("KUBECTL_SNAPSHOT_DEBIAN_MIRROR", "http://deb.debian.org/debian")
SUITE = "bookworm"
PACKAGES = ("python3", "ca-certificates", "iproute2")  # ip: CRIU dumping a network namespace (the nftables probe)
PY = "python3.11"
VENV = "/usr/local/lib/kubectl-snapshot/venv"  # not under /opt/kubectl-snapshot: the DaemonSet mounts the host's there
WRAPPER = "/opt/kubectl-snapshot-runc.pyz"
AGENT_CLIENT = "ks-agent"  # the launcher in bin/, the Python program in libexec/ (install_agent_client)
PYCRIU = Path("/usr/lib/python3/dist-packages/pycriu")
PATH = f"{VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar+zstd"
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
DROP = (
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "usr/share/lintian",
    "var/cache/apt",
    "var/lib/apt/lists",
    "var/log",
    "debootstrap",
)
SOURCES = (
    "kubectl_snapshot",
    "shim",
    "pyproject.toml",
    "hack/build-wrapper-pyz.py",
    "hack/import_closure.py",
    "hack/agent_image.py",
    "hack/node_bundle.py",
    "launcher",
)
NODE_BUNDLE = "/usr/local/lib/kubectl-snapshot/node-bundle"
# What the node bundle is made of on this machine (hack/node_bundle.py takes them from /): in the cache key.
BUNDLE_INPUTS = ("/usr/sbin/criu", "/usr/bin/python3", "/lib/x86_64-linux-gnu/libc.so.6", "/usr/bin/tar")


def log(msg: str) -> None:
    print(f"[agent-image] {msg}", file=sys.stderr, flush=True)


def run(*cmd: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
        raise SystemExit(f"error: {' '.join(cmd[:4])} ... failed ({proc.returncode}):\n{tail}")
    return proc


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@contextmanager
def locked(name: str) -> Iterator[None]:
    """One build per cache entry at a time (two test sessions, CI and a developer)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


# --- layers ------------------------------------------------------------------------------------


def _normalize(ti: tarfile.TarInfo) -> tarfile.TarInfo | None:
    if ti.isdev() or ti.isfifo():
        return None  # the runtime provides /dev
    ti.mtime = 0
    ti.uname = ti.gname = ""
    ti.pax_headers = {}
    return ti


def write_layer(root: Path, out: Path, *, prefix: str = "") -> str:
    """zstd tar of `root` (sorted, normalized) at `out`; returns the diff_id (sha256 of the tar)."""
    paths: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        paths.extend(Path(dirpath) / n for n in dirnames)
        paths.extend(Path(dirpath) / n for n in filenames)
    paths.sort(key=lambda p: str(p.relative_to(root)))

    class Tee(io.RawIOBase):
        def __init__(self, sink: Any) -> None:
            self.sink, self.hash = sink, hashlib.sha256()

        def writable(self) -> bool:
            return True

        def write(self, b: Any) -> int:
            self.hash.update(b)
            self.sink.write(b)
            return len(b)

    cctx = zstandard.ZstdCompressor(level=6, threads=-1, write_checksum=True)
    with out.open("wb") as f, cctx.stream_writer(f, closefd=False) as zw:
        tee = Tee(zw)
        with tarfile.open(fileobj=tee, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for p in paths:
                tar.add(p, arcname=prefix + str(p.relative_to(root)), recursive=False, filter=_normalize)
    return "sha256:" + tee.hash.hexdigest()


def base_layer() -> tuple[Path, str]:
    """The cached Debian base layer (built with debootstrap the first time)."""
    recipe = {"recipe": RECIPE, "suite": SUITE, "variant": "minbase", "packages": PACKAGES, "mirror": MIRROR}
    key = "base-" + sha256_hex(json.dumps(recipe, sort_keys=True).encode())[:16]
    layer, meta = CACHE / f"{key}.tar.zst", CACHE / f"{key}.json"
    with locked(key):
        if layer.exists() and meta.exists():
            return layer, json.loads(meta.read_text())["diff_id"]
        if shutil.which("debootstrap") is None:
            raise SystemExit("error: debootstrap is missing\nhint: apt-get install debootstrap")
        log(f"debootstrap {SUITE} minbase + {', '.join(PACKAGES)} (once per machine, a few minutes)")
        with tempfile.TemporaryDirectory(dir=CACHE, prefix=".base-") as tmp:
            rootfs = Path(tmp, "rootfs")
            run("debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", SUITE, str(rootfs), MIRROR)
            for p in DROP:
                shutil.rmtree(rootfs / p, ignore_errors=True)
            for cache in rootfs.glob("var/cache/ldconfig/*"):
                cache.unlink()
            (rootfs / "var/log").mkdir()
            partial = layer.with_suffix(".partial")
            diff_id = write_layer(rootfs, partial)
            partial.rename(layer)
            meta.write_text(json.dumps({"diff_id": diff_id, "recipe": recipe}))
        return layer, diff_id


# --- the app layer -----------------------------------------------------------------------------


def requirements() -> tuple[list[str], list[str]]:
    """(the project's runtime requirements, constraints pinning them to the tested .venv's versions)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    freeze = run(sys.executable, "-m", "pip", "freeze", "--exclude-editable").stdout.splitlines()
    pins = sorted(line for line in freeze if "==" in line and not line.startswith(("-", "kubectl-snapshot")))
    return list(project["dependencies"]), pins


def wheels(reqs: list[str], pins: list[str]) -> Path:
    """cp311 manylinux wheels of the runtime dependencies (cached by requirements + pins)."""
    key = "wheels-" + sha256_hex(json.dumps([RECIPE, reqs, pins]).encode())[:16]
    out = CACHE / key
    with locked(key):
        if (out / ".complete").exists():
            return out
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        constraints = out / "constraints.txt"
        constraints.write_text("\n".join(pins) + "\n")
        log("downloading cp311 manylinux wheels from PyPI")
        run(
            sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(out), "--only-binary=:all:",
            "--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_17_x86_64",
            "--platform", "manylinux_2_28_x86_64", "--python-version", "3.11", "--implementation", "cp",
            "--abi", "cp311", "--abi", "abi3", "--abi", "none", "-c", str(constraints), *reqs,
        )  # fmt: skip
        (out / ".complete").write_text("")
    return out


def source_hash() -> str:
    h = hashlib.sha256()
    for top in SOURCES:
        base = REPO / top
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file())
        for p in files:
            if "__pycache__" in p.parts or p.suffix == ".pyc":
                continue
            h.update(str(p.relative_to(REPO)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def bundle_inputs_hash() -> str:
    h = hashlib.sha256()
    for p in BUNDLE_INPUTS:
        path = Path(p).resolve()
        h.update(str(path).encode() + b"\0" + (path.read_bytes() if path.is_file() else b"missing") + b"\0")
    return h.hexdigest()


def build_launcher(out: Path) -> None:
    """The static launcher (launcher): no libc, no interpreter, runs on any Linux host as it is."""
    go = shutil.which("go") or "/usr/local/go/bin/go"
    env = {**os.environ, "CGO_ENABLED": "0", "GOTOOLCHAIN": "local"}
    run(
        go, "build", "-trimpath", "-ldflags", "-s -w -buildid=", "-o", str(out), ".",
        cwd=str(REPO / "launcher"), env=env,
    )  # fmt: skip


def install_agent_client(venv: Path, launcher: Path) -> None:
    """bin/ks-agent as the static launcher in front of the Python ks-agent (libexec/ks-agent): a served
    `checkpoint` or `restore` goes to the node's agent without starting an interpreter
    (launcher/agentclient.go); everything else, and those where the agent does not serve them, runs
    the Python program as before."""
    from shim.service import localapi

    client = venv / "bin" / AGENT_CLIENT
    shutil.copyfile(launcher, client)
    client.chmod(0o755)
    Path(f"{client}.launch").write_text(
        localapi.client_launch([f"{VENV}/bin/python3", f"{VENV}/libexec/{AGENT_CLIENT}"])
    )


def _entry_points() -> dict[str, str]:
    return dict(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"])


def build_app_tree(root: Path, wheel_dir: Path) -> None:
    """The venv, the project, pycriu and the wrapper zipapp under `root` (an empty dir = image /)."""
    venv = root / VENV.lstrip("/")
    site = venv / "lib" / PY / "site-packages"
    (venv / "bin").mkdir(parents=True)
    site.mkdir(parents=True)
    # A venv is a pyvenv.cfg beside bin/python -> the base's interpreter; no pip inside the image.
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\ninclude-system-site-packages = false\nversion = 3.11\n")
    (venv / "bin" / "python3").symlink_to("/usr/bin/python3")
    (venv / "bin" / "python").symlink_to("python3")
    with tempfile.TemporaryDirectory() as tmp:
        run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", tmp, str(REPO))
        project_wheel = next(Path(tmp).glob("kubectl_snapshot-*.whl"))
        run(
            sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--no-compile",
            "--target", str(site), str(project_wheel), *map(str, sorted(wheel_dir.glob("*.whl"))),
        )  # fmt: skip
    shutil.rmtree(site / "bin", ignore_errors=True)  # scripts pip wrote for --target (wrong shebang)
    if not PYCRIU.is_dir():
        raise SystemExit(f"error: {PYCRIU} is missing\nhint: run hack/install-node-deps.sh (python3-pycriu)")
    shutil.copytree(PYCRIU, site / "pycriu", ignore=shutil.ignore_patterns("__pycache__"))
    for name, target in _entry_points().items():
        module, _, func = target.partition(":")
        # ks-agent is the launcher (below); its Python program lives in libexec under the same name
        script = venv / ("libexec" if name == AGENT_CLIENT else "bin") / name
        script.parent.mkdir(exist_ok=True)
        script.write_text(
            f"#!{VENV}/bin/python3\nimport sys\nfrom {module} import {func}\n\nif __name__ == '__main__':\n"
            f"    sys.exit({func}())\n"
        )
        script.chmod(0o755)
    for p in site.rglob("*.dist-info/RECORD"):
        p.write_text("")  # pip's RECORD lists build-machine paths for scripts; nothing uninstalls here
    run(
        sys.executable, "-m", "compileall", "-q", "-j", "0", "--invalidation-mode", "unchecked-hash",
        "-s", str(root), "-p", "/", str(site),
    )  # fmt: skip
    wrapper = root / WRAPPER.lstrip("/")
    host_python = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
    run(host_python, str(REPO / "hack" / "build-wrapper-pyz.py"), str(wrapper))
    with tempfile.TemporaryDirectory() as tmp:
        launcher = Path(tmp, "launcher")
        build_launcher(launcher)
        install_agent_client(venv, launcher)
        log("node bundle: CRIU, python and their loader and libraries from this machine")
        run(
            host_python, str(REPO / "hack" / "node_bundle.py"), str(root / NODE_BUNDLE.lstrip("/")),
            "--launcher", str(launcher), "--pyz", str(wrapper), "--hook-site", str(site),
        )  # fmt: skip


# --- image -------------------------------------------------------------------------------------


def _put(blobs: Path, data: bytes, media_type: str) -> dict[str, Any]:
    digest = sha256_hex(data)
    (blobs / digest).write_bytes(data)
    return {"mediaType": media_type, "digest": "sha256:" + digest, "size": len(data)}


def _put_file(blobs: Path, path: Path, media_type: str) -> dict[str, Any]:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    dest = blobs / h.hexdigest()
    if not dest.exists():
        try:
            os.link(path, dest)  # the cached base layer: shared by every image layout, not copied
        except OSError:
            shutil.copyfile(path, dest)
    return {"mediaType": media_type, "digest": "sha256:" + h.hexdigest(), "size": path.stat().st_size}


def build_image() -> Path:
    """An OCI layout dir for the current sources (cached); returns it."""
    base, base_diff = base_layer()
    reqs, pins = requirements()
    wheel_dir = wheels(reqs, pins)
    inputs = [RECIPE, base_diff, reqs, pins, source_hash(), bundle_inputs_hash()]
    key = "image-" + sha256_hex(json.dumps(inputs).encode())[:16]
    layout = CACHE / key
    with locked(key):
        if (layout / "index.json").exists():
            log(f"cached: {layout}")
            return layout
        log("building the app layer")
        with tempfile.TemporaryDirectory(dir=CACHE, prefix=".app-") as tmp:
            tree = Path(tmp, "tree")
            tree.mkdir()
            build_app_tree(tree, wheel_dir)
            app = Path(tmp, "app.tar.zst")
            app_diff = write_layer(tree, app)
            staging = Path(tmp, "layout")
            blobs = staging / "blobs" / "sha256"
            blobs.mkdir(parents=True)
            layers = [_put_file(blobs, base, LAYER_TYPE), _put_file(blobs, app, LAYER_TYPE)]
            config = {
                "architecture": "amd64",
                "os": "linux",
                "created": "1970-01-01T00:00:00Z",
                "config": {
                    "Entrypoint": ["ks-agent"],
                    "Env": [f"PATH={PATH}", "PYTHONDONTWRITEBYTECODE=1", "LANG=C.UTF-8"],
                    "Labels": {"org.opencontainers.image.title": "kubectl-snapshot-agent"},
                },
                "rootfs": {"type": "layers", "diff_ids": [base_diff, app_diff]},
                "history": [
                    {"created": "1970-01-01T00:00:00Z", "created_by": f"debootstrap {SUITE} {' '.join(PACKAGES)}"},
                    {
                        "created": "1970-01-01T00:00:00Z",
                        "created_by": "hack/agent_image.py: venv, wrapper, node bundle",
                    },
                ],
            }
            cfg = _put(blobs, json.dumps(config, sort_keys=True).encode(), CONFIG_TYPE)
            manifest = {"schemaVersion": 2, "mediaType": MANIFEST_TYPE, "config": cfg, "layers": layers}
            man = _put(blobs, json.dumps(manifest, sort_keys=True).encode(), MANIFEST_TYPE)
            (staging / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
            (staging / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [man]}))
            staging.rename(layout)
    prune(keep=layout)
    return layout


def prune(keep: Path, count: int = 3) -> None:
    """Delete all but the newest `count` image layouts (each source change makes one)."""
    layouts = sorted(CACHE.glob("image-*/index.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    for index in layouts[count:]:
        if index.parent != keep:
            shutil.rmtree(index.parent, ignore_errors=True)


def push(layout: Path, image_ref: str) -> str:
    ref = Reference.parse(image_ref)
    index = json.loads((layout / "index.json").read_text())
    man_desc = index["manifests"][0]
    blobs = layout / "blobs" / "sha256"
    manifest_bytes = (blobs / man_desc["digest"].split(":", 1)[1]).read_bytes()
    manifest = json.loads(manifest_bytes)
    client = RegistryClient(credentials=CredentialStore.from_docker_config(None))
    for desc in [manifest["config"], *manifest["layers"]]:
        path = blobs / desc["digest"].split(":", 1)[1]
        if client.push_blob(ref, digest=desc["digest"], size=desc["size"], path=str(path)):
            log(f"pushed {desc['digest'][:19]} ({desc['size']} bytes)")
    digest = client.push_manifest(ref, manifest_bytes, MANIFEST_TYPE)
    return f"{ref.registry}/{ref.repository}@{digest}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("image_ref", help="REGISTRY/REPO:TAG to push to")
    parser.add_argument("--no-push", action="store_true", help="only build (prints the OCI layout dir)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit("error: building the agent image needs root (debootstrap)\nhint: sudo " + sys.argv[0])
    layout = build_image()
    try:
        print(layout if args.no_push else push(layout, args.image_ref))
    except SnapshotError as e:
        print(f"error: {e}" + (f"\nhint: {e.hint}" if e.hint else ""), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
