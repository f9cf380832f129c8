"""What someone who can push to the registry makes of a snapshot: edit a container's checkpoint layer,
reseal it, re-sign it, as a valid artifact under a new tag.

Snapshots are sealed (core/sealing.py) and signed (adapters/signatures.py), so editing bytes in clear gives
an artifact the agent refuses at its first look. These helpers play the attacker's worst case with the
project's own code: the namespace key read from the agent's key Secret (`namespace_key`), the layer
opened, edited, sealed under a fresh data key wrapped for the same namespace, config and manifest
digests recomputed (`edit_container_layer`); then either the original signature replayed onto the new
digest (`replay_signature`: all a tenant without the signing key can do) or a real signature with the
agent's own signing key and the original's signed origin (`resign`: the signing Secret stolen too), so
that a test reaches whichever check it means to show.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubectl_snapshot.adapters.keystore import KEY_SECRET
from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.adapters.signatures import sign_snapshot, verify_snapshot
from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.encryption import EncryptionInfo
from kubectl_snapshot.core.oci import parse_manifest
from kubectl_snapshot.core.provenance import SigningKey, TrustPolicy, signature_tag
from kubectl_snapshot.core.reference import Reference
from kubectl_snapshot.core.sealing import LocalNamespaceKey, NamespaceKey, Opener, Sealer
from shim.service import nodekey
from tests.support.cluster import Cluster


def namespace_key(cluster: Cluster, namespace: str) -> LocalNamespaceKey:
    """The namespace's current key, as the agent keeps it (read as cluster admin)."""
    secret = cluster.get_json("secret", KEY_SECRET, "-n", K.AGENT_NAMESPACE)
    return LocalNamespaceKey(base64.b64decode(secret["data"][namespace]))


def agent_signing_key(node: str) -> SigningKey:
    """The key `node`'s agent signs its snapshots with, as root on that node reads it (the e2e cluster's
    nodes share this machine, and the agents' default state root)."""
    path = Path(C.DEFAULT_STATE_DIR) / node / nodekey.KEY_DIR / nodekey.KEY_FILE
    return SigningKey.from_pem(path.read_bytes(), where=str(path))


def _digest(data: bytes | bytearray) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _blob(reg: RegistryClient, ref: Reference, digest: str) -> bytes:
    buf = io.BytesIO()
    reg.fetch_blob(ref, digest, buf)
    return buf.getvalue()


def edit_container_layer(
    ref: Reference,
    to: Reference,
    edit: Callable[[bytes], bytes],
    *,
    key: NamespaceKey | None,
    container: int = 0,
) -> Reference:
    """Push to `to` (a tag) the snapshot `ref` with container `container`'s layer replaced by
    `edit(plaintext layer)`: opened with `key` and resealed under a fresh data key for the same
    namespace when the snapshot is sealed (`key` is then required), config and manifest digests
    recomputed, every other blob copied unchanged. Returns the new snapshot pinned by digest."""
    reg = RegistryClient()
    body, _, _ = reg.get_manifest(ref)
    man = json.loads(body)
    config = json.loads(reg.read_blob(ref, man["config"]["digest"], max_size=16 << 20))
    rec = config["containers"][container]
    old = rec["layer"]
    stored = _blob(reg, ref, old)
    enc = config.get("encryption")
    if enc is not None:
        if key is None:
            raise AssertionError(f"{ref} is sealed for namespace {enc['namespace']!r}: give its key")
        info = EncryptionInfo.from_dict(enc)
        plain = bytes(Opener(info, key).reader(old, io.BytesIO(stored)).read())
        sealer = Sealer(key, info.namespace)
        dek = sealer.stream_key()
        new = b"".join(sealer.seal_stream([edit(plain)], dek))
        new_digest = _digest(new)
        sealer.record(new_digest, dek)
        keys = dict(enc["keys"])
        del keys[old]
        keys.update(sealer.info([new_digest]).keys)
        enc["keys"] = keys
    else:
        new = edit(stored)
        new_digest = _digest(new)
    rec["layer"] = new_digest
    reg.push_blob(to, digest=new_digest, size=len(new), data=new)
    config_bytes = json.dumps(config).encode()
    config_digest = _digest(config_bytes)
    reg.push_blob(to, digest=config_digest, size=len(config_bytes), data=config_bytes)
    for layer in man["layers"]:
        if layer["digest"] == old:
            layer.update(digest=new_digest, size=len(new))
        elif (to.registry, to.repository) != (ref.registry, ref.repository):
            reg.push_blob(to, digest=layer["digest"], size=layer["size"], data=_blob(reg, ref, layer["digest"]))
    man["config"].update(digest=config_digest, size=len(config_bytes))
    out = json.dumps(man).encode()
    parse_manifest(out)  # still a well-formed snapshot manifest
    digest = reg.push_manifest(to, out, man["mediaType"])
    return Reference(to.registry, to.repository, digest=digest)


