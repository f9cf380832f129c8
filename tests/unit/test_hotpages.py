"""The pages a container's processes asked for first (core/hotpages.py), as a snapshot records them
(``containers[].hotPages``) and as the node keeps them between a restore and the next save
(shim/engine/hottraces.py). A list that does not parse is dropped, never an error: the snapshot still
reads, as without one. Served from: tests/unit/test_lazy_source.py (warm); with real CRIU:
tests/integration/test_lazy_session.py."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from kubectl_snapshot.core import hotpages as H
from kubectl_snapshot.core.hotpages import HotRange
from kubectl_snapshot.core.model import parse_config
from shim.engine.hottraces import HotTraces
from tests.unit.test_oci_model import config

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


def test_a_record_keeps_its_hot_pages_through_the_config() -> None:
    cfg = config()
    hot = (HotRange(1, A, 3), HotRange(12, A + 16 * P, 1))
    cfg = replace(cfg, containers=(replace(cfg.containers[0], hot=hot),))
    body = cfg.to_bytes()
    assert json.loads(body)["containers"][0]["hotPages"] == [[1, A, 3], [12, A + 16 * P, 1]]
    assert parse_config(body) == cfg
    # none recorded: no key at all (a snapshot without a lazy restore behind it reads as before)
    assert "hotPages" not in json.loads(config().to_bytes())["containers"][0]


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
def test_a_malformed_list_is_dropped_and_the_snapshot_still_reads(bad: object) -> None:
    d = json.loads(config().to_bytes())
    d["containers"][0]["hotPages"] = bad
    cfg = parse_config(json.dumps(d).encode())
    assert cfg.containers[0].hot == ()
    assert cfg.containers[0] == config().containers[0]


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


def test_inspect_says_how_many_pages_a_lazy_restore_fetches_first() -> None:
    from kubectl_snapshot.console.inspect import inspect_data, inspect_text
    from kubectl_snapshot.core import constants as C
    from kubectl_snapshot.core.artifact import Artifact
    from kubectl_snapshot.core.oci import Descriptor, build_manifest
    from kubectl_snapshot.core.reference import Reference

    ref = Reference.parse("127.0.0.1:5000/r@sha256:" + "1" * 64)
    for hot in ((HotRange(1, A, 3), HotRange(7, A, 2)), ()):
        cfg = config()
        cfg = replace(cfg, containers=(replace(cfg.containers[0], hot=hot),))
        layer = Descriptor(C.CHECKPOINT_LAYER_MEDIA_TYPE, cfg.containers[0].layer_digest, 10)
        manifest = build_manifest(config=Descriptor(C.CONFIG_MEDIA_TYPE, "sha256:" + "2" * 64, 5), layers=[layer],
                                  artifact_type=C.ARTIFACT_TYPE, annotations={})  # fmt: skip
        data = inspect_data(Artifact(ref, manifest, cfg))
        text = inspect_text(data)
        assert data["containers"][0]["hotPages"] == sum(h.pages for h in hot)
        assert ("5 pages used first, fetched first by a lazy restore" in text) == bool(hot), text
