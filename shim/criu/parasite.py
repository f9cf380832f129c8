"""CRIU's parasite, left mapped in a task by a dump that failed: unmapped once the containers are thawed
(threat A4).

To dump a task CRIU injects its parasite: code and a shared area in a memfd CRIU names ``CRIUMFD``
(compel), mapped into the task, and unmapped again when CRIU cures it. When CRIU dies in the middle
(killed, OOM; ``CRIU_FAULT=1``) or its parasite cannot connect (``CRIU_FAULT=5``), the cure does not
happen and the task keeps two ``/memfd:CRIUMFD (deleted)`` mappings (~48 KiB): memory of the workload's
that CRIU's next dump saves with it. They are unmapped from inside the task (shim/host/ptrace.py).

Only mappings that were not there before the dump are touched: the tasks' CRIUMFD mappings are listed
before the freeze (a process of the pod may run a CRIU of its own, whose mappings are its own).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from shim.host import ptrace

log = logging.getLogger(__name__)

PARASITE_FILE = "/memfd:CRIUMFD (deleted)"


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    inode: int


def parasite_mappings(maps: str) -> list[Mapping]:
    """The CRIUMFD mappings in the text of a /proc/PID/maps."""
    found = []
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5] == PARASITE_FILE:
            start, end = (int(x, 16) for x in parts[0].split("-"))
            found.append(Mapping(start, end, int(parts[4])))
    return found


def processes(pids: Sequence[int]) -> list[int]:
    """`pids` and every process below them (through /proc/PID/task/TID/children, as CRIU walks a tree)."""
    seen: list[int] = []
    todo = list(pids)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.append(pid)
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
    return seen


def _pid_namespace(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return ""


def _mappings(pid: int) -> list[Mapping]:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return parasite_mappings(f.read())
    except OSError:  # the process ended
        return []


def present(pids: Sequence[int]) -> dict[int, frozenset[int]]:
    """The CRIUMFD mappings (their inodes) of the processes of `pids`' trees now."""
    return {pid: frozenset(m.inode for m in found) for pid in processes(pids) if (found := _mappings(pid))}


def cure(pids: Sequence[int], before: dict[int, frozenset[int]]) -> list[str]:
    """Unmap the CRIUMFD mappings of `pids`' trees that `before` does not list; what was unmapped, as
    ``PID:START-END``. A process whose cure fails is logged and left as it is (it runs on)."""
    cured: list[str] = []
    pods = {ns for ns in map(_pid_namespace, pids) if ns}
    for pid in processes(pids):
        left = [m for m in _mappings(pid) if m.inode not in before.get(pid, frozenset())]
        # a pid the walk listed that ended and was given to a process elsewhere (a CRIU dumping another pod
        # holds CRIUMFD mappings of its own) is not traced: only processes of the containers' pid namespaces
        if not left or _pid_namespace(pid) not in pods:
            continue
        try:
            results = ptrace.run_munmap(pid, [(m.start, m.end) for m in left])
        except (OSError, ValueError) as e:
            log.warning("CRIU's parasite stays mapped in process %d: %s", pid, e)
            continue
        for m, r in zip(left, results, strict=False):
            if r == 0:
                cured.append(f"{pid}:{m.start:x}-{m.end:x}")
            else:
                log.warning("CRIU's parasite stays mapped in process %d at %x: %s", pid, m.start, os.strerror(-r))
    return cured


@contextlib.contextmanager
def cured_after_failure(pids: Sequence[int]) -> Iterator[None]:
    """Around a dump and its thaw: on a failure, what CRIU's parasite left in the tasks is unmapped (after
    the thaw inside this context put them back to run)."""
    before = present(pids)
    try:
        yield
    except BaseException:
        cured = cure(pids, before)
        if cured:
            log.warning("unmapped what CRIU's parasite left after its dump failed: %s", ", ".join(cured))
        raise
