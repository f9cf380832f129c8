"""Issue 10 item 1: what the agent refuses to touch in a pod's volumes, on the real filesystem.

The restore worker runs against a fake of the Kubernetes port and a kubelet root in tmp_path; the
registry it asks is 127.0.0.1:1 (nothing listens: the fetch fails at once, which is the path that
wrote the registry's message through the tenant's symlink before the fix). The e2e version with the
real agent is tests/e2e/test_tenant_attacks.py.
"""

from __future__ import annotations

import io
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import FailedPrecondition, UnsafeArchive
from kubectl_snapshot.core.model import HostFacts, PodRecord
from kubectl_snapshot.core.podspec import restore_pod
from kubectl_snapshot.core.reference import Reference
from shim.controller.podinfo import (
    check_restore_pod,
    empty_dir_rel,
    held_restore,
    restore_volume_names,
    running_containers,
)
from shim.controller.restores import RestoreWorker
from shim.controller.settings import NodeSettings
from shim.files.archive import safe_extract, tar_directories
from tests.support.fakekube import EventRecorder, RecordedEvent
from tests.support.tarcraft import craft_tar, dir_, hard, reg

DIGEST = "sha256:" + "1" * 64


def good_pod() -> dict[str, Any]:
    record = PodRecord(
        name="app",
        namespace="a",
        uid="old",
        node="n0",
        spec={
            "containers": [{"name": "c", "image": "r/busybox@sha256:" + "2" * 64}],
            "volumes": [{"name": "data", "emptyDir": {}}],
        },
    )
    pod = restore_pod(record, reference=Reference.parse(f"127.0.0.1:1/x@{DIGEST}"), namespace="a", gate_image="g:1")
    pod["metadata"]["uid"] = "0b8f6c2e-1111-2222-3333-444455556666"
    pod["spec"]["nodeName"] = "n1"
    # what the API server adds when it defaults the pod
    pod["spec"]["initContainers"][0].update(imagePullPolicy="IfNotPresent", terminationMessagePath="/dev/x")
    pod["spec"]["initContainers"][0]["volumeMounts"].append(
        {"name": "kube-api-access-x1", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount", "readOnly": True}
    )
    return pod


def test_a_pod_made_by_restore_passes() -> None:
    check_restore_pod(good_pod())


def _mutations() -> list[Any]:
    def no_gate(p: dict[str, Any]) -> None:
        p["spec"].pop("initContainers")

    def tenant_init_first(p: dict[str, Any]) -> None:
        p["spec"]["initContainers"].insert(0, {"name": "plant", "image": "busybox", "command": ["ln", "-s"]})

    def tenant_init_after(p: dict[str, Any]) -> None:
        p["spec"]["initContainers"].append({"name": "later", "image": "busybox"})

    def other_command(p: dict[str, Any]) -> None:
        p["spec"]["initContainers"][0]["command"] = ["sh", "-c", "ln -s /etc/shadow /gate/failed"]

    def extra_args(p: dict[str, Any]) -> None:
        p["spec"]["initContainers"][0]["args"] = ["x"]

    def gate_as_sidecar(p: dict[str, Any]) -> None:
        p["spec"]["initContainers"][0]["restartPolicy"] = "Always"

    def gate_mounted_elsewhere(p: dict[str, Any]) -> None:
        p["spec"]["initContainers"][0]["volumeMounts"] = [{"name": K.GATE_VOLUME, "mountPath": "/elsewhere"}]

    def gate_subpath(p: dict[str, Any]) -> None:
        p["spec"]["initContainers"][0]["volumeMounts"][0]["subPath"] = "x"

    def gate_hostpath(p: dict[str, Any]) -> None:
        for v in p["spec"]["volumes"]:
            if v["name"] == K.GATE_VOLUME:
                v.pop("emptyDir")
                v["hostPath"] = {"path": "/var/lib/kubectl-snapshot"}

    def gate_twice(p: dict[str, Any]) -> None:
        p["spec"]["volumes"].append({"name": K.GATE_VOLUME, "emptyDir": {}})

    def app_mounts_gate(p: dict[str, Any]) -> None:
        p["spec"]["containers"][0]["volumeMounts"] = [{"name": K.GATE_VOLUME, "mountPath": "/g"}]

    def ephemeral(p: dict[str, Any]) -> None:
        p["spec"]["ephemeralContainers"] = [{"name": "dbg", "image": "busybox"}]

    def sidecar_first(p: dict[str, Any]) -> None:
        p["spec"]["initContainers"].insert(0, {"name": "side", "image": "busybox", "restartPolicy": "Always"})

    def sidecar_mounts_gate(p: dict[str, Any]) -> None:
        side = {"name": "side", "image": "busybox", "restartPolicy": "Always"}
        side["volumeMounts"] = [{"name": K.GATE_VOLUME, "mountPath": "/g"}]  # type: ignore[assignment]
        p["spec"]["initContainers"].append(side)

    return [
        no_gate,
        tenant_init_first,
        tenant_init_after,
        other_command,
        extra_args,
        gate_as_sidecar,
        gate_mounted_elsewhere,
        gate_subpath,
        gate_hostpath,
        gate_twice,
        app_mounts_gate,
        ephemeral,
        sidecar_first,
        sidecar_mounts_gate,
    ]


@pytest.mark.parametrize("mutate", _mutations(), ids=lambda f: f.__name__)
def test_pods_that_only_look_like_a_restore_are_refused(mutate: Any) -> None:
    pod = good_pod()
    mutate(pod)
    with pytest.raises(FailedPrecondition, match=r"restore pod|ephemeral"):
        check_restore_pod(pod)
    # nor is any of them taken for a restore pod without the gate (held at create instead): the agent
    # checks them as gated restore pods (shim/controller/restores.py), which refuses them
    assert not held_restore(pod)


def test_a_restore_pod_without_the_gate_or_its_volume_is_held_not_checked_for_a_gate() -> None:
    """The legitimate gateless shape (`kubectl snapshot restore` on nodes that hold its containers):
    no gate volume, native sidecars only; with the restore annotation alone."""
    pod = good_pod()
    pod["spec"]["initContainers"] = [{"name": "side", "image": "busybox", "restartPolicy": "Always"}]
    pod["spec"]["volumes"] = [v for v in pod["spec"]["volumes"] if v["name"] != K.GATE_VOLUME]
    assert held_restore(pod)
    pod["metadata"]["annotations"].pop(K.ANN_RESTORE_FROM)
    assert not held_restore(pod)  # not a restore pod at all


def test_restored_volumes_must_be_emptydirs_of_the_pod() -> None:
    pod = good_pod()
    restore_volume_names(pod, ["data"])
    for bad in (K.GATE_VOLUME, "nope", "../../etc"):
        with pytest.raises(FailedPrecondition, match="not an emptyDir"):
            restore_volume_names(pod, [bad])
    pod["spec"]["volumes"].append({"name": "cfg", "configMap": {"name": "x"}})
    with pytest.raises(FailedPrecondition):
        restore_volume_names(pod, ["cfg"])


def test_empty_dir_rel_refuses_odd_names() -> None:
    assert empty_dir_rel("u-1", "data") == "pods/u-1/volumes/kubernetes.io~empty-dir/data"
    for uid, vol in (("..", "data"), ("u", ".."), ("u", "a/b"), ("u/../..", "x")):
        with pytest.raises(Exception, match="invalid"):
            empty_dir_rel(uid, vol)


# --- snapshot side: nothing unfrozen beside the dumped containers ---------------------------------


def running_pod() -> dict[str, Any]:
    return {
        "metadata": {"name": "p", "namespace": "a", "uid": "u"},
        "spec": {"containers": [{"name": "app"}]},
        "status": {
            "phase": "Running",
            "containerStatuses": [{"name": "app", "containerID": "containerd://abc", "state": {"running": {}}}],
        },
    }


def test_plain_pod_is_snapshotted() -> None:
    assert running_containers(running_pod()).ids == ["abc"]


def test_a_running_ephemeral_container_is_refused() -> None:
    pod = running_pod()
    pod["status"]["ephemeralContainerStatuses"] = [{"name": "x", "state": {"running": {}}}]
    with pytest.raises(FailedPrecondition, match="ephemeral container 'x' running"):
        running_containers(pod)
    pod["status"]["ephemeralContainerStatuses"] = [{"name": "x", "state": {"terminated": {"exitCode": 0}}}]
    assert running_containers(pod).ids == ["abc"]


def test_native_sidecars_are_frozen_and_dumped_first_completed_init_containers_are_not() -> None:
    """A native sidecar (restartPolicy Always) runs beside the app: it is snapshotted with it, before it
    (the kubelet starts it first on restore too); an init container that ran to completion is not."""
    pod = running_pod()
    pod["spec"]["initContainers"] = [{"name": "setup"}, {"name": "side", "restartPolicy": "Always"}]
    pod["status"]["initContainerStatuses"] = [
        {"name": "setup", "state": {"terminated": {"exitCode": 0}}},
        {"name": "side", "containerID": "containerd://sss", "state": {"running": {}}},
    ]
    got = running_containers(pod)
    assert (got.names, got.ids) == (["side", "app"], ["sss", "abc"])
    pod["status"]["initContainerStatuses"][1]["state"] = {"waiting": {}}
    with pytest.raises(FailedPrecondition, match="container 'side' of pod a/p is not running"):
        running_containers(pod)


def test_a_restore_pod_with_its_sidecars_after_the_gate_is_one() -> None:
    pod = good_pod()
    pod["spec"]["initContainers"].append({"name": "side", "image": "busybox", "restartPolicy": "Always"})
    check_restore_pod(pod)


# --- the restore worker against planted links -----------------------------------------------------


@dataclass
class FakeKube(EventRecorder):
    annotations: list[dict[str, Any]] = field(default_factory=list)
    events: list[RecordedEvent] = field(default_factory=list)

    def patch_pod_annotations(
        self, ns: str, name: str, annotations: dict[str, str | None], *, status: bool = False
    ) -> dict[str, Any]:
        self.annotations.append(annotations)
        return {}


def worker(tmp_path: Path) -> tuple[RestoreWorker, FakeKube, Path]:
    kube = FakeKube()
    kubelet = tmp_path / "kubelet"
    settings = NodeSettings(node="n1", state_root=str(tmp_path / "state"), kubelet_root=str(kubelet))
    facts = HostFacts()
    return RestoreWorker(kube=kube, settings=settings, facts=facts), kube, kubelet


def volume_dir(kubelet: Path, pod: dict[str, Any], name: str) -> Path:
    d = kubelet / empty_dir_rel(pod["metadata"]["uid"], name)
    d.mkdir(parents=True)
    return d


def test_gate_symlinks_planted_by_the_pod_are_not_followed(tmp_path: Path) -> None:
    w, kube, kubelet = worker(tmp_path)
    victim = tmp_path / "state" / "wrapper"
    victim.parent.mkdir(parents=True)
    victim.write_text("#!/bin/sh\nexec runc\n")
    pod = good_pod()
    gate = volume_dir(kubelet, pod, K.GATE_VOLUME)
    volume_dir(kubelet, pod, "data")
    (gate / "failed").symlink_to(victim)
    (gate / ".failed.tmp").symlink_to(victim)
    w.run(pod)
    assert victim.read_text() == "#!/bin/sh\nexec runc\n"
    assert not (gate / "failed").is_symlink() and "127.0.0.1:1" in (gate / "failed").read_text()
    assert kube.annotations[-1][K.ANN_RESTORE_STATUS].startswith(K.RESTORE_FAILED_PREFIX)


def test_a_pod_that_is_not_a_restore_pod_gets_no_write_at_all(tmp_path: Path) -> None:
    w, kube, kubelet = worker(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("keep")
    pod = good_pod()
    pod["spec"]["initContainers"].insert(0, {"name": "plant", "image": "busybox"})
    gate = volume_dir(kubelet, pod, K.GATE_VOLUME)
    (gate / "failed").symlink_to(victim)
    w.run(pod)
    assert victim.read_text() == "keep"
    assert (gate / "failed").is_symlink() and sorted(os.listdir(gate)) == ["failed"]
    assert "not a restore pod" in kube.annotations[-1][K.ANN_RESTORE_STATUS]
    assert kube.events[-1].reason == K.EVENT_RESTORE_FAILED


def test_a_gate_volume_that_is_a_link_is_refused(tmp_path: Path) -> None:
    w, kube, kubelet = worker(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    pod = good_pod()
    volume_dir(kubelet, pod, "data")
    (kubelet / empty_dir_rel(pod["metadata"]["uid"], K.GATE_VOLUME)).symlink_to(elsewhere)
    w.run(pod)
    assert os.listdir(elsewhere) == []
    assert kube.annotations[-1][K.ANN_RESTORE_STATUS].startswith(K.RESTORE_FAILED_PREFIX)


# --- volume contents: extraction into, and capture from, a tenant-writable dir --------------------


def test_volume_extraction_replaces_planted_links_and_takes_only_its_volume(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "f").write_text("keep")
    vol = tmp_path / "vol"
    vol.mkdir()
    (vol / "file").symlink_to(victim / "f")  # planted by a racing container
    (vol / "dir").symlink_to(victim)
    data = craft_tar(
        [
            dir_("data"),
            reg("data/file", b"from the snapshot"),
            dir_("data/dir"),
            reg("data/dir/inner", b"x"),
            hard("data/dir/h", "data/file"),
            dir_("other"),
            reg("other/secret", b"not for this volume"),
        ]
    )
    fd = os.open(vol, os.O_RDONLY | os.O_DIRECTORY)
    try:
        safe_extract(io.BytesIO(data), fd, only="data", overwrite=True)
    finally:
        os.close(fd)
    assert (victim / "f").read_text() == "keep" and os.listdir(victim) == ["f"]
    assert (vol / "file").read_text() == "from the snapshot" and not (vol / "file").is_symlink()
    assert (vol / "dir").is_dir() and not (vol / "dir").is_symlink()
    assert sorted(os.listdir(vol)) == ["dir", "file"]


def test_a_volume_comes_back_with_its_own_owner_mode_and_times(tmp_path: Path) -> None:
    """The volume's directory itself (chmod'ed, chowned, given an attribute by the workload) is restored
    onto the target directory, after its contents, and only for the volume extracted."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("x")
    os.chmod(src, 0o2750)
    os.chown(src, 1234, 5678)
    os.setxattr(src, "user.kind", b"scratch")
    os.utime(src, ns=(1_600_000_000_000_000_000, 1_600_000_000_000_000_000))
    other = tmp_path / "other"
    other.mkdir()
    os.chmod(other, 0o700)
    out = io.BytesIO()
    fds = [os.open(src, os.O_RDONLY | os.O_DIRECTORY), os.open(other, os.O_RDONLY | os.O_DIRECTORY)]
    try:
        tar_directories([("v0", fds[0]), ("v1", fds[1])], out)
    finally:
        for fd in fds:
            os.close(fd)
    target = tmp_path / "target"
    target.mkdir()
    os.chmod(target, 0o777)  # an emptyDir as the kubelet makes it
    safe_extract(io.BytesIO(out.getvalue()), str(target), only="v0", overwrite=True)
    st = os.stat(target)
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o2750, 1234, 5678)
    assert st.st_mtime_ns == 1_600_000_000_000_000_000
    assert os.getxattr(target, "user.kind") == b"scratch"
    assert (target / "f").read_text() == "x"
    # the whole archive extracted (no `only`): nothing is applied to the destination itself
    whole = tmp_path / "whole"
    whole.mkdir()
    os.chmod(whole, 0o711)
    safe_extract(io.BytesIO(out.getvalue()), str(whole), overwrite=True)
    assert stat.S_IMODE(os.stat(whole).st_mode) == 0o711
    assert stat.S_IMODE(os.stat(whole / "v0").st_mode) == 0o2750


def test_a_volume_root_that_is_not_a_directory_is_refused(tmp_path: Path) -> None:
    data = craft_tar([reg("data", b"not a dir")])
    (tmp_path / "vol").mkdir()
    with pytest.raises(UnsafeArchive, match="non-directory"):
        safe_extract(io.BytesIO(data), str(tmp_path / "vol"), only="data", overwrite=True)


def test_hard_link_out_of_the_volume_is_refused(tmp_path: Path) -> None:
    data = craft_tar([dir_("a"), reg("a/f", b"1"), dir_("b"), hard("b/h", "a/f")])
    (tmp_path / "b").mkdir()
    with pytest.raises(UnsafeArchive, match="outside"):
        safe_extract(io.BytesIO(data), str(tmp_path / "b"), only="b", overwrite=True)


def test_volume_capture_records_links_as_links(tmp_path: Path) -> None:
    secret = tmp_path / "host-secret"
    secret.write_text("root only")
    vol = tmp_path / "vol"
    vol.mkdir()
    (vol / "leak").symlink_to(secret)
    (vol / "dirleak").symlink_to(tmp_path)
    (vol / "ok").write_text("mine")
    out = io.BytesIO()
    fd = os.open(vol, os.O_RDONLY | os.O_DIRECTORY)
    try:
        tar_directories([("v", fd)], out)
    finally:
        os.close(fd)
    import tarfile

    with tarfile.open(fileobj=io.BytesIO(out.getvalue())) as tf:
        members = {m.name: m for m in tf.getmembers()}
        assert members["v/leak"].issym() and members["v/dirleak"].issym()
        assert sorted(members) == ["v", "v/dirleak", "v/leak", "v/ok"]
        assert b"root only" not in out.getvalue()


def test_checkpoint_volume_capture_refuses_a_volume_that_is_a_link(tmp_path: Path) -> None:
    from shim.engine.checkpoint import CheckpointRequest, _capture_volumes
    from shim.host.safefs import UnsafePath

    (tmp_path / "real").mkdir()
    (tmp_path / "vol").symlink_to(tmp_path / "real")
    req = CheckpointRequest(
        containers=["c"], target=Reference.parse("127.0.0.1:1/x:v"), volumes=[str(tmp_path / "vol")]
    )
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(UnsafePath):
        _capture_volumes(req, str(work))


def test_the_wrappers_refusal_becomes_the_restore_status(tmp_path: Path) -> None:
    """Item 2: the image check's reason, reported by the kubelet, ends up in the restore status too."""
    w, kube, _ = worker(tmp_path)
    pod = good_pod()
    pod["metadata"]["annotations"][K.ANN_RESTORE_STATUS] = K.RESTORE_STAGED
    message = (
        "failed to create containerd task: failed to create shim task: OCI runtime create failed: "
        "refusing to restore: the CRIU images grant more than the container's spec: process 1: effective "
        "capabilities CAP_SYS_ADMIN (0x200000) beyond the container's"
    )
    pod["status"] = {
        "containerStatuses": [
            {"name": "c", "state": {"waiting": {"reason": "CreateContainerError", "message": message}}}
        ]
    }
    w.consider(pod)
    status = kube.annotations[-1][K.ANN_RESTORE_STATUS]
    assert status.startswith(K.RESTORE_FAILED_PREFIX + "container c: refusing to restore") and "CAP_SYS_ADMIN" in status
    assert kube.events[-1].reason == K.EVENT_RESTORE_REFUSED  # told apart from a failure
    # other create errors are the kubelet's business
    pod["status"]["containerStatuses"][0]["state"]["waiting"]["message"] = "image not found"
    n = len(kube.annotations)
    w.consider(pod)
    assert len(kube.annotations) == n
