"""A lazy restore on a node without Kubernetes (`ks-agent restore --lazy`): the restored containers run
before their memory is back, their pages served by this process from the registry's chunks.

The same sessions as the agent's (shim/engine/lazyrestore.py: a page server and CRIU's lazy-pages daemon
per container, listening in its staged dir before the container is created); what differs is who serves
them and who ends a container whose pages cannot all come. Here it is the process that ran the restore:
the command waits until every page is in (`wait`, with progress), and a container whose lazy phase fails
(a page that cannot be fetched after the page server's retries, a daemon that dies) is killed through
containerd before the daemon's connection goes (the kernel would zero-fill what had not come). So is
every container still in its lazy phase when this process is asked to stop (SIGINT, SIGTERM, SIGHUP:
`end`). A process killed outright (SIGKILL) cannot end them, and the kernel then gives zeros for the pages
that had not come: each lazily staged dir names the process serving it (`mark_served`), and `ks-agent
recover`, or the next `ks-agent restore`, kills the containers whose server is gone (`end_orphaned`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kubectl_snapshot.core.errors import NotFound, SnapshotError
from shim.criu.pageproto import PAGE_SIZE
from shim.criu.pageserver import ServeStats
from shim.engine.lazyrestore import LazySession, LazyStage, give_slot
from shim.engine.staging import LAZY_PREFIX
from shim.host import private

log = logging.getLogger(__name__)

KillFn = Callable[[str], None]  # ends the container with this id (SIGKILL through containerd)


@dataclass
class Outcome:
    """One container's lazy phase once it ended: every page in, or ended with the reason."""

    container: str  # the restored container's id
    pages: int = 0
    seconds: float = 0.0
    error: str = ""


class NodeLazyPhase:
    """The lazy sessions of one node-level restore, keyed by the restored container's id."""

    def __init__(self, stages: Sequence[tuple[str, LazyStage]], *, criu: str, criu_version: str, kill: KillFn) -> None:
        self._stages = list(stages)
        self._criu, self._criu_version, self._kill = criu, criu_version, kill
        self._sessions: dict[str, LazySession] = {}
        self._outcomes: dict[str, Outcome] = {}
        self._changed = threading.Condition()

    def total_bytes(self) -> int:
        return sum(st.lazy_bytes for _, st in self._stages)

    def served_bytes(self) -> int:
        return sum(s.server.stats.pages for s in self._sessions.values()) * PAGE_SIZE

    def start(self) -> NodeLazyPhase:
        """Start every session (each daemon listens before this returns); on a failure the started ones
        are closed and the slots of those never started given back, then it raises."""
        try:
            for cid, st in self._stages:
                session = LazySession(
                    st,
                    criu=[self._criu],
                    criu_version=self._criu_version,
                    on_failure=self._failed(cid),
                    on_done=self._done(cid),
                )
                self._sessions[cid] = session
                session.start()
        except BaseException:
            self.close()
            give_slot(len(self._stages) - len(self._sessions))
            raise
        return self

    def _failed(self, cid: str) -> Callable[[str], None]:
        def report(reason: str) -> None:
            try:  # before the daemon's connection goes: the process never runs on zero-filled memory
                self._kill(cid)
            except (SnapshotError, OSError) as e:
                reason += f" (ending the container failed: {e})"
            self._ended(Outcome(cid, self._served(cid), error=reason))

        return report

    def _done(self, cid: str) -> Callable[[ServeStats, float], None]:
        def report(stats: ServeStats, seconds: float) -> None:
            self._ended(Outcome(cid, stats.pages, seconds))

        return report

    def _served(self, cid: str) -> int:
        s = self._sessions.get(cid)
        return s.server.stats.pages if s is not None else 0

    def _ended(self, outcome: Outcome) -> None:
        with self._changed:
            self._outcomes.setdefault(outcome.container, outcome)
            self._changed.notify_all()

    def wait(self, on_bytes: Callable[[int], None] | None = None, *, poll_s: float = 0.2) -> list[Outcome]:
        """Until every container's lazy phase ended; `on_bytes` gets the bytes served since its last call."""
        told = 0
        with self._changed:
            while len(self._outcomes) < len(self._stages):
                self._changed.wait(poll_s)
                for cid, s in self._sessions.items():  # ended without a word: its restore never came
                    if cid not in self._outcomes and s.thread is not None and not s.thread.is_alive():
                        self._outcomes[cid] = Outcome(cid, error="its restore never asked for a page")
                        with contextlib.suppress(SnapshotError, OSError):
                            self._kill(cid)  # whatever runs there has no memory behind it
                if on_bytes is not None:
                    now = self.served_bytes()
                    if now > told:
                        on_bytes(now - told)
                        told = now
        for s in self._sessions.values():  # each closes itself once its daemon is gone; wait for that
            if s.thread is not None:
                s.thread.join(30)
        return [self._outcomes[cid] for cid, _ in self._stages]

    def end(self, reason: str) -> list[str]:
        """Stop now: every container still in its lazy phase is ended (killed), then every session closed;
        returns those it ended."""
        ended = []
        for cid, session in self._sessions.items():
            with self._changed:
                over = cid in self._outcomes
            if not over:
                session.end(reason)
                ended.append(cid)
        self.close()
        return ended

    def close(self) -> None:
        for s in self._sessions.values():
            s.close()


