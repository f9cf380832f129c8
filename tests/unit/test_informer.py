"""The agent's list-then-watch loop (shim/controller/informer.py) over a scripted API: it lists once,
resumes every watch from the last resourceVersion (bookmarks included) and lists again only on 410."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from kubectl_snapshot.core.errors import Expired, Unavailable
from shim.controller.informer import Informer


def obj(name: str, rv: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "resourceVersion": rv}}


class ScriptedApi:
    """Each watch call takes the next script entry: a list of events, or an exception to raise."""

    def __init__(self, script: list[Any], stop: threading.Event) -> None:
        self.script, self.stop = script, stop
        self.lists = 0
        self.watched_from: list[str] = []

    def list_fn(self) -> tuple[list[dict[str, Any]], str]:
        self.lists += 1
        return [obj("a", "10"), obj("b", "11")], "12"

    def watch_fn(self, rv: str) -> Iterator[tuple[str, dict[str, Any]]]:
        self.watched_from.append(rv)
        if not self.script:
            self.stop.set()
            return
        step = self.script.pop(0)
        if isinstance(step, Exception):
            raise step
        yield from step


def run(script: list[Any]) -> tuple[ScriptedApi, Informer, list[str]]:
    stop = threading.Event()
    api = ScriptedApi(script, stop)
    seen: list[str] = []
    inf = Informer("test", api.list_fn, api.watch_fn, lambda o: seen.append(o["metadata"]["name"]), retry_s=0)
    inf.run(stop)
    return api, inf, seen


def test_steady_state_lists_once_and_resumes_each_watch_where_the_last_ended() -> None:
    api, inf, seen = run(
        [
            [("ADDED", obj("c", "13")), ("MODIFIED", obj("a", "14"))],
            [],  # a watch the server ended with nothing new
            [("BOOKMARK", obj("", "20"))],  # only a newer resourceVersion
            [("DELETED", obj("b", "21"))],
        ]
    )
    assert api.lists == 1 and inf.lists == 1 and inf.ready.is_set()
    assert api.watched_from == ["12", "14", "14", "20", "21"]
    assert seen == ["a", "b", "c", "a"]  # DELETED and BOOKMARK are not handed to the handler


def test_expired_resource_version_lists_again_other_errors_resume() -> None:
    api, _, seen = run(
        [
            [("ADDED", obj("c", "13"))],
            Unavailable("connection reset"),  # resumes from 13, no list
            Expired("too old resource version"),  # lists again
            [],
        ]
    )
    assert api.lists == 2
    assert api.watched_from == ["12", "13", "13", "12", "12"]
    assert seen == ["a", "b", "c", "a", "b"]


def test_a_failing_handler_does_not_stop_the_watch() -> None:
    stop = threading.Event()
    api = ScriptedApi([[("ADDED", obj("c", "13"))]], stop)
    seen: list[str] = []

    def handle(o: dict[str, Any]) -> None:
        if o["metadata"]["name"] == "a":
            raise RuntimeError("boom")
        seen.append(o["metadata"]["name"])

    Informer("test", api.list_fn, api.watch_fn, handle, retry_s=0).run(stop)
    assert seen == ["b", "c"] and api.watched_from == ["12", "13"]
