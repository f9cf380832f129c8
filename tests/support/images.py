"""Test images built from Debian packages on this machine, as OCI layout tarballs (no registry, no internet).

- ``busybox_image(daemon)``: /bin/busybox from busybox-static plus symlinks for all its applets.
- ``python_image(daemon)``: a Debian bookworm minbase rootfs with python3 (debootstrap from
  deb.debian.org, once per machine), plus busybox for the shell tools.

Each tarball is cached under /var/cache/kubectl-snapshot/images/ (``KUBECTL_SNAPSHOT_CACHE``) under a
key hashing the recipe and its inputs, and is built reproducibly (sorted entries, mtime 0, root-owned),
so the image digest is stable for as long as the inputs do not change. Importing uses
``ctr images import``, which also unpacks the layers into the daemon's overlayfs snapshotter.

Prewarm the cache (slow the first time, seconds afterwards): ``python -m tests.support.images``.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import pytest

RECIPE_VERSION = "2"
CACHE_DIR = Path(os.environ.get("KUBECTL_SNAPSHOT_CACHE", "/var/cache/kubectl-snapshot")) / "images"
BUSYBOX = Path("/bin/busybox")
BUSYBOX_IMAGE = "localhost/kubectl-snapshot-test/busybox:1"
PYTHON_IMAGE = "localhost/kubectl-snapshot-test/python:1"
DEBIAN_MIRROR = "http://deb.debian.org/debian"

_imported: set[tuple[str, str, str]] = set()


class Daemon(Protocol):
    """What importing needs from a containerd test daemon (see tests.support.containerd)."""

    @property
    def address(self) -> str: ...

    @property
    def namespace(self) -> str: ...

    @property
    def ctr(self) -> str: ...


# --- reproducible OCI layout -------------------------------------------------------------------


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _normalize(ti: tarfile.TarInfo) -> tarfile.TarInfo | None:
    if ti.isdev() or ti.isfifo():
        return None  # runtime creates /dev; device nodes in layers need privileges on unpack
    ti.mtime = 0
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    ti.pax_headers = {}
    return ti


def _layer_from_dir(root: Path, out: Path) -> None:
    """An uncompressed layer tar of `root`, entries sorted and metadata normalized (reproducible)."""
    with tarfile.open(out, "w", format=tarfile.GNU_FORMAT) as tar:
        paths: list[Path] = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            paths.extend(Path(dirpath) / n for n in dirnames)
            paths.extend(Path(dirpath) / n for n in filenames)
        for p in sorted(paths, key=lambda p: str(p.relative_to(root))):
            tar.add(p, arcname=str(p.relative_to(root)), recursive=False, filter=_normalize)


def _write_oci_layout(layer_tar: Path, out: Path, *, name: str, config_extra: dict[str, Any]) -> None:
    """An OCI layout tarball (index.json, oci-layout, blobs) of a one-layer linux/amd64 image."""
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        blobs = Path(tmp, "blobs", "sha256")
        blobs.mkdir(parents=True)
        # Uncompressed layer: containerd unpacks it without a gunzip pass (test images are local anyway).
        diff_id = _sha256_file(layer_tar)
        shutil.copyfile(layer_tar, blobs / diff_id)
        layer_digest = diff_id

        def put(doc: dict[str, Any]) -> tuple[str, int]:
            data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
            digest = hashlib.sha256(data).hexdigest()
            (blobs / digest).write_bytes(data)
            return "sha256:" + digest, len(data)

        config = {
            "architecture": "amd64",
            "os": "linux",
            "created": "1970-01-01T00:00:00Z",
            "config": config_extra,
            "rootfs": {"type": "layers", "diff_ids": ["sha256:" + diff_id]},
            "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "tests/support/images.py"}],
        }
        cfg_digest, cfg_size = put(config)
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": cfg_digest,
                "size": cfg_size,
            },
            "layers": [
                {
                    "mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": "sha256:" + layer_digest,
                    "size": (blobs / layer_digest).stat().st_size,
                }
            ],
        }
        man_digest, man_size = put(manifest)
        index = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": man_digest,
                    "size": man_size,
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {
                        "io.containerd.image.name": name,
                        "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1],
                    },
                }
            ],
        }
        Path(tmp, "index.json").write_text(json.dumps(index, sort_keys=True))
        Path(tmp, "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
        partial = out.with_suffix(".partial")
        with tarfile.open(partial, "w", format=tarfile.GNU_FORMAT) as tar:
            for p in [
                "oci-layout",
                "index.json",
                "blobs",
                "blobs/sha256",
                *sorted(f"blobs/sha256/{b.name}" for b in blobs.iterdir()),
            ]:
                tar.add(Path(tmp, p), arcname=p, recursive=False, filter=_normalize)
        partial.rename(out)


@contextmanager
def _locked(key: str) -> Iterator[None]:
    """Serialize builds of one image across processes (pytest-xdist, two sessions)."""
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with open(CACHE_DIR / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _cached(kind: str, recipe: dict[str, Any], build: Callable[[Path], dict[str, Any]], name: str) -> Path:
    key = kind + "-" + hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    out = CACHE_DIR / f"{key}.oci.tar"
    if out.exists():
        return out
    with _locked(key):
        if out.exists():
            return out
        with tempfile.TemporaryDirectory(dir=CACHE_DIR, prefix=f".{kind}-") as tmp:
            rootfs = Path(tmp, "rootfs")
            rootfs.mkdir()
            config_extra = build(rootfs)
            layer = Path(tmp, "layer.tar")
            _layer_from_dir(rootfs, layer)
            _write_oci_layout(layer, out, name=name, config_extra=config_extra)
    return out


# --- recipes -----------------------------------------------------------------------------------


def _install_busybox(rootfs: Path) -> None:
    applets = subprocess.run([str(BUSYBOX), "--list"], capture_output=True, text=True, check=True).stdout.split()
    (rootfs / "bin").mkdir(exist_ok=True)
    dst = rootfs / "bin" / "busybox"
    if not dst.exists():
        shutil.copy2(BUSYBOX, dst)
    for applet in sorted(set(applets)):
        link = rootfs / "bin" / applet
        if not link.exists() and not link.is_symlink():
            link.symlink_to("busybox")


def _busybox_recipe() -> dict[str, Any]:
    if not BUSYBOX.exists():
        pytest.skip(f"{BUSYBOX} is missing (apt-get install busybox-static; hack/install-node-deps.sh)")
    return {"recipe": RECIPE_VERSION, "busybox": _sha256_file(BUSYBOX)}


def _build_busybox(rootfs: Path) -> dict[str, Any]:
    for d in ("bin", "dev", "etc", "proc", "sys", "tmp", "root", "run", "var/tmp"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    os.chmod(rootfs / "tmp", 0o1777)
    _install_busybox(rootfs)
    (rootfs / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534::/:/bin/false\n")
    (rootfs / "etc/group").write_text("root:x:0:\nnogroup:x:65534:\n")
    return {"Env": ["PATH=/bin"], "Cmd": ["/bin/sh"]}


def _python_recipe() -> dict[str, Any]:
    recipe = _busybox_recipe()
    if shutil.which("debootstrap") is None:
        pytest.skip("debootstrap is missing (apt-get install debootstrap; hack/install-node-deps.sh)")
    recipe.update(suite="bookworm", variant="minbase", include=["python3-minimal"], mirror=DEBIAN_MIRROR)
    return recipe


def _build_python(rootfs: Path) -> dict[str, Any]:
    _debootstrap(rootfs, ["python3-minimal"])
    busybox_dir = rootfs / "opt" / "busybox"
    busybox_dir.mkdir(parents=True)
    shutil.copy2(BUSYBOX, busybox_dir / "busybox")
    return {
        "Env": [
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "PYTHONDONTWRITEBYTECODE=1",
        ],
        "Cmd": ["/usr/bin/python3"],
    }


# --- Debian images of real workloads (tests/e2e/test_conformance.py) ---------------------------------


def debian_versions(packages: list[str]) -> dict[str, str]:
    """The bookworm versions of `packages` in this host's apt lists (what debootstrap would install
    from deb.debian.org now): the cache key of an image, so a point release builds it again. Packages
    the lists do not name (no `apt-get update` yet) key as "unknown"."""
    out = {}
    for p in packages:
        proc = subprocess.run(["apt-cache", "madison", p], capture_output=True, text=True, check=False)
        versions = [
            line.split("|")[1].strip()
            for line in proc.stdout.splitlines()
            if line.count("|") >= 2 and "debian.org/debian" in line and " bookworm" in line.split("|")[2]
        ]
        out[p] = versions[0] if versions else "unknown"
    return out


def debian_tarball(
    kind: str,
    name: str,
    packages: list[str],
    *,
    files: dict[str, tuple[bytes, int]] | None = None,
    config: dict[str, Any] | None = None,
) -> Path:
    """A cached one-layer image: debootstrap bookworm minbase with `packages`, plus `files` (in-image
    path -> (content, mode)) and the image config `config` (Env, Cmd, ...). Keyed by the packages'
    versions and the files' contents."""
    if shutil.which("debootstrap") is None:
        pytest.skip("debootstrap is missing (apt-get install debootstrap; hack/install-node-deps.sh)")
    files = files or {}
    recipe = {
        "recipe": RECIPE_VERSION,
        "suite": "bookworm",
        "variant": "minbase",
        "packages": debian_versions(sorted(packages)),
        "files": {k: [hashlib.sha256(v).hexdigest(), mode] for k, (v, mode) in sorted(files.items())},
        "config": config or {},
        "mirror": DEBIAN_MIRROR,
    }

    def build(rootfs: Path) -> dict[str, Any]:
        _debootstrap(rootfs, packages)
        _write_files(rootfs, files)
        env = ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
        return {"Env": env, **(config or {})}

    return _cached(kind, recipe, build, name)


