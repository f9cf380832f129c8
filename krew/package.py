#!/usr/bin/env python3
"""Build the krew release of the plugin: `kubectl-snapshot` as one zipapp, its archive and manifest.

Why a zipapp with vendored pure-Python dependencies: krew installs a file and puts it on PATH; the
user's machine has a python3 but none of our packages. Everything the plugin imports (click,
kubernetes and its closure, requests, pyyaml, tqdm) has a pure-Python form, so one platform-independent
file serves Linux and macOS. Node-only dependencies (grpcio, protobuf, zstandard, blake3, prometheus-client),
cryptography (compiled; the plugin asks for it where it signs or verifies) and the asyncio client's
aiohttp are left out; compiled extension files are dropped (pyyaml and charset-normalizer fall
back to their pure-Python modules).

The dependency files are copied from the installed distributions of the Python running this script
(the project venv), so the build is offline and reproducible: sorted entries, fixed timestamps, and
the archive's sha256 only changes when the inputs do.

Usage: .venv/bin/python krew/package.py [--out DIR] [--version vX.Y.Z] [--uri-base URL]
Writes DIR/kubectl-snapshot (the zipapp), DIR/kubectl-snapshot-VERSION.tar.gz and DIR/snapshot.yaml.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.metadata as md
import importlib.util
import io
import re
import sys
import tarfile
import zipfile
from importlib._bootstrap_external import _code_to_hash_pyc  # type: ignore[attr-defined]
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "hack"))
from import_closure import closure as module_closure  # noqa: E402  (hack/import_closure.py)

ENTRY = "kubectl_snapshot.cli.main"  # what __main__.py runs (MAIN below)
PROJECT = "kubectl-snapshot"
BIN = "kubectl-snapshot"
COMPLETE = "kubectl_complete-snapshot"
# kubectl (>= 1.26) runs kubectl_complete-snapshot from PATH for TAB after `kubectl snapshot`; krew links
# only `bin`, so the caveats tell how to link this one too. It asks the plugin through kubectl itself.
COMPLETE_SCRIPT = b"""#!/bin/sh
# kubectl's plugin completion for `kubectl snapshot` (see `kubectl snapshot completion --help`)
exec kubectl snapshot __complete "$@"
"""
PLUGIN = "snapshot"
EXCLUDED = {
    "grpcio",
    "protobuf",
    "zstandard",
    "blake3",  # compiled: page hashes, the node agent only
    "aiohttp",
    "grpcio-tools",
    "google-auth",
    "prometheus-client",  # the node agent only
    "cryptography",  # compiled: the agent (metrics certificate, encryption, signatures); the plugin asks for it
    "cffi",
    "pycparser",
}
DROP_SUFFIXES = (".so", ".pyd", ".dylib", ".pyc", ".pyi")
EPOCH = (1980, 1, 1, 0, 0, 0)
MIN_PYTHON = (3, 11)
MAIN = f'''"""kubectl-snapshot, the kubectl plugin, as a zipapp (built by krew/package.py)."""
import sys

if sys.version_info < {MIN_PYTHON!r}:
    sys.stderr.write(
        "error: kubectl-snapshot needs Python {MIN_PYTHON[0]}.{MIN_PYTHON[1]} or newer, this is %d.%d\\n"
        "hint: install a newer python3 and put it first on PATH\\n" % sys.version_info[:2]
    )
    sys.exit(1)

from {ENTRY} import entry

entry()
'''


def _requirement(req: str) -> tuple[str, bool]:
    """(name, applies): markers are evaluated for this (Linux/macOS) Python with no extras."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip vendors it
        from pip._vendor.packaging.requirements import Requirement  # type: ignore[assignment]
    parsed = Requirement(req)
    applies = parsed.marker is None or parsed.marker.evaluate({"extra": ""})
    return parsed.name, bool(applies)


def _installed(name: str) -> bool:
    try:
        md.distribution(name)
    except md.PackageNotFoundError:
        return False
    return True


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure() -> list[str]:
    """The installed distributions the plugin needs (its requirements, recursively, minus EXCLUDED)."""
    seen: set[str] = set()
    todo = [PROJECT]
    while todo:
        name = todo.pop()
        if _norm(name) in seen or _norm(name) in EXCLUDED:
            continue
        seen.add(_norm(name))
        for req in md.requires(name) or []:
            dep, applies = _requirement(req)
            if not applies:
                continue
            if not _installed(dep):
                raise SystemExit(f"error: {name} needs {dep}, which is not installed in {sys.prefix}")
            todo.append(dep)
    seen.discard(_norm(PROJECT))
    return sorted(seen)


def dist_files(name: str) -> dict[str, Path]:
    """arcname -> file for one distribution: its modules and data, no metadata, bytecode or binaries."""
    dist = md.distribution(name)
    out: dict[str, Path] = {}
    for f in dist.files or []:
        arc = str(f).replace("\\", "/")
        top = arc.split("/", 1)[0]
        if arc.startswith("..") or top.endswith((".dist-info", ".egg-info", ".data")) or "__pycache__" in arc:
            continue
        if arc.endswith(DROP_SUFFIXES) or top == "bin":
            continue
        path = Path(str(dist.locate_file(f)))
        if path.is_file():
            out[arc] = path
    return out


