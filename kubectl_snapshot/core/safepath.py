"""Validation of path names that come from untrusted archives and metadata.

Everything inside a snapshot is attacker-controlled (see docs/security threat model C1-C6): tar member
names, link targets, and the paths listed in ``deleted.files``. This module decides, without touching
the filesystem, whether such a name is acceptable; ``shim/files/archive.py`` then performs the writes with
``O_NOFOLLOW`` directory walks so that the check cannot be raced.
"""

from __future__ import annotations

import posixpath

from kubectl_snapshot.core.errors import UnsafeArchive

PATH_MAX = 4096
NAME_MAX = 255
_HINT = "the snapshot is corrupted or was crafted; do not restore it, and take a new snapshot"


class ExtractLimits:
    """Caps that stop decompression and tar bombs before they fill the node's disk. A plain class: the
    runtime wrapper extracts a rootfs diff with it and imports no dataclasses (shim/runtime_wrapper.py)."""

    __slots__ = ("max_member_bytes", "max_members", "max_total_bytes")
    max_total_bytes: int
    max_members: int
    max_member_bytes: int

    def __init__(
        self, *, max_total_bytes: int = 64 << 30, max_members: int = 1_000_000, max_member_bytes: int = 64 << 30
    ) -> None:
        set_ = object.__setattr__  # immutable, as a shared default argument must be
        set_(self, "max_total_bytes", max_total_bytes)
        set_(self, "max_members", max_members)
        set_(self, "max_member_bytes", max_member_bytes)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"ExtractLimits is immutable: cannot set {name}")

    def __copy__(self) -> ExtractLimits:  # immutable: a copy is the same value (as a tuple's)
        return self

    def __deepcopy__(self, memo: dict[int, object]) -> ExtractLimits:
        return self

    def __repr__(self) -> str:
        return (
            f"ExtractLimits(max_total_bytes={self.max_total_bytes}, max_members={self.max_members}, "
            f"max_member_bytes={self.max_member_bytes})"
        )


def _unsafe(name: str, why: str) -> UnsafeArchive:
    return UnsafeArchive(f"refusing archive member {name!r}: {why}", hint=_HINT)


def check_member_name(name: str) -> str:
    """Return `name` as a normalized relative POSIX path, or raise UnsafeArchive.

    Refused: empty names, NUL bytes, absolute paths, any ``..`` component, backslashes (a name that
    means a different path to a Windows-minded tool than to us), over-long names and components.
    ``./a//b/`` normalizes to ``a/b``; the archive root itself (``.`` or ``./``) is returned as ``"."``
    and callers decide whether they accept it (only as a directory).
    """
    if not name:
        raise _unsafe(name, "empty name")
    if "\x00" in name:
        raise _unsafe(name, "NUL byte in name")
    if "\\" in name:
        raise _unsafe(name, "backslash in name")
    if len(name.encode("utf-8", "surrogateescape")) > PATH_MAX:
        raise _unsafe(name[:64] + "...", f"name longer than {PATH_MAX} bytes")
    if name.startswith("/"):
        raise _unsafe(name, "absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        raise _unsafe(name, "'..' component")
    if any(len(p.encode("utf-8", "surrogateescape")) > NAME_MAX for p in parts):
        raise _unsafe(name, f"a component is longer than {NAME_MAX} bytes")
    if not parts:
        return "."
    return "/".join(parts)


def check_container_path(path: str) -> str:
    """Validate an absolute in-container path (e.g. a ``deleted.files`` entry); return it relative.

    ``/etc/foo`` -> ``etc/foo``. The rootfs root itself and any ``..`` are refused (podman#27977).
    """
    if not path.startswith("/"):
        raise _unsafe(path, "container path must be absolute (e.g. /etc/foo)")
    rel = check_member_name(path.lstrip("/") or ".")
    if rel == ".":
        raise _unsafe(path, "refers to the container's root directory")
    return rel


def check_symlink_target(name: str, target: str, *, allow_absolute: bool) -> None:
    """Refuse a symlink at member `name` whose `target` could lead outside the extraction root.

    Relative targets must resolve inside the root *and* may use ``..`` only as leading components:
    the link's parent directories are real directories (the extractor never writes below a symlink),
    so leading ``..`` are resolved exactly as written, whereas ``a/..`` could climb out of whatever
    ``a`` points to (``l -> .`` then ``m -> l/..`` escapes although it normalizes to ``.``).
    Absolute targets are allowed only for container rootfs content (``allow_absolute``), where the
    kernel resolves them inside the container's root, never on the host; in that mode the "no climb
    after a descent" rule is moot (an absolute link is strictly more powerful) and is not applied,
    only the lexical "stays inside" rule is, so odd but legal container links still restore.
    """
    if not target or "\x00" in target:
        raise _unsafe(name, "symlink with an empty or NUL-containing target")
    if len(target.encode("utf-8", "surrogateescape")) > PATH_MAX:
        raise _unsafe(name, "symlink target too long")
    if target.startswith("/"):
        if allow_absolute:
            return
        raise _unsafe(name, f"symlink to absolute path {target!r}")
    parts = [p for p in target.split("/") if p not in ("", ".")]
    seen_normal = False
    for p in parts:
        if p == "..":
            if seen_normal and not allow_absolute:
                raise _unsafe(name, f"symlink target {target!r} climbs ('..') after a descent")
        else:
            seen_normal = True
    parent = posixpath.dirname(name)
    resolved = posixpath.normpath(posixpath.join(parent, target)) if parent else posixpath.normpath(target)
    if resolved == ".." or resolved.startswith("../"):
        raise _unsafe(name, f"symlink target {target!r} resolves outside the extraction directory")
