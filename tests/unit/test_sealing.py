"""Encryption at rest with real AES-256-GCM (core/sealing.py): the segment framing refuses tampering,
truncation, reordering and a wrong key; convergent chunk keys dedupe only within a namespace; wrapped
data keys open only with their namespace's key and only for their own blob."""

from __future__ import annotations

import base64
import io
import os
from collections.abc import Sequence

import pytest

from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.encryption import SCHEME, EncryptionInfo
from kubectl_snapshot.core.errors import FailedPrecondition
from kubectl_snapshot.core.model import (
    ContainerRecord,
    HostFacts,
    SnapshotConfig,
    layer_media_type,
    manifest_annotations,
    parse_config,
)
from kubectl_snapshot.core.sealing import (
    HEADER,
    MAGIC,
    MIN_SEGMENT,
    TAG,
    WRAP_BATCH,
    DecryptionFailed,
    LocalNamespaceKey,
    Opener,
    OpeningReader,
    Sealer,
    key_id_of,
    new_key,
    open_bytes,
    seal_bytes,
    seal_stream,
    sealed_size,
)

SEG = MIN_SEGMENT  # small segments: many of them in a small blob


def segments(blob: bytes | bytearray, seg: int = SEG) -> tuple[bytes, list[bytes]]:
    blob = bytes(blob)
    body = blob[HEADER.size :]
    step = seg + TAG
    return blob[: HEADER.size], [body[i : i + step] for i in range(0, len(body), step)]


def read_all(blob: bytes | bytearray, dek: bytes, piece: int = 1000) -> bytes:
    r = OpeningReader(io.BytesIO(blob), dek)
    out = []
    while b := r.read(piece):
        out.append(b)
    return b"".join(out)


@pytest.mark.parametrize("n", [0, 1, SEG - 1, SEG, SEG + 1, 3 * SEG, 3 * SEG + 17])
def test_round_trip_whole_and_streamed_at_every_boundary(n: int) -> None:
    dek, data = new_key(), os.urandom(n)
    whole = seal_bytes(data, dek, segment_size=SEG)
    pieces = [data[i : i + 777] for i in range(0, n, 777)]
    streamed = b"".join(seal_stream(pieces, dek, segment_size=SEG))
    assert whole == streamed  # one format, whichever way it was written
    assert len(whole) == sealed_size(n, SEG)
    assert n < 16 or data not in whole  # (a byte or two may occur in any ciphertext by chance)
    assert open_bytes(whole, dek) == data
    assert read_all(whole, dek) == data
    assert OpeningReader(io.BytesIO(whole), dek).read() == data


def test_a_flipped_byte_anywhere_is_refused() -> None:
    dek, data = new_key(), os.urandom(3 * SEG + 5)
    blob = seal_bytes(data, dek, segment_size=SEG)
    for pos in (HEADER.size + 3, HEADER.size + SEG + TAG + 10, len(blob) - 1):
        bad = bytearray(blob)
        bad[pos] ^= 1
        with pytest.raises(DecryptionFailed, match="does not authenticate"):
            open_bytes(bytes(bad), dek)
        with pytest.raises(DecryptionFailed):
            read_all(bytes(bad), dek)


def test_a_scratch_buffer_is_reused_grown_and_stays_usable_after_a_refusal() -> None:
    dek, scratch = new_key(), bytearray()
    for n in (3 * SEG + 5, SEG, 5 * SEG):  # grows, then a smaller blob uses its start, then grows again
        data = os.urandom(n)
        with open_bytes(seal_bytes(data, dek, segment_size=SEG), dek, into=scratch) as view:
            assert view == data
        assert len(scratch) >= n
    bad = bytearray(seal_bytes(os.urandom(2 * SEG), dek, segment_size=SEG))
    bad[-1] ^= 1
    with pytest.raises(DecryptionFailed):
        open_bytes(bad, dek, into=scratch)
    data = os.urandom(7 * SEG)  # no view of the scratch buffer was left behind: it can grow
    with open_bytes(seal_bytes(data, dek, segment_size=SEG), dek, into=scratch) as view:
        assert view == data


def test_a_changed_header_is_refused() -> None:
    dek = new_key()
    blob = seal_bytes(os.urandom(2 * SEG), dek, segment_size=SEG)
    other_size = HEADER.pack(MAGIC, 2 * SEG) + blob[HEADER.size :]
    with pytest.raises(DecryptionFailed):
        open_bytes(other_size, dek)
    with pytest.raises(DecryptionFailed, match="bad magic"):
        open_bytes(b"NOTSEAL!" + blob[8:], dek)
    with pytest.raises(DecryptionFailed, match="segment size"):
        open_bytes(HEADER.pack(MAGIC, 7) + blob[HEADER.size :], dek)


