"""The pages a container's processes asked for first (core/hotpages.py), as a snapshot's container layer
holds them (``kubectl-snapshot.hotpages.json``, read from the staged dir) and as the node keeps them
between a restore and the next save (shim/engine/hottraces.py). A list that does not parse is dropped,
never an error: the restore goes on as without one. Served from: tests/unit/test_lazy_source.py (warm); with real CRIU:
tests/integration/test_lazy_session.py. Kept on disk in the restored pod's state dir, so that an agent
restart does not lose them."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core import hotpages as H
from kubectl_snapshot.core.hotpages import HotRange
from shim.engine.hottraces import HotTraces, read_staged
from shim.engine.staging import StatePaths

P = H.PAGE
A = 0x7F0000000000


def test_faults_become_ranges_in_first_touch_order() -> None:
    faults = [(5, A + 3 * P), (5, A + 4 * P + 17), (5, A + 5 * P), (6, A), (5, A + 4 * P), (5, A), (6, A + P)]
    assert H.from_faults(faults) == (
        HotRange(5, A + 3 * P, 3),  # a walk upwards, one range; the offset within a page is dropped
        HotRange(6, A, 1),
        HotRange(5, A, 1),  # page A + 4P again: already there
        HotRange(6, A + P, 1),  # task 6's next page, but after task 5's fault: its own range
    )
    assert len(H.from_faults([(1, A + 2 * i * P) for i in range(50)], limit=10)) == 10


def test_merge_puts_this_restores_faults_first_then_what_the_snapshot_adds() -> None:
    now = (HotRange(1, A, 4),)
    before = (HotRange(1, A + P, 2), HotRange(1, A + 8 * P, 1), HotRange(2, A, 1))
    assert H.merge(now, before) == (HotRange(1, A, 4), HotRange(1, A + 8 * P, 1), HotRange(2, A, 1))
    assert H.merge(now, before, limit=2) == (HotRange(1, A, 4), HotRange(1, A + 8 * P, 1))
    assert H.merge((), before) == before


def test_the_layer_file_round_trips() -> None:
    hot = (HotRange(1, A, 3), HotRange(12, A + 16 * P, 1))
    data = H.to_bytes(hot)
    assert json.loads(data) == {"version": 1, "ranges": [[1, A, 3], [12, A + 16 * P, 1]]}
    assert H.from_bytes(data) == hot


@pytest.mark.parametrize(
    "bad",
    [
        "not a list",
        [[1, A]],
        [[1, A, 0]],
        [[0, A, 1]],
        [[1, A + 1, 1]],
        [[1, A, H.MAX_RANGE_PAGES + 1]],
        [[1, A, True]],
        [[1, float(A), 1]],
        [[1, A, 1]] * (H.MAX_RANGES + 1),
    ],
)
def test_a_malformed_list_is_dropped_never_an_error(bad: object) -> None:
    assert H.from_bytes(json.dumps({"version": 1, "ranges": bad}).encode()) == ()
    assert H.from_bytes(json.dumps({"version": 1, "ranges": [[1, A, 1]]}).encode()) == (HotRange(1, A, 1),)


@pytest.mark.parametrize("data", [b"", b"{", b"[]", b'{"version": 2, "ranges": []}', b" " * (H.MAX_FILE_BYTES + 1)])
def test_a_file_that_is_not_as_written_is_dropped(data: bytes) -> None:
    assert H.from_bytes(data) == ()


def test_a_staged_containers_file_is_read_and_a_link_or_a_missing_one_is_nothing(tmp_path: Path) -> None:
    hot = (HotRange(1, A, 3),)
    assert read_staged(str(tmp_path)) == ()  # a layer without one (a pod never restored lazily)
    (tmp_path / C.HOT_PAGES_FILE).write_bytes(H.to_bytes(hot))
    assert read_staged(str(tmp_path)) == hot
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "target").write_bytes(H.to_bytes(hot))
    (other / C.HOT_PAGES_FILE).symlink_to(other / "target")  # never followed
    assert read_staged(str(other)) == ()
    (tmp_path / C.HOT_PAGES_FILE).unlink()
    (tmp_path / C.HOT_PAGES_FILE).mkdir()  # not a plain file
    assert read_staged(str(tmp_path)) == ()


def test_the_node_keeps_each_pods_containers_apart_and_the_latest_only() -> None:
    traces = HotTraces(keep=2)
    one, two = (HotRange(1, A, 1),), (HotRange(1, A + P, 1),)
    traces.remember("uid-a", "app", one)
    traces.remember("uid-b", "app", two)
    assert traces.recall("uid-a", "app") == one and traces.recall("uid-b", "app") == two
    assert traces.recall("uid-a", "sidecar") == () and traces.recall("uid-c", "app") == ()
    traces.remember("uid-a", "app", two)  # a later restore of the same pod: replaced
    assert traces.recall("uid-a", "app") == two
    traces.remember("uid-c", "app", one)  # beyond `keep`: the least recently remembered goes
    assert traces.recall("uid-b", "app") == () and traces.recall("uid-c", "app") == one
    traces.remember("uid-c", "app", ())  # restored from a snapshot without any: nothing carried
    assert traces.recall("uid-c", "app") == ()
    traces.remember("", "app", one)  # no pod (a node-level save): never kept
    assert traces.recall("", "app") == ()


def test_an_agent_restarted_between_a_restore_and_the_next_save_still_has_the_list(tmp_path: Path) -> None:
    paths = StatePaths(str(tmp_path))
    uid = "0f6d0c1e-1111-4a4a-9c9c-0123456789ab"
    os.makedirs(paths.pod_dir(uid))  # the restored pod's state dir (staging made it)
    hot = (HotRange(7, A, 2), HotRange(7, A + 9 * P, 1))
    before = HotTraces()
    before.keep_in(paths.hot_trace)
    before.remember(uid, "app", hot)
    stored = Path(paths.hot_trace(uid, "app"))
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600 and H.from_bytes(stored.read_bytes()) == hot

    after = HotTraces()  # the agent's next start: nothing in memory
    assert after.recall(uid, "app") == ()  # not told where: memory only
    after.keep_in(paths.hot_trace)
    assert after.recall(uid, "app") == hot
    assert after.recall(uid, "sidecar") == ()

    # a later restore of the pod that brought none: the file goes too
    after.remember(uid, "app", ())
    assert not stored.exists() and HotTraces().recall(uid, "app") == ()

    # the pod is gone (its state dir collected): nothing written, nothing read, no error
    other = "22222222-1111-4a4a-9c9c-0123456789ab"
    after.remember(other, "app", hot)
    assert not os.path.exists(paths.pod_dir(other))
    fresh = HotTraces()
    fresh.keep_in(paths.hot_trace)
    assert fresh.recall(other, "app") == ()

    # names no state dir is made of stay in memory; a link planted at the file is never read through
    after.remember("../escape", "app", hot)
    assert after.recall("../escape", "app") == hot and not (tmp_path / "escape").exists()
    target = tmp_path / "target"
    target.write_bytes(H.to_bytes(hot))
    Path(paths.hot_trace(uid, "web")).symlink_to(target)
    assert fresh.recall(uid, "web") == ()
