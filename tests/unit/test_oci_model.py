"""The OCI model and the snapshot config: round trips and refusal of malformed input."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.errors import FailedPrecondition
from kubectl_snapshot.core.model import (
    ContainerRecord,
    DumpStats,
    HostFacts,
    ProcessInfo,
    SnapshotConfig,
    VolumeRecord,
    check_layers_match,
    manifest_annotations,
    parse_config,
    stored_runtime_spec,
)
from kubectl_snapshot.core.oci import Descriptor, build_manifest, parse_manifest, sha256_digest

D1 = sha256_digest(b"one")
D2 = sha256_digest(b"two")


def config() -> SnapshotConfig:
    rec = ContainerRecord(
        name="app",
        id="abc",
        image="localhost/busybox:1",
        image_digest=D2,
        layer_digest=D1,
        spec={"process": {"args": ["sh"]}},
        stats=DumpStats(process_count=2, memory_bytes=8192, pages_written=2, processes=(ProcessInfo(1, 0, "sh"),)),
    )
    return SnapshotConfig(
        group="pod",
        namespace="default",
        created="2026-11-29T12:00:00Z",
        containers=(rec,),
        host=HostFacts(kernel="6.18", arch="x86_64", criu_version="4.2.1", cpu_flags=("avx2",)),
        volumes=(VolumeRecord("vol-0", "/data"),),
        volumes_layer=D2,
    )


def test_config_round_trip() -> None:
    cfg = config()
    again = parse_config(cfg.to_bytes())
    assert again == cfg
    assert again.to_bytes() == cfg.to_bytes()  # canonical: same bytes, same digest


def test_manifest_round_trip_and_annotations() -> None:
    cfg = config()
    body = cfg.to_bytes()
    m = build_manifest(
        config=Descriptor(C.CONFIG_MEDIA_TYPE, sha256_digest(body), len(body)),
        layers=[Descriptor(C.CHECKPOINT_LAYER_MEDIA_TYPE, D1, 10, {C.ANN_TITLE: "app.tar.zst"})],
        artifact_type=C.ARTIFACT_TYPE,
        annotations=manifest_annotations(cfg),
    )
    parsed = parse_manifest(m.to_bytes())
    assert parsed == m
    assert parsed.digest == sha256_digest(m.to_bytes())
    d = json.loads(m.to_bytes())
    assert d["artifactType"] == C.ARTIFACT_TYPE and d["schemaVersion"] == 2
    assert d["annotations"][C.ANN_CRIU_VERSION] == "4.2.1"
    assert d["annotations"][C.ANN_CREATED] == "2026-11-29T12:00:00Z"


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(schemaVersion=1), "schemaVersion"),
        (lambda d: d["layers"][0].update(digest="md5:abc"), "digest"),
        (lambda d: d["layers"][0].update(size=-1), "size"),
        (lambda d: d.update(mediaType=C.OCI_INDEX), "not an OCI image manifest"),
        (lambda d: d["config"].update(mediaType="no slash"), "mediaType"),
        (lambda d: d.update(layers="nope"), "layers"),
    ],
)
def test_malformed_manifests_are_refused(mutate, message) -> None:  # type: ignore[no-untyped-def]
    d = {
        "schemaVersion": 2,
        "mediaType": C.OCI_MANIFEST,
        "config": {"mediaType": C.CONFIG_MEDIA_TYPE, "digest": D1, "size": 1},
        "layers": [{"mediaType": C.CHECKPOINT_LAYER_MEDIA_TYPE, "digest": D2, "size": 1}],
    }
    mutate(d)
    with pytest.raises(FailedPrecondition, match=message):
        parse_manifest(json.dumps(d).encode())


def test_not_json_is_refused() -> None:
    with pytest.raises(FailedPrecondition, match="not valid JSON"):
        parse_manifest(b"\xff\x00")
    with pytest.raises(FailedPrecondition, match="not valid JSON"):
        parse_config(b"{")


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d.update(formatVersion=99), "format version"),
        (lambda d: d.update(containers=[]), "no containers"),
        (lambda d: d["containers"][0].update(layer="sha256:short"), "layer digest"),
        (lambda d: d.update(containers=d["containers"] * 2), "duplicate"),
        (lambda d: d["volumes"][0].update(name="../etc"), "volume name"),
        (lambda d: d.update(volumesLayer="x"), "volumes layer"),
    ],
)
def test_malformed_configs_are_refused(mutate, message) -> None:  # type: ignore[no-untyped-def]
    d = json.loads(config().to_bytes())
    mutate(d)
    with pytest.raises(FailedPrecondition, match=message):
        parse_config(json.dumps(d).encode())


def test_layers_named_by_the_config_must_be_in_the_manifest() -> None:
    cfg = config()
    check_layers_match(cfg, [D1, D2])
    with pytest.raises(FailedPrecondition, match="lacks"):
        check_layers_match(cfg, [D2])
    with pytest.raises(FailedPrecondition, match="volumes layer"):
        check_layers_match(cfg, [D1])


def test_stored_spec_drops_the_environment() -> None:
    """process.env holds the values the kubelet resolved from secretKeyRef: never stored (format v3)."""
    spec: dict[str, Any] = {
        "process": {"args": ["app"], "env": ["DB_PASSWORD=hunter2"], "cwd": "/"},
        "root": {"path": "rootfs"},
    }
    stored = stored_runtime_spec(spec)
    assert stored == {"process": {"args": ["app"], "cwd": "/"}, "root": {"path": "rootfs"}}
    assert spec["process"]["env"] == ["DB_PASSWORD=hunter2"]  # the caller's spec is untouched


def test_v3_config_with_an_environment_is_refused_and_v2_still_reads() -> None:
    d = json.loads(config().to_bytes())
    assert d["formatVersion"] == 3
    d["containers"][0]["spec"]["process"]["env"] = ["A=1"]
    with pytest.raises(FailedPrecondition, match="environment"):
        parse_config(json.dumps(d).encode())
    d["formatVersion"] = 2  # older snapshots recorded it; they are still read
    assert parse_config(json.dumps(d).encode()).format_version == 2