def test_truncation_is_refused_even_at_a_segment_boundary() -> None:
    dek, data = new_key(), os.urandom(3 * SEG + 100)
    blob = seal_bytes(data, dek, segment_size=SEG)
    header, segs = segments(blob)
    assert len(segs) == 4
    cut_at_boundary = header + b"".join(segs[:2])  # drops the final segment: what is left is all valid
    with pytest.raises(DecryptionFailed, match="segment 1"):
        open_bytes(cut_at_boundary, dek)
    with pytest.raises(DecryptionFailed):
        read_all(cut_at_boundary, dek)
    with pytest.raises(DecryptionFailed):
        open_bytes(blob[:-1], dek)
    with pytest.raises(DecryptionFailed):
        read_all(blob[: HEADER.size + 5], dek)
    with pytest.raises(DecryptionFailed):
        open_bytes(blob[: HEADER.size - 1], dek)


def test_a_multiple_of_the_segment_size_cut_after_a_full_segment_is_refused() -> None:
    dek, data = new_key(), os.urandom(2 * SEG)
    blob = seal_bytes(data, dek, segment_size=SEG)
    header, segs = segments(blob)
    assert len(segs) == 2 and len(segs[1]) == SEG + TAG  # the final segment is full
    with pytest.raises(DecryptionFailed):
        open_bytes(header + segs[0], dek)
    with pytest.raises(DecryptionFailed):
        read_all(header + segs[0], dek)


def test_reordered_duplicated_or_appended_segments_are_refused() -> None:
    dek, data = new_key(), os.urandom(3 * SEG + 100)
    header, segs = segments(seal_bytes(data, dek, segment_size=SEG))
    for crafted in (
        [segs[1], segs[0], segs[2], segs[3]],
        [segs[0], segs[0], segs[2], segs[3]],
        [*segs, segs[3]],
        [*segs, b"x" * 40],
        [segs[0], segs[1], segs[3]],
    ):
        with pytest.raises(DecryptionFailed):
            open_bytes(header + b"".join(crafted), dek)
        with pytest.raises(DecryptionFailed):
            read_all(header + b"".join(crafted), dek)


def test_a_wrong_data_key_is_refused() -> None:
    blob = seal_bytes(b"secret pages", new_key())
    with pytest.raises(DecryptionFailed):
        open_bytes(blob, new_key())


def sealer(kek: bytes, ns: str) -> Sealer:
    return Sealer(LocalNamespaceKey(kek), ns, segment_size=SEG)


def test_convergent_chunks_dedupe_within_a_namespace_only() -> None:
    kek_a, kek_b = new_key(), new_key()
    chunk = os.urandom(2 * SEG + 3)
    c1, d1 = sealer(kek_a, "a").seal_chunk(chunk)
    c2, d2 = sealer(kek_a, "a").seal_chunk(chunk)  # another snapshot, same namespace
    assert (c1, d1) == (c2, d2)  # same blob, same digest: the registry already has it
    assert chunk not in c1
    _, d3 = sealer(kek_b, "b").seal_chunk(chunk)
    assert d3 != d1  # another namespace's key: unrelated ciphertext
    _, d4 = sealer(kek_a, "a").seal_chunk(chunk[:-1] + bytes([chunk[-1] ^ 1]))
    assert d4 != d1


def info_and_blobs(kek: bytes, ns: str) -> tuple[EncryptionInfo, dict[str, bytes], bytes, bytes]:
    s = sealer(kek, ns)
    chunk, layer = os.urandom(SEG + 9), os.urandom(3 * SEG)
    sealed_chunk, cd = s.seal_chunk(chunk)
    dek = s.stream_key()
    sealed_layer = b"".join(s.seal_stream([layer], dek))
    from kubectl_snapshot.core.oci import sha256_digest

    ld = sha256_digest(sealed_layer)
    s.record(ld, dek)
    return s.info([cd, ld]), {cd: bytes(sealed_chunk), ld: sealed_layer}, chunk, layer


def test_opener_round_trip_and_the_config_record() -> None:
    kek = new_key()
    info, blobs, chunk, layer = info_and_blobs(kek, "team-a")
    assert info.scheme == SCHEME and info.namespace == "team-a" and info.key_id == key_id_of(kek)
    again = EncryptionInfo.from_dict(info.to_dict())
    assert again == info
    opener = Opener(again, LocalNamespaceKey(kek))
    (cd, sealed_chunk), (ld, sealed_layer) = blobs.items()
    assert opener.open_chunk(cd, sealed_chunk) == chunk
    assert opener.reader(ld, io.BytesIO(sealed_layer)).read() == layer


