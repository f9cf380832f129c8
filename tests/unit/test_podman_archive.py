"""The documents an export writes for podman (core/podman_archive.py): each refusal beside what passes."""

from __future__ import annotations

import dataclasses

import pytest

from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core import podman_archive as P
from kubectl_snapshot.core.errors import InvalidArgument, NotFound
from kubectl_snapshot.core.model import ContainerRecord, PodRecord, SnapshotConfig
from kubectl_snapshot.core.oci import sha256_digest
from tests.unit.test_oci_model import config

IMAGE_ID = "0b9d2caf8a17983a1731f61c532475a923ad905a81b41dfb9f79916811edd37c"
REF_DIGEST = sha256_digest(b"manifest")


def two_containers() -> SnapshotConfig:
    cfg = config()
    other = dataclasses.replace(cfg.containers[0], name="sidecar", id="def")
    return dataclasses.replace(cfg, containers=(cfg.containers[0], other))


def test_the_only_container_is_chosen_and_a_named_one_among_several() -> None:
    assert P.choose_container(config(), None).name == "app"
    cfg = two_containers()
    assert P.choose_container(cfg, "sidecar").name == "sidecar"
    with pytest.raises(InvalidArgument, match="holds one") as e:
        P.choose_container(cfg, None)  # an archive holds one container: which one must be said
    assert "--container" in (e.value.hint or "")
    with pytest.raises(NotFound, match="no container 'nope'") as missing:
        P.choose_container(cfg, "nope")
    assert "app, sidecar" in (missing.value.hint or "")


def test_image_ids_are_config_digests() -> None:
    assert P.image_id(IMAGE_ID) == IMAGE_ID
    assert P.image_id("sha256:" + IMAGE_ID) == IMAGE_ID
    for bad in ("", "latest", "sha256:abc", "sha512:" + IMAGE_ID, IMAGE_ID.upper()):
        with pytest.raises(InvalidArgument, match="image id"):
            P.image_id(bad)
    assert P.config_digest_of({"config": {"digest": "sha256:" + IMAGE_ID}}) == "sha256:" + IMAGE_ID
    for manifest in ({}, {"config": {"digest": "md5:x"}}, {"config": "sha256:" + IMAGE_ID}):
        with pytest.raises(InvalidArgument):
            P.config_digest_of(manifest)


def test_dumps_podman_reads() -> None:
    cfg = config()
    d = P.podman_dumps(cfg, cfg.containers[0], reference_digest=REF_DIGEST, rootfs_image_id=IMAGE_ID)
    c = d.config
    assert c["name"] == "app" and c["rootfsImageName"] == "localhost/busybox:1"
    assert c["rootfsImageID"] == IMAGE_ID  # podman requires both name and id
    assert c["runtime"] == "runc" and c["command"] == ["sh"]
    assert len(c["id"]) == 64 and c["id"] == P.export_container_id(REF_DIGEST, "app")
    assert c["id"] != P.export_container_id(REF_DIGEST, "sidecar")
    assert c["spec"] == d.spec
    assert "createNetNS" not in c  # a network namespace of its own is in CRIU's images: podman adds none
    assert d.spec["annotations"][P.MANAGER_ANNOTATION] == "libpod"  # checkpointctl: a podman archive
    assert d.spec["annotations"][C.ANN_CRIU_ROOTFS_IMAGE_SHA] == cfg.containers[0].image_digest
    assert d.spec["process"]["env"] == [P.DEFAULT_PATH_ENV]  # v3 stores none: processes exec'd later get PATH
    assert d.restore_flags == ("--tcp-established", "--file-locks")
    assert len(d.warnings) == 1 and "volumes (vol-0)" in d.warnings[0]  # not carried: said
    plain = dataclasses.replace(cfg, volumes=(), volumes_layer=None)
    quiet = P.podman_dumps(plain, plain.containers[0], reference_digest=REF_DIGEST, rootfs_image_id=IMAGE_ID)
    assert quiet.warnings == ()
    assert cfg.containers[0].spec == {"process": {"args": ["sh"]}}  # the record is not changed
    renamed = P.podman_dumps(cfg, cfg.containers[0], reference_digest=REF_DIGEST, rootfs_image_id=IMAGE_ID, name="x-1")
    assert renamed.config["name"] == "x-1"
    with pytest.raises(InvalidArgument, match="podman accepts"):
        P.podman_dumps(cfg, cfg.containers[0], reference_digest=REF_DIGEST, rootfs_image_id=IMAGE_ID, name="-bad")


