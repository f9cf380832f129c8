"""Final save (issue 13): a protected pod that is terminated gracefully is saved, with stop, before its
containers receive SIGTERM (pure decisions; docs/kubernetes.md, "Final save").

How it fits together:

- admission (deploy/resume.py) gives each container of a protected pod (one the resume policy
  mutates) a ``preStop`` hook ``sleep: {seconds: hook_sleep_s(grace)}``: the kubelet runs it before
  SIGTERM, it needs nothing in the image, and it holds the containers for most of the pod's
  ``terminationGracePeriodSeconds``. A pod whose manifest has a preStop hook of its own keeps it and
  gets none of ours (no container), and no final save (``decide`` says why in an Event).
- the node's agent sees the pod's ``deletionTimestamp`` (drain/eviction, scale-down, delete) and
  ``decide`` says whether to take a final save: a PodSnapshot with ``stop`` labelled as the pod's
  final save. The save deletes the pod object once the push is verified and kills the frozen
  containers: they never receive SIGTERM. The controller's replacement resumes from it
  (core/resume.py picks the newest good save and waits for one still running, and for a
  terminating predecessor of a Deployment whose final save may not exist yet).
- if the save fails or comes too late, the pod ends as it would have (the hook ends, SIGTERM, the
  rest of the grace period), the last periodic save stands, and ``late_message`` is the Event.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import timestamps as T

DEFAULT_GRACE_S = 30  # the API server's default terminationGracePeriodSeconds
MIN_GRACE_S = 5  # below this no hook is added and no final save is tried: no time for one
MAX_MARGIN_S = 10  # what the hook leaves of the grace period for SIGTERM, at most
MIN_WINDOW_S = 2  # a final save is not started with less than this left before the hook ends
THAW_MARGIN_S = 1.0  # a final save's containers are thawed this long before the hook ends (thaw_by)


def hook_sleep_s(grace_s: int | None) -> int | None:
    """Seconds of the preStop sleep admission adds for a pod with this grace period (None: no hook).

    The hook takes the grace period less a margin of a fifth of it (1 s to 10 s): the margin is
    what a pod whose final save failed still gets between SIGTERM and SIGKILL. The same formula is
    written in CEL by deploy/resume.py (variable ``hookSleep``); tests/e2e/test_final_save.py reads
    the hook the real API server wrote and compares it with this."""
    grace = DEFAULT_GRACE_S if grace_s is None else int(grace_s)
    if grace < MIN_GRACE_S:
        return None
    return grace - margin_s(grace)


def margin_s(grace_s: int) -> int:
    return min(MAX_MARGIN_S, max(1, grace_s // 5))


@dataclass(frozen=True)
class Decision:
    save: bool  # take a final save now
    reason: str = ""  # why not (empty when there is nothing to say)
    event: bool = False  # the reason is worth an Event on the pod (the user expected a final save)
    window_s: float = 0.0  # seconds left before the earliest hook ends (when save)


def _prestop(container: Mapping[str, Any]) -> Mapping[str, Any] | None:
    return ((container.get("lifecycle") or {}).get("preStop")) or None


def _prestop_sleep(container: Mapping[str, Any]) -> int | None:
    """The seconds of the container's preStop sleep hook; None where it has no such hook."""
    sleep = (_prestop(container) or {}).get("sleep")
    return int(sleep.get("seconds") or 0) if sleep else None


def protected(pod: Mapping[str, Any]) -> bool:
    """A pod the resume admission policy mutated (its workload's new pods resume from its saves)."""
    return bool(((pod.get("metadata") or {}).get("annotations") or {}).get(K.ANN_RESUME_POLICY))


