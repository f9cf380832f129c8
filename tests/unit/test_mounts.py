"""Which repositories the agent offers the registry as cross-repository mount sources."""

from __future__ import annotations

from typing import Any

from kubectl_snapshot.core.errors import PermissionDenied
from kubectl_snapshot.core.reference import Reference
from shim.controller.mounts import mount_candidates, previous_repositories
from tests.support.fakekube import StrictKube

D = "@sha256:" + "a" * 64


def snap(ref: str, created: str, phase: str = "Succeeded") -> dict[str, Any]:
    return {"metadata": {"creationTimestamp": created}, "status": {"phase": phase, "reference": ref}}


def test_other_repositories_of_the_same_registry_newest_first() -> None:
    target = Reference.parse("reg:5000/team/web:v3")
    objs = [
        snap("reg:5000/team/old" + D, "2026-11-01T00:00:00Z"),
        snap("reg:5000/team/web" + D, "2026-11-03T00:00:00Z"),  # the target's own repository: HEAD covers it
        snap("other:5000/team/web" + D, "2026-11-04T00:00:00Z"),  # another registry cannot mount
        snap("reg:5000/team/new" + D, "2026-11-02T00:00:00Z"),
        snap("reg:5000/team/failed" + D, "2026-11-05T00:00:00Z", phase="Failed"),
        snap("reg:5000/team/new" + D, "2026-11-01T12:00:00Z"),  # once per repository
        {"metadata": {}, "status": {"phase": "Succeeded", "reference": "not a reference!"}},
    ]
    assert [r.repository for r in mount_candidates(objs, target)] == ["team/new", "team/old"]


def test_listing_by_the_pod_label_and_unreadable_lists() -> None:
    class Kube(StrictKube):
        def __init__(self, fail: bool) -> None:
            self.fail, self.calls = fail, list[tuple[str | None, str | None]]()

        def list_snapshots(self, ns: str | None, *, label_selector: str | None = None) -> list[dict[str, Any]]:
            self.calls.append((ns, label_selector))
            if self.fail:
                raise PermissionDenied("forbidden")
            return [snap("reg:5000/a/b" + D, "2026-11-01T00:00:00Z")]

    ok = Kube(False)
    got = previous_repositories(ok, "team-a", "web", Reference.parse("reg:5000/a/c:v1"))
    assert [r.repository for r in got] == ["a/b"] and ok.calls == [("team-a", "kubectl-snapshot.io/pod=web")]
    assert previous_repositories(Kube(True), "team-a", "web", Reference.parse("reg:5000/a/c:v1")) == []
