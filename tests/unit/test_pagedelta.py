"""Page deltas (format v4): encoding, applying, refusing hostile deltas and configs, chunk layouts and
the node's page index (a cache: anything wrong with it means full chunks)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.chunks import (
    PAGE_SIZE,
    Chunk,
    Delta,
    PagemapRun,
    chunk_digests,
    chunk_sizes,
    delta_digests,
    delta_raw_length,
    parse_pages_files,
    plan_chunks,
    span_layouts,
)
from kubectl_snapshot.core.errors import DigestMismatch, FailedPrecondition
from kubectl_snapshot.core.model import ContainerRecord, HostFacts, SnapshotConfig, check_layers_match, parse_config
from kubectl_snapshot.core.pagedelta import (
    MAGIC,
    PAGE_HASH_BYTES,
    apply_delta,
    encode_delta,
    page_hashes,
    plan_delta,
    worth_a_delta,
)
from shim.engine import pageindex
from shim.engine.pageindex import BaseChunk, PageIndex

D = ["sha256:" + c * 64 for c in "0123456789abcdef"]
KEY = bytes(range(32))  # a node's page hash key


def chunk(pages: int, seed: int = 1) -> bytearray:
    return bytearray(random.Random(seed).randbytes(pages * PAGE_SIZE))


def layout(*pieces: tuple[int, int]) -> bytes:
    """(first page number, pages) pieces as core/chunks.span_layouts encodes them."""
    return b"".join(struct.pack("<QQ", p * PAGE_SIZE, n * PAGE_SIZE) for p, n in pieces)


def test_a_delta_carries_exactly_the_changed_pages_and_rebuilds_the_chunk() -> None:
    base = chunk(64)
    new = bytearray(base)
    for i in (0, 7, 8, 63):
        new[i * PAGE_SIZE + 5] ^= 0x5A
    lay = layout((1000, 64))
    plan = plan_delta(lay, page_hashes(base, KEY), lay, page_hashes(new, KEY))
    assert plan is not None and plan.literals == (0, 7, 8, 63) and not plan.identical
    assert plan.copies == ((1, 1, 6), (9, 9, 54))
    delta = encode_delta(new, plan)
    assert len(delta) == delta_raw_length(4, 2) and delta.startswith(MAGIC)
    assert apply_delta(base, delta, length=len(new), literals=4, copies=2, where="t") == new


def test_pages_are_matched_by_address_when_the_range_gains_and_loses_pages() -> None:
    base = chunk(64)
    # the new chunk: pages 1000..1009 gone, 1064..1073 new (a grown heap), page 1030 changed
    new = bytearray(base[10 * PAGE_SIZE :]) + chunk(10, seed=2)
    new[20 * PAGE_SIZE] ^= 1  # address 1030
    plan = plan_delta(layout((1000, 64)), page_hashes(base, KEY), layout((1010, 64)), page_hashes(new, KEY))
    assert plan is not None and plan.pages == 64
    assert plan.literals == (20, *range(54, 64))
    assert plan.copies == ((0, 10, 20), (21, 31, 33))
    delta = encode_delta(new, plan)
    assert apply_delta(base, delta, length=len(new), literals=11, copies=2, where="t") == new


def test_page_hashes_are_keyed_blake3_of_each_page_and_depend_on_the_key() -> None:
    import blake3
    import xxhash

    a = chunk(3)
    pages = [a[i * PAGE_SIZE : (i + 1) * PAGE_SIZE] for i in range(3)]
    assert page_hashes(a, KEY) == b"".join(blake3.blake3(p, key=KEY).digest(PAGE_HASH_BYTES) for p in pages)
    assert len(page_hashes(a, KEY)) == 3 * PAGE_HASH_BYTES
    changed = bytearray(a)
    changed[2 * PAGE_SIZE + 4095] ^= 1  # the last byte of the last page
    assert page_hashes(changed, KEY)[: 2 * PAGE_HASH_BYTES] == page_hashes(a, KEY)[: 2 * PAGE_HASH_BYTES]
    assert page_hashes(changed, KEY)[2 * PAGE_HASH_BYTES :] != page_hashes(a, KEY)[2 * PAGE_HASH_BYTES :]
    # another node's key, or no key at all (the unkeyed XXH3-128 of older agents), agrees on no page
    other = page_hashes(a, bytes(32))
    unkeyed = b"".join(xxhash.xxh3_128_digest(p) for p in pages)
    mine = page_hashes(a, KEY)
    for i in range(3):
        page = slice(i * PAGE_HASH_BYTES, (i + 1) * PAGE_HASH_BYTES)
        assert mine[page] != other[page] and mine[page] != unkeyed[page]


def test_an_unchanged_chunk_is_its_base_and_inconsistent_inputs_give_no_plan() -> None:
    a = chunk(4)
    lay = layout((7, 4))
    plan = plan_delta(lay, page_hashes(a, KEY), lay, page_hashes(a, KEY))
    assert plan is not None and plan.identical
    five = page_hashes(chunk(5), KEY)
    assert plan_delta(lay, page_hashes(a, KEY), lay, five) is None  # hashes of 5 pages, layout of 4
    assert plan_delta(lay, page_hashes(a, KEY), b"", b"") is None
    with pytest.raises(ValueError):
        page_hashes(b"x" * 100, KEY)
    with pytest.raises(ValueError):
        page_hashes(a, KEY[:16])


def test_a_delta_is_worth_it_only_for_a_part_of_the_chunk() -> None:
    assert worth_a_delta(0, 100) and worth_a_delta(1, 100) and worth_a_delta(50, 100)
    # more than half: a delta only while it is mostly new since the last snapshot, and not nearly all
    assert worth_a_delta(80, 100) and worth_a_delta(80, 100, fresh=60)
    assert not worth_a_delta(80, 100, fresh=59)  # mostly pages sent before: a new base instead
    assert worth_a_delta(80, 100, fresh=0)  # ... unless it is the last snapshot's delta, already stored
    assert not worth_a_delta(88, 100) and worth_a_delta(87, 100)
    assert not worth_a_delta(100, 100, fresh=100)


def _delta(
    copies: list[tuple[int, int, int]], indexes: list[int], out: int = 16, magic: bytes = MAGIC
) -> tuple[bytes, int, int]:
    head = magic + struct.pack("<III", out, len(copies), len(indexes))
    body = b"".join(struct.pack("<III", *c) for c in copies) + struct.pack(f"<{len(indexes)}I", *indexes)
    return head + body + bytes(len(indexes) * PAGE_SIZE), len(indexes), len(copies)


GOOD = _delta([(0, 0, 1), (3, 3, 13)], [1, 2])


@pytest.mark.parametrize(
    ("delta", "match"),
    [
        ((GOOD[0][:-1], 2, 2), "holds"),  # truncated
        ((GOOD[0] + b"x", 2, 2), "holds"),  # trailing bytes
        ((GOOD[0], 3, 2), "holds"),  # the config says other counts
        (_delta([(0, 0, 1), (3, 3, 13)], [1, 2], magic=b"NOTDELTA"), "header"),
        (_delta([(0, 0, 1), (3, 3, 13)], [1, 2], out=17), "says 17 pages"),
        (_delta([(0, 0, 1), (3, 3, 13)], [2, 1]), "out of order"),
        (_delta([(0, 0, 1), (3, 3, 13)], [1, 1]), "out of order"),
        (_delta([(0, 0, 1), (3, 3, 13)], [1, 0xFFFFFFFF]), "outside"),
        (_delta([(0, 0, 1), (3, 3, 13)], [0, 1]), "copied too"),  # page 0 given twice
        (_delta([(0, 0, 1), (3, 3, 13)], [1]), "unset"),  # page 2 given by nobody
        (_delta([(3, 3, 13), (0, 0, 1)], [1, 2]), "out of order"),
        (_delta([(0, 0, 2), (1, 3, 15)], [], out=16), "overlapping"),
        (_delta([(0, 0, 1), (3, 4, 13)], [1, 2]), "outside the base"),  # base has 16 pages
        (_delta([(0, 0, 0), (3, 3, 13)], [1, 2]), "copies 0 pages"),
        (_delta([(0, 0xFFFFFFF0, 0x20)], [], out=16), "outside the base"),
        (_delta([], [], out=16), "unset"),
    ],
)
def test_a_hostile_delta_is_refused_with_what_is_wrong(delta: tuple[bytes, int, int], match: str) -> None:
    raw, literals, copies = delta
    with pytest.raises(DigestMismatch, match=match) as e:
        apply_delta(chunk(16), raw, length=16 * PAGE_SIZE, literals=literals, copies=copies, where="page delta X")
    assert "page delta X" in e.value.message and e.value.hint


def test_a_well_formed_delta_of_the_same_shape_applies() -> None:
    raw, literals, copies = GOOD
    out = apply_delta(chunk(16), raw, length=16 * PAGE_SIZE, literals=literals, copies=copies, where="t")
    assert out[PAGE_SIZE : 3 * PAGE_SIZE] == bytes(2 * PAGE_SIZE) and out[3 * PAGE_SIZE :] == chunk(16)[3 * PAGE_SIZE :]


def test_a_base_that_is_not_whole_pages_is_refused() -> None:
    raw, literals, copies = GOOD
    with pytest.raises(DigestMismatch, match="whole pages"):
        apply_delta(b"x" * 100, raw, length=16 * PAGE_SIZE, literals=literals, copies=copies, where="t")


def dch(offset: int, length: int, delta: dict[str, Any] | None = None, digest: str = D[1]) -> dict[str, Any]:
    d: dict[str, Any] = {"offset": offset, "length": length, "digest": digest, "size": 100}
    if delta is not None:
        d["delta"] = delta
    return d


def test_a_chunk_record_with_a_delta_round_trips_and_names_both_blobs() -> None:
    raw = [{"name": "pages-1.img", "size": 8 * PAGE_SIZE,
            "chunks": [dch(0, 8 * PAGE_SIZE, {"digest": D[2], "size": 5000, "pages": 1, "copies": 2,
                                              "baseLength": 9 * PAGE_SIZE})]}]  # fmt: skip
    files = parse_pages_files(raw, "c")
    assert files[0].chunks[0] == Chunk(0, 8 * PAGE_SIZE, D[1], 100, Delta(D[2], 5000, 1, 2, 9 * PAGE_SIZE))
    assert [f.to_dict() for f in files] == raw
    assert chunk_digests(files) == [D[1], D[2]]
    assert delta_digests(files) == {D[2]}
    assert chunk_sizes(files) == {D[1]: 100, D[2]: 5000}


def dl(**kw: Any) -> dict[str, Any]:
    return {"digest": D[2], "size": 10, "pages": 1, "copies": 1, "baseLength": 8 * PAGE_SIZE, **kw}


@pytest.mark.parametrize(
    ("delta", "length", "match"),
    [
        (dl(pages=0, copies=0), 8 * PAGE_SIZE, "copy count"),  # a delta that gives nothing
        (dl(pages=9), 8 * PAGE_SIZE, "page count"),
        (dl(pages=True), 8 * PAGE_SIZE, "page count"),
        (dl(pages=4, copies=5), 8 * PAGE_SIZE, "copy count"),  # more runs than copied pages
        (dl(baseLength=0), 8 * PAGE_SIZE, "base length"),
        (dl(baseLength=PAGE_SIZE + 1), 8 * PAGE_SIZE, "base length"),
        (dl(baseLength=32 << 20), 8 * PAGE_SIZE, "base length"),
        (dl(digest="md5:x"), 8 * PAGE_SIZE, "digest"),
        (dl(size=3 * PAGE_SIZE), 8 * PAGE_SIZE, "blob size"),
        (dl(), 8 * PAGE_SIZE + 1, "whole pages"),
        ([1], 8 * PAGE_SIZE, "not an object"),
    ],
)
def test_an_invalid_delta_record_is_refused(delta: Any, length: int, match: str) -> None:
    raw = [{"name": "pages-1.img", "size": length, "chunks": [dch(0, length, delta)]}]
    with pytest.raises(FailedPrecondition, match=match):
        parse_pages_files(raw, "c")


def config_with(pages_raw: list[dict[str, Any]], version: int) -> bytes:
    rec = ContainerRecord(name="c", id="c", image="", image_digest="", layer_digest=D[0], spec={})
    d = SnapshotConfig(group="g", namespace="n", created="t", containers=(rec,), host=HostFacts()).to_dict()
    d["formatVersion"] = version
    d["containers"][0]["pages"] = pages_raw
    return json.dumps(d).encode()


def test_deltas_need_format_v4_and_every_blob_in_the_manifest() -> None:
    raw = [{"name": "pages-1.img", "size": PAGE_SIZE,
            "chunks": [dch(0, PAGE_SIZE, {"digest": D[2], "size": 100, "pages": 1, "copies": 0,
                                          "baseLength": PAGE_SIZE})]}]  # fmt: skip
    with pytest.raises(FailedPrecondition, match="v3 snapshot config lists page deltas"):
        parse_config(config_with(raw, 3))
    cfg = parse_config(config_with(raw, C.DELTA_FORMAT_VERSION))
    assert cfg.blob_digests() == [D[0], D[1], D[2]]  # encryption keys must cover the delta too
    check_layers_match(cfg, [D[0], D[1], D[2]])
    with pytest.raises(FailedPrecondition, match=D[2]):
        check_layers_match(cfg, [D[0], D[1]])  # the delta is missing
    with pytest.raises(FailedPrecondition, match=D[1]):
        check_layers_match(cfg, [D[0], D[2]])  # the base is missing


def test_layouts_name_the_pages_a_chunk_holds_and_ignore_changes_elsewhere() -> None:
    span = 1 << 20
    runs = [PagemapRun(0x10000000, 512), PagemapRun(0x20000000, 300)]
    size = 812 * PAGE_SIZE
    spans = plan_chunks(runs, size, span)
    lay = span_layouts(runs, size, spans)
    assert lay is not None and len(lay) == len(spans) and len(set(lay)) == len(lay)
    # a mapping grows before them: the file offsets shift, the layouts of the same ranges do not
    runs2 = [PagemapRun(0x1000, 20), *runs]
    spans2 = plan_chunks(runs2, size + 20 * PAGE_SIZE, span)
    lay2 = span_layouts(runs2, size + 20 * PAGE_SIZE, spans2)
    assert lay2 is not None and set(lay) <= set(lay2)
    assert span_layouts(runs, size + PAGE_SIZE, spans) is None  # runs do not account for the file


def base(length_pages: int = 4, digest: str = D[3]) -> BaseChunk:
    n = length_pages
    return BaseChunk(digest, 1234, n * PAGE_SIZE, os.urandom(32), os.urandom(n * PAGE_HASH_BYTES), layout((9, n)))


def test_the_page_index_keeps_this_snapshots_bases_only(tmp_path: Path) -> None:
    idx = PageIndex.load(str(tmp_path), "scope")
    assert len(idx) == 0 and idx.get("a") is None
    a, b = (
        base(),
        replace(base(8, D[4]), last=(layout((9, 8)), os.urandom(8 * PAGE_HASH_BYTES))),
    )  # b: last stored as a delta
    idx.put("a", a)
    idx.put("b", b)
    idx.save()
    again = PageIndex.load(str(tmp_path), "scope")
    assert again.get("a") == a and again.get("b") == b
    again.put("b", b)
    again.save()
    third = PageIndex.load(str(tmp_path), "scope")
    assert third.get("a") is None and third.get("b") == b


def test_the_page_index_finds_a_base_by_the_other_windows_of_its_chunk(tmp_path: Path) -> None:
    idx = PageIndex.load(str(tmp_path), "scope")
    a, b = base(), base(8, D[4])
    idx.put("w1", a, also=["w2", "w3"])
    idx.put("w3", b, also=["w4"])  # w3 is b's first window: b's own key wins over a's alias
    idx.save()
    again = PageIndex.load(str(tmp_path), "scope")
    assert again.get("w1") == a and again.get("w2") == a
    assert again.get("w3") == b and again.get("w4") == b
    assert again.get("w5") is None
    again.put("w4", b)  # this snapshot's bases only: a and its aliases go
    again.save()
    third = PageIndex.load(str(tmp_path), "scope")
    assert third.get("w1") is None and third.get("w2") is None and third.get("w4") == b


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "symlink"])
def test_a_damaged_page_index_means_full_chunks_not_an_error(tmp_path: Path, damage: str) -> None:
    idx = PageIndex.load(str(tmp_path), "s")
    idx.put("a", base())
    idx.save()
    path = tmp_path / "s.idx"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-3] ^= 1
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[:-PAGE_HASH_BYTES]))
    elif damage == "garbage":
        path.write_bytes(b"garbage")
    else:
        path.rename(tmp_path / "real")
        path.symlink_to(tmp_path / "real")
    assert len(PageIndex.load(str(tmp_path), "s")) == 0


def test_the_page_index_keeps_the_most_recent_scopes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pageindex, "MAX_FILES", 3)
    for i in range(5):
        idx = PageIndex.load(str(tmp_path), f"s{i}")
        idx.put("a", base())
        idx.save()
        os.utime(tmp_path / f"s{i}.idx", (1000 + i, 1000 + i))
    idx = PageIndex.load(str(tmp_path), "s5")
    idx.put("a", base())
    idx.save()
    assert sorted(p.name for p in tmp_path.iterdir()) == [pageindex.KEY_FILE, "s3.idx", "s4.idx", "s5.idx"]


def test_the_page_index_keeps_the_newest_scopes_within_the_node_byte_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(pageindex.ENV_BUDGET_MIB, "1")
    for i in range(5):  # scopes of 400 KiB: two fit in 1 MiB beside the one being saved
        (tmp_path / f"old{i}.idx").write_bytes(b"x" * (400 << 10))
        os.utime(tmp_path / f"old{i}.idx", (1000 + i, 1000 + i))
    (tmp_path / "other.txt").write_bytes(b"x" * (2 << 20))  # not an index: never touched
    idx = PageIndex.load(str(tmp_path), "now")
    idx.put("a", base())
    idx.save()
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == ["now.idx", "old3.idx", "old4.idx", "other.txt", pageindex.KEY_FILE]
    # the scope just saved stays even when it alone is over the budget (and its clock is behind): the rest go
    (tmp_path / "big.idx").write_bytes(b"x" * (3 << 20))
    os.utime(tmp_path / "big.idx", (1, 1))
    pageindex._prune(str(tmp_path), keep="big.idx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.idx", "other.txt", pageindex.KEY_FILE]


@pytest.mark.parametrize(
    ("value", "mib"), [("", 1024), ("0", 1024), ("-5", 1024), ("abc", 1024), (" 64 ", 64), ("2048", 2048)]
)
def test_the_page_index_budget_is_a_positive_number_of_mib_else_the_default(value: str, mib: int) -> None:
    assert pageindex.budget_bytes({pageindex.ENV_BUDGET_MIB: value}) == mib << 20
    assert pageindex.budget_bytes({}) == pageindex.DEFAULT_BUDGET_MIB << 20


def test_scopes_differ_by_pod_repository_container_and_key() -> None:
    k = pageindex.scope_key("r:5000", "repo", "uid-a", "app", None)
    assert k != pageindex.scope_key("r:5000", "repo2", "uid-a", "app", None)
    assert k != pageindex.scope_key("r:5000", "repo", "uid-a", "app2", None)
    assert k != pageindex.scope_key("r:5000", "repo", "uid-a", "app", "k1-abc")
    # two pods of one policy: same repository, same container name, never one index
    assert k != pageindex.scope_key("r:5000", "repo", "uid-b", "app", None)


def test_the_node_key_is_made_once_private_and_replaced_when_damaged(tmp_path: Path) -> None:
    d = tmp_path / "page-index"
    key = pageindex.node_key(str(d))
    assert len(key) == 32 and pageindex.node_key(str(d)) == key
    assert (d / pageindex.KEY_FILE).stat().st_mode & 0o777 == 0o600
    assert d.stat().st_mode & 0o777 == 0o700
    assert PageIndex.load(str(d), "s").key == key
    (d / pageindex.KEY_FILE).write_bytes(b"short")
    fresh = pageindex.node_key(str(d))
    assert len(fresh) == 32 and fresh != key and pageindex.node_key(str(d)) == fresh


def test_an_index_hashed_with_another_key_is_never_read(tmp_path: Path) -> None:
    idx = PageIndex.load(str(tmp_path), "s")
    idx.put("a", base())
    idx.save()
    assert len(PageIndex.load(str(tmp_path), "s")) == 1
    # the same file under another node's key (or a key made again after its file was lost)
    (tmp_path / pageindex.KEY_FILE).write_bytes(bytes(32))
    assert len(PageIndex.load(str(tmp_path), "s")) == 0


def _pages_dir(d: Path, pages: bytes, vaddr: int = 0x7F0000000000) -> Path:
    from tests.unit.test_chunks import write_pagemap

    d.mkdir()
    (d / "pages-1.img").write_bytes(pages)
    write_pagemap(d / "pagemap-1.img", 1, [{1: vaddr, 4: 4, 5: len(pages) // PAGE_SIZE}])
    return d


def test_an_index_an_older_agent_wrote_is_never_read(tmp_path: Path) -> None:
    """Older agents hashed pages with unkeyed XXH3-128 (format v2 of the index file). Such a file, though
    its hashes would match the pages exactly, is not compared with anything: the next save is full."""
    import xxhash

    from kubectl_snapshot.core.reference import Reference
    from shim.engine.chunks import plan_checkpoint
    from shim.engine.stream import push_chunks
    from tests.support.fakenode import FakeRegistry

    pages = bytearray(chunk(1024, seed=5))
    reg, ref = FakeRegistry(), Reference.parse("registry.test/app:v1")
    plans = plan_checkpoint(str(_pages_dir(tmp_path / "d1", bytes(pages))))
    first = push_chunks(reg, ref, plans)
    # the v2 file the older agent kept after that save: its bases with their pages' XXH3-128
    parts, meta = [], []
    for i, c in enumerate(first.files[0].chunks):
        keys, lay = plans[0].layout(i)
        raw = bytes(pages[c.offset : c.offset + c.length])
        hashes = b"".join(xxhash.xxh3_128_digest(raw[j : j + PAGE_SIZE]) for j in range(0, len(raw), PAGE_SIZE))
        parts += [lay, hashes]
        meta.append([keys[0], c.digest, c.size, c.length, c.digest.removeprefix("sha256:"), [len(lay), len(hashes)]])
    head = json.dumps({"entries": meta, "aliases": {}}).encode()
    body = struct.pack("<I", len(head)) + head + b"".join(parts)
    index_dir = tmp_path / "index"
    index_dir.mkdir()
    (index_dir / "s.idx").write_bytes(b"KSPIDX2\n" + hashlib.sha256(body).digest() + body)

    pages[3 * PAGE_SIZE] ^= 1  # one page changed: against a base that is read, a one-page delta
    index = PageIndex.load(str(index_dir), "s")
    assert len(index) == 0
    second = push_chunks(reg, ref, plan_checkpoint(str(_pages_dir(tmp_path / "d2", bytes(pages)))), index=index)
    assert all(c.delta is None for c in second.files[0].chunks)


def test_a_pods_save_never_takes_another_pods_bases(tmp_path: Path) -> None:
    """Two pods of one policy (same repository, same container name) on one node: pod B's save has no
    base from pod A's, though A's last save holds B's pages but one; A's own next save does."""
    from kubectl_snapshot.core.model import PodRecord
    from kubectl_snapshot.core.reference import Reference
    from shim.engine.checkpoint import CheckpointRequest, checkpoint
    from shim.engine.staging import StatePaths
    from tests.support.fakenode import FakeContainerd, FakeRegistry
    from tests.unit.test_chunks import write_pagemap

    memory = {"ca": bytearray(chunk(1024, seed=9))}
    memory["cb"] = bytearray(memory["ca"])
    memory["cb"][700 * PAGE_SIZE] ^= 1  # pod B: the same program and data, one page differs

    class Dumping(FakeContainerd):
        def checkpoint_task(self, cid: str, *, image_path: str, work_path: str, **kw: Any) -> None:
            super().checkpoint_task(cid, image_path=image_path, work_path=work_path, **kw)
            Path(image_path, "pages-1.img").write_bytes(bytes(memory[cid]))
            write_pagemap(Path(image_path, "pagemap-1.img"), 1, [{1: 0x7F0000000000, 4: 4, 5: 1024}])

    reg, paths = FakeRegistry(), StatePaths(str(tmp_path))
    host = HostFacts(kernel="6.18", arch="x86_64", criu_version="4.2.1")

    def save(cid: str, uid: str, tag: str) -> SnapshotConfig:
        req = CheckpointRequest(
            containers=[cid],
            names=["app"],
            target=Reference.parse(f"127.0.0.1:5000/team/autosave:{tag}"),
            namespace="team",
            pod=PodRecord(name=f"pod-{uid}", namespace="team", uid=uid),
        )
        checkpoint(req, containerd=Dumping({cid}), registry=reg, paths=paths, host=host)
        return parse_config(reg.blobs[json.loads(reg.manifests[tag])["config"]["digest"]])

    save("ca", "uid-a", "a1")
    b = save("cb", "uid-b", "b1")
    # whole chunks: no base of A's
    assert b.format_version == C.FORMAT_VERSION and not delta_digests(b.containers[0].pages)
    memory["ca"][700 * PAGE_SIZE] ^= 1
    a = save("ca", "uid-a", "a2")
    assert a.format_version == C.DELTA_FORMAT_VERSION and delta_digests(a.containers[0].pages)  # A's own base: a delta


def test_window_keys_name_every_window_a_chunk_covers_first_page_first() -> None:
    from shim.engine.chunks import MAX_WINDOW_KEYS, window_keys

    span = 16 * PAGE_SIZE
    keys = window_keys("pages-1.img", span, layout((40, 4), (60, 20)))  # windows 2; 3, 4
    assert len(keys) == 3 and len(set(keys)) == 3
    # the same range with a page merged in before it still shares its windows
    assert set(keys) <= set(window_keys("pages-1.img", span, layout((10, 1), (40, 4), (60, 20))))
    assert not set(keys) & set(window_keys("pages-2.img", span, layout((40, 4), (60, 20))))  # another file
    assert not set(keys) & set(window_keys("pages-1.img", 2 * span, layout((40, 4), (60, 20))))  # another span
    assert len(window_keys("pages-1.img", span, layout((0, 16 * 100)))) == MAX_WINDOW_KEYS


def test_sealed_chunks_converge_with_and_without_a_page_index(tmp_path: Path) -> None:
    """The same pages seal to the same blobs whether or not the agent hashes pages for page deltas (the
    data key's seed is the compressed chunk's sha256 either way), so an agent with page deltas off, or a
    node without an index, still finds what another one stored."""
    from kubectl_snapshot.core.reference import Reference
    from kubectl_snapshot.core.sealing import LocalNamespaceKey, Sealer
    from shim.engine.chunks import plan_checkpoint
    from shim.engine.pageindex import PageIndex
    from shim.engine.stream import push_chunks
    from tests.support.fakenode import FakeRegistry
    from tests.unit.test_chunks import write_pagemap

    n = 2048 + 7
    (tmp_path / "pages-1.img").write_bytes(chunk(n))
    write_pagemap(tmp_path / "pagemap-1.img", 1, [{1: 0x7F0000000000, 4: 4, 5: n}])
    plans = plan_checkpoint(str(tmp_path))
    assert len(plans[0].spans) > 1 and all(plans[0].keys)
    key = LocalNamespaceKey(bytes(range(32)))
    ref = Reference.parse("registry.test/app:v1")
    index = PageIndex.load(str(tmp_path / "index"), "scope")
    with_index = push_chunks(FakeRegistry(), ref, plans, sealer=Sealer(key, "ns"), index=index)
    without = push_chunks(FakeRegistry(), ref, plans, sealer=Sealer(key, "ns"))
    assert [c.digest for c in with_index.files[0].chunks] == [c.digest for c in without.files[0].chunks]
    assert len(index._new) == len(plans[0].spans)  # the pages were hashed for the next save


def test_a_chunk_cut_differently_finds_its_base_by_any_window_the_base_covered(tmp_path: Path) -> None:
    """A small piece of pages in front of a range is merged into the range's chunk (its first window is
    the piece's); once the piece grows into a chunk of its own, the range's chunk starts with a window
    that was not the base's first: found through the index's aliases, it is a delta, not sent whole
    (bench/run.py's object heap did this about once in four saves)."""
    from kubectl_snapshot.core.reference import Reference
    from shim.engine.chunks import plan_checkpoint
    from shim.engine.pageindex import PageIndex
    from shim.engine.stream import push_chunks
    from tests.support.fakenode import FakeRegistry
    from tests.unit.test_chunks import write_pagemap

    span = 8 << 20  # 2048 pages; a piece under a quarter of it is merged into the next chunk
    top = 0x10000000 + span  # the range starts at a window boundary; the piece ends just before it
    n = 1200
    rng_pages = chunk(n, seed=7)
    ref = Reference.parse("registry.test/app:v1")
    reg = FakeRegistry()

    def save(piece: int, d: Path) -> Any:
        d.mkdir()
        (d / "pages-1.img").write_bytes(bytes(chunk(piece, seed=piece)) + bytes(rng_pages))
        write_pagemap(d / "pagemap-1.img", 1, [{1: top - piece * PAGE_SIZE, 4: 4, 5: piece}, {1: top, 4: 4, 5: n}])
        plans = plan_checkpoint(str(d), span=span)
        index = PageIndex.load(str(tmp_path / "index"), "scope")
        pushed = push_chunks(reg, ref, plans, index=index)
        index.save()
        return plans, pushed

    plans, first = save(16, tmp_path / "d1")
    assert len(plans[0].spans) == 1 and len(plans[0].keys[0]) == 2  # the piece merged: two windows
    plans, second = save(600, tmp_path / "d2")
    assert len(plans[0].spans) == 2  # the piece is a chunk of its own now
    _, rest = second.files[0].chunks
    assert rest.delta is not None and rest.digest == first.files[0].chunks[0].digest
    assert rest.delta.pages == 0  # the range's pages all come from the base
    assert second.uploaded < 0.6 * first.uploaded  # the piece (new pages) and a tiny delta, not the range again


def test_a_page_delta_is_sent_without_asking_the_registry_first(tmp_path: Path) -> None:
    """A delta holds the pages that changed in this save: no registry can have it, so it goes up without
    a lookup (one round trip less per changed chunk); whole chunks are still looked up (another
    snapshot may have stored them)."""
    from kubectl_snapshot.core.reference import Reference
    from shim.engine.chunks import plan_checkpoint
    from shim.engine.pageindex import PageIndex
    from shim.engine.stream import push_chunks
    from tests.support.fakenode import FakeRegistry
    from tests.unit.test_chunks import write_pagemap

    class Recording(FakeRegistry):
        def __init__(self) -> None:
            super().__init__()
            self.pushes: list[tuple[str, bool]] = []

        def push_blob(self, ref: Reference, **kw: Any) -> bool:
            self.pushes.append((kw["digest"], bool(kw.get("fresh"))))
            return super().push_blob(ref, **kw)

    n = 1024
    pages = bytearray(chunk(n, seed=3))
    reg, ref = Recording(), Reference.parse("registry.test/app:v1")

    def save(d: Path) -> Any:
        d.mkdir()
        (d / "pages-1.img").write_bytes(bytes(pages))
        write_pagemap(d / "pagemap-1.img", 1, [{1: 0x7F0000000000, 4: 4, 5: n}])
        index = PageIndex.load(str(tmp_path / "index"), "scope")
        pushed = push_chunks(reg, ref, plan_checkpoint(str(d)), index=index)
        index.save()
        return pushed

    first = save(tmp_path / "d1")
    assert reg.pushes and not any(fresh for _, fresh in reg.pushes)  # whole chunks: looked up first
    reg.pushes.clear()
    pages[5 * PAGE_SIZE : 6 * PAGE_SIZE] = bytes(PAGE_SIZE)  # one page changed
    second = save(tmp_path / "d2")
    [c] = [c for c in second.files[0].chunks if c.delta is not None]
    assert reg.pushes == [(c.delta.digest, True)]
    assert c.digest == first.files[0].chunks[0].digest
