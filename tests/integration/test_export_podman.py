"""`ks-agent export`: a snapshot taken through containerd becomes the checkpoint archive podman and
checkpointctl read. Real components: containerd, runc, CRIU, the registry, podman 5.4 (Debian's, as
hack/install-bench-deps.sh installs it) and checkpointctl (hack/build-go-tool.sh checkpointctl).

Run under `flock /run/ks-e2e.lock` (host CRIU and containerd)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import tarfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.test_agent_roundtrip import (
    agent,
    cleanup,
    client,
    on,
    read_counter,
    start_counter,
    unique,
)
from tests.support.containerd import containerd_a
from tests.support.images import BUSYBOX_IMAGE, busybox_image, busybox_tarball
from tests.support.podman import checkpointctl_bin, podman, podman_read, require_podman, restore_flags
from tests.support.registry import registry

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def podman_image() -> str:
    """The busybox test image in podman's store (the one the containerd container runs); its id."""
    require_podman()
    podman("load", "-i", str(busybox_tarball()))
    return podman("image", "inspect", "--format", "{{.Id}}", BUSYBOX_IMAGE).stdout.strip()


@pytest.fixture(scope="module")
def checkpointctl() -> str:
    return checkpointctl_bin()


@pytest.fixture
def podman_names() -> Iterator[list[str]]:
    names: list[str] = []
    yield names
    for n in names:
        podman("rm", "-f", n, check=False)


def snapshot_counter(containerd_a, registry, cleanup) -> tuple[str, str, int]:  # type: ignore[no-untyped-def]
    """A running counter in containerd, snapshotted and stopped: (reference, its token, a count it had)."""
    a = client(containerd_a)
    image = busybox_image(containerd_a)
    cid = unique("export")
    cleanup(a, cid)
    start_counter(a, containerd_a, cid, image)
    tok, value = read_counter(a, cid)
    ref = agent("checkpoint", *on(containerd_a), "--stop", "--to", registry.ref("export", cid), cid).stdout.strip()
    return ref, tok, value


