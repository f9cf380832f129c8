"""Autosave (SnapshotPolicy) decisions, pure: which pods a policy selects, when a pod's next save is
due, what each save is called and labelled, and which saves retention deletes.

The agent (shim/controller/policies.py) feeds these with what it reads from the API server and acts
on the answers; nothing here does I/O, so every rule is unit-tested on its own.
"""

from __future__ import annotations

import datetime
import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import timestamps as T
from kubectl_snapshot.core.errors import InvalidArgument
from kubectl_snapshot.core.podspec import snapshot_name, snapshot_object, timestamp
from kubectl_snapshot.core.reference import Reference
from kubectl_snapshot.core.workload import Workload, label_value, provenance_labels

BACKOFF_BASE_S = 5.0  # first retry after a failed save; doubles per failure, capped at the interval
FIRST_SAVE_SPREAD_S = 60.0  # a pod's first save comes within this (or one interval, if shorter) of its start
KEEP_FAILED = 2  # failed saves kept per pod (to read why); older ones are deleted

_DURATION = re.compile(r"^(?:[0-9]+[hms])+$")
_PART = re.compile(r"([0-9]+)([hms])")
_UNIT = {"h": 3600, "m": 60, "s": 1}


def parse_duration(text: str, what: str = "duration") -> float:
    """Seconds of a Go-style duration restricted to h/m/s (``30s``, ``5m``, ``1h30m``): the CRD's pattern."""
    if not isinstance(text, str) or not _DURATION.match(text):
        raise InvalidArgument(
            f"{what} {text!r} is not a duration", hint="write it like 30s, 5m, 1h or 1h30m (h, m, s units)"
        )
    return float(sum(int(n) * _UNIT[u] for n, u in _PART.findall(text)))


def format_duration(seconds: float) -> str:
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    out = (f"{h}h" if h else "") + (f"{m}m" if m else "") + (f"{s}s" if s or not (h or m) else "")
    return out


# --- which pods -------------------------------------------------------------------------------------


def selects(policy: Mapping[str, Any], pod: Mapping[str, Any], workload: Workload | None) -> bool:
    """Whether the policy selects the pod: same namespace, matchLabels a subset of the pod's labels and,
    when the policy names a workload, the pod belongs to it (`workload` None: not resolvable, no match)."""
    return not why_not_selected(policy, pod, workload)


def why_not_selected(policy: Mapping[str, Any], pod: Mapping[str, Any], workload: Workload | None) -> str:
    """Why the policy does not select the pod ('' when it does; selects() says the same as a bool).

    The agent asks this of the policy a pod's resume annotation names before it resumes or final-saves
    the pod: the annotation only says which policy, the policy's own selector says whether."""
    pmeta, meta = policy.get("metadata") or {}, pod.get("metadata") or {}
    name = pmeta.get("name")
    if pmeta.get("namespace") != meta.get("namespace"):
        return f"SnapshotPolicy {name} is of namespace {pmeta.get('namespace')}, the pod of {meta.get('namespace')}"
    spec = policy.get("spec") or {}
    match = ((spec.get("selector") or {}).get("matchLabels")) or {}
    if not match:
        return f"SnapshotPolicy {name} has no selector"  # the CRD requires one; empty never means "every pod"
    labels = meta.get("labels") or {}
    missing = sorted(f"{k}={v}" for k, v in match.items() if labels.get(k) != v)
    if missing:
        return f"SnapshotPolicy {name} does not select the pod: its labels lack {','.join(missing)}"
    want = spec.get("workload")
    if want and (workload is None or (workload.kind, workload.name) != (want.get("kind"), want.get("name"))):
        found = f"{workload.kind} {workload.name}" if workload else "no workload that could be read"
        return f"SnapshotPolicy {name} protects {want.get('kind')} {want.get('name')}, the pod belongs to {found}"
    return ""


def eligible(pod: Mapping[str, Any], node: str) -> bool:
    """Running on `node`, every container running, not being deleted: only such pods are saved."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    if meta.get("deletionTimestamp") or (pod.get("spec") or {}).get("nodeName") != node:
        return False
    if status.get("phase") != "Running":
        return False
    statuses = status.get("containerStatuses") or []
    return bool(statuses) and all("running" in (c.get("state") or {}) for c in statuses)


# --- one save ---------------------------------------------------------------------------------------


def save_labels(policy_name: str, pod: Mapping[str, Any], workload: Workload) -> dict[str, str]:
    """What a policy save is labelled with from the start: the provenance the agent records on every
    save (core/workload.py) and the policy's name (what retention and `policy describe` select by)."""
    labels = {**provenance_labels(pod, workload), K.LABEL_POLICY: label_value(policy_name)}
    return {k: v for k, v in labels.items() if v is not None}