def project_files() -> dict[str, Path]:
    """The plugin's own files: the modules `kubectl_snapshot.cli.main` imports, directly or not
    (hack/import_closure.py), and the package's data; nothing of the node side, nor the library
    modules only the agent uses."""
    modules = module_closure([ENTRY], REPO)
    data = [
        p.relative_to(REPO)
        for p in (REPO / "kubectl_snapshot").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith((".py", *DROP_SUFFIXES))
    ]
    return {rel.as_posix(): REPO / rel for rel in sorted([*modules, *data])}


def _add(z: zipfile.ZipFile, arc: str, data: bytes) -> None:
    info = zipfile.ZipInfo(arc, date_time=EPOCH)
    info.external_attr = 0o644 << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    z.writestr(info, data)


def _bytecode(arc: str, source: bytes) -> bytes | None:
    """Unchecked-hash bytecode beside each module: zipimport cannot cache compiled modules, and
    compiling the kubernetes client on every run costs seconds. A Python with another magic number
    ignores it and compiles the source."""
    try:
        code = compile(source, arc, "exec", dont_inherit=True)
        return bytes(_code_to_hash_pyc(code, importlib.util.source_hash(source), False))
    except (SyntaxError, ValueError):
        return None


def build_zipapp(out: Path) -> list[str]:
    """Write the zipapp; returns the vendored distributions."""
    files: dict[str, Path] = {}
    deps = closure()
    for dep in deps:
        files.update(dist_files(dep))
    files.update(project_files())
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        entries = {"__main__.py": MAIN.encode(), **{arc: p.read_bytes() for arc, p in files.items()}}
        for arc in sorted(entries):
            _add(z, arc, entries[arc])
            code = _bytecode(arc, entries[arc]) if arc.endswith(".py") else None
            if code is not None:
                _add(z, arc + "c", code)
    out.write_bytes(b"#!/usr/bin/env python3\n" + buf.getvalue())
    out.chmod(0o755)
    return deps


def build_archive(zipapp: Path, out: Path) -> None:
    """A reproducible tar.gz holding the zipapp, the completion helper and the license."""
    license_file = REPO / "LICENSE"
    if not license_file.exists():
        raise SystemExit(f"error: {license_file} is missing (krew-index requires a license in the archive)")
    members = [(BIN, zipapp.read_bytes(), 0o755), (COMPLETE, COMPLETE_SCRIPT, 0o755)]
    members.append(("LICENSE", license_file.read_bytes(), 0o644))
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, mode in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime, info.uname, info.gname = len(data), mode, 0, "root", "root"
            tar.addfile(info, io.BytesIO(data))
    with out.open("wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0) as gz:
        gz.write(raw.getvalue())


def manifest(version: str, uri: str, sha256: str) -> dict[str, object]:
    files = [{"from": BIN, "to": "."}, {"from": COMPLETE, "to": "."}, {"from": "LICENSE", "to": "."}]
    return {
        "apiVersion": "krew.googlecontainertools.github.com/v1alpha2",
        "kind": "Plugin",
        "metadata": {"name": PLUGIN},
        "spec": {
            "version": version,
            "homepage": "https://github.com/kubectl-snapshot/kubectl-snapshot",
            "shortDescription": "Snapshot running pods with CRIU and restore them anywhere",
            "description": (
                "A save game for pods: `kubectl snapshot pod/NAME` freezes a running pod for a moment,\n"
                "captures its memory, processes, files and emptyDir volumes as an OCI artifact in a\n"
                "registry, and `kubectl snapshot restore` brings it back on any node. Needs the\n"
                "kubectl-snapshot node agent (`kubectl snapshot install`) and python3 >= 3.11.\n"
            ),
            "caveats": (
                "The plugin needs python3 (3.11 or newer) on PATH.\n"
                "Install the node agent once per cluster: kubectl snapshot install --agent-image IMAGE\n"
                "For `kubectl snapshot <TAB>` (kubectl >= 1.26 completion), link the completion helper:\n"
                f'  ln -sf "${{KREW_ROOT:-$HOME/.krew}}/store/snapshot/{version}/{COMPLETE}" \\\n'
                '     "${KREW_ROOT:-$HOME/.krew}/bin/"\n'
            ),
            "platforms": [
                {
                    "selector": {"matchExpressions": [{"key": "os", "operator": "In", "values": ["linux", "darwin"]}]},
                    "uri": uri,
                    "sha256": sha256,
                    "bin": BIN,
                    "files": files,
                }
            ],
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "dist" / "krew")
    ap.add_argument("--version", default="v" + md.version(PROJECT))
    ap.add_argument("--uri-base", default="https://github.com/kubectl-snapshot/kubectl-snapshot/releases/download")
    args = ap.parse_args(argv)
    if not re.match(r"^v\d+\.\d+\.\d+", args.version):
        ap.error("--version must look like v1.2.3 (krew requires a semantic version with a leading v)")
    args.out.mkdir(parents=True, exist_ok=True)
    zipapp = args.out / BIN
    deps = build_zipapp(zipapp)
    archive = args.out / f"{BIN}-{args.version}.tar.gz"
    build_archive(zipapp, archive)
    sha = hashlib.sha256(archive.read_bytes()).hexdigest()
    uri = f"{args.uri_base.rstrip('/')}/{args.version}/{archive.name}"
    doc = manifest(args.version, uri, sha)
    (args.out / f"{PLUGIN}.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    print(f"{archive} sha256:{sha} ({len(deps)} vendored distributions: {', '.join(deps)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
