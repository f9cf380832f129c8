"""Restore of sealed layers (shim/engine/restore.py): a layer is decrypted as a stream from its
verified download, and a tampered, truncated or wrongly keyed layer stops the extraction with the
layer named (real zstd, tar and AES-GCM; no registry needed)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from kubectl_snapshot.core.oci import sha256_digest
from kubectl_snapshot.core.sealing import DecryptionFailed, LocalNamespaceKey, Opener, Sealer, new_key
from shim.engine.restore import _extract_fresh, _extract_volume
from shim.files.archive import tar_directory
from shim.files.zstdio import open_zstd_writer

SEG = 4096


def sealed_layer(src: Path, sealer: Sealer) -> tuple[bytes, str]:
    buf = io.BytesIO()
    with open_zstd_writer(buf, level=1) as zw:
        tar_directory(str(src), zw)
    dek = sealer.stream_key()
    pieces = [buf.getvalue()[i : i + 1000] for i in range(0, len(buf.getvalue()), 1000)]
    blob = b"".join(sealer.seal_stream(pieces, dek))
    digest = sha256_digest(blob)
    sealer.record(digest, dek)
    return blob, digest


@pytest.fixture
def layer(tmp_path: Path) -> tuple[Path, Sealer, bytes, str, bytes]:
    src = tmp_path / "src"
    (src / "vol-0").mkdir(parents=True)
    payload = os.urandom(5 * SEG + 123)
    (src / "vol-0" / "data.bin").write_bytes(payload)
    (src / "spec.dump").write_text("{}")
    kek = new_key()
    sealer = Sealer(LocalNamespaceKey(kek), "ns", segment_size=SEG)
    blob, digest = sealed_layer(src, sealer)
    return tmp_path, sealer, blob, digest, kek


def test_a_sealed_layer_and_volume_extract(layer) -> None:  # type: ignore[no-untyped-def]
    tmp, sealer, blob, digest, kek = layer
    path = tmp / "blob"
    path.write_bytes(blob)
    opener = Opener(sealer.info([digest]), LocalNamespaceKey(kek))
    _extract_fresh(str(path), str(tmp / "out"), opener=opener, digest=digest)
    assert (tmp / "out" / "vol-0" / "data.bin").read_bytes() == (tmp / "src" / "vol-0" / "data.bin").read_bytes()
    _extract_volume(str(path), "vol-0", str(tmp / "vol"), opener, digest)
    assert (tmp / "vol" / "data.bin").read_bytes() == (tmp / "src" / "vol-0" / "data.bin").read_bytes()


@pytest.mark.parametrize("damage", ["flip", "truncate", "wrong-key"])
def test_a_damaged_or_foreign_layer_stops_the_extraction(layer, damage: str) -> None:  # type: ignore[no-untyped-def]
    tmp, sealer, blob, digest, kek = layer
    if damage == "flip":
        bad = bytearray(blob)
        bad[len(bad) // 2] ^= 1
        blob = bytes(bad)
    elif damage == "truncate":
        blob = blob[: 12 + 2 * (SEG + 16)]  # cut at a segment boundary
    if damage == "wrong-key":
        kek = new_key()
    path = tmp / "blob"
    path.write_bytes(blob)
    opener = Opener(sealer.info([digest]), LocalNamespaceKey(kek))
    with pytest.raises(DecryptionFailed) as e:
        _extract_fresh(str(path), str(tmp / "out"), opener=opener, digest=digest)
    assert digest in e.value.message
    assert not (tmp / "out" / "vol-0" / "data.bin").exists() or damage != "wrong-key"