def save_object(
    policy: Mapping[str, Any], pod: Mapping[str, Any], workload: Workload, now: datetime.datetime, attempt: int = 1
) -> dict[str, Any]:
    """The PodSnapshot a policy creates for one save of `pod`: `<pod>-<stamp>[-N]`, pushed to the
    policy's repository under a tag of the same name (unique per pod and save)."""
    spec = policy.get("spec") or {}
    pod_name = str((pod.get("metadata") or {}).get("name") or "")
    name = snapshot_name(pod_name, now, attempt)
    repo = Reference.parse(str(spec.get("destination") or ""), default_tag=None)
    tag = name if len(name) <= 128 else f"{pod_name[: 127 - len(timestamp(now, attempt))]}-{timestamp(now, attempt)}"
    target = Reference(registry=repo.registry, repository=repo.repository, tag=tag)
    obj = snapshot_object(
        name=name,
        namespace=str((pod.get("metadata") or {}).get("namespace") or ""),
        pod=pod_name,
        target=target,
        registry_secret=spec.get("registrySecret") or None,
        insecure=bool(spec.get("insecure")),
        include_volumes=bool(spec.get("includeVolumes", True)),
        pod_uid=str((pod.get("metadata") or {}).get("uid") or ""),
    )
    obj["metadata"]["labels"] = save_labels(str((policy.get("metadata") or {}).get("name") or ""), pod, workload)
    return obj


# --- the schedule -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Save:
    """One PodSnapshot a policy made for a pod, as far as scheduling and retention care."""

    name: str
    created: float
    phase: str  # "" (not claimed yet) | Pending | Running | Succeeded | Failed
    completed: float | None = None
    started: float | None = None
    reference: str = ""
    size: int = 0
    message: str = ""

    @property
    def terminal(self) -> bool:
        return self.phase in K.TERMINAL_PHASES

    @property
    def good(self) -> bool:
        return self.phase == K.PHASE_SUCCEEDED

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> Save:
        meta, status = obj.get("metadata") or {}, obj.get("status") or {}
        created = T.seconds(meta.get("creationTimestamp")) or 0.0
        return cls(
            name=str(meta.get("name") or ""),
            created=created,
            phase=str(status.get("phase") or ""),
            completed=T.seconds(status.get("completionTime")),
            started=T.seconds(status.get("startTime")),
            reference=str(status.get("reference") or ""),
            size=int(status.get("size") or 0),
            message=str(status.get("message") or ""),
        )


def backoff_s(failures: int, interval_s: float, base_s: float = BACKOFF_BASE_S) -> float:
    """Delay before retrying after `failures` consecutive failed saves: base, 2x base, ... capped at the interval."""
    if failures <= 0:
        return interval_s
    return float(min(interval_s, base_s * (2 ** min(failures - 1, 30))))


@dataclass(frozen=True)
class Schedule:
    in_flight: str | None  # the save not finished yet (no other is started meanwhile)
    due: float  # when the next save is due
    failures: int  # consecutive failed saves, newest first
    last: Save | None  # the newest terminal save
    last_good: Save | None


def first_save_due(uid: str, interval_s: float, *, pod_started: float, policy_created: float) -> float:
    """When a pod's first save is due: at its own offset after it started (or after the policy came, for
    a pod older than the policy), the offset a fraction of min(interval, FIRST_SAVE_SPREAD_S) set by the
    pod's uid. Pods that start together, or that a new policy finds running, are so spread over the
    interval instead of all due in the same second; each next save is due one interval after the last
    was created, so they stay spread (a node saves one pod at a time: 50 pods due at once queue for half
    a minute, and a pod's place in that queue changes from one interval to the next). The same uid and
    times give the same answer after an agent restart."""
    return spread_due(uid, interval_s, max(pod_started, policy_created))


