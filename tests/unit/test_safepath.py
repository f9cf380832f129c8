"""Name and link-target validation for untrusted archives (threat model C1/C2, pure logic)."""

from __future__ import annotations

import copy

import pytest

from kubectl_snapshot.core.errors import FailedPrecondition, UnsafeArchive
from kubectl_snapshot.core.safepath import (
    ExtractLimits,
    check_container_path,
    check_member_name,
    check_symlink_target,
)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("a", "a"),
        ("./a//b/", "a/b"),
        ("a/./b", "a/b"),
        (".", "."),
        ("./", "."),
        ("checkpoint/pages-1.img", "checkpoint/pages-1.img"),
        ("..a/b..", "..a/b.."),
    ],
)
def test_member_names_are_normalized(name: str, expected: str) -> None:
    assert check_member_name(name) == expected


@pytest.mark.parametrize(
    "name",
    [
        "",
        "../x",
        "/etc/x",
        "a/../../x",
        "./../x",
        "a/..",
        "..",
        "a\x00b",
        "a\\..\\x",
        "x" * 4097,
        "d/" + "n" * 256,
    ],
)
def test_unsafe_member_names_are_refused(name: str) -> None:
    with pytest.raises(UnsafeArchive) as exc:
        check_member_name(name)
    assert isinstance(exc.value, FailedPrecondition)
    assert exc.value.hint
    assert "refusing archive member" in exc.value.message


@pytest.mark.parametrize(
    ("name", "target"),
    [
        ("a", "b"),
        ("d/l", "../x"),
        ("d/e/l", "../../x/y"),
        ("l", "."),
        ("d/l", ".."),
    ],
)
def test_relative_symlinks_inside_are_accepted(name: str, target: str) -> None:
    check_symlink_target(name, target, allow_absolute=False)


@pytest.mark.parametrize(
    ("name", "target"),
    [
        ("l", "/etc"),
        ("l", ".."),
        ("d/l", "../../x"),
        ("m", "l/.."),  # climbs out of whatever l points to (l -> . then m -> l/.. escapes)
        ("d/l", "x/../../y"),
        ("l", ""),
        ("l", "a\x00b"),
    ],
)
def test_escaping_symlinks_are_refused(name: str, target: str) -> None:
    with pytest.raises(UnsafeArchive):
        check_symlink_target(name, target, allow_absolute=False)


def test_rootfs_mode_allows_absolute_targets_but_not_lexical_escapes() -> None:
    check_symlink_target("bin/sh", "/usr/bin/busybox", allow_absolute=True)
    check_symlink_target("usr/lib/x", "a/../b", allow_absolute=True)
    with pytest.raises(UnsafeArchive):
        check_symlink_target("usr/x", "../../../etc/shadow", allow_absolute=True)


def test_container_paths() -> None:
    assert check_container_path("/etc/foo") == "etc/foo"
    assert check_container_path("//etc//foo/") == "etc/foo"
    for bad in ("etc/foo", "/", "/../../tmp/victim", "/a/../../b", ""):
        with pytest.raises(UnsafeArchive):
            check_container_path(bad)


def test_limits_defaults_are_frozen() -> None:
    lim = ExtractLimits()
    assert lim.max_members == 1_000_000
    assert lim.max_total_bytes == 64 << 30
    with pytest.raises(AttributeError):
        lim.max_members = 1
    assert copy.deepcopy(lim) is lim and copy.copy(lim) is lim  # a value: copies are the same object
