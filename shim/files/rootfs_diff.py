"""The container's writable layer: capture it from overlayfs' upperdir, apply it onto a new rootfs.

Format (CRI-O / checkpointctl compatible): ``rootfs-diff.tar`` is a plain tar of what the upperdir
holds (added or changed files, dirs, symlinks, hard links), without overlay's private markers, and
``deleted.files`` is a JSON list of absolute in-container paths to remove before extracting it.

Overlay markers are translated as follows:
- a whiteout (char device 0:0) means "deleted": its path goes to the deleted list, not into the tar;
- an opaque directory (xattr ``trusted.overlay.opaque`` or ``user.overlay.opaque`` = ``y``) hides all
  lower content below it: its path goes to the deleted list *and* the directory (with its upper
  content) goes into the tar, so a restore first clears the directory, then recreates it;
- redirected directories and metacopy-only files (``redirect_dir``/``metacopy`` mount features, not
  used by containerd's overlay snapshotter) keep their data in a lower layer: capturing them would
  silently lose data, so they are refused with FailedPrecondition.

The capture reads a tree the tenant controls: call it while the container is frozen; files are
opened with O_NOFOLLOW below directory fds so a link can never make us read a host file.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Sequence

from kubectl_snapshot.core.errors import FailedPrecondition, UnsafeArchive
from kubectl_snapshot.core.safepath import ExtractLimits, check_container_path
from shim.files.archive import ByteSink, safe_extract, tar_directory

TYPE_CHECKING = False  # the runtime wrapper applies diffs with this: typing is not imported at run time
if TYPE_CHECKING:
    from typing import BinaryIO

OPAQUE_XATTRS = ("trusted.overlay.opaque", "user.overlay.opaque")
_DATA_ELSEWHERE_XATTRS = (
    "trusted.overlay.redirect",
    "user.overlay.redirect",
    "trusted.overlay.metacopy",
    "user.overlay.metacopy",
)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

Mount = tuple[str, str, Sequence[str]]


def upperdir_from_mounts(mounts: Sequence[Mount]) -> str | None:
    """The writable upperdir of a container rootfs, from containerd ``Snapshots.Mounts`` (type, source, options).

    Returns None when the rootfs is not an overlay with an upperdir: e.g. the ``bind`` mount of an
    active snapshot with no parent (native snapshotter, or an image with no layers). Such a rootfs
    holds the image *and* the changes in one directory, so there is no diff to read from it; the
    caller must refuse (FailedPrecondition: use the overlayfs snapshotter) or compute the diff with
    containerd's Diff service. Tarring the whole directory instead was rejected: it would silently
    turn a few-KiB diff into a copy of the whole image. Mount types such as ``format/mkdir/overlay``
    (containerd 2.x mount transformers) count as overlay.
    """
    for mtype, _source, options in mounts:
        if mtype.rsplit("/", 1)[-1] != "overlay":
            continue
        for opt in options:
            key, sep, value = opt.partition("=")
            if sep and key == "upperdir" and value:
                return value
    return None


def _xattr(fd: int, name: str) -> bytes | None:
    try:
        return os.getxattr(fd, name)
    except OSError as e:
        if e.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return None
        raise


def capture_rootfs_diff(upperdir: str, out: ByteSink) -> list[str]:
    """Write rootfs-diff.tar of `upperdir` to `out`; return the deleted.files list (sorted).

    See the module docstring for how whiteouts and opaque directories are recorded. Raises
    FailedPrecondition for redirect/metacopy entries (their data is not in the upperdir).
    """
    deleted: list[str] = []

    def on_entry(rel: str, st: os.stat_result, fd: int | None) -> bool:
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
            deleted.append("/" + rel)
            return False
        if fd is not None:
            for name in _DATA_ELSEWHERE_XATTRS:
                if _xattr(fd, name) is not None:
                    raise FailedPrecondition(
                        f"cannot capture the writable layer: /{rel} has overlay xattr {name}, so its data "
                        "lives in a lower layer",
                        hint="mount the container rootfs without redirect_dir/metacopy (containerd's "
                        "overlayfs snapshotter default)",
                    )
            if stat.S_ISDIR(st.st_mode) and any(_xattr(fd, x) == b"y" for x in OPAQUE_XATTRS):
                deleted.append("/" + rel)
        return True

    tar_directory(upperdir, out, on_entry=on_entry)
    return sorted(deleted)


def _remove_in_root(root_fd: int, rel: str) -> None:
    """Remove rootfs/`rel` (recursively) without following any symlink; missing is fine.

    A parent that is a symlink or not a directory means the path does not exist as a real path in
    this rootfs (overlay never records deletions through links), so nothing is removed.
    """
    parts = rel.split("/")
    fd = os.dup(root_fd)
    try:
        for comp in parts[:-1]:
            try:
                nfd = os.open(comp, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                    return
                raise
            os.close(fd)
            fd = nfd
        leaf = parts[-1]
        try:
            st = os.stat(leaf, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(leaf, dir_fd=fd)  # fd-based, symlink-attack resistant on Linux
        else:
            os.unlink(leaf, dir_fd=fd)
    finally:
        os.close(fd)


def apply_rootfs_diff(
    rootfs: str,
    diff_tar: BinaryIO,
    deleted: Sequence[str],
    *,
    limits: ExtractLimits = ExtractLimits(),  # noqa: B008 (frozen dataclass: safe default)
) -> None:
    """Apply a captured diff onto a freshly prepared rootfs (the new container's bundle/rootfs).

    First every `deleted` path is validated (absolute, no ``..``: podman#27977) and removed without
    following links; then the tar is extracted with safe_extract in rootfs mode: existing files are
    replaced, absolute symlink targets are allowed (the kernel resolves them inside the container),
    setuid/sticky modes and fifos are kept, device nodes are still refused, and no write ever goes
    through a symlink. Raises UnsafeArchive before touching the rootfs if any deleted path is bad.
    """
    if isinstance(deleted, (str, bytes)):
        raise UnsafeArchive("deleted.files must be a JSON list of paths, not a string")
    rels = []
    for path in deleted:
        if not isinstance(path, str):
            raise UnsafeArchive(f"deleted.files entry {path!r} is not a string")
        rels.append(check_container_path(path))
    root_fd = os.open(rootfs, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for rel in rels:
            _remove_in_root(root_fd, rel)
    finally:
        os.close(root_fd)
    safe_extract(
        diff_tar,
        rootfs,
        limits=limits,
        allow_absolute_symlinks=True,
        allow_special_modes=True,
        allow_fifos=True,
        overwrite=True,
    )
