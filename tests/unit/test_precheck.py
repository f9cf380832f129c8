"""The image check the agent runs at staging, against the most the runtime can grant a pod's container
(issue 41, item 7), and the `--dry-run=server` comparison of a snapshot's recorded runtime spec.

Each refusal comes with the legitimate case it must let through: the bound may only refuse what the
check at create (shim/criu/guard.py, against the real config.json) refuses for certain.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pycriu")

from kubectl_snapshot.core.runtimegrant import DEFAULT_CAPABILITIES, dry_run_problems, spec_bound
from shim.criu import guard as criu_guard
from shim.engine.precheck import bound_grant, check_staged, staged_problems
from tests.unit.test_criu_guard import DEFAULT_CAPS, bundle, creds, make_images


def pod(sc: dict[str, Any] | None = None, pod_sc: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    c: dict[str, Any] = {"name": "app", "image": "x"}
    if sc is not None:
        c["securityContext"] = sc
    out: dict[str, Any] = {"containers": [c], **spec}
    if pod_sc is not None:
        out["securityContext"] = pod_sc
    return out


def staged(tmp_path: Path, **images: Any) -> list[tuple[str, str]]:
    make_images(tmp_path / "app" / "checkpoint", **images)
    return [("app", str(tmp_path / "app"))]


def check(tmp_path: Path, spec: dict[str, Any], **images: Any) -> list[str]:
    return staged_problems(spec, staged(tmp_path, **images), reader=criu_guard.ImageReader())


# --- the bound a pod spec gives ----------------------------------------------------------------------


def test_the_default_bound_is_containerds_default_capabilities() -> None:
    assert frozenset(DEFAULT_CAPS) == DEFAULT_CAPABILITIES
    b = spec_bound(pod(), "app")
    assert b.capabilities == DEFAULT_CAPABILITIES and not b.all_capabilities
    assert (b.uid, b.seccomp, b.no_new_privs, b.user_namespace) == (None, False, False, False)


def test_the_bound_follows_add_drop_privileged_and_container_over_pod() -> None:
    b = spec_bound(pod({"capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}}), "app")
    assert b.capabilities == {"CAP_NET_BIND_SERVICE"}
    b = spec_bound(pod({"capabilities": {"add": ["SYS_ADMIN"], "drop": ["NET_RAW"]}}), "app")
    assert "CAP_SYS_ADMIN" in b.capabilities and "CAP_NET_RAW" not in b.capabilities
    assert spec_bound(pod({"privileged": True}), "app").all_capabilities
    b = spec_bound(pod({"privileged": True}, pod_sc={"seccompProfile": {"type": "RuntimeDefault"}}), "app")
    assert not b.seccomp  # containerd runs a privileged container unconfined
    b = spec_bound(
        pod({"seccompProfile": {"type": "Unconfined"}}, pod_sc={"seccompProfile": {"type": "RuntimeDefault"}}), "app"
    )
    assert not b.seccomp
    b = spec_bound(pod({"runAsUser": 0}, pod_sc={"runAsUser": 1000}), "app")
    assert b.uid == 0
    assert spec_bound(pod(pod_sc={"runAsUser": 1000}), "app").uid == 1000
    assert spec_bound(pod({"allowPrivilegeEscalation": False}), "app").no_new_privs
    assert spec_bound(pod(hostUsers=False), "app").user_namespace
    sidecar: dict[str, Any] = {
        "initContainers": [{"name": "side", "restartPolicy": "Always", "securityContext": {"runAsUser": 7}}]
    }
    assert spec_bound(pod(**sidecar), "side").uid == 7
    with pytest.raises(KeyError):
        spec_bound(pod(), "nope")


# --- the staged images against the bound: each refusal with its legitimate twin --------------------


def test_images_of_the_same_pod_spec_pass(tmp_path: Path) -> None:
    """A snapshot of a default pod (default capabilities, a RuntimeDefault filter) restored into the same spec."""
    assert check(tmp_path / "a", pod()) == []
    assert check(tmp_path / "b", pod(pod_sc={"seccompProfile": {"type": "RuntimeDefault"}})) == []
    restricted = {"capabilities": {"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}, "allowPrivilegeEscalation": False}
    images = {"creds_by_tid": {1: creds(caps=["CAP_NET_BIND_SERVICE"], no_new_privs=True)}}
    assert check(tmp_path / "c", pod(restricted), **images) == []


def test_capabilities_the_pod_drops_are_refused(tmp_path: Path) -> None:
    out = check(tmp_path, pod({"capabilities": {"drop": ["ALL"]}}))
    assert out and all("capabilities" in p and "beyond the container's" in p for p in out), out
    assert out[0].startswith("container app: process 1: ")


def test_a_process_that_dropped_them_itself_passes_a_pod_that_drops_them(tmp_path: Path) -> None:
    images = {"creds_by_tid": {1: creds(caps=[])}}
    assert check(tmp_path, pod({"capabilities": {"drop": ["ALL"]}}), **images) == []


def test_no_filter_under_a_pod_that_sets_a_profile_is_refused(tmp_path: Path) -> None:
    out = check(tmp_path, pod(pod_sc={"seccompProfile": {"type": "RuntimeDefault"}}), seccomp=("disabled", 0))
    assert out == ["container app: process 1: no seccomp filter, but the container has a seccomp profile"]


def test_no_filter_with_no_profile_set_is_left_to_the_check_at_create(tmp_path: Path) -> None:
    """Unset, the kubelet's seccompDefault decides: not known before create, so not refused here."""
    assert check(tmp_path, pod(), seccomp=("disabled", 0)) == []


