#!/usr/bin/env python3
"""Assemble the node bundle: everything kubectl-snapshot runs on a node's host, with its own loader.

A node has no python3, no CRIU and maybe no shell (Bottlerocket, Talos, Flatcar, COS). So the agent
image carries, and `ks-agent install-node` copies to /opt/kubectl-snapshot/NODE/, a
tree that needs nothing of the host's userland:

    lib/ld-linux-x86-64.so.2, lib/*.so*      the dynamic loader and every library below (ELF DT_NEEDED
                                             closure, resolved in ROOT, flattened)
    libexec/criu                             CRIU (4.2.1 from Debian sid, as hack/install-node-deps.sh)
    libexec/python3.X, lib/python3.X/        the interpreter and its stdlib (no site-packages)
    lib/hook-site/pycriu, lib/hook-site/google/{protobuf,_upb}
                                             what the hook's CRIU image check decodes the images with
                                             (shim/criu/guard.py): Debian's pycriu and the protobuf runtime
                                             of --hook-site (the agent's venv: the upb C extension, several
                                             times faster than Debian's pure-Python protobuf); the hook's
                                             launcher names it in KUBECTL_SNAPSHOT_PYCRIU_PATH
    libexec/tar                              GNU tar: what CRIU execs (from PATH) to dump and restore tmpfs
                                             mounts (every container's /dev, /dev/shm, Secret volumes); the
                                             CRIU launcher puts install-node's bin/ (tar's launcher) first in
                                             PATH, and tar's launcher does --gzip itself (GNU tar would run
                                             gzip through /bin/sh)
    kubectl-snapshot-runc.pyz                the runtime wrapper (hack/build-wrapper-pyz.py)
    launcher                                 static ELF (launcher): execs `lib/ld-linux... --library-path
                                             lib libexec/PROG ...` from a .launch file install-node writes
    bundle.json                              versions, where each part came from, sha256 of every file

Programs are run through the bundle's loader (`ld.so --library-path`), so neither the host's loader
nor its libraries are used, and children (runc, the restored processes) see no LD_LIBRARY_PATH.

ROOT is a Debian root file system holding criu and python3 (`/` on a machine prepared by
hack/install-node-deps.sh; a build stage in Containerfile). The result is reproducible for the same
inputs. Usage: hack/node_bundle.py OUT --launcher BIN --pyz PYZ --hook-site SITE [--root ROOT]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

LIB_DIRS = ("lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu", "lib64", "usr/lib64", "lib", "usr/lib")
CRIU_VERSION = "4.2.1"
# programs CRIU runs by name: (file in ROOT, Debian package). GNU tar, as CRIU passes it GNU options
# (--sparse, --check-links, ...); its --gzip is done by the launcher (launcher: gzipFilter).
TOOLS = {"tar": ("/usr/bin/tar", "tar")}
STDLIB_SKIP = {
    "site-packages", "dist-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3",
    "pydoc_data", "distutils", "venv", "unittest", "sqlite3", "curses", "dbm", "xmlrpc", "wsgiref",
}  # fmt: skip
# extension modules nothing on the node imports (and the libraries only they would pull in)
DYNLOAD_SKIP = re.compile(
    r"^(_sqlite3|_dbm|_gdbm|readline|_curses|_curses_panel|_tkinter|_test\w*|xx\w*|_ctypes_test|nis|_crypt|_uuid|_lzma|_bz2|_decimal|_ssl)\."
)
DT_NEEDED, DT_STRTAB = 1, 5


def elf_info(path: Path) -> tuple[str | None, list[str]]:
    """(PT_INTERP, DT_NEEDED names) of a 64-bit little-endian ELF file."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise SystemExit(f"error: {path} is not a 64-bit little-endian ELF file")
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    interp, dynamic, loads = None, None, []
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz, _, _ = struct.unpack_from("<IIQQQQQQ", data, phoff + i * phentsize)
        if p_type == 3:  # PT_INTERP
            interp = data[p_offset : p_offset + p_filesz].rstrip(b"\0").decode()
        elif p_type == 2:  # PT_DYNAMIC
            dynamic = (p_offset, p_filesz)
        elif p_type == 1:  # PT_LOAD
            loads.append((p_vaddr, p_offset, p_filesz))
    if dynamic is None:
        return interp, []
    entries = [struct.unpack_from("<qQ", data, dynamic[0] + o) for o in range(0, dynamic[1], 16)]
    strtab_vaddr = next(v for t, v in entries if t == DT_STRTAB)
    strtab = next(off + strtab_vaddr - va for va, off, size in loads if va <= strtab_vaddr < va + size)
    needed = []
    for tag, val in entries:
        if tag == DT_NEEDED:
            end = data.index(b"\0", strtab + val)
            needed.append(data[strtab + val : end].decode())
    return interp, needed


