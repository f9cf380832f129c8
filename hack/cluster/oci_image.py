#!/usr/bin/env python3
"""Build a tiny single-layer OCI image from host files and push it to a local registry.

Why: the test cluster is offline (no registry.k8s.io, no Docker Hub), so its pause and busybox
images are made here from Debian's static binaries. The layer tar is deterministic (mtime 0,
root-owned, sorted), so the same inputs always give the same digests. The image is written as an
OCI layout (usable with `ctr images import`) and pushed with the plain distribution API
(monolithic blob upload, then the manifest), stdlib only so it runs before any venv exists.

Usage:
  oci_image.py --layout DIR --ref 127.0.0.1:5005/kubectl-snapshot/pause:3.10-ks \
      --file /tmp/pause:/pause --entrypoint /pause [--push]
  oci_image.py --layout DIR --ref .../busybox:1.37 --busybox /bin/busybox --cmd sh [--push]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar"


def _tarinfo(name: str, kind: bytes, mode: int, size: int = 0, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.size, info.linkname = kind, mode, size, link
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    info.mtime = 0
    return info


def build_layer(files: list[tuple[str, str]], busybox: str | None, dirs: list[str]) -> bytes:
    """Return the layer tar: DEST files copied from SRC, busybox applet links, empty dirs."""
    entries: dict[str, tuple[tarfile.TarInfo, bytes]] = {}

    def add_dir(path: str) -> None:
        parts = path.strip("/").split("/")
        for i in range(1, len(parts) + 1):
            d = "/".join(parts[:i])
            if d and d not in entries:
                entries[d] = (_tarinfo(d, tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755), b"")

    def add_file(src: str, dest: str) -> None:
        data = Path(src).read_bytes()
        dest = dest.strip("/")
        add_dir(os.path.dirname(dest))
        mode = 0o755 if os.access(src, os.X_OK) else 0o644
        entries[dest] = (_tarinfo(dest, tarfile.REGTYPE, mode, len(data)), data)

    for d in dirs:
        add_dir(d)
    for src, dest in files:
        add_file(src, dest)
    if busybox:
        add_file(busybox, "/bin/busybox")
        applets = subprocess.run([busybox, "--list-full"], capture_output=True, text=True, check=True)
        for path in applets.stdout.split():
            path = path.strip("/")
            if path == "bin/busybox" or path in entries:
                continue
            add_dir(os.path.dirname(path))
            entries[path] = (_tarinfo(path, tarfile.SYMTYPE, 0o777, link="/bin/busybox"), b"")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(entries):
            info, data = entries[name]
            tar.addfile(info, io.BytesIO(data) if data else None)
    return buf.getvalue()


def _descriptor(media_type: str, data: bytes) -> dict[str, object]:
    return {"mediaType": media_type, "digest": "sha256:" + hashlib.sha256(data).hexdigest(), "size": len(data)}


def write_layout(layout: Path, ref: str, layer: bytes, entrypoint: list[str], cmd: list[str]) -> bytes:
    """Write an OCI image layout under `layout`; return the manifest bytes."""
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": entrypoint or None, "Cmd": cmd or None, "Env": ["PATH=/bin:/sbin:/usr/bin"]},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]},
    }
    config_bytes = json.dumps(config, sort_keys=True).encode()
    manifest = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_TYPE,
        "config": _descriptor(CONFIG_TYPE, config_bytes),
        "layers": [_descriptor(LAYER_TYPE, layer)],
    }
    manifest_bytes = json.dumps(manifest, sort_keys=True).encode()
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    for data in (layer, config_bytes, manifest_bytes):
        (blobs / hashlib.sha256(data).hexdigest()).write_bytes(data)
    desc = _descriptor(MANIFEST_TYPE, manifest_bytes)
    desc["annotations"] = {"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": ref.rsplit(":", 1)[1]}
    (layout / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [desc]}
    (layout / "index.json").write_text(json.dumps(index, sort_keys=True))
    return manifest_bytes


def _request(
    method: str, url: str, data: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str]]:
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers)
    except urllib.error.HTTPError as err:
        if method == "HEAD" and err.code == 404:
            return 404, {}
        body = err.read()[:500].decode(errors="replace")
        raise SystemExit(f"error: {method} {url} -> HTTP {err.code}: {body}") from err


def push(layout: Path, ref: str, manifest_bytes: bytes) -> None:
    """Push blobs (skipping those present) and then the manifest: no partial image is tagged."""
    host, _, rest = ref.partition("/")
    repo, _, tag = rest.rpartition(":")
    base = f"http://{host}/v2/{repo}"
    manifest = json.loads(manifest_bytes)
    for desc in [manifest["config"], *manifest["layers"]]:
        digest = desc["digest"]
        if _request("HEAD", f"{base}/blobs/{digest}")[0] == 200:
            continue
        _, headers = _request("POST", f"{base}/blobs/uploads/")
        location = headers["Location"]
        if location.startswith("/"):
            location = f"http://{host}{location}"
        sep = "&" if "?" in location else "?"
        data = (layout / "blobs" / "sha256" / digest.split(":", 1)[1]).read_bytes()
        _request("PUT", f"{location}{sep}digest={digest}", data, {"Content-Type": "application/octet-stream"})
    _request("PUT", f"{base}/manifests/{tag}", manifest_bytes, {"Content-Type": MANIFEST_TYPE})


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", required=True, type=Path)
    parser.add_argument("--ref", required=True, help="HOST:PORT/REPO:TAG")
    parser.add_argument("--file", action="append", default=[], help="SRC:DEST")
    parser.add_argument("--dir", action="append", default=[])
    parser.add_argument("--busybox", help="path of a static busybox: adds it with all applet links")
    parser.add_argument("--entrypoint", action="append", default=[])
    parser.add_argument("--cmd", action="append", default=[])
    parser.add_argument("--push", action="store_true")
    args = parser.parse_args(argv)
    files = [(src, dest) for src, _, dest in (f.partition(":") for f in args.file)]
    layer = build_layer(files, args.busybox, args.dir)
    manifest = write_layout(args.layout, args.ref, layer, args.entrypoint, args.cmd)
    if args.push:
        push(args.layout, args.ref, manifest)
    print(args.ref + "@sha256:" + hashlib.sha256(manifest).hexdigest())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
