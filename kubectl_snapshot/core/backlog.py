"""Threat E2: a burst of requests from one namespace. The agent queues each namespace's snapshots, and its
restores, fairly (shim/controller/workqueue.py, fairness.py), but a queue without a bound lets one namespace
park hundreds of requests on a node: each waits, holds a PodSnapshot in Running and a claim, and is looked at
by every pass of the queue. A namespace may have at most `bound` of each kind queued or running on a node
(the node setting `--namespace-backlog`); one more is refused at once, with the reason and a hint, and another
namespace is not affected. A final save (a pod being terminated: its last chance) and a resume (a workload's
replacement) are never refused, but count. Pure: the agent holds a lock around it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from kubectl_snapshot.core.errors import InvalidArgument, TooManyRequests

DEFAULT_NAMESPACE_BACKLOG: Final = 20  # per namespace, node and kind: a few users' and policies' saves at once


def parse_bound(setting: str) -> int:
    """`--namespace-backlog`: a positive whole number, or empty for the default."""
    value = setting.strip()
    if not value:
        return DEFAULT_NAMESPACE_BACKLOG
    if not value.isdigit() or int(value) < 1:
        raise InvalidArgument(
            f"--namespace-backlog must be a positive whole number, got {setting!r}",
            hint=f"leave it empty for the default ({DEFAULT_NAMESPACE_BACKLOG})",
        )
    return int(value)


@dataclass
class Backlog:
    """What each namespace has queued or running of one kind (`what`: "snapshots", "restores") on `node`."""

    bound: int
    what: str
    node: str = ""
    counts: dict[str, int] = field(default_factory=dict)

    def admit(self, namespace: str, *, exempt: bool = False) -> TooManyRequests | None:
        """Count one more request of `namespace`, or the refusal when it is over the bound (nothing counted)."""
        n = self.counts.get(namespace, 0)
        if n >= self.bound and not exempt:
            where = f" on node {self.node}" if self.node else ""
            return TooManyRequests(
                f"refused: namespace {namespace} already has {n} {self.what} queued or running{where}, the most "
                f"one namespace may (--namespace-backlog={self.bound}); this one was not queued",
                hint=f"wait for those {self.what} to finish, then try again; an administrator can raise the agent's "
                "--namespace-backlog",
            )
        self.counts[namespace] = n + 1
        return None

    def done(self, namespace: str) -> None:
        """One request of `namespace` finished (or was dropped)."""
        n = self.counts.get(namespace, 0) - 1
        if n > 0:
            self.counts[namespace] = n
        else:
            self.counts.pop(namespace, None)
