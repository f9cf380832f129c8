"""`ks-agent import`: a checkpoint archive of another tool checked member by member (path traversal,
links, stray files refused; the kubelet's and podman's archives let through), and pushed as a signed
snapshot that says it was imported, with no tag left behind when the push fails."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

from kubectl_snapshot.adapters.signatures import verify_for_restore
from kubectl_snapshot.core import checkpoint_archive as A
from kubectl_snapshot.core.errors import InvalidArgument, NotFound, Unavailable
from kubectl_snapshot.core.model import HostFacts, parse_config
from kubectl_snapshot.core.oci import parse_manifest
from kubectl_snapshot.core.provenance import Origin, SigningKey, TrustPolicy
from kubectl_snapshot.core.reference import Reference
from shim.engine.importer import ImportRequest, extract, import_archive, plain_rootfs_diff
from shim.engine.staging import StatePaths
from tests.support.fakenode import FakeRegistry

TARGET = Reference.parse("127.0.0.1:5000/imported:v1")
HOST = HostFacts(kernel="6.1", arch="x86_64", criu_version="4.1")
KUBELET_SPEC: dict[str, Any] = {
    "ociVersion": "1.2.0",
    "process": {"args": ["sh", "-c", "count"], "env": ["PASSWORD=hunter2", "PATH=/bin"], "cwd": "/"},
    "root": {"path": "rootfs"},
    "annotations": {
        A.ANN_CRI_CONTAINER_NAME: "counter",
        A.ANN_CRI_SANDBOX_NAME: "web-0",
        A.ANN_CRI_SANDBOX_NAMESPACE: "shop",
        A.ANN_CRI_SANDBOX_UID: "uid-1",
        A.ANN_CRI_IMAGE_NAME: "registry.example/busybox:1.37",
    },
}
# containerd's crmetadata.ContainerConfig, as its CRI writes config.dump for the kubelet
KUBELET_CONFIG = {
    "id": "abc123",
    "name": "counter",
    "rootfsImageName": "registry.example/busybox:1.37",
    "rootfsImageRef": "sha256:" + "1" * 64,
    "runtime": "io.containerd.runc.v2",
    "createdTime": "2026-12-05T10:00:00Z",
    "checkpointedTime": "2026-12-05T10:01:00Z",
}


def archive(path: Path, entries: dict[str, bytes | None], *, extra: list[tarfile.TarInfo] = ()) -> Path:  # type: ignore[assignment]
    """A tar of `entries` (None: a directory) plus the prepared `extra` members."""
    with tarfile.open(path, "w") as tar:
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        for info in extra:
            tar.addfile(info, io.BytesIO(b"x" * info.size) if info.isreg() else None)
    return path


def kubelet_entries() -> dict[str, bytes | None]:
    return {
        "checkpoint": None,
        "checkpoint/inventory.img": b"\x00" * 16,
        "checkpoint/core-1.img": b"\x01" * 32,
        "config.dump": json.dumps(KUBELET_CONFIG).encode(),
        "spec.dump": json.dumps(KUBELET_SPEC).encode(),
        "status": b"{}",
        "container.log": b"1\n2\n",
        "rootfs-diff.tar": b"",
        "stats-dump": b"",
    }


# --- members ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,kind",
    [
        ("../etc/passwd", "file"),
        ("checkpoint/../../x", "file"),
        ("/etc/shadow", "file"),
        ("checkpoint/sub/core.img", "file"),
        ("checkpoint/inventory.img", "symbolic link"),
        ("config.dump", "hard link"),
        ("notes.txt", "file"),
        ("etc", "dir"),
    ],
)
def test_members_outside_a_checkpoint_archives_layout_are_refused(name: str, kind: str) -> None:
    with pytest.raises(InvalidArgument):
        A.check_member(name, kind)


@pytest.mark.parametrize(
    "name,kind,path",
    [
        ("./checkpoint/pages-1.img", "file", "checkpoint/pages-1.img"),
        ("config.dump", "file", "config.dump"),
        ("rootfs-diff.tar", "file", "rootfs-diff.tar"),
        ("status", "file", "status"),
        ("checkpoint/", "dir", None),
        ("./", "dir", None),
    ],
)
def test_the_members_of_kubelet_and_podman_archives_are_let_through(name: str, kind: str, path: str | None) -> None:
    assert A.check_member(name, kind) == path


def test_a_traversing_member_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    entries = kubelet_entries()
    entries["../../escaped"] = b"owned"
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(InvalidArgument, match=r"leaves the archive's directory"):
        extract(str(archive(tmp_path / "a.tar", entries)), str(out))
    assert not (tmp_path / "escaped").exists()


def test_a_symlink_member_is_refused(tmp_path: Path) -> None:
    link = tarfile.TarInfo("checkpoint/pages-1.img")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/shadow"
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(InvalidArgument, match=r"symbolic link"):
        extract(str(archive(tmp_path / "a.tar", kubelet_entries(), extra=[link])), str(out))


def test_a_tar_without_criu_images_or_not_a_tar_is_not_a_checkpoint_archive(tmp_path: Path) -> None:
    entries = kubelet_entries()
    del entries["checkpoint/inventory.img"]
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(InvalidArgument, match=r"not a checkpoint archive: it has no checkpoint/inventory.img"):
        extract(str(archive(tmp_path / "a.tar", entries)), str(out))
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"this is not a tar" * 100)
    with pytest.raises(InvalidArgument, match=r"is not a tar archive"):
        extract(str(junk), str(tmp_path / "out2"))


def test_a_kubelet_archive_extracts(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    written = extract(str(archive(tmp_path / "a.tar", kubelet_entries())), str(out))
    assert "checkpoint/core-1.img" in written and (out / "checkpoint/core-1.img").read_bytes() == b"\x01" * 32


# --- the dumps -------------------------------------------------------------------------------------


def test_a_kubelet_archive_describes_its_pods_container() -> None:
    c = A.describe(KUBELET_CONFIG, KUBELET_SPEC)
    assert (c.name, c.pod, c.namespace, c.pod_uid, c.runtime) == ("counter", "web-0", "shop", "uid-1", "containerd")
    assert c.image == "registry.example/busybox:1.37"


def test_a_podman_archive_describes_its_container_and_a_bad_name_is_refused() -> None:
    spec = {"process": {"args": ["sh"]}, "root": {"path": "/x"}, "annotations": {"io.container.manager": "libpod"}}
    c = A.describe({"name": "web", "rootfsImageName": "docker.io/library/busybox:1.37"}, spec)
    assert (c.name, c.runtime, c.namespace) == ("web", "podman", "")
    with pytest.raises(InvalidArgument, match=r"not a container name"):
        A.describe({"name": "Web_1", "rootfsImageName": "busybox"}, spec)
    with pytest.raises(InvalidArgument, match=r"not an OCI runtime spec"):
        A.describe({"name": "web", "rootfsImageName": "busybox"}, {"annotations": {}})
    with pytest.raises(InvalidArgument, match=r"not JSON"):
        A.parse_dump(b"{nope", "config.dump")


# --- the import ------------------------------------------------------------------------------------


def test_an_import_is_a_signed_snapshot_that_says_it_was_imported(tmp_path: Path) -> None:
    reg, key = FakeRegistry(), SigningKey.generate()
    req = ImportRequest(str(archive(tmp_path / "a.tar", kubelet_entries())), TARGET, key, node="ks-n1", host=HOST)
    result = import_archive(req, registry=reg, paths=StatePaths(str(tmp_path / "state")))
    manifest = parse_manifest(reg.manifests["v1"])
    cfg = parse_config(reg.blobs[manifest.config.digest])
    (rec,) = cfg.containers
    assert (rec.name, rec.image, cfg.namespace, cfg.pod and cfg.pod.name) == (
        "counter",
        "registry.example/busybox:1.37",
        "shop",
        "web-0",
    )
    assert "env" not in rec.spec["process"]  # resolved secrets are not stored
    # verified with the importer's key, the origin the archive's, marked imported
    verdict = verify_for_restore(reg, result.reference, "shop", "uid-1", TrustPolicy(keys=(key.public,)))
    assert verdict.verified and verdict.claim is not None
    assert verdict.claim.origin.imported and verdict.claim.origin.node == "ks-n1"
    assert not (tmp_path / "state" / "downloads" / "import").exists()


def test_an_agents_origin_is_never_marked_imported() -> None:
    opt = Origin(namespace="shop", pod="web-0").to_optional("k")
    assert "io.kubectl-snapshot.imported" not in opt and not Origin.from_optional(opt).imported
    assert Origin.from_optional(Origin(namespace="shop", imported=True).to_optional("k")).imported


def test_a_failed_import_leaves_no_tag(tmp_path: Path) -> None:
    reg = FakeRegistry(fail_push=True)
    req = ImportRequest(str(archive(tmp_path / "a.tar", kubelet_entries())), TARGET, SigningKey.generate(), host=HOST)
    with pytest.raises(Unavailable):
        import_archive(req, registry=reg, paths=StatePaths(str(tmp_path / "state")))
    assert reg.manifests == {}


def test_a_missing_archive_or_one_without_a_namespace_is_refused(tmp_path: Path) -> None:
    paths = StatePaths(str(tmp_path / "state"))
    with pytest.raises(NotFound):
        import_archive(
            ImportRequest(str(tmp_path / "none.tar"), TARGET, host=HOST), registry=FakeRegistry(), paths=paths
        )
    entries = kubelet_entries()
    spec = json.loads(entries["spec.dump"] or b"")
    del spec["annotations"][A.ANN_CRI_SANDBOX_NAMESPACE]
    entries["spec.dump"] = json.dumps(spec).encode()
    path = str(archive(tmp_path / "a.tar", entries))
    with pytest.raises(InvalidArgument, match=r"names no namespace"):
        import_archive(ImportRequest(path, TARGET, host=HOST), registry=FakeRegistry(), paths=paths)
    # ... which --namespace gives
    reg = FakeRegistry()
    import_archive(ImportRequest(path, TARGET, namespace="shop", host=HOST), registry=reg, paths=paths)
    assert "v1" in reg.manifests


def test_containerds_gzipped_rootfs_diff_is_stored_as_a_plain_tar(tmp_path: Path) -> None:
    plain = archive(tmp_path / "diff.tar", {"tmp/count": b"5\n"})
    gz = tmp_path / "rootfs-diff.tar"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    plain_rootfs_diff(str(gz))
    assert gz.read_bytes() == plain.read_bytes()
    plain_rootfs_diff(str(gz))  # a plain tar stays as it is
    assert gz.read_bytes() == plain.read_bytes()
    empty = tmp_path / "empty" / "rootfs-diff.tar"
    empty.parent.mkdir()
    empty.write_bytes(b"")
    plain_rootfs_diff(str(empty))
    assert not empty.exists()
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"\x1f\x8bnot gzip at all")
    with pytest.raises(InvalidArgument, match=r"not a valid gzip stream"):
        plain_rootfs_diff(str(bad))