def test_no_new_privs_off_under_allow_privilege_escalation_false_is_refused(tmp_path: Path) -> None:
    out = check(tmp_path / "a", pod({"allowPrivilegeEscalation": False}))
    assert out == ["container app: process 1: no_new_privs is off but the container sets noNewPrivileges"]
    images = {"creds_by_tid": {1: creds(no_new_privs=True)}}
    assert check(tmp_path / "b", pod({"allowPrivilegeEscalation": False}), **images) == []


def test_a_uid_other_than_run_as_user_is_refused_and_the_images_user_is_left_alone(tmp_path: Path) -> None:
    out = check(
        tmp_path / "a",
        pod({"runAsUser": 1000, "capabilities": {"drop": ["ALL"]}}),
        creds_by_tid={1: creds(0, 0, caps=[])},
    )
    assert any("uids" in p and "uid 1000" in p for p in out), out
    # runAsUser unset: the image's USER decides (unknown here), so a non-root process passes
    assert (
        check(tmp_path / "b", pod({"capabilities": {"drop": ["ALL"]}}), creds_by_tid={1: creds(1000, 1000, caps=[])})
        == []
    )
    # root with CAP_SETUID may hold any uid (as at create)
    assert check(tmp_path / "c", pod({"runAsUser": 0}), creds_by_tid={1: creds(33, 33)}) == []


def test_mounts_and_lsm_labels_are_left_to_the_check_at_create(tmp_path: Path) -> None:
    """Where runc mounts is resolved in the image's rootfs, known only at create; LSM labels likewise."""
    odd = [{"mountpoint": "/", "fstype": 17, "flags": 0}, {"mountpoint": "/nowhere", "fstype": 16, "fsname": "ext4"}]
    images = {"mounts": odd, "creds_by_tid": {1: creds(lsm_profile="some-profile")}}
    assert check(tmp_path, pod(), **images) == []
    assert criu_guard.image_problems(str(tmp_path / "app" / "checkpoint"), bundle(), lsms=frozenset({"apparmor"}))


def test_check_staged_raises_the_wrappers_refusal(tmp_path: Path) -> None:
    dirs = staged(tmp_path)
    check_staged(pod(), dirs, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(criu_guard.ImageGrantsMore) as e:
        check_staged(pod({"capabilities": {"drop": ["ALL"]}}), dirs, cache_dir=str(tmp_path / "cache"))
    assert e.value.message.startswith("refusing to restore: the CRIU images grant more than the container's spec:")


def test_the_bound_is_never_tighter_than_the_real_bundle() -> None:
    """For the same pod spec, the bundle containerd writes (as the unit tests' bundles model it) grants no
    capability outside the bound."""
    g = bound_grant(spec_bound(pod(), "app"))
    real = criu_guard.bundle_grant(bundle())
    assert real.bounding & ~g.bounding == 0 and real.permitted & ~g.permitted == 0


# --- --dry-run=server: the recorded runtime spec against the admitted pod ---------------------------


def recorded(**kw: Any) -> dict[str, Any]:
    return bundle(**kw)


def test_dry_run_passes_the_same_spec_and_names_what_a_tighter_one_lacks() -> None:
    assert dry_run_problems(pod(), [("app", recorded())]) == []
    out = dry_run_problems(pod({"capabilities": {"drop": ["NET_RAW"]}}), [("app", recorded())])
    assert out == ["container app: ran with capabilities CAP_NET_RAW that the new pod's spec does not grant"]
    out = dry_run_problems(pod({"allowPrivilegeEscalation": False}), [("app", recorded())])
    assert out and "allowPrivilegeEscalation: false" in out[0]
    no_filter = recorded()
    del no_filter["linux"]["seccomp"]
    out = dry_run_problems(pod(pod_sc={"seccompProfile": {"type": "RuntimeDefault"}}), [("app", no_filter)])
    assert out and "without a seccomp filter" in out[0]
    assert dry_run_problems(pod(pod_sc={"seccompProfile": {"type": "RuntimeDefault"}}), [("app", recorded())]) == []
    out = dry_run_problems(pod({"runAsUser": 1000, "capabilities": {"drop": ["ALL"]}}), [("app", recorded(caps=[]))])
    assert out == ["container app: ran as uid 0, the new pod's spec runs it as uid 1000"]
    assert dry_run_problems(pod(), [("gone", recorded())]) == [
        "container gone: the new pod has no container of that name"
    ]