def spread_due(uid: str, interval_s: float, since: float) -> float:
    """`since` plus the pod's own offset: a fraction of min(interval, FIRST_SAVE_SPREAD_S) set by its uid."""
    digest = hashlib.blake2b(uid.encode(), digest_size=8).digest()
    fraction = int.from_bytes(digest, "big") / 2**64
    return since + fraction * min(interval_s, FIRST_SAVE_SPREAD_S)


def overdue_not_before(uid: str, interval_s: float, due: float, now: float) -> float:
    """The earliest a save found overdue when an agent takes a pod up (it was down, or the pod's node
    agent changed) may start: at the pod's own offset from now, so the pods whose saves fell due while
    no agent ran are spread as first saves are, not all started in the same second (which queues them
    behind each other and meets the namespace's backlog bound, E2). 0 when the save is not overdue."""
    return spread_due(uid, interval_s, now) if due < now else 0.0


def schedule(saves: Iterable[Save], interval_s: float, now: float, *, first_due: float | None = None) -> Schedule:
    """Where a pod's schedule stands, from its saves alone (so it survives an agent restart): the first
    save is due at `first_due` (first_save_due; at once when not given), the next one interval after the
    newest save was created, or after a backoff when the newest finished saves failed; nothing is due
    while one is in flight."""
    ordered = sorted(saves, key=lambda s: (s.created, s.name), reverse=True)
    in_flight = next((s.name for s in ordered if not s.terminal), None)
    terminal = [s for s in ordered if s.terminal]
    failures = 0
    for s in terminal:
        if s.good:
            break
        failures += 1
    last = terminal[0] if terminal else None
    last_good = next((s for s in terminal if s.good), None)
    if not ordered:
        due = now if first_due is None else first_due
    elif failures and last is not None:
        due = (last.completed or last.created) + backoff_s(failures, interval_s)
    else:
        due = ordered[0].created + interval_s
    return Schedule(in_flight=in_flight, due=due, failures=failures, last=last, last_good=last_good)


# --- retention --------------------------------------------------------------------------------------


def retention(
    saves: Iterable[Save], *, keep_last: int, max_age_s: float | None, now: float, keep_failed: int = KEEP_FAILED
) -> list[Save]:
    """The finished saves of one pod to delete: good ones beyond the newest `keep_last`, good ones older
    than `max_age_s` except the newest good one, failed ones beyond the newest `keep_failed` or older
    than max_age. Saves still in flight are never deleted."""
    terminal = sorted((s for s in saves if s.terminal), key=lambda s: (s.created, s.name), reverse=True)
    good = [s for s in terminal if s.good]
    failed = [s for s in terminal if not s.good]

    def old(s: Save) -> bool:
        return max_age_s is not None and now - s.created > max_age_s

    doomed = [s for i, s in enumerate(good) if i >= max(1, keep_last) or (i > 0 and old(s))]
    doomed += [s for i, s in enumerate(failed) if i >= keep_failed or old(s)]
    return sorted(doomed, key=lambda s: (s.created, s.name))


def orphan_retention(saves: Iterable[Save], *, max_age_s: float | None, now: float) -> list[Save]:
    """Saves of a pod that no longer exists: kept (a replacement pod may resume from them) unless older
    than max_age; without max_age they are left alone."""
    if max_age_s is None:
        return []
    return sorted((s for s in saves if s.terminal and now - s.created > max_age_s), key=lambda s: s.created)


# --- policy status ----------------------------------------------------------------------------------


def pod_status_entry(pod: Mapping[str, Any], node: str, sched: Schedule, *, suspended: bool = False) -> dict[str, Any]:
    """One entry of status.pods (the agent of the pod's node applies it)."""
    meta = pod.get("metadata") or {}
    entry: dict[str, Any] = {"name": str(meta.get("name") or ""), "uid": str(meta.get("uid") or ""), "node": node}
    good, last = sched.last_good, sched.last
    if good is not None:
        entry["lastSaveTime"] = T.rfc3339(good.completed or good.created)
        entry["lastSnapshot"] = good.name
        if good.reference:
            entry["lastReference"] = good.reference
        entry["lastSize"] = good.size
    if last is not None:
        entry["lastResult"] = last.phase
        if not last.good and last.message:
            entry["lastMessage"] = last.message[:1000]
    entry["consecutiveFailures"] = sched.failures
    if not suspended:
        entry["nextSaveTime"] = T.rfc3339(sched.due)
    return entry
