"""Build hand-crafted (also malicious) tar archives in memory for extraction tests.

``craft_tar([reg("a", b"x"), sym("d", "/etc"), reg("d/passwd", b"pwn")])`` returns the tar bytes;
tarfile is used only to *write*, so names and links are exactly what the test says.
"""

from __future__ import annotations

import io
import tarfile
from dataclasses import dataclass, field


@dataclass
class Entry:
    name: str
    kind: bytes = tarfile.REGTYPE
    data: bytes = b""
    linkname: str = ""
    mode: int = 0o644
    uid: int = 0
    gid: int = 0
    mtime: int = 1_700_000_000
    devmajor: int = 0
    devminor: int = 0
    pax: dict[str, str] = field(default_factory=dict)


def reg(name: str, data: bytes = b"", mode: int = 0o644, uid: int = 0, gid: int = 0) -> Entry:
    return Entry(name, tarfile.REGTYPE, data, mode=mode, uid=uid, gid=gid)


def dir_(name: str, mode: int = 0o755) -> Entry:
    return Entry(name, tarfile.DIRTYPE, mode=mode)


def sym(name: str, target: str) -> Entry:
    return Entry(name, tarfile.SYMTYPE, linkname=target, mode=0o777)


def hard(name: str, target: str) -> Entry:
    return Entry(name, tarfile.LNKTYPE, linkname=target)


def dev(name: str, kind: bytes = tarfile.CHRTYPE, major: int = 1, minor: int = 3) -> Entry:
    return Entry(name, kind, devmajor=major, devminor=minor)


def craft_tar(entries: list[Entry], *, fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for e in entries:
            ti = tarfile.TarInfo(e.name)
            ti.type, ti.mode, ti.uid, ti.gid, ti.mtime = e.kind, e.mode, e.uid, e.gid, e.mtime
            ti.linkname, ti.devmajor, ti.devminor = e.linkname, e.devmajor, e.devminor
            if e.pax:
                ti.pax_headers = dict(e.pax)
            if e.kind == tarfile.REGTYPE:
                ti.size = len(e.data)
                tf.addfile(ti, io.BytesIO(e.data))
            else:
                tf.addfile(ti)
    return buf.getvalue()
