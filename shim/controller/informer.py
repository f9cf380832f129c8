"""List once, then watch from where the list ended, for as long as the agent runs.

What every Kubernetes informer does, without the cache (the agent's handlers read what they need):

- the first list (in pages) hands every existing object to the handler and yields the
  resourceVersion the watch starts from;
- a watch that times out (the API server ends each after ``timeoutSeconds``) is re-opened from the
  last resourceVersion seen, bookmarks included, so that in steady state nothing is listed again and
  nothing is delivered twice;
- only an expired resourceVersion (HTTP 410 Gone, in the response or as an ERROR event) makes it
  list again; any other failure waits ``retry_s`` and resumes from the same place.

Handlers must be idempotent: after a re-list they see objects they saw before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kubectl_snapshot.core.errors import Expired, SnapshotError

log = logging.getLogger(__name__)

Obj = dict[str, Any]
ListFn = Callable[[], tuple[Iterable[Obj], str]]
WatchFn = Callable[[str], Iterator[tuple[str, Obj]]]


@dataclass
class Informer:
    name: str
    list_fn: ListFn
    watch_fn: WatchFn  # called with the resourceVersion to resume from
    handle: Callable[[Obj], None]
    on_delete: Callable[[Obj], None] | None = None  # DELETED events (not seen again after a re-list)
    ready: threading.Event = field(default_factory=threading.Event)  # set after the first full list
    retry_s: float = 2.0
    lists: int = 0  # how many times it listed (1 in steady state)
    watches: int = 0  # how many watches it opened

    def run(self, stop: threading.Event) -> None:
        version: str | None = None
        while not stop.is_set():
            try:
                if version is None:
                    version = self._list()
                version = self._watch(version, stop)
            except Expired as e:
                log.info("%s: %s; listing again", self.name, e.message)
                version = None
            except SnapshotError as e:
                log.warning("%s watch: %s; retrying", self.name, e)
                stop.wait(self.retry_s)
            except Exception:
                log.exception("%s watch failed; retrying", self.name)
                stop.wait(self.retry_s)

    def _list(self) -> str:
        items, version = self.list_fn()
        self.lists += 1
        for obj in items:
            self._safe(obj)
        self.ready.set()
        return version

    def _watch(self, version: str, stop: threading.Event) -> str:
        """One watch, until the server ends it; returns the resourceVersion to resume from."""
        self.watches += 1
        for kind, obj in self.watch_fn(version):
            version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
            if kind in ("ADDED", "MODIFIED"):
                self._safe(obj)
            elif kind == "DELETED" and self.on_delete is not None:
                self._safe(obj, self.on_delete)
            if stop.is_set():
                break
        return version

    def _safe(self, obj: Obj, handle: Callable[[Obj], None] | None = None) -> None:
        try:
            (handle or self.handle)(obj)
        except Exception:
            log.exception("%s: handling %s failed", self.name, (obj.get("metadata") or {}).get("name"))