def _write_files(rootfs: Path, files: dict[str, tuple[bytes, int]]) -> None:
    for path, (content, mode) in files.items():
        target = rootfs / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
        target.chmod(mode)


def _debootstrap(rootfs: Path, packages: list[str]) -> None:
    args = ["debootstrap", "--variant=minbase"]
    if packages:
        args.append("--include=" + ",".join(sorted(packages)))
    proc = subprocess.run([*args, "bookworm", str(rootfs), DEBIAN_MIRROR], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
        raise RuntimeError(f"debootstrap failed ({proc.returncode}):\n{tail}")
    for p in (
        "var/cache/apt",
        "var/lib/apt/lists",
        "var/log",
        "debootstrap",
        "usr/share/doc",
        "usr/share/man",
        "usr/share/info",
        "usr/share/locale",
    ):
        shutil.rmtree(rootfs / p, ignore_errors=True)
    for cache in rootfs.glob("var/cache/ldconfig/*"):
        cache.unlink()


def scratch_tarball(kind: str, name: str, files: dict[str, tuple[bytes, int]], config: dict[str, Any]) -> Path:
    """An image of `files` alone: no shell, no libc, no /etc (a distroless-like image of a static binary)."""
    recipe = {
        "recipe": RECIPE_VERSION,
        "files": {k: [hashlib.sha256(v).hexdigest(), mode] for k, (v, mode) in sorted(files.items())},
        "config": config,
    }

    def build(rootfs: Path) -> dict[str, Any]:
        _write_files(rootfs, files)
        return dict(config)

    return _cached(kind, recipe, build, name)


def busybox_tarball() -> Path:
    """The cached OCI layout tarball of the busybox test image (built if missing)."""
    return _cached("busybox", _busybox_recipe(), _build_busybox, BUSYBOX_IMAGE)


def python_tarball() -> Path:
    """The cached OCI layout tarball of the python test image (debootstrap the first time: minutes)."""
    return _cached("python", _python_recipe(), _build_python, PYTHON_IMAGE)


# --- importing ---------------------------------------------------------------------------------


def import_image(daemon: Daemon, tarball: Path, name: str) -> str:
    """Import (and unpack into overlayfs) `tarball` into the daemon's namespace; returns `name`."""
    key = (daemon.address, daemon.namespace, str(tarball))
    if key in _imported:
        return name
    if not Path(daemon.ctr).exists():
        pytest.skip(f"{daemon.ctr} is missing (hack/install-node-deps.sh builds it)")
    proc = subprocess.run(
        [
            daemon.ctr,
            "--address",
            daemon.address,
            "-n",
            daemon.namespace,
            "images",
            "import",
            "--local",
            "--platform",
            "linux/amd64",
            str(tarball),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"ctr images import {tarball} failed: {proc.stderr.strip()}")
    _imported.add(key)
    return name


def busybox_image(daemon: Daemon) -> str:
    """Name of the busybox test image, imported and unpacked in `daemon`."""
    return import_image(daemon, busybox_tarball(), BUSYBOX_IMAGE)


def python_image(daemon: Daemon) -> str:
    """Name of the python3 test image, imported and unpacked in `daemon`."""
    return import_image(daemon, python_tarball(), PYTHON_IMAGE)


def push_tarball(registry: str, tarball: Path, repo: str) -> str:
    """Push a cached OCI layout tarball (one image) to `registry` as `repo` (name:tag); its reference by
    digest."""
    from kubectl_snapshot.adapters.registry import RegistryClient
    from kubectl_snapshot.core.reference import Reference

    ref = Reference.parse(f"{registry}/{repo}")
    client = RegistryClient()
    with tarfile.open(tarball) as tar:

        def blob(digest: str) -> bytes:
            f = tar.extractfile("blobs/sha256/" + digest.split(":", 1)[1])
            assert f is not None
            return f.read()

        index_file = tar.extractfile("index.json")
        assert index_file is not None
        desc = json.load(index_file)["manifests"][0]
        manifest_bytes = blob(desc["digest"])
        parsed = json.loads(manifest_bytes)
        for d in [parsed["config"], *parsed["layers"]]:
            client.push_blob(ref, digest=d["digest"], size=d["size"], data=blob(d["digest"]))
        client.push_manifest(ref, manifest_bytes, desc.get("mediaType") or parsed["mediaType"])
    return f"{registry}/{repo.rsplit(':', 1)[0]}@{desc['digest']}"


def image_digest(tarball: Path) -> str:
    """The manifest digest recorded in an OCI layout tarball (stable across cache hits)."""
    with tarfile.open(tarball) as tar:
        member = tar.extractfile("index.json")
        assert member is not None
        index = json.load(io.TextIOWrapper(member))
    return str(index["manifests"][0]["digest"])


if __name__ == "__main__":
    for build in (busybox_tarball, python_tarball):
        path = build()
        print(f"{path}  {image_digest(path)}")
