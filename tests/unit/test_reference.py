"""Reference parsing follows docker's rules; bad input gets InvalidArgument with a hint."""

from __future__ import annotations

import pytest

from kubectl_snapshot.core.errors import InvalidArgument
from kubectl_snapshot.core.reference import (
    Reference,
    api_host,
    is_loopback_registry,
    normalize_registry,
    validate_digest,
)

D = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("text", "registry", "repository", "tag", "digest"),
    [
        ("busybox", "docker.io", "library/busybox", "latest", None),
        ("user/app:1.0", "docker.io", "user/app", "1.0", None),
        ("docker.io/busybox", "docker.io", "library/busybox", "latest", None),
        ("index.docker.io/user/app", "docker.io", "user/app", "latest", None),
        ("localhost/app", "localhost", "app", "latest", None),
        ("localhost:5000/a/b/c:t", "localhost:5000", "a/b/c", "t", None),
        ("127.0.0.1:5000/snap/web:v1", "127.0.0.1:5000", "snap/web", "v1", None),
        ("[::1]:5000/snap/web", "[::1]:5000", "snap/web", "latest", None),
        ("ghcr.io/org/my-app_x.y__z", "ghcr.io", "org/my-app_x.y__z", "latest", None),
        (f"reg.example:443/a@{D}", "reg.example:443", "a", None, D),
        (f"reg.example/a:t@{D}", "reg.example", "a", "t", D),
        ("  reg.example/a:T_1.x-y  ", "reg.example", "a", "T_1.x-y", None),
    ],
)
def test_parse(text: str, registry: str, repository: str, tag: str | None, digest: str | None) -> None:
    ref = Reference.parse(text)
    assert (ref.registry, ref.repository, ref.tag, ref.digest) == (registry, repository, tag, digest)
    assert Reference.parse(str(ref)) == ref  # str() round-trips


def test_default_tag_can_be_disabled() -> None:
    assert Reference.parse("reg.example/a", default_tag=None).tag is None
    assert Reference.parse("reg.example/a", default_tag="snap").tag == "snap"


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "empty"),
        ("reg.example/App", "lowercase"),
        ("reg.example/a:-bad", "bad tag"),
        ("reg.example/a:" + "x" * 129, "bad tag"),
        ("reg.example/a@sha256:abc", "bad digest"),
        ("reg.example/a@md5:" + "a" * 32, "bad digest"),
        ("reg.example/a@sha256:" + "AB" * 32, "bad digest"),
        ("https://reg.example/a", "URL scheme"),
        ("reg.example/a//b", "bad name component"),
        ("reg.example/a/-b", "bad name component"),
        ("reg.example/", "no repository"),
        ("bad_host.example/a", "bad registry"),
        ("reg.example/" + "a" * 300, "longer than"),
    ],
)
def test_parse_rejects(text: str, why: str) -> None:
    with pytest.raises(InvalidArgument, match=why) as info:
        Reference.parse(text)
    assert info.value.hint
    assert info.value.exit_code == 2


def test_with_digest_and_tag_keep_the_rest() -> None:
    ref = Reference.parse("reg.example:5000/a/b:t")
    pinned = ref.with_digest(D)
    assert (pinned.registry, pinned.repository, pinned.tag, pinned.digest) == (
        "reg.example:5000",
        "a/b",
        "t",
        D,
    )
    assert str(pinned) == f"reg.example:5000/a/b:t@{D}"
    assert pinned.with_tag("u").tag == "u" and pinned.with_tag("u").digest == D
    assert ref.name == "reg.example:5000/a/b"
    with pytest.raises(InvalidArgument):
        ref.with_digest("sha256:nothex")
    with pytest.raises(InvalidArgument):
        ref.with_tag("no/slash")


def test_validate_digest() -> None:
    assert validate_digest(D) == D
    with pytest.raises(InvalidArgument, match="invalid digest"):
        validate_digest("sha256:../../etc")


@pytest.mark.parametrize(
    ("registry", "loopback"),
    [
        ("localhost", True),
        ("localhost:5000", True),
        ("LOCALHOST:5000", True),
        ("127.0.0.1", True),
        ("127.3.4.5:80", True),
        ("[::1]", True),
        ("[::1]:5000", True),
        ("::1", True),
        ("10.0.0.1:5000", False),
        ("128.0.0.1", False),
        ("localhost.example.com", False),
        ("registry-1.docker.io", False),
        ("[::2]:5000", False),
    ],
)
def test_is_loopback_registry(registry: str, loopback: bool) -> None:
    assert is_loopback_registry(registry) is loopback


def test_docker_hub_names() -> None:
    assert normalize_registry("https://index.docker.io/v1/") == "docker.io"
    assert normalize_registry("http://Reg.Example:5000") == "reg.example:5000"
    assert api_host("docker.io") == "registry-1.docker.io"
    assert Reference.parse("busybox").api_host == "registry-1.docker.io"
    assert api_host("127.0.0.1:5000") == "127.0.0.1:5000"


@pytest.mark.parametrize(
    "fields",
    [
        {"registry": "r.example", "repository": "../etc"},
        {"registry": "r.example", "repository": "a", "tag": "x/y"},
        {"registry": "r.example", "repository": "a", "digest": "sha256:zz"},
        {"registry": "r.example/evil", "repository": "a"},
        {"registry": "", "repository": "a"},
    ],
)
def test_direct_construction_is_validated(fields: dict[str, str]) -> None:
    with pytest.raises(InvalidArgument):
        Reference(**fields)
