"""The image check against seccomp filters as the real CRIU 4.x writes them (issue 41).

A process of a pod with `seccompProfile: RuntimeDefault` has one filter; one that also sandboxes itself
(a browser, systemd's services, a JVM agent) has more. Each case is the legitimate dump, which must
pass, beside the same images edited to drop or defang the filters, which must be refused for that
reason.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from shim.criu.guard import CAPABILITIES, image_problems
from tests.support.criu_dump import dump_workload

pytestmark = pytest.mark.skipif(importlib.util.find_spec("pycriu") is None, reason="pycriu missing")

# Installs `n` seccomp filters (each: acct(2) -> EPERM, everything else allowed), then forks a child and
# starts a thread, which inherit them, and waits to be dumped.
_WORKLOAD = textwrap.dedent(
    """
    import ctypes, os, struct, sys, threading, time
    PR_SET_SECCOMP, SECCOMP_MODE_FILTER, NR_ACCT = 22, 2, 163
    ins = [(0x20, 0, 0, 0), (0x15, 0, 1, NR_ACCT), (0x06, 0, 0, 0x00050001), (0x06, 0, 0, 0x7FFF0000)]
    code = b"".join(struct.pack("<HBBI", *i) for i in ins)
    buf = ctypes.create_string_buffer(code, len(code))
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    prog = Prog(len(ins), ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    for _ in range(int(sys.argv[2])):
        if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
            sys.exit("prctl: %d" % ctypes.get_errno())
    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    if os.fork() == 0:
        time.sleep(3600)
        os._exit(0)
    open(sys.argv[1], "w").close()
    time.sleep(3600)
    """
)

ALL_CAPS = list(CAPABILITIES)
# What a RuntimeDefault pod's bundle says (the profile's text does not matter to the check: presence)
BUNDLE: dict[str, Any] = {
    "process": {
        "user": {"uid": 0, "gid": 0},
        "capabilities": {k: ALL_CAPS for k in ("bounding", "effective", "permitted", "inheritable")},
    },
    "linux": {
        "seccomp": {"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [{"names": ["read"], "action": "SCMP_ACT_ALLOW"}]}
    },
}


def _dump(tmp_path: Path, filters: int) -> Iterator[Path]:
    for dumped in dump_workload(tmp_path, _WORKLOAD, str(filters)):
        yield dumped.images_dir


@pytest.fixture
def one_filter(tmp_path: Path) -> Iterator[Path]:
    yield from _dump(tmp_path, 1)


@pytest.fixture
def two_filters(tmp_path: Path) -> Iterator[Path]:
    yield from _dump(tmp_path, 2)


def _edit(images: Path, name: str, edit: Any) -> None:
    import pycriu.images as pi

    path = images / name
    with open(path, "rb") as f:
        img = pi.load(f)
    edit(img["entries"])
    with open(path, "wb") as f:
        pi.dump(img, f)


def _cores(images: Path) -> list[str]:
    return sorted(p.name for p in images.glob("core-*.img"))


def test_one_filter_as_criu_writes_it_restores(one_filter: Path) -> None:
    assert image_problems(str(one_filter), BUNDLE, lsms=frozenset()) == []


def test_stacked_filters_as_criu_writes_them_restore(two_filters: Path) -> None:
    assert image_problems(str(two_filters), BUNDLE, lsms=frozenset()) == []


def test_filters_taken_out_of_the_images_are_refused(one_filter: Path) -> None:
    for name in _cores(one_filter):
        _edit(one_filter, name, lambda e: e[0]["thread_core"].update(seccomp_mode="disabled"))
    out = image_problems(str(one_filter), BUNDLE, lsms=frozenset())
    assert out and all("no seccomp filter, but the container has a seccomp profile" in p for p in out), out


def test_filters_rewritten_to_allow_everything_are_refused(two_filters: Path) -> None:
    allow_all = b"\x06\x00\x00\x00" + (0x7FFF0000).to_bytes(4, "little")
    import base64

    def defang(entries: list[dict[str, Any]]) -> None:
        for f in entries[0]["seccomp_filters"]:
            f["filter"] = base64.b64encode(allow_all).decode()

    _edit(two_filters, "seccomp.img", defang)
    out = image_problems(str(two_filters), BUNDLE, lsms=frozenset())
    assert out and all("allows every system call" in p for p in out), out


def test_a_thread_pointed_past_the_filters_is_refused(one_filter: Path) -> None:
    name = _cores(one_filter)[0]
    _edit(one_filter, name, lambda e: e[0]["thread_core"].update(seccomp_filter=7))
    out = image_problems(str(one_filter), BUNDLE, lsms=frozenset())
    assert any("without a valid filter chain" in p for p in out), out


def test_threads_rely_on_the_leaders_tsync_and_without_it_are_refused(one_filter: Path) -> None:
    """CRIU writes the other threads as unfiltered and restores the leader's chain with TSYNC; the same
    images with TSYNC cleared would leave those threads without a filter."""

    def untsync(entries: list[dict[str, Any]]) -> None:
        for f in entries[0]["seccomp_filters"]:
            f["flags"] = 0

    _edit(one_filter, "seccomp.img", untsync)
    out = image_problems(str(one_filter), BUNDLE, lsms=frozenset())
    assert out and all("thread" in p and "no seccomp filter" in p for p in out), out
