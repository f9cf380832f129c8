"""Whether the node's disk can take what the agent is about to write: pure arithmetic.

The kubelet starts evicting pods once the node filesystem's available space falls under its threshold
(``evictionHard: nodefs.available``, 10% by default). The agent writes as root beside the pods (CRIU's
dumps, volume tars, a restore's downloads and staged images), and those bytes are charged to no pod's
ephemeral storage: a large dump or two restores at once could push the node over the threshold and have
the kubelet evict tenants' pods. So every write the agent expects is reserved before it starts:

- the room is the filesystem's available space, less what the node keeps free (the eviction threshold,
  or a larger floor the caller asks for), less what is already promised to writes in flight;
- a promise counts in full until its write ends, also the part already written (which the available
  space shows too): pessimistic while both run, never an over-commitment;
- a namespace's restores together may hold at most ``namespace_share`` of the node's staging room (the
  available space above the floor, promises not subtracted), so one tenant's restores cannot take the
  disk from the others.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kubectl_snapshot.core.errors import FailedPrecondition, InvalidArgument
from kubectl_snapshot.core.status import human_bytes

DUMP = "dump"  # a snapshot's CRIU images, writable layers and volume tars in the agent's work dir
STAGING = "staging"  # a restore's downloads and staged images: the kind a namespace's share limits
DEFAULT_EVICTION_THRESHOLD = "10%"  # the kubelet's default evictionHard nodefs.available
DEFAULT_NAMESPACE_SHARE = "50%"

_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
_UNITS |= {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
_QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]+)?)([kMGTPE]i?)?")
_PERCENT = re.compile(r"([0-9]+(?:\.[0-9]+)?)%")


@dataclass(frozen=True)
class Threshold:
    """Available space the node keeps: a share of the filesystem's size, or bytes (as the kubelet's)."""

    percent: float | None = 10.0
    bytes: int = 0

    def of(self, total: int) -> int:
        return int(total * self.percent / 100) if self.percent is not None else self.bytes


def parse_threshold(text: str) -> Threshold:
    """``"10%"`` or a Kubernetes quantity of bytes (``"5Gi"``, ``"500M"``, ``"1073741824"``)."""
    value = text.strip()
    pct = _PERCENT.fullmatch(value)
    if pct:
        percent = float(pct.group(1))
        if percent >= 100:
            raise InvalidArgument(f"disk eviction threshold {text!r}: a share must be under 100%")
        return Threshold(percent=percent)
    q = _QUANTITY.fullmatch(value)
    if not q:
        raise InvalidArgument(
            f"disk eviction threshold {text!r} is neither a percentage nor a quantity of bytes",
            hint="use the kubelet's evictionHard nodefs.available value, e.g. 10% or 5Gi",
        )
    return Threshold(percent=None, bytes=int(float(q.group(1)) * _UNITS[q.group(2) or ""]))


def parse_share(text: str) -> float:
    """``"50%"`` -> 0.5; ``"100%"`` lifts the per-namespace limit."""
    pct = _PERCENT.fullmatch(text.strip())
    if not pct or not 0 < float(pct.group(1)) <= 100:
        raise InvalidArgument(
            f"staging namespace share {text!r} is not a percentage above 0% and at most 100%",
            hint="e.g. 50%: one namespace's restores may hold half of the node's staging room at most",
        )
    return float(pct.group(1)) / 100


@dataclass(frozen=True)
class DiskPolicy:
    """The node's settings for its disk (core/nodesettings.py: disk_eviction_threshold, staging_namespace_share)."""

    threshold: Threshold = Threshold()
    namespace_share: float = 0.5

    @classmethod
    def parse(cls, threshold: str, namespace_share: str) -> DiskPolicy:
        return cls(parse_threshold(threshold), parse_share(namespace_share))


@dataclass(frozen=True)
class FsState:
    """One filesystem as statvfs reports it, read at the reservation."""

    path: str
    total: int  # f_blocks * f_frsize
    available: int  # f_bavail * f_frsize: what unprivileged writers (the kubelet's view) have left


@dataclass(frozen=True)
class Ask:
    need: int  # bytes the write is expected to take
    what: str  # for the message: "the dump of pod ns/name", ...
    hint: str  # what to do when refused
    kind: str = DUMP
    namespace: str = ""  # the tenant it is done for ("" outside Kubernetes: no share applies)
    keep: int = 0  # free bytes the caller keeps besides the threshold (the larger floor counts)


@dataclass(frozen=True)
class Held:
    """What is already promised on the same filesystem."""

    total: int = 0
    namespace: int = 0  # of it, by the same namespace's writes of the same kind


def admit(ask: Ask, fs: FsState, held: Held, policy: DiskPolicy) -> int:
    """Raise FailedPrecondition (retryable: space frees up) unless `ask` fits; returns the room it saw
    (the most the write may take, its own need included)."""
    floor = max(policy.threshold.of(fs.total), ask.keep)
    room = fs.available - floor - held.total
    if ask.need > room:
        raise FailedPrecondition(
            f"not enough space on the filesystem of {fs.path} for {ask.what}: it needs {human_bytes(ask.need)}; "
            f"{human_bytes(fs.available)} available, of which {human_bytes(floor)} is kept free (the kubelet "
            f"evicts pods below it) and {human_bytes(held.total)} is promised to snapshots and restores in flight",
            hint=ask.hint,
            retryable=True,
        )
    if ask.kind == STAGING and ask.namespace and policy.namespace_share < 1:
        staging = max(0, fs.available - floor)
        allowed = int(policy.namespace_share * staging)
        if held.namespace + ask.need > allowed:
            raise FailedPrecondition(
                f"namespace {ask.namespace!r} may not stage more on this node now: {ask.what} needs "
                f"{human_bytes(ask.need)} and its restores in flight hold {human_bytes(held.namespace)}, over its "
                f"share ({policy.namespace_share:.0%}, {human_bytes(allowed)}) of the {human_bytes(staging)} the "
                "node has for staging",
                hint="wait for the namespace's other restores to finish, or restore on another node (--node)",
                retryable=True,
            )
    return room
