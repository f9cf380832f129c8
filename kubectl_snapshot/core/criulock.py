"""Which nf_tables tables are the network lock a CRIU dump left behind (threat A2).

With ``network-lock nftables`` (shim/criu/config.py) CRIU locks a dumped task's network namespace with a
table of family ``inet`` named ``CRIU-<its run id>`` (criu/netfilter.c, ``nftables_get_table``) and
deletes it when the dump ends, well or not. A CRIU that is killed in between (``kill -9``, the OOM
killer, a crash) deletes nothing: every packet of the pod is dropped for good while the pod runs on.
The agent lists the namespace's tables before the dump and, when the dump failed, lifts the tables of
CRIU's name that appeared meanwhile: never a table that was there before (another CRIU's, still
working) or of another name (kube-proxy's, a CNI's, the agent's own dump lock).
"""

from __future__ import annotations

from collections.abc import Iterable

CRIU_TABLE_PREFIX = "CRIU-"


def is_criu_table(name: str) -> bool:
    """A table named as CRIU names its network lock."""
    return name.startswith(CRIU_TABLE_PREFIX) and len(name) > len(CRIU_TABLE_PREFIX)


def left_by_dump(before: Iterable[str], after: Iterable[str]) -> list[str]:
    """CRIU's lock tables in `after` that were not in `before`, in `after`'s order, each once."""
    seen = set(before)
    left: list[str] = []
    for name in after:
        if is_criu_table(name) and name not in seen:
            seen.add(name)
            left.append(name)
    return left
