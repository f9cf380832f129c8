"""CRIU's page-server protocol (criu/page-xfer.c of 4.1 and 4.2) and the lazy layout of a dump."""

from __future__ import annotations

import struct

import pytest

from shim.criu import pageproto as pp
from shim.criu.pageproto import PAGE_SIZE, PagemapEntry, PageRange, Vma

ANON = pp.MAP_PRIVATE | pp.MAP_ANONYMOUS
P = PAGE_SIZE


def test_the_layout_follows_the_criu_version() -> None:
    # criu 4.2 (7e0da4d97) made nr_pages a u64: 32 bytes with the padding after cmd; 4.1 sends 24
    assert pp.iov_layout("4.2.1") is pp.LAYOUT_32 and pp.LAYOUT_32.size == 32
    assert pp.iov_layout("4.2") is pp.LAYOUT_32
    assert pp.iov_layout("5.0") is pp.LAYOUT_32
    assert pp.iov_layout("4.1.1") is pp.LAYOUT_24 and pp.LAYOUT_24.size == 24
    assert pp.iov_layout("3.17.1") is pp.LAYOUT_24
    with pytest.raises(pp.ProtocolError):
        pp.iov_layout("unknown")


def test_a_get_as_criu_4_2_sends_it() -> None:
    # struct page_server_iov {u32 cmd; u64 nr_pages; u64 vaddr; u64 dst_id} on x86-64 / arm64
    wire = struct.pack("<IIQQQ", 7, 0, 3, 0x7F0000001000, 42)
    iov = pp.decode_iov(wire, pp.LAYOUT_32)
    assert iov == pp.Iov(cmd=pp.PS_IOV_GET, nr_pages=3, vaddr=0x7F0000001000, dst_id=42)
    assert iov.length == 3 * P
    assert pp.get_request(42, 0x7F0000001000, 3).encode(pp.LAYOUT_32) == wire


def test_a_get_as_criu_4_1_sends_it() -> None:
    wire = struct.pack("<IIQQ", 7, 3, 0x7F0000001000, 42)
    assert pp.decode_iov(wire, pp.LAYOUT_24) == pp.get_request(42, 0x7F0000001000, 3)
    assert pp.get_request(42, 0x7F0000001000, 3).encode(pp.LAYOUT_24) == wire


def test_the_other_layout_is_refused_not_misread() -> None:
    # a 4.1 GET read as 4.2 (and the reverse) does not decode into some other request
    with pytest.raises(pp.ProtocolError, match="32 bytes"):
        pp.decode_iov(pp.get_request(1, P, 1).encode(pp.LAYOUT_24), pp.LAYOUT_32)
    with pytest.raises(pp.ProtocolError):
        pp.decode_iov(struct.pack("<IIQQ", 0xDEAD, 1, 2, 3), pp.LAYOUT_24)
    # flags belong to ADD_F only
    with pytest.raises(pp.ProtocolError):
        pp.decode_iov(struct.pack("<IIQQ", pp.encode_cmd(pp.PS_IOV_GET, pp.PE_PRESENT), 1, 2, 3), pp.LAYOUT_24)


def test_pages_reply_is_add_f_present_with_the_request_address() -> None:
    req = pp.get_request(7, 0x1000, 8)
    reply = pp.pages_reply(req, 5)
    wire = reply.encode(pp.LAYOUT_32)
    # the daemon keys the completion on (dst_id, vaddr) and copies nr_pages (<= asked) pages
    assert struct.unpack("<IIQQQ", wire) == ((pp.PE_PRESENT << 16) | pp.PS_IOV_ADD_F, 0, 5, 0x1000, 7)
    assert pp.decode_iov(wire, pp.LAYOUT_32) == pp.Iov(pp.PS_IOV_ADD_F, 5, 0x1000, 7, flags=pp.PE_PRESENT)
    for bad in (0, 9):  # CRIU never answers 0 pages (its own server closes instead), nor more than asked
        with pytest.raises(pp.ProtocolError):
            pp.pages_reply(req, bad)
    with pytest.raises(pp.ProtocolError):
        pp.pages_reply(pp.Iov(pp.PS_IOV_CLOSE), 1)


def test_close_and_its_answer() -> None:
    assert pp.decode_iov(struct.pack("<IIQQQ", 0x1023, 0, 0, 0, 0), pp.LAYOUT_32).cmd == pp.PS_IOV_CLOSE
    assert pp.decode_iov(struct.pack("<IIQQ", 0x1024, 0, 0, 0), pp.LAYOUT_24).cmd == pp.PS_IOV_FORCE_CLOSE
    assert pp.close_reply() == b"\0\0\0\0"
    assert pp.close_reply(-1) == b"\xff\xff\xff\xff"


def test_dst_id_of_the_dump_side() -> None:
    assert pp.encode_dst_id(1234) == (1234 << 8) | 1
    assert pp.decode_dst_id(pp.encode_dst_id(1234)) == ("pid", 1234)
    assert pp.decode_dst_id(pp.encode_dst_id(9, shmem=True)) == ("shmem", 9)
    assert pp.decode_dst_id((5 << 8) | 11) == ("pid", 5)  # CRIU 1.3 - 3.0
    assert pp.decode_dst_id((5 << 8) | 34) == ("shmem", 5)
    with pytest.raises(pp.ProtocolError):
        pp.decode_dst_id((5 << 8) | 99)


