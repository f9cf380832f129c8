"""Image/artifact references (``registry/repository[:tag][@digest]``), parsed like docker does.

Pure: no I/O. The grammar follows distribution's ``reference`` package closely enough that anything
``docker push`` accepts parses the same way here, so users can paste the names they already use:

* the first path component is a registry when it contains ``.`` or ``:`` or is ``localhost``
  (``[::1]:5000`` works too); otherwise the registry is ``docker.io`` and a single-component name
  gets the ``library/`` prefix;
* repository components are lowercase ``[a-z0-9]`` runs joined by ``.``, ``_``, ``__`` or ``-`` runs;
* tags are ``[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}``; digests are ``sha256:<64 lowercase hex>`` (the only
  algorithm the project writes, and the only one it verifies).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, replace

from kubectl_snapshot.core.errors import InvalidArgument

DOCKER_HUB: str = "docker.io"
DOCKER_HUB_API_HOST: str = "registry-1.docker.io"
_DOCKER_HUB_ALIASES = frozenset({"docker.io", "index.docker.io", "registry-1.docker.io"})

_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_COMPONENT_RE = re.compile(rf"^{_COMPONENT}$")
_TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_DIGEST_RE = re.compile(r"^sha256:[a-f0-9]{64}$")
_DOMAIN_LABEL = r"(?:[A-Za-z0-9]|[A-Za-z0-9][A-Za-z0-9-]*[A-Za-z0-9])"
_HOST_RE = re.compile(rf"^(?:{_DOMAIN_LABEL}(?:\.{_DOMAIN_LABEL})*|\[[0-9A-Fa-f:.]+\])(?::[0-9]{{1,5}})?$")
_MAX_NAME = 255

_HINT = (
    "use REGISTRY/REPOSITORY[:TAG][@sha256:DIGEST], e.g. 127.0.0.1:5000/snapshots/web:v1 "
    "(lowercase repository, tag of letters, digits, '_', '.', '-')"
)


def is_valid_digest(digest: str) -> bool:
    """True for ``sha256:<64 lowercase hex>``, the only digest form the project accepts."""
    return bool(_DIGEST_RE.match(digest))


def validate_digest(digest: str) -> str:
    """Return `digest` or raise InvalidArgument: every digest is checked before it is put in a URL."""
    if not is_valid_digest(digest):
        raise InvalidArgument(
            f"invalid digest {digest!r}",
            hint="a digest is 'sha256:' followed by 64 lowercase hex characters",
        )
    return digest


def _split_host_port(registry: str) -> tuple[str, str | None]:
    if registry.startswith("["):
        end = registry.find("]")
        if end < 0:
            return registry, None
        host, rest = registry[1:end], registry[end + 1 :]
        return host, rest[1:] if rest.startswith(":") else None
    if registry.count(":") > 1:  # bare IPv6 without brackets
        return registry, None
    host, _, port = registry.partition(":")
    return host, port or None


def is_loopback_registry(registry: str) -> bool:
    """True for localhost, 127.0.0.0/8 and ::1, with or without a port (plain HTTP is allowed there)."""
    host, _ = _split_host_port(registry.strip().lower())
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def normalize_registry(registry: str) -> str:
    """Canonical registry name: lowercase host, docker hub aliases folded to ``docker.io``.

    Accepts docker config keys too (``https://index.docker.io/v1/``, ``http://host:5000``).
    """
    text = registry.strip()
    for scheme in ("https://", "http://"):
        if text.lower().startswith(scheme):
            text = text[len(scheme) :]
    text = text.split("/", 1)[0].lower()
    return DOCKER_HUB if text in _DOCKER_HUB_ALIASES else text


def api_host(registry: str) -> str:
    """The host[:port] the HTTP API of `registry` is served on (docker.io lives elsewhere)."""
    return DOCKER_HUB_API_HOST if normalize_registry(registry) == DOCKER_HUB else registry


@dataclass(frozen=True)
class Reference:
    """A parsed reference. `registry` is "host[:port]"; at least one of tag/digest is usually set."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    def __post_init__(self) -> None:
        # References are also built directly (e.g. from a snapshot's recorded data): the fields end
        # up in URL paths, so every construction is checked, not just parse().
        if not _HOST_RE.match(self.registry):
            raise InvalidArgument(f"invalid registry {self.registry!r}", hint=_HINT)
        components = self.repository.split("/")
        if len(self.repository) > _MAX_NAME or not all(_COMPONENT_RE.match(c) for c in components):
            raise InvalidArgument(f"invalid repository {self.repository!r}", hint=_HINT)
        if self.tag is not None and not _TAG_RE.match(self.tag):
            raise InvalidArgument(f"invalid tag {self.tag!r}", hint=_HINT)
        if self.digest is not None:
            validate_digest(self.digest)

    @classmethod
    def parse(cls, text: str, *, default_tag: str | None = "latest") -> Reference:
        """Parse `text`; when it has neither tag nor digest, the tag is `default_tag`.

        Raises InvalidArgument with the reason and the expected form.
        """
        original = text
        text = text.strip()
        if not text:
            raise InvalidArgument("empty image reference", hint=_HINT)
        if "://" in text:
            raise InvalidArgument(
                f"invalid reference {original!r}: no URL scheme allowed",
                hint=_HINT + "; use --plain-http for a registry without TLS",
            )
        digest: str | None = None
        if "@" in text:
            text, digest = text.split("@", 1)
            if not is_valid_digest(digest):
                raise InvalidArgument(
                    f"invalid reference {original!r}: bad digest {digest!r}",
                    hint="a digest is 'sha256:' followed by 64 lowercase hex characters",
                )
        tag: str | None = None
        slash = text.rfind("/")
        colon = text.rfind(":")
        if colon > slash and not text[colon:].endswith("]"):
            text, tag = text[:colon], text[colon + 1 :]
            if not _TAG_RE.match(tag):
                raise InvalidArgument(f"invalid reference {original!r}: bad tag {tag!r}", hint=_HINT)
        first, sep, rest = text.partition("/")
        if sep and ("." in first or ":" in first or first == "localhost" or first.startswith("[")):
            registry, repository = first, rest
            if not _HOST_RE.match(registry):
                raise InvalidArgument(f"invalid reference {original!r}: bad registry {registry!r}", hint=_HINT)
            if normalize_registry(registry) == DOCKER_HUB:
                registry = DOCKER_HUB
        else:
            registry, repository = DOCKER_HUB, text
        if registry == DOCKER_HUB and "/" not in repository:
            repository = f"library/{repository}"
        if not repository:
            raise InvalidArgument(f"invalid reference {original!r}: no repository", hint=_HINT)
        for component in repository.split("/"):
            if not _COMPONENT_RE.match(component):
                why = "must be lowercase" if component.lower() != component else "bad name component"
                raise InvalidArgument(
                    f"invalid reference {original!r}: repository {repository!r} {why} ({component!r})",
                    hint=_HINT,
                )
        if len(registry) + 1 + len(repository) > _MAX_NAME:
            raise InvalidArgument(
                f"invalid reference {original!r}: name longer than {_MAX_NAME} characters", hint=_HINT
            )
        if tag is None and digest is None:
            tag = default_tag
        return cls(registry=registry, repository=repository, tag=tag, digest=digest)

    def with_digest(self, digest: str) -> Reference:
        """The same repository (and tag) pinned to `digest`."""
        return replace(self, digest=validate_digest(digest))

    def with_tag(self, tag: str) -> Reference:
        """The same repository under `tag` (keeps a digest if set)."""
        if not _TAG_RE.match(tag):
            raise InvalidArgument(f"invalid tag {tag!r}", hint=_HINT)
        return replace(self, tag=tag)

    @property
    def name(self) -> str:
        """``registry/repository``."""
        return f"{self.registry}/{self.repository}"

    @property
    def api_host(self) -> str:
        """The host[:port] to send HTTP requests to."""
        return api_host(self.registry)

    def __str__(self) -> str:
        text = self.name
        if self.tag:
            text += f":{self.tag}"
        if self.digest:
            text += f"@{self.digest}"
        return text