def in_root(root: Path, path: str) -> Path:
    """`path` (absolute, as the ROOT system sees it) resolved inside ROOT, following symlinks there."""
    p = root / path.lstrip("/")
    for _ in range(40):
        if not p.is_symlink():
            return p
        target = os.readlink(p)
        p = root / target.lstrip("/") if target.startswith("/") else p.parent / target
        p = Path(os.path.normpath(p))
    raise SystemExit(f"error: too many symlinks at {path}")


def find_lib(root: Path, name: str) -> Path:
    for d in LIB_DIRS:
        candidate = in_root(root, f"/{d}/{name}")
        if candidate.is_file():
            return candidate
    raise SystemExit(f"error: library {name} not found under {root}")


def closure(root: Path, binaries: list[Path]) -> tuple[str, dict[str, Path]]:
    """(the loader's file name, {soname: file}) for everything the binaries load."""
    loader: str | None = None
    libs: dict[str, Path] = {}
    todo = list(binaries)
    while todo:
        interp, needed = elf_info(todo.pop())
        if interp:
            loader = os.path.basename(interp)
            libs.setdefault(loader, in_root(root, interp))
        for name in needed:
            if name not in libs:
                libs[name] = find_lib(root, name)
                todo.append(libs[name])
    if loader is None:
        raise SystemExit("error: no program interpreter found (static binaries only?)")
    return loader, libs


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def copy(src: Path, dst: Path, mode: int = 0o644) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    os.chmod(dst, mode)


HOOK_SITE = "lib/hook-site"
# what the hook imports from HOOK_SITE: pycriu (from ROOT, Debian's python3-pycriu: not on PyPI) and
# the protobuf runtime (from --hook-site)
PYCRIU = "/usr/lib/python3/dist-packages/pycriu"
PROTOBUF_DIRS = ("google/protobuf", "google/_upb")


def copy_hook_site(out: Path, root: Path, site: Path) -> list[Path]:
    """pycriu and protobuf into out/HOOK_SITE; returns the extension modules copied (for the closure)."""
    pycriu = in_root(root, PYCRIU)
    if not (pycriu / "images").is_dir():
        raise SystemExit(f"error: {root} has no {PYCRIU}\nhint: hack/install-node-deps.sh (python3-pycriu)")
    if not (site / "google" / "protobuf").is_dir():
        raise SystemExit(f"error: {site} has no google/protobuf\nhint: pass the agent's venv site-packages")
    skip = shutil.ignore_patterns("__pycache__", "*.pyi", "testdata")
    shutil.copytree(pycriu, out / HOOK_SITE / "pycriu", ignore=skip)
    for rel in PROTOBUF_DIRS:
        if (site / rel).is_dir():
            shutil.copytree(site / rel, out / HOOK_SITE / rel, ignore=skip)
    return sorted((out / HOOK_SITE).rglob("*.so"))


