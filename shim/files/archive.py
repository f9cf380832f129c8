"""Tar streams: safe extraction of untrusted snapshots, deterministic packing.

Extraction never trusts the archive (threat model C1-C4, the CPython tarfile CVEs): every member name
goes through ``core.safepath``; every write happens through directory fds opened component by
component with ``O_NOFOLLOW``, so no write can follow a symlink, whatever the archive or a concurrent
process put on disk; links, devices, special modes and sizes are checked before anything is written.
``tarfile.extractall`` is not used at all.

Packing is a push pipeline that never needs a second copy on disk::

    hw = HashingWriter(upload_or_file)              # shim/files/pipes.py: sha256 + size of the compressed bytes
    with open_zstd_writer(hw, level=1, threads=-1) as zw:   # shim/files/zstdio.py
        tar_directory(checkpoint_dir, zw)           # deterministic tar straight into zstd
    blob_digest, blob_size = hw.digest, hw.size

Standard library only: the runtime wrapper extracts the plain rootfs-diff tar with it on the host's bare
python3 (zstd streams are shim/files/zstdio.py, which the wrapper never imports).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import sys
import tarfile
from collections.abc import Callable, Iterable

from kubectl_snapshot.core.errors import UnsafeArchive
from kubectl_snapshot.core.safepath import ExtractLimits, check_member_name, check_symlink_target

CHUNK = 1 << 20
# GNU long names / pax headers are read into memory whole by tarfile: cap them.
MAX_HEADER_BYTES = 1 << 20
# tarfile's stream reader copies its leftover buffer on every header read: keep it moderate.
_READ_BUF = 64 << 10

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_HINT = "the snapshot is corrupted or was crafted; do not restore it, and take a new snapshot"
_SETID = stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX


# The runtime wrapper applies rootfs diffs with this module: typing and dataclasses are not imported at
# run time (shim/runtime_wrapper.py, "what it imports at start").
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import IO, Any, BinaryIO, Protocol, Self

    from _typeshed import SupportsRead

    class ByteSink(Protocol):
        """Anything with write(bytes): a file, a socket wrapper, HashingWriter, a zstd writer."""

        def write(self, data: bytes, /) -> object: ...

else:
    ByteSink = object  # at run time only annotations name it


class ExtractReport:
    """What an extraction wrote: member count and regular-file bytes."""

    __slots__ = ("bytes", "members")

    def __init__(self, *, members: int, bytes: int) -> None:
        self.members, self.bytes = members, bytes


def _unsafe(name: str, why: str) -> UnsafeArchive:
    return UnsafeArchive(f"refusing archive member {name!r}: {why}", hint=_HINT)


# tarfile's header errors are not in its typed public API; they have existed unchanged since 3.2.
_EOF_HEADER: type[Exception] = getattr(tarfile, "EOFHeaderError")  # noqa: B009
_EMPTY_HEADER: type[Exception] = getattr(tarfile, "EmptyHeaderError")  # noqa: B009
_TRUNCATED_HEADER: type[Exception] = getattr(tarfile, "TruncatedHeaderError")  # noqa: B009


class _CappedTarInfo(tarfile.TarInfo):
    """TarInfo that makes tarfile strict: no silent stop on a bad header, capped extended headers.

    Stock tarfile treats a corrupt, truncated or missing header after the first member as the end of
    the archive and returns what it has; a truncated download would then extract "successfully".
    Here only the zero block that ends a tar ends it.
    """

    @classmethod
    def frombuf(cls, buf: bytes | bytearray, encoding: str, errors: str) -> Self:
        try:
            return super().frombuf(buf, encoding, errors)
        except _EOF_HEADER:
            raise
        except (_EMPTY_HEADER, _TRUNCATED_HEADER) as e:
            raise UnsafeArchive(f"truncated archive (no end-of-archive marker): {e}", hint=_HINT) from e
        except tarfile.HeaderError as e:
            raise UnsafeArchive(f"corrupt tar header: {e}", hint=_HINT) from e

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        header_types = (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE)
        if self.type in header_types and self.size > MAX_HEADER_BYTES:
            raise _unsafe(self.name, f"extended header of {self.size} bytes (limit {MAX_HEADER_BYTES})")
        info: tarfile.TarInfo = super()._proc_member(tarfile_)  # type: ignore[misc]
        return info

    # Sparse members: only the format tar_directory writes (PAX, GNU 1.0), its map read strictly.
    # (tarfile's own reader takes any int() for a number and fails with a bare ValueError on a map
    # cut short; the older formats are refused.)
    def _proc_sparse(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        raise _unsafe(self.name, "old GNU sparse member (not a format kubectl-snapshot writes)")

    def _proc_gnusparse_00(self, next_: tarfile.TarInfo, pax_headers: dict[str, str], buf: bytes) -> None:
        raise _unsafe(next_.name, "GNU sparse 0.0 member (not a format kubectl-snapshot writes)")

    def _proc_gnusparse_01(self, next_: tarfile.TarInfo, pax_headers: dict[str, str]) -> None:
        raise _unsafe(next_.name, "GNU sparse 0.1 member (not a format kubectl-snapshot writes)")

    def _proc_gnusparse_10(
        self, next_: tarfile.TarInfo, pax_headers: dict[str, str], tarfile_: tarfile.TarFile
    ) -> None:
        name = pax_headers.get("GNU.sparse.name", next_.name)
        if "size" in pax_headers:  # tarfile would then skip the member by its real size, not its stored one
            raise _unsafe(name, "sparse member with a size header")
        stored = next_.size  # the header's size: the map block(s) and the data regions
        try:
            realsize = _decimal(pax_headers.get("GNU.sparse.realsize", ""))
        except ValueError:
            raise _unsafe(name, "sparse member without a valid GNU.sparse.realsize") from None
        fileobj = tarfile_.fileobj
        buf, numbers, count = b"", list[int](), -1
        while count < 0 or len(numbers) < 2 * count:
            while b"\n" not in buf:
                if len(buf) > 40 or fileobj.tell() - next_.offset_data >= stored:
                    raise _unsafe(name, "sparse map cut short or malformed")
                block = fileobj.read(_BLOCK)
                if len(block) != _BLOCK:
                    raise _unsafe(name, "sparse map cut short")
                buf += block
            field, buf = buf.split(b"\n", 1)
            try:
                value = _decimal(field.decode("ascii"))
            except (UnicodeDecodeError, ValueError):
                raise _unsafe(name, "sparse map holds something other than decimal numbers") from None
            if count < 0:
                if value > MAX_SPARSE_SEGMENTS + 1:
                    raise _unsafe(name, f"sparse map of {value} regions (limit {MAX_SPARSE_SEGMENTS})")
                count = value
            else:
                numbers.append(value)
        sparse = list(zip(numbers[::2], numbers[1::2], strict=True))
        map_bytes = fileobj.tell() - next_.offset_data
        end = 0
        for off, n in sparse:
            if off < end or off + n > realsize:
                raise _unsafe(name, "sparse map with regions out of order, overlapping or past the file's size")
            end = off + n
        if map_bytes + sum(n for _, n in sparse) > stored:
            raise _unsafe(name, "sparse map names more data than the member holds")
        next_.offset_data = fileobj.tell()
        setattr(next_, "sparse", sparse)  # noqa: B010 (typeshed has tarfile's sparse map as bytes)


class _Tree:
    """dest opened once; every path below it is reached through O_NOFOLLOW directory fds."""

    def __init__(self, dest: str | int) -> None:
        if isinstance(dest, int):  # an fd the caller opened without following links (shim/host/safefs.py)
            self.fd = os.dup(dest)
        else:
            self.fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._cache: tuple[str, int] | None = None
        self.created_dirs: set[str] = set()

    def close(self) -> None:
        self.forget()
        os.close(self.fd)

    def forget(self) -> None:
        """Drop the cached parent fd (after anything was removed, it may name a deleted dir)."""
        if self._cache is not None:
            os.close(self._cache[1])
            self._cache = None

    def parent(self, rel: str, *, create: bool) -> tuple[int, str]:
        """(fd of rel's parent directory, leaf name). The fd is borrowed: do not close it.

        Refuses (UnsafeArchive) when a component is a symlink or not a directory; creates missing
        components (0755) when `create`, else raises FileNotFoundError.
        """
        head, _, leaf = rel.rpartition("/")
        if self._cache is not None and self._cache[0] == head:
            return self._cache[1], leaf
        fd = os.dup(self.fd)
        done: list[str] = []
        try:
            for comp in head.split("/") if head else []:
                done.append(comp)
                try:
                    nfd = os.open(comp, _DIR_FLAGS, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise
                    os.mkdir(comp, 0o755, dir_fd=fd)
                    self.created_dirs.add("/".join(done))
                    nfd = os.open(comp, _DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise _unsafe(rel, f"parent {'/'.join(done)!r} is a symlink or not a directory") from e
                    raise
                os.close(fd)
                fd = nfd
        except BaseException:
            os.close(fd)
            raise
        self.forget()
        self._cache = (head, fd)
        return fd, leaf

    def open_dir(self, rel: str) -> int | None:
        """An owned O_NOFOLLOW fd of directory rel, or None if it is gone or no longer a directory."""
        if rel == ".":
            return os.dup(self.fd)
        try:
            pfd, leaf = self.parent(rel, create=False)
            return os.open(leaf, _DIR_FLAGS, dir_fd=pfd)
        except (FileNotFoundError, NotADirectoryError, UnsafeArchive):
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                return None
            raise


def _clear_leaf(tree: _Tree, pfd: int, leaf: str, name: str, *, new_is_dir: bool, overwrite: bool) -> bool:
    """Make room for member `name`; True if an existing directory is kept (dir over dir)."""
    try:
        st = os.stat(leaf, dir_fd=pfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        if new_is_dir:
            return True
        if not overwrite:
            raise _unsafe(name, "would replace a directory")
        # pfd (the cached fd) is the parent of what is removed, so it stays valid.
        shutil.rmtree(leaf, dir_fd=pfd)
        return False
    if not overwrite:
        raise _unsafe(name, "already exists in the destination")
    os.unlink(leaf, dir_fd=pfd)
    return False


def _corrupt_input_errors() -> tuple[type[BaseException], ...]:
    """What a corrupt or truncated stream raises; ZstdError only if zstandard is loaded (else nothing raised it)."""
    zstd = sys.modules.get("zstandard")
    return (tarfile.TarError, EOFError, *((zstd.ZstdError,) if zstd is not None else ()))


def _ns(m: tarfile.TarInfo) -> tuple[int, int]:
    ns = mtime_ns(m)
    return ns, ns


def safe_extract(
    fileobj: BinaryIO,
    dest: str | int,
    *,
    only: str | None = None,
    limits: ExtractLimits = ExtractLimits(),  # noqa: B008 (frozen dataclass: safe default)
    allow_absolute_symlinks: bool = False,
    preserve_owner: bool = True,
    allow_special_modes: bool = False,
    allow_fifos: bool = False,
    overwrite: bool = False,
) -> ExtractReport:
    """Stream the tar in `fileobj` into the existing directory `dest`, refusing anything unsafe.

    Refused with UnsafeArchive (message names the member): bad names (core.safepath), duplicates,
    symlinks that are absolute (unless `allow_absolute_symlinks`: container rootfs content, resolved
    by the kernel inside the container) or resolve outside dest, hard links to anything but a regular
    file extracted earlier from this archive, char/block devices and fifos, members below a symlink,
    setuid/setgid/sticky regular files (unless `allow_special_modes`), fifos (unless `allow_fifos`:
    harmless inside a container rootfs), size/count over `limits`, and
    corrupt tar data. Without `overwrite` an existing non-directory is never replaced (fresh staging
    dirs); with it (applying a rootfs diff) existing files are unlinked and replaced, and a directory
    replaced by a non-directory is removed with its contents. On refusal nothing has been written
    outside dest; partial content may remain inside: extract into a fresh dir and delete it on error.
    Ownership is restored only when `preserve_owner` and running as root.
    `dest` may be a directory fd (borrowed, not closed). With `only`, just the members below the
    top-level directory `only` are extracted, with that prefix removed (one volume of a volumes layer),
    and that directory's own owner, mode, times and extended attributes are given to `dest`; the others
    are still checked but skipped, and hard links out of `only` are refused.
    """
    opts = _Options(
        only=only,
        limits=limits,
        allow_absolute_symlinks=allow_absolute_symlinks,
        chown=preserve_owner and os.geteuid() == 0,
        allow_special_modes=allow_special_modes,
        allow_fifos=allow_fifos,
        overwrite=overwrite,
    )
    run = _Extraction(_Tree(dest), opts)
    try:
        with tarfile.open(fileobj=fileobj, mode="r|", tarinfo=_CappedTarInfo, bufsize=_READ_BUF) as tf:
            for m in tf:
                name = run.admit(m)
                if name is not None:
                    run.place(tf, m, name)
            _finish_dirs(run.tree, run.dirs, chown=opts.chown)
    except _corrupt_input_errors() as e:
        raise UnsafeArchive(f"corrupt or truncated archive: {e}", hint=_HINT) from e
    finally:
        run.tree.close()
    return ExtractReport(members=run.members, bytes=run.total)


class _Options:
    __slots__ = (
        "allow_absolute_symlinks",
        "allow_fifos",
        "allow_special_modes",
        "chown",
        "limits",
        "only",
        "overwrite",
    )

    def __init__(
        self,
        *,
        only: str | None,
        limits: ExtractLimits,
        allow_absolute_symlinks: bool,
        chown: bool,
        allow_special_modes: bool,
        allow_fifos: bool,
        overwrite: bool,
    ) -> None:
        self.only, self.limits, self.chown, self.overwrite = only, limits, chown, overwrite
        self.allow_absolute_symlinks = allow_absolute_symlinks
        self.allow_special_modes, self.allow_fifos = allow_special_modes, allow_fifos


class _Extraction:
    """One safe_extract run: what has been seen and written so far, and the two steps per member."""

    def __init__(self, tree: _Tree, opts: _Options) -> None:
        self.tree, self.opts = tree, opts
        self.seen: set[str] = set()
        self.regular: set[str] = set()
        self.dirs: list[tuple[str, tarfile.TarInfo]] = []
        self.members = self.total = 0

    def admit(self, m: tarfile.TarInfo) -> str | None:
        """The checked name to write member `m` at, or None to skip it (outside `only`, or the
        destination itself); counts it against the limits."""
        o = self.opts
        self.members += 1
        if self.members > o.limits.max_members:
            raise _unsafe(m.name, f"more than {o.limits.max_members} members")
        name = check_member_name(m.name)
        if name in self.seen:
            raise _unsafe(name, "duplicate member name")
        self.seen.add(name)
        if o.only is not None:
            stripped = _strip_prefix(name, o.only)
            if stripped is None:
                return None
            name = stripped
            if m.islnk():
                target = _strip_prefix(check_member_name(m.linkname), o.only)
                if target is None or target == ".":
                    raise _unsafe(name, f"hard link to {m.linkname!r}, outside {o.only!r}")
                m.linkname = target
        if name == ".":
            if not m.isdir():
                raise _unsafe(m.name, "non-directory member replacing the destination itself")
            if o.only is not None:  # the volume's own directory: its owner, mode and times go to dest
                attrs = _member_xattrs(m, name)
                if FILE_CAPS in attrs:
                    m.pax_headers = {k: v for k, v in m.pax_headers.items() if k != XATTR_RECORD + FILE_CAPS}
                self.dirs.append((".", m))
            return None
        if m.isreg():
            regions = sparse_regions(m)
            data = m.size if regions is None else sum(n for _, n in regions)  # holes take no space
            if data > o.limits.max_member_bytes:
                raise _unsafe(name, f"{data} bytes, over the per-member limit")
            self.total += data
            if self.total > o.limits.max_total_bytes:
                raise _unsafe(name, f"archive exceeds the {o.limits.max_total_bytes}-byte limit")
            if m.mode & _SETID and not o.allow_special_modes:
                raise _unsafe(name, f"setuid/setgid/sticky mode {m.mode:o}")
        if m.isreg() or m.isdir():
            attrs = _member_xattrs(m, name)  # checked before anything is written
            if FILE_CAPS in attrs and not o.allow_special_modes:  # privileges: only a rootfs diff restores them
                m.pax_headers = {k: v for k, v in m.pax_headers.items() if k != XATTR_RECORD + FILE_CAPS}
        return name

    def place(self, tf: tarfile.TarFile, m: tarfile.TarInfo, name: str) -> None:
        """Write admitted member `m` at `name`, by its type; refuse the types never extracted."""
        tree, o = self.tree, self.opts
        if m.isreg():
            _write_file(tree, tf, m, name, chown=o.chown, overwrite=o.overwrite)
            self.regular.add(name)
        elif m.isdir():
            pfd, leaf = tree.parent(name, create=True)
            if not _clear_leaf(tree, pfd, leaf, name, new_is_dir=True, overwrite=o.overwrite):
                os.mkdir(leaf, 0o700, dir_fd=pfd)
            self.dirs.append((name, m))
        elif m.issym():
            check_symlink_target(name, m.linkname, allow_absolute=o.allow_absolute_symlinks)
            pfd, leaf = tree.parent(name, create=True)
            _clear_leaf(tree, pfd, leaf, name, new_is_dir=False, overwrite=o.overwrite)
            os.symlink(m.linkname, leaf, dir_fd=pfd)
            _set_meta_nofollow(pfd, leaf, m, chown=o.chown, mode=False)
        elif m.islnk():
            _hardlink(tree, m, name, self.regular, overwrite=o.overwrite)
            self.regular.add(name)
        elif m.ischr() or m.isblk():
            raise _unsafe(name, "device node")
        elif m.isfifo():
            if not o.allow_fifos:
                raise _unsafe(name, "fifo")
            pfd, leaf = tree.parent(name, create=True)
            _clear_leaf(tree, pfd, leaf, name, new_is_dir=False, overwrite=o.overwrite)
            os.mkfifo(leaf, 0o600, dir_fd=pfd)
            _set_meta_nofollow(pfd, leaf, m, chown=o.chown)
        else:
            raise _unsafe(name, f"unsupported member type {m.type!r}")


def _strip_prefix(name: str, top: str) -> str | None:
    if name == top:
        return "."
    if name.startswith(top + "/"):
        return name[len(top) + 1 :]
    return None


def _set_meta_nofollow(pfd: int, leaf: str, m: tarfile.TarInfo, *, chown: bool, mode: bool = True) -> None:
    if chown:
        os.chown(leaf, m.uid, m.gid, dir_fd=pfd, follow_symlinks=False)
    if mode:  # fifos only: Linux cannot chmod a symlink itself
        os.chmod(leaf, m.mode & 0o777, dir_fd=pfd, follow_symlinks=False)
    os.utime(leaf, ns=_ns(m), dir_fd=pfd, follow_symlinks=False)


def _write_file(
    tree: _Tree, tf: tarfile.TarFile, m: tarfile.TarInfo, name: str, *, chown: bool, overwrite: bool
) -> None:
    pfd, leaf = tree.parent(name, create=True)
    _clear_leaf(tree, pfd, leaf, name, new_is_dir=False, overwrite=overwrite)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(leaf, flags, 0o600, dir_fd=pfd)
    try:
        src = tf.extractfile(m)
        if src is None:  # pragma: no cover - isreg() members always have data
            raise _unsafe(name, "no data")
        with src:
            regions = sparse_regions(m)
            if regions is None:
                while chunk := src.read(CHUNK):
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view) :]
            else:  # the data regions where they were; the holes stay holes
                _write_regions(src, fd, regions, name)
                os.ftruncate(fd, m.size)
        if chown:
            os.fchown(fd, m.uid, m.gid)
        os.fchmod(fd, m.mode & 0o7777)  # after chown, which clears setuid bits
        _set_xattrs(fd, m, name)  # after chown and the data, which clear file capabilities
        os.utime(fd, ns=_ns(m))
    finally:
        os.close(fd)


def _member_xattrs(m: tarfile.TarInfo, name: str) -> dict[str, bytes]:
    """The kept extended attributes a member records, checked (count, size); others are ignored."""
    out: dict[str, bytes] = {}
    for key, value in m.pax_headers.items():
        if not key.startswith(XATTR_RECORD) or not kept_xattr(attr := key[len(XATTR_RECORD) :]):
            continue
        raw = value.encode("utf-8", "surrogateescape")
        if len(raw) > MAX_XATTR_BYTES:
            raise _unsafe(name, f"extended attribute {attr!r} of {len(raw)} bytes")
        out[attr] = raw
    if len(out) > MAX_XATTRS:
        raise _unsafe(name, f"{len(out)} extended attributes (limit {MAX_XATTRS})")
    return out


def _set_xattrs(fd: int, m: tarfile.TarInfo, name: str) -> None:
    for attr, value in _member_xattrs(m, name).items():
        try:
            os.setxattr(fd, attr, value)
        except OSError as e:  # a filesystem without user attributes (an older tmpfs) loses only those
            if not (attr.startswith("user.") and e.errno in (errno.EOPNOTSUPP, errno.ENOTSUP)):
                raise


def sparse_regions(m: tarfile.TarInfo) -> list[tuple[int, int]] | None:
    """A sparse member's (offset, length) data regions; None for any other member."""
    regions: list[tuple[int, int]] | None = getattr(m, "sparse", None)
    return regions


def _write_regions(src: IO[bytes], fd: int, regions: list[tuple[int, int]], name: str) -> None:
    """Each (offset, length) region of a sparse member from tarfile's unbuffered member reader (its
    holes are never read: they would come back as zeros), in order: the archive is only read forward."""
    raw = getattr(src, "raw", src)
    for off, n in regions:
        raw.seek(off)
        pos, left = off, n
        while left:
            chunk = raw.read(min(CHUNK, left))
            if not chunk:
                raise _unsafe(name, "sparse member cut short")
            view = memoryview(chunk)
            while view:
                written = os.pwrite(fd, view, pos)
                view, pos = view[written:], pos + written
            left -= len(chunk)


def _decimal(text: str) -> int:
    """A non-negative decimal of at most 20 digits (no sign, spaces or underscores, which int() takes)."""
    if not (0 < len(text) <= 20 and text.isascii() and text.isdigit()):
        raise ValueError(text)
    return int(text)


def _hardlink(tree: _Tree, m: tarfile.TarInfo, name: str, regular: set[str], *, overwrite: bool) -> None:
    try:
        target = check_member_name(m.linkname)
    except UnsafeArchive as e:
        raise _unsafe(name, f"hard link target is unsafe ({e.message})") from e
    if target not in regular:
        raise _unsafe(name, f"hard link to {m.linkname!r}, which is not a regular file of this archive")
    tfd, tleaf = tree.parent(target, create=False)
    tfd = os.dup(tfd)  # the next parent() call may close the cached fd
    try:
        if not stat.S_ISREG(os.stat(tleaf, dir_fd=tfd, follow_symlinks=False).st_mode):
            raise _unsafe(name, f"hard link target {target!r} is no longer a regular file")
        pfd, leaf = tree.parent(name, create=True)
        _clear_leaf(tree, pfd, leaf, name, new_is_dir=False, overwrite=overwrite)
        pfd, leaf = tree.parent(name, create=False)
        os.link(tleaf, leaf, src_dir_fd=tfd, dst_dir_fd=pfd, follow_symlinks=False)
    finally:
        os.close(tfd)


def _finish_dirs(tree: _Tree, dirs: list[tuple[str, tarfile.TarInfo]], *, chown: bool) -> None:
    """Apply directory owner/mode/mtime last, deepest first, so writing children cannot undo them."""
    for name, m in sorted(dirs, key=lambda d: d[0], reverse=True):
        fd = tree.open_dir(name)
        if fd is None:
            continue
        try:
            if chown:
                os.fchown(fd, m.uid, m.gid)
            os.fchmod(fd, m.mode & 0o7777)
            _set_xattrs(fd, m, name)
            os.utime(fd, ns=_ns(m))
        finally:
            os.close(fd)


# --- packing ------------------------------------------------------------------------------------

EntryFilter = Callable[[str, os.stat_result, "int | None"], bool]


def _sort_key(name: str) -> bytes:
    return name.encode("utf-8", "surrogateescape")


def tar_directory(
    src: str | int,
    out: ByteSink,
    *,
    arcname: str = "",
    follow_symlinks: bool = False,
    on_entry: EntryFilter | None = None,
    limits: ExtractLimits = ExtractLimits(),  # noqa: B008 (immutable: safe default)
    exact_mtimes: bool = True,
) -> None:
    """Write a deterministic PAX tar of the tree at `src` into `out` (a stream; never seeks).

    Entries are sorted by byte order; modes, uid/gid, mtimes (to the nanosecond: a PAX `mtime` record
    for a fraction of a second, unless `exact_mtimes` is False), symlinks, hard links (as tar links)
    and device/fifo nodes are recorded; user/group names are left empty so the bytes
    do not depend on the host's passwd; sockets are skipped. `arcname` prefixes every name and adds a
    directory entry for the root; with "" the root itself is not recorded. Without
    `follow_symlinks` every file is opened with O_NOFOLLOW below directory fds, so a workload racing
    symlinks in its own tree cannot make us read host files. `on_entry(relpath, lstat, fd)` (fd is
    an open fd for directories and regular files, else None) may return False to leave an entry out
    (and, for a directory, its contents). `src` may be a directory fd (borrowed, not closed).
    A tree that safe_extract would refuse under `limits` (more entries, a bigger file, more data) is
    refused here, before it is stored: a snapshot nobody can restore is not taken.
    """
    tar_directories(
        [(arcname, src)],
        out,
        follow_symlinks=follow_symlinks,
        on_entry=on_entry,
        limits=limits,
        exact_mtimes=exact_mtimes,
    )


def tar_directories(
    sources: Iterable[tuple[str, str | int]],
    out: ByteSink,
    *,
    follow_symlinks: bool = False,
    on_entry: EntryFilter | None = None,
    limits: ExtractLimits = ExtractLimits(),  # noqa: B008 (immutable: safe default)
    exact_mtimes: bool = True,
) -> None:
    """One tar of several trees, each under its own `arcname` (see tar_directory); hard links are
    recorded only within one tree, so each tree extracts on its own (one volume per tree)."""
    # Not a `with`: on error the end-of-archive blocks must not be written after a partial member.
    # "w" on a forward-only sink (tarfile's "w|" re-buffers every byte through 10 KiB slices).
    sink: IO[bytes] = _TellingWriter(out)  # type: ignore[assignment]  # tarfile needs write and tell
    tf = _CaptureTarFile(limits, exact_mtimes, fileobj=sink, mode="w", format=tarfile.PAX_FORMAT)
    tf.copybufsize = CHUNK  # type: ignore[attr-defined]  # stdlib default: 16 KiB copies
    for arcname, src in sources:
        _add_tree(tf, src, arcname, follow_symlinks=follow_symlinks, on_entry=on_entry)
    tf.close()


class _CaptureTarFile(tarfile.TarFile):
    """A TarFile that refuses, before writing it, the member past what safe_extract admits under the
    same limits: the member count, one member's data and the archive's data (a sparse member's data
    regions, not its holes), so that every archive written here can be restored. Without
    `exact_mtimes` members keep whole-second mtimes (no PAX record for the fraction)."""

    def __init__(self, limits: ExtractLimits, exact_mtimes: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._limits, self._exact_mtimes = limits, exact_mtimes
        self._members = self._total = 0

    def addfile(self, tarinfo: tarfile.TarInfo, fileobj: SupportsRead[bytes] | None = None) -> None:
        if not self._exact_mtimes and "mtime" in tarinfo.pax_headers:
            tarinfo.pax_headers = {k: v for k, v in tarinfo.pax_headers.items() if k != "mtime"}
        limits = self._limits
        name = tarinfo.pax_headers.get("GNU.sparse.name", tarinfo.name)
        self._members += 1
        if self._members > limits.max_members:
            raise UnsafeArchive(
                f"more than {limits.max_members} files and directories to archive (at {name!r}); "
                "a restore refuses more",
                hint="keep the count of files in the container's writable layer and its captured volumes "
                "under that limit (many small files belong on a persistent volume, which is not captured)",
            )
        if tarinfo.isreg():
            # a sparse member's size counts its map block(s) too: its data is its regions'
            data = fileobj.data_bytes if isinstance(fileobj, _SparseReader) else tarinfo.size
            self._total += data
            for what, held, cap in (("this file", data, limits.max_member_bytes),
                                    ("the archive", self._total, limits.max_total_bytes)):  # fmt: skip
                if held > cap:
                    raise UnsafeArchive(
                        f"{name!r}: {what} would hold more than {cap} bytes of data; a restore refuses more",
                        hint="keep such data on a persistent volume, which is not captured",
                    )
        super().addfile(tarinfo, fileobj)


def _add_tree(
    tf: tarfile.TarFile, src: str | int, arcname: str, *, follow_symlinks: bool, on_entry: EntryFilter | None
) -> None:
    nofollow = 0 if follow_symlinks else os.O_NOFOLLOW
    links: dict[tuple[int, int], str] = {}
    visited: set[tuple[int, int]] = set()  # directory loops are only possible with follow_symlinks
    prefix = arcname.strip("/")
    # Iterative DFS (no recursion limit on deep trees): (dir fd, relative path, remaining sorted names)
    stack: list[tuple[int, str, list[str]]] = []
    root_fd = os.dup(src) if isinstance(src, int) else os.open(src, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        root_st = os.fstat(root_fd)
        visited.add((root_st.st_dev, root_st.st_ino))
        stack.append((root_fd, "", sorted(os.listdir(root_fd), key=_sort_key)))
    except BaseException:
        os.close(root_fd)
        raise
    try:
        if prefix:
            ti = _tarinfo(prefix, root_st, tarfile.DIRTYPE)
            ti.pax_headers = {**ti.pax_headers, **_xattr_records(root_fd, prefix)}
            tf.addfile(ti)
        while stack:
            dfd, rel, names = stack[-1]
            if not names:
                os.close(dfd)
                stack.pop()
                continue
            entry = names.pop(0)
            path = f"{rel}/{entry}" if rel else entry
            arc = f"{prefix}/{path}" if prefix else path
            st = os.stat(entry, dir_fd=dfd, follow_symlinks=follow_symlinks)
            mode = st.st_mode
            if stat.S_ISDIR(mode):
                if (st.st_dev, st.st_ino) in visited:
                    continue
                cfd = os.open(entry, (_DIR_FLAGS & ~os.O_NOFOLLOW) | nofollow, dir_fd=dfd)
                if on_entry is not None and not on_entry(path, st, cfd):
                    os.close(cfd)
                    continue
                ti = _tarinfo(arc, st, tarfile.DIRTYPE)
                ti.pax_headers = {**ti.pax_headers, **_xattr_records(cfd, path)}
                tf.addfile(ti)
                if follow_symlinks:
                    visited.add((st.st_dev, st.st_ino))
                stack.append((cfd, path, sorted(os.listdir(cfd), key=_sort_key)))
            elif stat.S_ISREG(mode):
                _add_regular(tf, dfd, entry, path, arc, st, nofollow, on_entry, links)
            elif stat.S_ISSOCK(mode) or (on_entry is not None and not on_entry(path, st, None)):
                continue
            elif stat.S_ISLNK(mode):
                ti = _tarinfo(arc, st, tarfile.SYMTYPE)
                ti.linkname = os.readlink(entry, dir_fd=dfd)
                tf.addfile(ti)
            elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
                ti = _tarinfo(arc, st, tarfile.CHRTYPE if stat.S_ISCHR(mode) else tarfile.BLKTYPE)
                ti.devmajor, ti.devminor = os.major(st.st_rdev), os.minor(st.st_rdev)
                tf.addfile(ti)
            elif stat.S_ISFIFO(mode):
                tf.addfile(_tarinfo(arc, st, tarfile.FIFOTYPE))
    finally:
        for dfd, _, _ in stack:
            os.close(dfd)


class _TellingWriter:
    """The two methods TarFile("w") uses on its file: write() and tell(); nothing ever seeks."""

    def __init__(self, out: ByteSink) -> None:
        self._out = out
        self._pos = 0

    def write(self, data: bytes) -> int:
        self._out.write(data)
        self._pos += len(data)
        return len(data)

    def tell(self) -> int:
        return self._pos


def _add_regular(
    tf: tarfile.TarFile,
    dfd: int,
    entry: str,
    path: str,
    arc: str,
    st: os.stat_result,
    nofollow: int,
    on_entry: EntryFilter | None,
    links: dict[tuple[int, int], str],
) -> None:
    ffd = os.open(entry, os.O_RDONLY | os.O_CLOEXEC | nofollow, dir_fd=dfd)
    with open(ffd, "rb", closefd=True) as f:
        fst = os.fstat(ffd)
        if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(fst.st_mode):
            raise UnsafeArchive(
                f"{path!r} was replaced while it was being archived",
                hint="archive only frozen or quiescent trees",
                retryable=True,
            )
        if on_entry is not None and not on_entry(path, fst, ffd):
            return
        key = (fst.st_dev, fst.st_ino)
        if fst.st_nlink > 1 and key in links:
            ti = _tarinfo(arc, fst, tarfile.LNKTYPE)
            ti.linkname = links[key]
            tf.addfile(ti)
            return
        if fst.st_nlink > 1:
            links[key] = arc
        xattrs = _xattr_records(ffd, path)
        segments = _sparse_segments(ffd, fst, path)
        if segments is not None:
            _add_sparse(tf, ffd, arc, fst, segments, xattrs)
            return
        ti = _tarinfo(arc, fst, tarfile.REGTYPE)
        ti.size = fst.st_size
        ti.pax_headers = {**ti.pax_headers, **xattrs}
        tf.addfile(ti, f)


# --- extended attributes ------------------------------------------------------------------------
# Recorded as PAX `SCHILY.xattr.NAME` records (what GNU tar --xattrs, Go's archive/tar and
# containers/storage write): file capabilities (`setcap` on a binary in the writable layer: without
# them it would no longer bind its port or open its raw socket after a restore), POSIX ACLs and user
# attributes. Never overlay's own (`trusted.overlay.*`, `user.overlay.*`: the upperdir's markers,
# handled as whiteouts and opaque dirs), nor `trusted.*` or security labels, which belong to the node.
XATTR_RECORD = "SCHILY.xattr."
FILE_CAPS = "security.capability"
_XATTRS_KEPT = (FILE_CAPS, "system.posix_acl_access", "system.posix_acl_default")
MAX_XATTRS = 64  # per file: more is refused at capture and on restore
MAX_XATTR_BYTES = 64 << 10  # the kernel's own limit for one value


def kept_xattr(name: str) -> bool:
    return name in _XATTRS_KEPT or (name.startswith("user.") and not name.startswith("user.overlay."))


def _xattr_records(fd: int, path: str) -> dict[str, str]:
    """The kept extended attributes of the open file `fd` as PAX records (values as bytes decoded with
    surrogateescape: tarfile writes them back byte for byte), sorted by name."""
    try:
        names = sorted(n for n in os.listxattr(fd) if kept_xattr(n))
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.ENOTSUP):
            return {}
        raise
    if len(names) > MAX_XATTRS:
        raise UnsafeArchive(
            f"{path!r} has {len(names)} extended attributes (at most {MAX_XATTRS} are recorded per file)",
            hint="remove the extended attributes the workload does not need",
        )
    records: dict[str, str] = {}
    for name in names:
        try:
            value = os.getxattr(fd, name)
        except OSError as e:
            if e.errno == errno.ENODATA:  # removed between the listing and the read
                continue
            raise
        records[XATTR_RECORD + name] = value.decode("utf-8", "surrogateescape")
    return records


# --- sparse files -------------------------------------------------------------------------------
# A file with holes (ftruncate past its end, a preallocated image, a database file) is recorded as a
# PAX sparse member, GNU format 1.0 (what GNU tar writes with --sparse --sparse-version=1.0, and what
# CPython's tarfile and Go's archive/tar read): its data regions only, so neither the archive nor the
# restored file holds its holes as zeros. Written densely, a file truncated to 4 GiB holding 6 bytes
# was written out in full while the pod was frozen, until the freeze guard's deadline failed the
# snapshot (tests/integration/test_agent_roundtrip.py): a workload could make the node write any size.
SPARSE_MAJOR, SPARSE_MINOR = "1", "0"
# At most this many data regions per file: the map is read into memory whole on restore. A file
# with more is refused at capture (checked before anything of it is written).
MAX_SPARSE_SEGMENTS = 1 << 16
_SPARSE_PLACEHOLDER = "GNUSparseFile.0/data"  # the header's own name; the real one is GNU.sparse.name
_BLOCK = tarfile.BLOCKSIZE


def _sparse_segments(fd: int, st: os.stat_result, path: str) -> list[tuple[int, int]] | None:
    """The (offset, length) data regions of a file with holes, ending with (size, 0) when a hole ends
    it (as GNU tar writes); None for a file without holes (or a filesystem that cannot tell): dense."""
    size = st.st_size
    if size == 0 or st.st_blocks * 512 >= size:
        return None
    segments: list[tuple[int, int]] = []
    pos = 0
    try:
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError as e:
                if e.errno == errno.ENXIO:  # no data after pos: a hole to the end
                    break
                raise
            if start >= size:
                break
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            if end <= start:  # pragma: no cover - the kernel always reports a hole at the end
                return None
            segments.append((start, end - start))
            if len(segments) > MAX_SPARSE_SEGMENTS:
                raise UnsafeArchive(
                    f"{path!r} is a sparse file of more than {MAX_SPARSE_SEGMENTS} separate data regions",
                    hint="kubectl-snapshot records at most that many regions per file; keep such a file "
                    "out of what is snapshotted (e.g. a volume that is not captured) or write it densely",
                )
            pos = end
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP):  # no SEEK_DATA here: read it whole
            return None
        raise
    if segments == [(0, size)]:
        return None
    if not segments or sum(segments[-1]) < size:
        segments.append((size, 0))
    return segments


def _add_sparse(
    tf: tarfile.TarFile, fd: int, arc: str, st: os.stat_result, segments: list[tuple[int, int]], xattrs: dict[str, str]
) -> None:
    text = f"{len(segments)}\n" + "".join(f"{off}\n{n}\n" for off, n in segments)
    mapping = text.encode("ascii")
    mapping += b"\0" * (-len(mapping) % _BLOCK)
    ti = _tarinfo(_SPARSE_PLACEHOLDER, st, tarfile.REGTYPE)
    ti.pax_headers = {
        **ti.pax_headers,
        "GNU.sparse.major": SPARSE_MAJOR,
        "GNU.sparse.minor": SPARSE_MINOR,
        "GNU.sparse.name": arc,
        "GNU.sparse.realsize": str(st.st_size),
        **xattrs,
    }
    ti.size = len(mapping) + sum(n for _, n in segments)
    tf.addfile(ti, _SparseReader(fd, mapping, segments, arc))  # read() is all addfile uses


class _SparseReader:
    """The member's data: the map block(s), then each data region read from the file (pread)."""

    def __init__(self, fd: int, mapping: bytes, segments: list[tuple[int, int]], name: str) -> None:
        self._fd, self._head, self._name = fd, mapping, name
        self._todo = [(off, n) for off, n in segments if n]
        self.data_bytes = sum(n for _, n in segments)  # the member's data, as safe_extract counts it

    def read(self, size: int = -1) -> bytes:
        out: list[bytes] = []
        want = size if size >= 0 else 1 << 62
        while want > 0 and (self._head or self._todo):
            if self._head:
                piece, self._head = self._head[:want], self._head[want:]
            else:
                off, n = self._todo[0]
                piece = os.pread(self._fd, min(want, n), off)
                if not piece:
                    raise UnsafeArchive(
                        f"{self._name!r} shrank while it was being archived",
                        hint="archive only frozen or quiescent trees",
                        retryable=True,
                    )
                self._todo[0] = (off + len(piece), n - len(piece))
                if self._todo[0][1] == 0:
                    self._todo.pop(0)
            out.append(piece)
            want -= len(piece)
        return b"".join(out)


def _tarinfo(name: str, st: os.stat_result, kind: bytes) -> tarfile.TarInfo:
    ti = tarfile.TarInfo(name)
    ti.type = kind
    ti.mode = stat.S_IMODE(st.st_mode)
    ti.uid, ti.gid = st.st_uid, st.st_gid
    ti.uname = ti.gname = ""
    ti.mtime = int(st.st_mtime)
    if st.st_mtime_ns >= 0 and st.st_mtime_ns % NS:  # the fraction: a PAX record (whole seconds: none)
        ti.pax_headers = {"mtime": mtime_record(st.st_mtime_ns)}
    return ti


NS = 1_000_000_000


def mtime_record(ns: int) -> str:
    """A PAX `mtime` record of `ns` nanoseconds (>= 0): seconds, then the fraction without trailing
    zeros, as GNU tar --format=posix writes it ("1700000000.5")."""
    sec, frac = divmod(ns, NS)
    return f"{sec}.{frac:09d}".rstrip("0").rstrip(".")


_NS_RANGE = (-(1 << 63), (1 << 63) - 1)  # what os.utime takes (a crafted 1e30, inf or nan would raise)


def mtime_ns(m: tarfile.TarInfo) -> int:
    """The member's mtime in nanoseconds: exact from its PAX record (a float would round it), else the
    header's (whole seconds, or what tarfile parsed); held within what the kernel takes."""
    raw = m.pax_headers.get("mtime", "")
    sec, _, frac = raw.partition(".")
    if 0 < len(sec) <= 12 and sec.isascii() and sec.isdigit() and len(frac) <= 9 and (not frac or frac.isdigit()):
        ns = int(sec) * NS + int(frac.ljust(9, "0"))
    else:
        try:
            ns = int(m.mtime * NS)
        except (OverflowError, ValueError):  # inf, nan
            ns = 0
    return max(_NS_RANGE[0], min(ns, _NS_RANGE[1]))