def test_another_namespaces_key_cannot_open_the_data_keys() -> None:
    kek_a, kek_b = new_key(), new_key()
    info, blobs, _, _ = info_and_blobs(kek_a, "team-a")
    cd, sealed = next(iter(blobs.items()))
    with pytest.raises(DecryptionFailed, match="does not open with this namespace's key") as e:
        Opener(info, LocalNamespaceKey(kek_b)).open_chunk(cd, sealed)
    assert "team-a" in e.value.message and cd in e.value.message
    # the record relabelled as another namespace's: the wrap is bound to the namespace it was made for
    relabelled = EncryptionInfo(info.scheme, "team-b", info.key_id, info.keys)
    with pytest.raises(DecryptionFailed):
        Opener(relabelled, LocalNamespaceKey(kek_a)).open_chunk(cd, sealed)


def test_a_wrapped_key_opens_only_the_blob_it_names() -> None:
    kek = new_key()
    info, blobs, _, _ = info_and_blobs(kek, "ns")
    (cd, sealed_chunk), (ld, _) = blobs.items()
    swapped = EncryptionInfo(info.scheme, info.namespace, info.key_id, {cd: info.keys[ld], ld: info.keys[cd]})
    with pytest.raises(DecryptionFailed, match="does not open"):
        Opener(swapped, LocalNamespaceKey(kek)).open_chunk(cd, sealed_chunk)
    raw = bytearray(base64.b64decode(info.keys[cd]))
    raw[20] ^= 1
    keys = {**info.keys, cd: base64.b64encode(raw).decode()}
    tampered = EncryptionInfo(info.scheme, info.namespace, info.key_id, keys)
    with pytest.raises(DecryptionFailed):
        Opener(tampered, LocalNamespaceKey(kek)).open_chunk(cd, sealed_chunk)


def test_key_ids_name_keys_without_revealing_them() -> None:
    k = new_key()
    assert key_id_of(k) == LocalNamespaceKey(k).key_id == key_id_of(bytes(k))
    assert key_id_of(k) != key_id_of(new_key())
    assert k.hex()[:16] not in key_id_of(k)


def config_with(info: EncryptionInfo | None, layer: str) -> SnapshotConfig:
    rec = ContainerRecord(name="c", id="c", image="i", image_digest="", layer_digest=layer, spec={})
    return SnapshotConfig(group="g", namespace="ns", created="t", containers=(rec,), host=HostFacts(), encryption=info)


def test_the_config_carries_the_record_and_every_blob_needs_a_key() -> None:
    kek = new_key()
    info, blobs, _, _ = info_and_blobs(kek, "ns")
    cd, ld = list(blobs)
    only_layer = EncryptionInfo(info.scheme, info.namespace, info.key_id, {ld: info.keys[ld]})
    cfg = config_with(only_layer, ld)
    parsed = parse_config(cfg.to_bytes())
    assert parsed.encryption == only_layer
    assert manifest_annotations(cfg)[C.ANN_ENCRYPTION] == SCHEME
    assert layer_media_type(C.CHUNK_MEDIA_TYPE, cfg).endswith("+encrypted")
    assert layer_media_type(C.CHUNK_MEDIA_TYPE, config_with(None, ld)) == C.CHUNK_MEDIA_TYPE
    with pytest.raises(FailedPrecondition, match="1 without a key"):
        parse_config(config_with(EncryptionInfo(info.scheme, "ns", info.key_id, {cd: info.keys[cd]}), ld).to_bytes())
    with pytest.raises(FailedPrecondition, match="1 keys for no blob"):
        parse_config(config_with(info, ld).to_bytes())


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(scheme="rot13"),
        lambda d: d.update(keyId=""),
        lambda d: d.update(keys=[]),
        lambda d: d["keys"].update({"sha256:" + "0" * 64: "short"}),
        lambda d: d["keys"].update({"md5:x": "A" * 80}),
    ],
)
def test_an_invalid_record_is_refused(mutate) -> None:  # type: ignore[no-untyped-def]
    info, _, _, _ = info_and_blobs(new_key(), "ns")
    d = info.to_dict()
    mutate(d)
    with pytest.raises(FailedPrecondition):
        EncryptionInfo.from_dict(d)