def test_dump_options_decide_the_restore_flags() -> None:
    cfg = config()
    rec = dataclasses.replace(cfg.containers[0], tcp_established=False, file_locks=False)
    d = P.podman_dumps(cfg, rec, reference_digest=REF_DIGEST, rootfs_image_id=IMAGE_ID)
    assert d.restore_flags == ()


def test_a_pod_container_loses_the_old_node_s_cgroup_and_namespace_paths_with_a_warning() -> None:
    spec = {
        "process": {"args": ["sleep", "1d"], "env": ["A=1"]},
        "linux": {
            "cgroupsPath": "kubepods-besteffort:cri-containerd:abc",
            "namespaces": [{"type": "network", "path": "/proc/42/ns/net"}, {"type": "mount"}],
        },
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/etc/hosts", "type": "bind", "source": "/var/lib/kubelet/pods/u1/etc-hosts"},
        ],
    }
    rec = ContainerRecord(
        name="app", id="abc", image="docker.io/library/busybox:1", image_digest="", layer_digest=REF_DIGEST, spec=spec
    )
    cfg = dataclasses.replace(
        config(),
        containers=(rec,),
        volumes=(),
        volumes_layer=None,
        pod=PodRecord(name="web", namespace="team-a", uid="u1"),
    )
    d = P.podman_dumps(cfg, rec, reference_digest=REF_DIGEST, rootfs_image_id=IMAGE_ID)
    assert "cgroupsPath" not in d.spec["linux"]
    assert d.spec["linux"]["namespaces"] == [{"type": "network"}, {"type": "mount"}]
    assert len(d.warnings) == 2 and "network" in d.warnings[0] and "loopback only" in d.warnings[0]
    # the pod's network namespace was external to CRIU's dump: podman must create one to hand to it
    assert (d.config["createNetNS"], d.config["networkMode"]) == (True, "none")
    assert "/etc/hosts from /var/lib/kubelet/pods/u1/etc-hosts" in d.warnings[1] and "/proc" not in d.warnings[1]
    assert d.spec["process"]["env"] == ["A=1"]  # an env that is there (v1/v2) is kept
    assert d.spec["annotations"][C.ANN_CRIU_POD_NAMESPACE] == "team-a"
    assert C.ANN_CRIU_ROOTFS_IMAGE_SHA not in d.spec["annotations"]  # no digest recorded, none claimed


def test_the_checkpoint_image_is_one_uncompressed_layer_marked_for_cri_o_and_checkpointctl() -> None:
    import json

    cfg = dataclasses.replace(config(), pod=PodRecord(name="web", namespace="team-a"))
    rec = cfg.containers[0]
    dumps = P.podman_dumps(cfg, rec, reference_digest=REF_DIGEST, rootfs_image_id=IMAGE_ID)
    layer = sha256_digest(b"archive")
    image_config, manifest = P.checkpoint_image(cfg, rec, dumps, layer_digest=layer, layer_size=7)
    m = json.loads(manifest)
    assert m["config"] == {
        "mediaType": P.OCI_IMAGE_CONFIG,
        "digest": sha256_digest(image_config),
        "size": len(image_config),
    }
    assert m["layers"] == [{"mediaType": P.OCI_LAYER_TAR, "digest": layer, "size": 7}]
    ann = m["annotations"]
    assert ann["io.kubernetes.cri-o.annotations.checkpoint.name"] == "app"
    assert ann["io.kubernetes.cri-o.annotations.checkpoint.rootfsImageID"] == IMAGE_ID
    assert ann["org.criu.checkpoint.rootfsImageID"] == IMAGE_ID
    assert ann[C.ANN_CRIU_POD_NAMESPACE] == "team-a" and ann[C.ANN_CRIU_CONTAINER_NAME] == "app"
    c = json.loads(image_config)
    assert c["rootfs"]["diff_ids"] == [layer]  # uncompressed: the layer's digest is its diff id
    assert c["architecture"] == "amd64" and c["os"] == "linux"
    # the same snapshot gives the same image, byte for byte
    assert P.checkpoint_image(cfg, rec, dumps, layer_digest=layer, layer_size=7) == (image_config, manifest)