def build(out: Path, *, root: Path, launcher: Path, pyz: Path, hook_site: Path) -> dict[str, object]:
    if out.exists():
        shutil.rmtree(out)
    criu = in_root(root, "/usr/sbin/criu")
    python = in_root(root, "/usr/bin/python3")
    m = re.fullmatch(r"python(3\.\d+)", python.name)
    if not criu.is_file() or not m:
        raise SystemExit(f"error: {root} has no /usr/sbin/criu or /usr/bin/python3\nhint: hack/install-node-deps.sh")
    pyver = m.group(1)
    stdlib = in_root(root, f"/usr/lib/python{pyver}")
    dynload = sorted(p for p in (stdlib / "lib-dynload").glob("*.so") if not DYNLOAD_SKIP.match(p.name))
    tools = {name: in_root(root, path) for name, (path, _) in TOOLS.items()}
    missing = [str(p) for p in tools.values() if not p.is_file()]
    if missing:
        raise SystemExit(f"error: {root} lacks {', '.join(missing)}\nhint: install Debian's tar there")
    extensions = copy_hook_site(out, root, hook_site)
    loader, libs = closure(root, [criu, python, *dynload, *tools.values(), *extensions])
    for name, src in sorted(libs.items()):
        copy(src, out / "lib" / name, 0o755)
    copy(criu, out / "libexec" / "criu", 0o755)
    copy(python, out / "libexec" / python.name, 0o755)
    for name, path in tools.items():
        copy(path, out / "libexec" / name, 0o755)
    for dirpath, dirnames, filenames in os.walk(stdlib):
        rel = Path(dirpath).relative_to(stdlib)
        dirnames[:] = sorted(d for d in dirnames if not (rel == Path(".") and d in STDLIB_SKIP) and
                             not d.startswith("config-"))  # fmt: skip
        for f in sorted(filenames):
            if f.endswith((".py", ".pyc")) or (f.endswith(".so") and Path(dirpath) / f in dynload):
                copy(Path(dirpath) / f, out / "lib" / f"python{pyver}" / rel / f)
    copy(pyz, out / "kubectl-snapshot-runc.pyz", 0o755)
    copy(launcher, out / "launcher", 0o755)

    def run_bundled(prog: str, *args: str) -> str:
        argv = [str(out / "lib" / loader), "--library-path", str(out / "lib"), str(out / "libexec" / prog), *args]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, env={"PATH": "/nonexistent"})
        if proc.returncode != 0:
            raise SystemExit(f"error: the bundled {prog} does not run: {(proc.stdout + proc.stderr)[-500:]}")
        return proc.stdout

    criu_version = re.search(r"Version:\s*(\S+)", run_bundled("criu", "--version"))
    if not criu_version or criu_version.group(1) != CRIU_VERSION:
        raise SystemExit(f"error: {criu} is not CRIU {CRIU_VERSION}\nhint: hack/install-node-deps.sh installs it")
    py_version = run_bundled(python.name, "-I", "-S", "-c", "import sys, json, zipfile; print(sys.version.split()[0])")
    # bytecode beside the sources (the hook runs with -B: nothing is compiled on a node, every import
    # would otherwise compile), unchecked-hash so that it does not depend on file times
    run_bundled(python.name, "-I", "-S", "-m", "compileall", "-q", "-j", "1", "--invalidation-mode", "unchecked-hash",
                str(out / HOOK_SITE))  # fmt: skip
    # the hook's image check must work with what the bundle carries (and only that: -I -S, no host site)
    probe = (
        f"import sys; sys.path.append({str(out / HOOK_SITE)!r}); import pycriu.images; import google.protobuf as p; "
        "from google.protobuf.internal import api_implementation as a; print(p.__version__, a.Type())"
    )
    pb_version, pb_impl = run_bundled(python.name, "-I", "-S", "-c", probe).split()
    tool_meta = {}
    for name, (_, package) in TOOLS.items():
        first = run_bundled(name, "--version").splitlines()[0]  # "tar (GNU tar) 1.34"
        tool_meta[name] = {"path": f"libexec/{name}", "version": first.split()[-1], "from": _package(root, package)}
        tool_meta[name]["sha256"] = sha256(out / "libexec" / name)
    files = {
        str(p.relative_to(out)): sha256(p) for p in sorted(out.rglob("*")) if p.is_file() and p.name != "bundle.json"
    }
    meta: dict[str, object] = {
        "loader": f"lib/{loader}",
        "criu": {"path": "libexec/criu", "version": criu_version.group(1), "from": _package(root, "criu")},
        "python": {
            "path": f"libexec/{python.name}",
            "version": py_version.strip(),
            "from": _package(root, f"{python.name}-minimal"),
        },
        "libc": _package(root, "libc6"),
        "hookSite": {
            "path": HOOK_SITE,
            "pycriu": _package(root, "python3-pycriu"),
            "protobuf": f"{pb_version} ({pb_impl})",
        },
        "tools": tool_meta,
        # what the hook and the agent do in a pod's network namespace, with no program at all
        "network": "in-process: setns(2) from a thread, nf_tables/rtnetlink/sock_diag netlink (shim/net/netns.py, "
        "shim/net/nftlock.py, shim/net/ifaddr.py, shim/net/tcpabort.py in the hook zipapp)",
        "hook": "kubectl-snapshot-runc.pyz",
        "files": files,
    }
    meta["digest"] = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    (out / "bundle.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    return meta


def _package(root: Path, name: str) -> str:
    """`name version` of a Debian package installed in ROOT (from its dpkg status file)."""
    try:
        status = (root / "var/lib/dpkg/status").read_text(errors="replace")
    except OSError:
        return "unknown"
    for block in status.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line and not line[0].isspace())
        if fields.get("Package") == name and "installed" in fields.get("Status", ""):
            return f"debian {name} {fields.get('Version', '?')}"
    return "unknown"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--root", type=Path, default=Path("/"))
    parser.add_argument("--launcher", type=Path, required=True, help="the static launcher (launcher)")
    parser.add_argument("--pyz", type=Path, required=True, help="kubectl-snapshot-runc.pyz")
    parser.add_argument(
        "--hook-site", type=Path, required=True, help="site-packages holding google/protobuf (the agent's venv)"
    )
    args = parser.parse_args(argv)
    meta = build(args.out, root=args.root, launcher=args.launcher, pyz=args.pyz, hook_site=args.hook_site)
    print(json.dumps({k: v for k, v in meta.items() if k != "files"}, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