def test_which_vmas_can_be_lazy() -> None:
    assert pp.can_be_lazy(Vma(0, P, ANON, 0))
    assert not pp.can_be_lazy(Vma(0, P, pp.MAP_PRIVATE, 0))  # file-backed
    assert not pp.can_be_lazy(Vma(0, P, pp.MAP_ANONYMOUS | 0x01, 0))  # shared
    assert not pp.can_be_lazy(Vma(0, P, ANON | pp.MAP_LOCKED, 0))
    assert not pp.can_be_lazy(Vma(0, P, ANON | pp.MAP_HUGETLB, 0))
    assert not pp.can_be_lazy(Vma(0, P, ANON, pp.VMA_AREA_VDSO | 1))
    assert not pp.can_be_lazy(Vma(0, P, ANON, pp.VMA_AREA_VVAR))


def test_lazy_layout_splits_at_vmas_and_stack_pages() -> None:
    base = 0x10000 * P
    vmas = [
        Vma(base, base + 4 * P, pp.MAP_PRIVATE, 0),  # file-backed: eager
        Vma(base + 4 * P, base + 12 * P, ANON, 0),  # heap-like: lazy but for the stack pointer's page
        Vma(base + 20 * P, base + 24 * P, ANON, pp.VMA_AREA_VDSO),
    ]
    # one entry across the first two VMAs (CRIU joins adjacent pages), one in the vDSO
    entries = [PagemapEntry(base + 2 * P, 10, pp.PE_PRESENT), PagemapEntry(base + 20 * P, 2, pp.PE_PRESENT)]
    sp = base + 7 * P + 123
    lay = pp.lazy_layout(vmas, entries, [sp])
    assert lay.entries == (
        PagemapEntry(base + 2 * P, 2, pp.PE_PRESENT),
        PagemapEntry(base + 4 * P, 3, pp.PE_LAZY),
        PagemapEntry(base + 7 * P, 1, pp.PE_PRESENT),
        PagemapEntry(base + 8 * P, 4, pp.PE_LAZY),
        PagemapEntry(base + 20 * P, 2, pp.PE_PRESENT),
    )
    assert lay.kept == (
        PageRange(base + 2 * P, 2, 0),
        PageRange(base + 7 * P, 1, 5 * P),
        PageRange(base + 20 * P, 2, 10 * P),
    )
    assert lay.lazy == (PageRange(base + 4 * P, 3, 2 * P), PageRange(base + 8 * P, 4, 6 * P))
    assert lay.kept_pages + lay.lazy_pages == 12


def test_lazy_layout_joins_adjacent_entries_and_keeps_pages_outside_vmas() -> None:
    vmas = [Vma(0x100 * P, 0x110 * P, ANON, 0)]
    entries = [
        PagemapEntry(0x100 * P, 2, pp.PE_PRESENT),
        PagemapEntry(0x102 * P, 3, pp.PE_PRESENT),
        PagemapEntry(0x120 * P, 1, pp.PE_PRESENT),  # no VMA: left for the restore, which will say so
    ]
    lay = pp.lazy_layout(vmas, entries, [])
    assert lay.lazy == (PageRange(0x100 * P, 5, 0),)
    assert lay.entries == (PagemapEntry(0x100 * P, 5, pp.PE_LAZY), PagemapEntry(0x120 * P, 1, pp.PE_PRESENT))
    assert lay.kept == (PageRange(0x120 * P, 1, 5 * P),)


def test_lazy_entries_are_cut_below_what_criu_lazy_pages_can_take() -> None:
    # a 3 GiB anonymous range (a training job's tensor): one eager entry, lazy in pieces CRIU's daemon takes
    n = (3 << 30) // P
    base = 0x7F0000000000
    lay = pp.lazy_layout([Vma(base, base + n * P, ANON, 0)], [PagemapEntry(base, n, pp.PE_PRESENT)], [])
    assert all(e.nr_pages <= pp.MAX_LAZY_ENTRY_PAGES and e.flags == pp.PE_LAZY for e in lay.entries)
    assert len(lay.entries) == -(-n // pp.MAX_LAZY_ENTRY_PAGES) and lay.lazy_pages == n
    # in order, back to back, in the pages image as in memory
    for a, b in zip(lay.lazy, lay.lazy[1:], strict=False):
        assert b.vaddr == a.end and b.offset == a.offset + a.nr_pages * P
    index = pp.RangeIndex({1: lay.lazy})
    assert index.find(1, base + (n - 1) * P, 8) == ((n - 1) * P, 1)
    # the legitimate small case stays one entry (the tests above)
    one = pp.lazy_layout([Vma(base, base + 64 * P, ANON, 0)], [PagemapEntry(base, 64, pp.PE_PRESENT)], [])
    assert one.entries == (PagemapEntry(base, 64, pp.PE_LAZY),)


def test_lazy_layout_refuses_incremental_entries() -> None:
    vmas = [Vma(0, 4 * P, ANON, 0)]
    for flags in (pp.PE_PARENT, pp.PE_LAZY, 0):
        with pytest.raises(pp.ProtocolError, match="full dump"):
            pp.lazy_layout(vmas, [PagemapEntry(0, 1, flags)], [])


def test_range_index_finds_offsets_and_bounds_the_answer() -> None:
    idx = pp.RangeIndex({1: [PageRange(0x10 * P, 4, 8 * P), PageRange(0x2 * P, 2, 0)], 2: []})
    assert idx.find(1, 0x10 * P, 1) == (8 * P, 1)
    assert idx.find(1, 0x12 * P, 16) == (10 * P, 2)  # only what the range holds
    assert idx.find(1, 0x3 * P, 4) == (P, 1)
    assert idx.total_pages() == 6
    for pid, addr in ((1, 0x4 * P), (1, 0x14 * P), (1, 0x10 * P + 1), (2, 0x10 * P), (3, 0)):
        with pytest.raises(KeyError):
            idx.find(pid, addr, 1)