def decide(pod: Mapping[str, Any], *, node: str, now: float, already: bool) -> Decision:
    """Whether the agent of `node` takes a final save of `pod` now. `already`: a final save of this
    pod exists (this agent made one, or an earlier life of it did)."""
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    if spec.get("nodeName") != node or not protected(pod) or not meta.get("deletionTimestamp"):
        return Decision(False)
    if already:
        return Decision(False)
    grace = meta.get("deletionGracePeriodSeconds")
    if grace is not None and int(grace) <= 0:
        # deleted with no grace: a stop save (migrate, or this very final save) or a forced delete
        return Decision(False)
    if status.get("phase") != "Running":
        return Decision(False)
    statuses = {c.get("name"): c for c in status.get("containerStatuses") or []}
    containers = spec.get("containers") or []
    for c in containers:
        if "running" not in ((statuses.get(c.get("name")) or {}).get("state") or {}):
            return Decision(False)  # a container already ended: the pod is going anyway
    sleeps = []
    for c in containers:
        sleep_s = _prestop_sleep(c)
        if sleep_s is None:
            own = "its own preStop hook" if _prestop(c) else "no preStop sleep hook"
            return Decision(
                False,
                f"no final save: container {c.get('name')!r} has {own} (admission adds the hook only to pods whose"
                f" containers have none and whose grace period is at least {MIN_GRACE_S}s), so the save could race"
                " SIGTERM; the pod ends as usual and its replacement resumes from its last periodic save",
                event=True,
            )
        sleeps.append(sleep_s)
    end = _hooks_end(meta, spec, min(sleeps))
    if end is None:
        return Decision(False)
    grace_s = _grace_s(meta, spec)
    window = end - now
    if window < MIN_WINDOW_S:
        return Decision(
            False,
            f"no final save: only {max(window, 0):.0f}s were left before SIGTERM (preStop sleep {min(sleeps)}s"
            f" of a {grace_s}s grace period); the pod ends as usual and its replacement resumes from its last"
            " periodic save",
            event=True,
        )
    return Decision(True, window_s=window)


def _grace_s(meta: Mapping[str, Any], spec: Mapping[str, Any]) -> int:
    grace = meta.get("deletionGracePeriodSeconds")
    return int(grace) if grace is not None else int(spec.get("terminationGracePeriodSeconds") or DEFAULT_GRACE_S)


def _hooks_end(meta: Mapping[str, Any], spec: Mapping[str, Any], sleep_s: int) -> float | None:
    """When the shortest preStop sleep ends: deletionTimestamp is the end of the grace period and the
    hooks started when it was set; a deletion with a shorter grace period than the pod's (drain
    --grace-period) cuts the hooks short."""
    deadline = T.seconds(meta.get("deletionTimestamp"))
    if deadline is None:
        return None
    return min(deadline - _grace_s(meta, spec) + sleep_s, deadline)


def thaw_by(pod: Mapping[str, Any]) -> float | None:
    """The deadline of the pod's final save (issue 43), in seconds since the epoch: its containers are
    thawed by then (THAW_MARGIN_S before the first preStop hook ends), whether the push was verified or
    not, so that a save that cannot finish never holds the pod frozen into SIGTERM. None: the pod is
    not being terminated, or a container has no preStop sleep."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    sleeps = [_prestop_sleep(c) for c in spec.get("containers") or []]
    if not sleeps or None in sleeps:
        return None
    end = _hooks_end(meta, spec, min(s for s in sleeps if s is not None))
    return None if end is None else end - THAW_MARGIN_S


def late_message(save_name: str, grace_s: int, why: str, last_good: str | None) -> str:
    """The Event on the pod when its final save did not finish in time (or failed)."""
    stands = f"the last periodic save {last_good} stands" if last_good else "no earlier save exists: it starts fresh"
    return (
        f"final save {save_name} did not finish within the pod's terminationGracePeriodSeconds ({grace_s}s): {why}."
        f" The pod ended as it would have; {stands} for its replacement."
        " Hint: raise terminationGracePeriodSeconds (docs/kubernetes.md, 'Final save', gives seconds per GiB)"
    )


def final_labels(labels: Mapping[str, str]) -> dict[str, str]:
    """A final save's labels: the policy save's, and the final-save mark."""
    return {**labels, K.LABEL_FINAL_SAVE: "true"}