def test_inspect_says_whether_and_how_a_snapshot_is_encrypted() -> None:
    from kubectl_snapshot.console.inspect import inspect_data, inspect_text
    from kubectl_snapshot.core.artifact import Artifact
    from kubectl_snapshot.core.oci import Descriptor, build_manifest
    from kubectl_snapshot.core.reference import Reference

    kek = new_key()
    info, blobs, _, _ = info_and_blobs(kek, "team-a")
    ld = list(blobs)[1]
    ref = Reference.parse("127.0.0.1:5000/r@sha256:" + "1" * 64)
    for info_or_none in (EncryptionInfo(info.scheme, "team-a", info.key_id, {ld: info.keys[ld]}), None):
        cfg = config_with(info_or_none, ld)
        layer = Descriptor(layer_media_type(C.CHECKPOINT_LAYER_MEDIA_TYPE, cfg), ld, 10)
        manifest = build_manifest(
            config=Descriptor(C.CONFIG_MEDIA_TYPE, "sha256:" + "2" * 64, 5),
            layers=[layer],
            artifact_type=C.ARTIFACT_TYPE,
            annotations={},
        )
        text = inspect_text(inspect_data(Artifact(ref, manifest, cfg)))
        if info_or_none is None:
            assert "Encrypted:  no" in text
        else:
            assert f"Encrypted:  {SCHEME} with the key of namespace team-a ({key_id_of(kek)})" in text


class CountingKey(LocalNamespaceKey):
    """A local key that counts its calls (a remote key pays a round trip for each)."""

    def __init__(self, kek: bytes) -> None:
        super().__init__(kek)
        self.calls: list[tuple[str, int]] = []

    def wrap(self, dek: bytes, aad: bytes) -> bytes:
        self.calls.append(("wrap", 1))
        return super().wrap(dek, aad)

    def unwrap(self, wrapped: bytes, aad: bytes) -> bytes:
        self.calls.append(("unwrap", 1))
        return super().unwrap(wrapped, aad)

    def wrap_many(self, items: Sequence[tuple[bytes, bytes]]) -> list[bytes]:
        self.calls.append(("wrap_many", len(items)))
        return [LocalNamespaceKey.wrap(self, d, a) for d, a in items]

    def unwrap_many(self, items: Sequence[tuple[bytes, bytes]]) -> list[bytes]:
        self.calls.append(("unwrap_many", len(items)))
        return [LocalNamespaceKey.unwrap(self, w, a) for w, a in items]


def test_a_snapshots_data_keys_are_wrapped_and_unwrapped_in_batches() -> None:
    """300 chunks: their keys are wrapped when the config's record is made, WRAP_BATCH to a call (a key
    broker's round trip each), not one call per chunk; a restore's first key unwraps them all likewise."""
    kek = new_key()
    key = CountingKey(kek)
    sealer = Sealer(key, "ns")
    blobs = dict(sealer.seal_chunk(os.urandom(64))[::-1] for _ in range(300))
    assert key.calls == []  # nothing wrapped while sealing
    info = sealer.info(blobs)
    assert key.calls == [("wrap_many", WRAP_BATCH), ("wrap_many", WRAP_BATCH), ("wrap_many", 300 - 2 * WRAP_BATCH)]
    assert sealer.info(list(blobs)[:5]).keys == {d: info.keys[d] for d in list(blobs)[:5]}  # wrapped once
    assert len(key.calls) == 3

    key.calls.clear()
    opener = Opener(info, key)
    for digest, sealed in blobs.items():
        assert len(opener.open_chunk(digest, sealed)) == 64
    assert key.calls == [("unwrap_many", WRAP_BATCH), ("unwrap_many", WRAP_BATCH), ("unwrap_many", 44)]


def test_a_batch_that_does_not_open_names_the_blob_and_the_others_still_open() -> None:
    kek = new_key()
    key = CountingKey(kek)
    sealer = Sealer(key, "ns")
    blobs = dict(sealer.seal_chunk(os.urandom(64))[::-1] for _ in range(3))
    info = sealer.info(blobs)
    bad, *good = list(blobs)
    raw = bytearray(base64.b64decode(info.keys[bad]))
    raw[20] ^= 1
    tampered = EncryptionInfo(
        info.scheme, info.namespace, info.key_id, {**info.keys, bad: base64.b64encode(raw).decode()}
    )
    opener = Opener(tampered, key)
    for digest in good:  # the batch fails; each is then asked on its own
        assert len(opener.open_chunk(digest, blobs[digest])) == 64
    with pytest.raises(DecryptionFailed, match=f"cannot decrypt blob {bad}"):
        opener.open_chunk(bad, blobs[bad])
