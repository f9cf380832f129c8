#!/usr/bin/env python3
"""Build kubectl-snapshot-runc.pyz: the runtime wrapper as one zipapp for the host's bare python3.

Why a zipapp: containerd runs the wrapper on the HOST (runc shim option ``BinaryName``), where only
Debian's /usr/bin/python3 (3.11, stdlib only) can be assumed. The wrapper's import closure is pure
Python and stdlib-only (the import-linter contract "the runtime wrapper stays light" in pyproject.toml
checks it), so the zipapp holds exactly that closure: the modules of this repository that
shim/runtime_wrapper.py imports, directly or not (every import statement counts, lazy ones included),
with their packages' ``__init__.py``, plus ``__main__.py -> shim.runtime_wrapper:main``.

The archive is reproducible (sorted entries, fixed timestamps), so its digest only changes with the
sources. Each module also gets a legacy ``.pyc`` beside it (unchecked-hash, compiled by the Python
running this script): zipimport uses it when the host Python has the same magic number and falls
back to the source otherwise, so a pass-through ``runc state`` does not pay for compiling.

Usage: hack/build-wrapper-pyz.py OUT.pyz   (run it with the host's /usr/bin/python3 for matching .pyc)
"""

from __future__ import annotations

import importlib.util
import io
import py_compile
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from import_closure import closure

REPO = Path(__file__).resolve().parents[1]
ENTRY = "shim.runtime_wrapper"
MAIN = (
    '"""kubectl-snapshot-runc: runc-compatible runtime that restores staged snapshots on create."""\n'
    "from shim.runtime_wrapper import main\n\nmain()\n"
)
SHEBANG = b"#!/usr/bin/python3 -I -S\n"
EPOCH = (1980, 1, 1, 0, 0, 0)


def sources() -> list[Path]:
    """The wrapper's files (its import closure in this repository), relative to the repository, sorted."""
    return closure([ENTRY], REPO)


def _compiled(rel: Path, source: bytes) -> bytes | None:
    """Unchecked-hash bytecode of `source` (None if it does not compile: leave that to the source)."""
    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp, rel.name), Path(tmp, rel.name + "c")
        src.write_bytes(source)
        try:
            py_compile.compile(
                str(src),
                cfile=str(out),
                dfile=str(rel),
                doraise=True,
                invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
            )
        except py_compile.PyCompileError:
            return None
        return out.read_bytes()


def _add(zf: zipfile.ZipFile, name: str, data: bytes) -> None:
    info = zipfile.ZipInfo(name, date_time=EPOCH)
    info.external_attr = 0o644 << 16
    # stored, not deflated: every module the hook imports would be inflated at each container create
    # (and zipimport would import zlib first); the archive's size does not matter on a node
    info.compress_type = zipfile.ZIP_STORED
    zf.writestr(info, data)


def build(out: Path) -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        entries: dict[str, bytes] = {"__main__.py": MAIN.encode()}
        for rel in sources():
            entries[rel.as_posix()] = (REPO / rel).read_bytes()
        for name in sorted(entries):
            _add(zf, name, entries[name])
            code = _compiled(Path(name), entries[name])
            if code is not None:
                _add(zf, name + "c", code)
    tmp = out.with_name(f".{out.name}.partial")
    tmp.write_bytes(SHEBANG + buf.getvalue())
    tmp.chmod(0o755)
    tmp.replace(out)


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    out = Path(argv[0]).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    build(out)
    magic = importlib.util.MAGIC_NUMBER.hex()
    print(f"{out} (python {sys.version_info.major}.{sys.version_info.minor} bytecode, magic {magic})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