def test_podman_restores_an_exported_snapshot_and_checkpointctl_reads_it(  # type: ignore[no-untyped-def]
    containerd_a, registry, cleanup, tmp_path, podman_image, checkpointctl, podman_names
):
    ref, tok_before, v_before = snapshot_counter(containerd_a, registry, cleanup)
    out = tmp_path / "counter.tar"
    name = f"ks-export-{uuid.uuid4().hex[:8]}"
    done = agent("export", *on(containerd_a), ref, "-o", str(out), "--name", name)
    assert done.stdout.strip() == str(out)
    assert "unencrypted" in done.stderr and "podman container restore --import" in done.stderr
    assert os.stat(out).st_mode & 0o777 == 0o600  # the pod's memory in clear: the owner's only

    with tarfile.open(out) as t:
        names = set(t.getnames())
        config = json.load(t.extractfile("config.dump"))  # type: ignore[arg-type]
    assert {"config.dump", "spec.dump", "rootfs-diff.tar", "checkpoint/inventory.img"} <= names
    assert any(n.startswith("checkpoint/pages-") for n in names)  # pages rebuilt from the chunks
    assert config["rootfsImageID"] == podman_image.removeprefix("sha256:")

    # checkpointctl reads it as a podman archive
    show = subprocess.run([checkpointctl, "show", str(out)], capture_output=True, text=True, timeout=60)
    assert show.returncode == 0, show.stderr
    assert BUSYBOX_IMAGE in show.stdout and "Podman" in show.stdout, show.stdout
    inspect = subprocess.run(
        [checkpointctl, "inspect", str(out), "--ps-tree", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert inspect.returncode == 0, inspect.stderr
    tree = json.dumps(json.loads(inspect.stdout))
    assert '"sh"' in tree  # the counter's shell in CRIU's process tree

    # podman brings the process back: same memory (the token), the count goes on
    podman_names.append(name)
    podman("container", "restore", "--import", str(out), *restore_flags(done.stderr))
    tok_after, v_after = podman_read(name)
    assert tok_after == tok_before
    assert v_after >= v_before
    deadline = time.monotonic() + 20
    while podman_read(name)[1] <= v_after + 5:
        assert time.monotonic() < deadline, "the restored counter does not advance"
        time.sleep(0.2)


def test_export_is_refused_without_a_trusted_signature_and_never_overwrites(  # type: ignore[no-untyped-def]
    containerd_a, registry, cleanup, tmp_path
):
    ref, _, _ = snapshot_counter(containerd_a, registry, cleanup)
    out = tmp_path / "x.tar"
    # a snapshot nobody trusted signed: refused like its restore, and no file is left
    other_key = tmp_path / "other.pub"
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    other_key.write_bytes(
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    refused = agent(
        "export", *on(containerd_a), ref, "-o", str(out), check=False,
        env={"KUBECTL_SNAPSHOT_TRUSTED_KEYS": str(other_key)},
    )  # fmt: skip
    assert refused.returncode != 0
    assert "error:" in refused.stderr and "trust" in refused.stderr, refused.stderr
    assert not out.exists()
    # the legitimate case: signed by the trusted key, it is written ...
    agent("export", *on(containerd_a), ref, "-o", str(out))
    assert out.stat().st_size > 0
    # ... nowhere it could be written: refused at once, with the way out
    nowhere = agent("export", *on(containerd_a), ref, "-o", str(tmp_path / "missing" / "x.tar"), check=False)
    assert nowhere.returncode != 0 and "error: cannot write" in nowhere.stderr and "hint:" in nowhere.stderr
    # ... and a second export to the same file is refused, the first left as it was
    before = out.read_bytes()
    again = agent("export", *on(containerd_a), ref, "-o", str(out), check=False)
    assert again.returncode != 0 and "exists" in again.stderr
    assert out.read_bytes() == before


def test_an_encrypted_snapshot_exports_only_with_its_namespace_s_key(  # type: ignore[no-untyped-def]
    containerd_a, registry, cleanup, tmp_path
):
    a = client(containerd_a)
    cid = unique("export-enc")
    cleanup(a, cid)
    start_counter(a, containerd_a, cid, busybox_image(containerd_a))
    keys = tmp_path / "keys"
    to = registry.ref("export-enc", cid)
    ref = agent("checkpoint", *on(containerd_a), "--encrypt", "--key-dir", str(keys), "--to", to, cid).stdout.strip()
    out = tmp_path / "enc.tar"
    # no key for its namespace here: refused before a byte is written
    empty = tmp_path / "no-keys"
    empty.mkdir()
    refused = agent("export", *on(containerd_a), ref, "-o", str(out), "--key-dir", str(empty), check=False)
    assert refused.returncode != 0 and "encrypted" in refused.stderr, refused.stderr
    # another namespace's key is never used for it
    other = agent(
        "export", *on(containerd_a), ref, "-o", str(out), "--key-dir", str(keys), "--key-namespace", "other",
        check=False,
    )  # fmt: skip
    assert other.returncode != 0 and "cannot be restored into 'other'" in other.stderr, other.stderr
    assert not out.exists()
    # with the namespace's key: decrypted, and the archive holds CRIU's images in clear
    agent("export", *on(containerd_a), ref, "-o", str(out), "--key-dir", str(keys))
    with tarfile.open(out) as t:
        inventory = t.extractfile("checkpoint/inventory.img")
        assert inventory is not None
        assert inventory.read(4) == struct.pack("<I", 0x58313116)  # CRIU's inventory magic: plaintext
        names = t.getnames()
    assert "rootfs-diff.tar" in names and any(n.startswith("checkpoint/pages-") for n in names)


def test_the_oci_checkpoint_image_carries_the_archive_and_the_documented_annotations(  # type: ignore[no-untyped-def]
    containerd_a, registry, cleanup, tmp_path, podman_image, checkpointctl
):
    """CRI-O is not on these machines: the image is checked against the annotations CRI-O's
    pkg/annotations and checkpointctl document, and its layer is read back by checkpointctl."""
    import io

    from kubectl_snapshot.adapters.registry import RegistryClient
    from kubectl_snapshot.core.reference import Reference

    ref, _, _ = snapshot_counter(containerd_a, registry, cleanup)
    out = tmp_path / "img.tar"
    target = registry.ref("ckpt-image", "v1")
    done = agent("export", *on(containerd_a), ref, "-o", str(out), "--oci-image", target)
    file_line, image_line = done.stdout.split()
    assert file_line == str(out) and image_line.startswith(target.rsplit(":", 1)[0] + "@sha256:")
    assert "unencrypted" in done.stderr and image_line in done.stderr  # the registry now holds it in clear too

    reg = RegistryClient()
    image = Reference.parse(image_line)
    body, media_type, _ = reg.get_manifest(Reference.parse(target))  # the tag names the same manifest
    manifest = json.loads(body)
    assert media_type == "application/vnd.oci.image.manifest.v1+json"
    ann = manifest["annotations"]
    with tarfile.open(out) as t:
        name = json.load(t.extractfile("config.dump"))["name"]  # type: ignore[arg-type]
    assert ann["io.kubernetes.cri-o.annotations.checkpoint.name"] == name
    assert ann["io.kubernetes.cri-o.annotations.checkpoint.rootfsImageName"] == BUSYBOX_IMAGE
    assert ann["io.kubernetes.cri-o.annotations.checkpoint.rootfsImageID"] == podman_image.removeprefix("sha256:")
    assert ann["org.criu.checkpoint.container.name"] == name
    assert ann["org.criu.checkpoint.rootfsImageName"] == BUSYBOX_IMAGE
    (layer,) = manifest["layers"]
    assert layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar"
    config = json.loads(reg.read_blob(image, manifest["config"]["digest"]))
    assert config["rootfs"]["diff_ids"] == [layer["digest"]] and config["os"] == "linux"
    buf = io.BytesIO()
    reg.fetch_blob(image, layer["digest"], buf)
    assert buf.getvalue() == out.read_bytes()  # the layer is the archive, entries at its root
    pulled = tmp_path / "layer.tar"
    pulled.write_bytes(buf.getvalue())
    show = subprocess.run([checkpointctl, "show", str(pulled)], capture_output=True, text=True, timeout=60)
    assert show.returncode == 0 and BUSYBOX_IMAGE in show.stdout, show.stderr
