"""Chunk boundaries (stable under changes elsewhere), tiling checks on untrusted configs, the pagemap reader."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest

from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.chunks import (
    MAX_CHUNK_BYTES,
    MAX_SPAN,
    MIN_SPAN,
    PAGE_SIZE,
    Chunk,
    PagemapRun,
    PagesFile,
    Span,
    choose_span,
    chunk_digests,
    fixed_chunks,
    parse_pages_files,
    plan_chunks,
)
from kubectl_snapshot.core.errors import FailedPrecondition
from kubectl_snapshot.core.model import ContainerRecord, HostFacts, SnapshotConfig, check_layers_match, parse_config
from shim.engine.chunks import IMG_COMMON_MAGIC, PAGEMAP_MAGIC, plan_checkpoint, read_pagemap

D = ["sha256:" + c * 64 for c in "0123456789abcdef"]
SPAN = MIN_SPAN
PAGES_PER_SPAN = SPAN // PAGE_SIZE


def tiles(spans: list[Span], size: int) -> bool:
    pos = 0
    for s in spans:
        if s.offset != pos or s.length <= 0:
            return False
        pos += s.length
    return pos == size


def contents(spans: list[Span], runs: list[PagemapRun]) -> list[tuple[int, ...]]:
    """The virtual page addresses each chunk holds (what decides whether its bytes can repeat)."""
    addrs = [r.vaddr + i * PAGE_SIZE for r in runs for i in range(r.nr_pages)]
    return [tuple(addrs[s.offset // PAGE_SIZE : (s.offset + s.length) // PAGE_SIZE]) for s in spans]


def test_span_is_a_power_of_two_near_total_over_target_and_stable_near_boundaries() -> None:
    assert choose_span(0) == MIN_SPAN
    assert choose_span(16 << 20) == MIN_SPAN == 4 << 20
    assert choose_span(32 << 20) == 8 << 20
    assert choose_span(64 << 20) == 16 << 20  # a small pod: a few blobs (each costs registry requests)
    assert choose_span(512 << 20) == 16 << 20
    assert choose_span(2 << 30) == MAX_SPAN == MAX_CHUNK_BYTES == 16 << 20
    # a process just over a power of two keeps the same span (rounding in log space, not up)
    assert choose_span((32 << 20) + (8 << 20)) == choose_span((32 << 20) - (8 << 20))
    assert choose_span((64 << 20) + (12 << 20)) == choose_span((64 << 20) - (12 << 20))


def test_chunks_cut_at_aligned_addresses_and_tile_the_file() -> None:
    runs = [PagemapRun(0x10000000 + 3 * PAGE_SIZE, 2 * PAGES_PER_SPAN)]  # starts 3 pages into a window
    size = 2 * SPAN
    spans = plan_chunks(runs, size, SPAN)
    assert tiles(spans, size)
    assert [s.length for s in spans] == [SPAN - 3 * PAGE_SIZE, SPAN, 3 * PAGE_SIZE]
    assert all(s.length <= SPAN for s in spans)


def test_a_new_mapping_before_the_heap_does_not_change_the_heap_chunks() -> None:
    heap = PagemapRun(0x7F0000000000, 8 * PAGES_PER_SPAN)
    before = [PagemapRun(0x1000, 5), heap]
    after = [PagemapRun(0x1000, 5), PagemapRun(0x200000, 17), heap]  # the process mapped something new
    s1 = plan_chunks(before, sum(r.nr_pages for r in before) * PAGE_SIZE, SPAN)
    s2 = plan_chunks(after, sum(r.nr_pages for r in after) * PAGE_SIZE, SPAN)
    heap1 = [c for c in contents(s1, before) if c and c[0] >= heap.vaddr]
    heap2 = [c for c in contents(s2, after) if c and c[0] >= heap.vaddr]
    assert heap1 == heap2 and len(heap1) == 8
    # whereas fixed offsets would have shifted every heap chunk
    f1 = contents(fixed_chunks(s1[-1].offset + s1[-1].length, SPAN), before)
    f2 = contents(fixed_chunks(s2[-1].offset + s2[-1].length, SPAN), after)
    assert not set(f1[1:]) & set(f2[1:])


def test_small_neighbours_are_merged_but_never_beyond_a_span() -> None:
    runs = [PagemapRun(i * SPAN * 4, 1) for i in range(40)]  # 40 single pages in 40 windows
    spans = plan_chunks(runs, 40 * PAGE_SIZE, SPAN)
    assert tiles(spans, 40 * PAGE_SIZE)
    assert len(spans) < 5 and all(s.length <= SPAN for s in spans)


def test_runs_that_do_not_match_the_file_fall_back_to_fixed_offsets() -> None:
    spans = plan_chunks([PagemapRun(0, 3)], 10 * PAGE_SIZE, SPAN)
    assert spans == fixed_chunks(10 * PAGE_SIZE, SPAN) == [Span(0, 10 * PAGE_SIZE)]
    with pytest.raises(ValueError):
        plan_chunks([], 0, 1000)


def pages(chunks: list[dict[str, Any]], size: int, name: str = "pages-1.img") -> dict[str, Any]:
    return {"name": name, "size": size, "chunks": chunks}


def ch(offset: int, length: int, digest: str = D[1], size: int = 100) -> dict[str, Any]:
    return {"offset": offset, "length": length, "digest": digest, "size": size}


def test_a_valid_chunk_list_round_trips() -> None:
    raw = [pages([ch(0, 8192), ch(8192, 4096, D[2])], 12288)]
    files = parse_pages_files(raw, "c")
    assert files[0].chunks[1] == Chunk(8192, 4096, D[2], 100)
    assert [f.to_dict() for f in files] == raw
    assert chunk_digests(files) == [D[1], D[2]]


@pytest.mark.parametrize(
    "raw, why",
    [
        ([pages([ch(0, 4096), ch(8192, 4096)], 12288)], "gap"),
        ([pages([ch(0, 8192), ch(4096, 8192)], 12288)], "gap or overlap"),
        ([pages([ch(0, 4096)], 8192)], "cover"),
        ([pages([ch(0, 4096)], 4096, name="../pages-1.img")], "name"),
        ([pages([ch(0, 4096)], 4096, name="pages-1.img/x")], "name"),
        ([pages([ch(0, 4096)], 4096), pages([ch(0, 4096)], 4096)], "twice"),
        ([pages([ch(0, 4096, digest="md5:abc")], 4096)], "digest"),
        ([pages([ch(0, MAX_CHUNK_BYTES + 4096)], MAX_CHUNK_BYTES + 4096)], "length"),
        ([pages([ch(0, 4096, size=1 << 30)], 4096)], "blob size"),
        ([pages([ch(0, 0)], 0)], "length"),
        ([pages([ch(-4096, 4096)], 0)], "offset"),
        ({"name": "pages-1.img"}, "not a list"),
    ],
)
def test_bad_chunk_lists_are_refused(raw: Any, why: str) -> None:
    with pytest.raises(FailedPrecondition) as e:
        parse_pages_files(raw, "container 0")
    assert why in e.value.message


def config_with(pages_raw: list[dict[str, Any]], version: int) -> bytes:
    rec = ContainerRecord(name="c", id="c", image="", image_digest="", layer_digest=D[0], spec={})
    cfg = SnapshotConfig(group="g", namespace="n", created="t", containers=(rec,), host=HostFacts())
    d = cfg.to_dict()
    d["formatVersion"] = version
    d["containers"][0]["pages"] = pages_raw
    import json

    return json.dumps(d).encode()


def test_config_v2_carries_chunks_and_every_chunk_must_be_a_manifest_layer() -> None:
    cfg = parse_config(config_with([pages([ch(0, 4096, D[3])], 4096)], 2))
    assert cfg.format_version == 2 and cfg.containers[0].pages[0].chunks[0].digest == D[3]
    assert parse_config(cfg.to_bytes()) == cfg
    check_layers_match(cfg, [D[0], D[3]])
    with pytest.raises(FailedPrecondition, match="chunk"):
        check_layers_match(cfg, [D[0]])


def test_v1_configs_still_read_but_cannot_carry_chunks_and_v5_is_refused() -> None:
    assert parse_config(config_with([], 1)).format_version == 1
    with pytest.raises(FailedPrecondition, match="v1"):
        parse_config(config_with([pages([ch(0, 4096)], 4096)], 1))
    with pytest.raises(FailedPrecondition, match="not supported"):
        parse_config(config_with([], 5))
    assert C.FORMAT_VERSION in C.SUPPORTED_FORMAT_VERSIONS


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def pb(fields: dict[int, int]) -> bytes:
    return b"".join(varint(k << 3) + varint(v) for k, v in fields.items())


def write_pagemap(path: Path, pages_id: int, entries: list[dict[int, int]]) -> None:
    msgs = [pb({1: pages_id}), *(pb(e) for e in entries)]
    path.write_bytes(
        struct.pack("<II", IMG_COMMON_MAGIC, PAGEMAP_MAGIC) + b"".join(struct.pack("<I", len(m)) + m for m in msgs)
    )


def test_pagemap_reader_keeps_present_pages_only(tmp_path: Path) -> None:
    write_pagemap(
        tmp_path / "pagemap-7.img",
        3,
        [
            {1: 0x400000, 2: 0, 4: 4, 5: 2},  # present (nr_pages in field 5, CRIU >= 3.x)
            {1: 0x500000, 2: 3, 4: 6},  # present + lazy, compat_nr_pages only
            {1: 0x600000, 4: 1, 5: 9},  # in the parent image: not in this pages file
            {1: 0x700000, 4: 0, 5: 9},  # not present (e.g. zero pages)
        ],
    )
    pages_id, runs = read_pagemap(str(tmp_path / "pagemap-7.img"))
    assert pages_id == 3
    assert runs == [PagemapRun(0x400000, 2), PagemapRun(0x500000, 3)]


def test_plan_checkpoint_uses_the_pagemap_and_leaves_small_page_files_in_the_layer(tmp_path: Path) -> None:
    n = 3 * PAGES_PER_SPAN
    write_pagemap(tmp_path / "pagemap-1.img", 1, [{1: 0x7F0000000000 + PAGE_SIZE, 4: 4, 5: n}])
    (tmp_path / "pages-1.img").write_bytes(b"\0" * n * PAGE_SIZE)
    (tmp_path / "pages-2.img").write_bytes(b"\0" * PAGE_SIZE)  # tiny: stays in the tar layer
    write_pagemap(tmp_path / "pagemap-2.img", 2, [{1: 0x1000, 4: 4, 5: 1}])
    plans = plan_checkpoint(str(tmp_path), span=SPAN)
    assert [p.name for p in plans] == ["pages-1.img"]
    assert [s.length for s in plans[0].spans] == [SPAN - PAGE_SIZE, SPAN, SPAN, PAGE_SIZE]
    # a corrupt pagemap only costs stability: fixed offsets, still a tiling
    (tmp_path / "pagemap-1.img").write_bytes(b"garbage!")
    plans = plan_checkpoint(str(tmp_path), span=SPAN)
    assert [s.length for s in plans[0].spans] == [SPAN, SPAN, SPAN]


def test_pages_file_record_validates_on_construction_from_dict() -> None:
    pf = PagesFile.from_dict(pages([ch(0, 4096)], 4096), "x")
    assert pf.size == 4096