def replay_signature(original: Reference, onto: Reference) -> None:
    """Copy `original`'s signature manifest to `onto`'s signature tag (same repository): the signed
    payload still names the original digest."""
    reg = RegistryClient()
    assert original.digest and onto.digest
    src = Reference(original.registry, original.repository, tag=signature_tag(original.digest))
    body, media_type, _ = reg.get_manifest(src)
    man = json.loads(body)
    dst = Reference(onto.registry, onto.repository, tag=signature_tag(onto.digest))
    for blob in [man["config"], *man["layers"]]:
        reg.push_blob(dst, digest=blob["digest"], size=blob["size"], data=_blob(reg, src, blob["digest"]))
    reg.push_manifest(dst, body, media_type)


def resign(original: Reference, edited: Reference, key: SigningKey) -> None:
    """Sign `edited` with `key`, claiming the origin `key` signed for `original` (so that the claim
    still matches the edited config's namespace and pod uid)."""
    reg = RegistryClient()
    verdict = verify_snapshot(reg, original, TrustPolicy((key.public,)))
    assert verdict.verified and verdict.claim is not None, verdict.reason
    sign_snapshot(reg, edited, verdict.claim.origin, key)


def edit_core_images(layer: bytes, edit: Callable[[dict[str, Any]], None]) -> bytes:
    """A container layer (tar.zst, plaintext) with `edit(creds)` applied to the credentials of every
    thread in every checkpoint/core-*.img (decoded and re-encoded with pycriu). A zombie's core
    image (a child that exited but was not reaped yet at the freeze, e.g. the counter's `sleep`)
    has no thread_core, so no credentials to edit; it is copied as it is."""
    import pycriu.images as images
    import zstandard

    raw = zstandard.ZstdDecompressor().decompressobj().decompress(layer)
    out = io.BytesIO()
    edited = 0
    with (
        tarfile.open(fileobj=io.BytesIO(raw)) as src,
        tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as dst,
    ):
        for m in src:
            data = src.extractfile(m).read() if m.isreg() else None  # type: ignore[union-attr]
            name = m.name.split("/")[-1]
            if data is not None and name.startswith("core-") and name.endswith(".img"):
                img = images.load(io.BytesIO(data))
                threads = [e["thread_core"] for e in img["entries"] if "thread_core" in e]
                if not threads:
                    dst.addfile(m, io.BytesIO(data))
                    continue
                for tc in threads:
                    edit(tc["creds"])
                buf = io.BytesIO()
                images.dump(img, buf)
                data = buf.getvalue()
                m.size = len(data)
                edited += 1
            dst.addfile(m, io.BytesIO(data) if data is not None else None)
    assert edited, "no core image in the layer"
    return zstandard.ZstdCompressor().compress(out.getvalue())


def machine_capabilities() -> list[int]:
    """Every capability a process on this machine can hold (its bounding set, as CRIU's two u32
    words): what an attacker would put into the images, nothing the kernel would refuse anyway."""
    with open("/proc/self/status") as f:
        bnd = next(int(line.split()[1], 16) for line in f if line.startswith("CapBnd:"))
    return [bnd & 0xFFFFFFFF, bnd >> 32]