RESTORER_FILE = ".restorer"  # in a lazily staged dir: "PID STARTTIME" of the process serving its pages


def _identity(pid: int) -> str | None:
    """ "PID STARTTIME" (field 22 of /proc/PID/stat): a pid reused by another process does not match."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return f"{pid} {rest[19]}" if len(rest) > 19 else None


def mark_served(staged_dirs: Sequence[str], where: str) -> None:
    """Name this process as the one serving these lazily staged dirs' pages, and `where` (containerd's
    address and namespace) their containers are, before they are created (the runtime wrapper moves
    each dir aside, file included)."""
    me = _identity(os.getpid()) or ""
    for d in staged_dirs:
        with private.create(os.path.join(d, RESTORER_FILE)) as f:
            f.write(f"{me}\n{where}\n")


def end_orphaned(by_id_root: str, kill: KillFn, where: str) -> list[str]:
    """The containers (in `where`: containerd's address and namespace) that a node-level lazy restore left
    running with pages still to come, its command gone without ending them (killed outright): killed
    now, each dir removed; returns their ids. A dir whose command still runs is left alone, as are the
    agent's (no RESTORER_FILE) and those of another containerd or namespace."""
    ended = []
    for name in sorted(os.listdir(by_id_root)) if os.path.isdir(by_id_root) else []:
        if not name.startswith(LAZY_PREFIX):
            continue
        d = os.path.join(by_id_root, name)
        try:
            with open(os.path.join(d, RESTORER_FILE)) as f:
                who, _, theirs = f.read().partition("\n")
        except OSError:
            continue
        pid = who.split(" ", 1)[0]
        if theirs.strip() != where or (pid.isdigit() and _identity(int(pid)) == who):
            continue  # another containerd's, or still served
        cid = name[len(LAZY_PREFIX) :]
        try:
            kill(cid)
        except NotFound:
            pass  # gone already: only its dir is left
        except (SnapshotError, OSError) as e:
            log.warning("container %s, restored lazily by a command that is gone: not ended: %s", cid, e)
            continue
        shutil.rmtree(d, ignore_errors=True)
        ended.append(cid)
    return ended


def criu_for_daemon() -> str:
    """The CRIU the runtime wrapper restores with (its KUBECTL_SNAPSHOT_CRIU, else `criu` on PATH): the
    lazy-pages daemon must be the same CRIU as the restore that connects to it."""
    from shim.host.facts import find_binary

    return os.environ.get("KUBECTL_SNAPSHOT_CRIU") or find_binary("criu")
