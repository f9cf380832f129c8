"""Threat C13: the restored processes may hold the old pod's bound ServiceAccount token in memory. Where the
snapshot's containers had a token mounted, the restore warns: a Warning Event on the new pod beside
RestoreStaged (the agent), a `warning:` line (the plugin). A pod with automountServiceAccountToken: false
(no token mounted) gets no warning. The decision is core/tokenclone.py; the Event plumbing runs the real
RestoreWorker.stage with its registry and staging steps replaced."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kubectl_snapshot.adapters.signatures import Authorized
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.artifact import Artifact
from kubectl_snapshot.core.model import ContainerRecord, HostFacts, PodRecord, SnapshotConfig
from kubectl_snapshot.core.oci import Descriptor, Manifest
from kubectl_snapshot.core.podspec import restore_pod
from kubectl_snapshot.core.reference import Reference
from kubectl_snapshot.core.tokenclone import TOKEN_DIR, cloned_token_warning, token_holders
from shim.controller import restores
from shim.controller.podinfo import empty_dir_rel
from shim.controller.restores import RestoreWorker
from shim.controller.resume_source import RestoreSource
from shim.controller.settings import NodeSettings
from shim.host import facts as hostfacts
from tests.support.fakekube import EventRecorder, RecordedEvent

DIGEST = "sha256:" + "1" * 64
PROJECTED = "/var/lib/kubelet/pods/old/volumes/kubernetes.io~projected/"
TOKEN_MOUNT = {"destination": TOKEN_DIR, "source": PROJECTED + "kube-api-access-x1", "type": "bind"}
APP = {"name": "app", "image": "r/busybox@sha256:" + "3" * 64}
PROC = {"destination": "/proc", "source": "proc", "type": "proc"}


def config(*mounts: dict[str, Any], pod_spec: dict[str, Any] | None = None, runtime: bool = True) -> SnapshotConfig:
    spec = {"mounts": list(mounts)} if runtime else {}
    rec = ContainerRecord(name="app", id="app", image="i", image_digest="", layer_digest=DIGEST, spec=spec)
    pod = PodRecord(name="web", namespace="team-a", uid="u-old", node="n0", spec=pod_spec or {"containers": [APP]})
    return SnapshotConfig(group="web", namespace="team-a", created="", containers=(rec,), host=HostFacts(), pod=pod)


def test_a_container_that_had_the_kubelets_token_mounted_is_warned_about() -> None:
    warning = cloned_token_warning(config(PROC, TOKEN_MOUNT))
    assert "container(s) app may hold pod team-a/web (uid u-old)'s ServiceAccount token in memory" in warning
    assert "bound to the old pod and stops working once the old pod is deleted" in warning
    assert f"re-read the token file under {TOKEN_DIR}" in warning


def test_a_pod_with_automount_false_gets_no_warning() -> None:
    """No token was mounted (automountServiceAccountToken: false): the same pod otherwise, no warning."""
    spec = {"automountServiceAccountToken": False, "containers": [APP]}
    assert cloned_token_warning(config(PROC, pod_spec=spec)) == ""
    assert cloned_token_warning(config(pod_spec=spec, runtime=False)) == ""  # a record without mounts


def test_a_projected_token_of_the_pods_own_at_another_path_counts_a_configmap_does_not() -> None:
    spec = {
        "containers": [APP],
        "automountServiceAccountToken": False,
        "volumes": [
            {"name": "vault", "projected": {"sources": [{"serviceAccountToken": {"audience": "vault", "path": "t"}}]}},
            {"name": "conf", "projected": {"sources": [{"configMap": {"name": "c"}}]}},
        ],
    }
    vault = {"destination": "/vault", "source": PROJECTED + "vault", "type": "bind"}
    conf = {"destination": "/conf", "source": PROJECTED + "conf", "type": "bind"}
    assert token_holders(config(PROC, vault, pod_spec=spec)) == ["app"]
    assert token_holders(config(PROC, conf, pod_spec=spec)) == []


def test_a_record_without_mounts_is_judged_by_its_pod_spec() -> None:
    assert token_holders(config(runtime=False)) == ["app"]  # the kubelet mounts a token unless told not to


# --- the Event, on the real restore worker ---------------------------------------------------------


@dataclass
class FakeKube(EventRecorder):
    annotations: list[dict[str, Any]] = field(default_factory=list)
    events: list[RecordedEvent] = field(default_factory=list)

    def patch_pod_annotations(self, ns: str, name: str, annotations: dict[str, Any], *, status: bool = False) -> Any:
        self.annotations.append(annotations)
        return {}

    def get_config_map(self, ns: str, name: str) -> dict[str, Any]:
        return {"data": {}}  # the trust ConfigMap: authorize_restore is replaced below


def staged_events(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cfg: SnapshotConfig) -> list[RecordedEvent]:
    ref = Reference.parse(f"127.0.0.1:1/x@{DIGEST}")
    manifest = Manifest(
        config=Descriptor("application/y", "sha256:" + "2" * 64, 2), layers=(Descriptor("x", DIGEST, 1),)
    )
    artifact = Artifact(ref, manifest, cfg)
    assert cfg.pod is not None
    pod = restore_pod(cfg.pod, reference=ref, namespace="team-a", gate_image="g:1")
    pod["metadata"]["uid"] = "0b8f6c2e-1111-2222-3333-444455556666"
    pod["spec"]["nodeName"] = "n1"
    kube = FakeKube()
    kubelet = tmp_path / "kubelet"
    (kubelet / empty_dir_rel(pod["metadata"]["uid"], K.GATE_VOLUME)).mkdir(parents=True)
    settings = NodeSettings(node="n1", state_root=str(tmp_path / "state"), kubelet_root=str(kubelet))
    worker = RestoreWorker(kube=kube, settings=settings, facts=HostFacts())
    # the registry, the signature and the download are other tests' business: here they pass
    monkeypatch.setattr(restores, "registry_for", lambda *a, **kw: object())
    monkeypatch.setattr(restores, "load_signed", lambda registry, r: (artifact, []))
    monkeypatch.setattr(restores, "authorize_restore", lambda *a: Authorized("team-a", "signed"))
    monkeypatch.setattr(restores, "stage_artifact", lambda *a, **kw: None)
    monkeypatch.setattr(restores, "check_staged", lambda *a, **kw: None)
    monkeypatch.setattr(hostfacts, "preflight_problems", lambda *a: [])
    ok = worker.stage(pod, lambda p: RestoreSource(ref))
    assert ok, kube.annotations
    return kube.events


def test_the_restored_pod_gets_a_warning_event_beside_restore_staged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    events = staged_events(tmp_path, monkeypatch, config(PROC, TOKEN_MOUNT))
    assert [(e.reason, e.type) for e in events] == [
        (K.EVENT_RESTORE_STAGED, "Normal"),
        (K.EVENT_CLONED_TOKEN, "Warning"),
    ]
    assert events[1].kind == "Pod" and "stops working once the old pod is deleted" in events[1].message


def test_a_restored_pod_that_had_no_token_gets_restore_staged_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = {"automountServiceAccountToken": False, "containers": [APP]}
    events = staged_events(tmp_path, monkeypatch, config(PROC, pod_spec=spec))
    assert [e.reason for e in events] == [K.EVENT_RESTORE_STAGED]


# --- the plugin's warning: line -------------------------------------------------------------------


def plugin_restore(monkeypatch: pytest.MonkeyPatch, cfg: SnapshotConfig) -> Any:
    from kubectl_snapshot.cli import restore as cli
    from kubectl_snapshot.cli import wiring

    artifact = Artifact(Reference.parse(f"127.0.0.1:1/x@{DIGEST}"), Manifest(Descriptor("a", DIGEST, 1), ()), cfg)
    pod = {"metadata": {"name": "web-restored", "namespace": "team-a"}}
    monkeypatch.setattr(wiring, "kube_client", lambda: object())
    monkeypatch.setattr(wiring, "namespace_of", lambda kube: "team-a")
    monkeypatch.setattr(cli, "build_restore", lambda req, **kw: (pod, artifact))
    monkeypatch.setattr(cli, "create_restore_pod", lambda body, **kw: pod)
    return CliRunner().invoke(cli.restore_cmd, ["--no-wait", "web-1"])


def test_the_plugin_prints_the_warning_for_a_pod_that_had_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    result = plugin_restore(monkeypatch, config(PROC, TOKEN_MOUNT))
    assert result.exit_code == 0, result.output
    assert "warning: the restored processes of container(s) app may hold" in result.stderr
    assert "pod/web-restored" in result.stdout


def test_the_plugin_prints_no_warning_for_a_pod_without_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = {"automountServiceAccountToken": False, "containers": [APP]}
    result = plugin_restore(monkeypatch, config(PROC, pod_spec=spec))
    assert result.exit_code == 0, result.output
    assert "warning:" not in result.stderr and "pod/web-restored" in result.stdout


def test_migrate_prints_the_warning_the_copy_carries(monkeypatch: pytest.MonkeyPatch) -> None:
    from kubectl_snapshot.app.migrate import MigrateResult
    from kubectl_snapshot.app.snapshot import SnapshotRequest
    from kubectl_snapshot.cli import migrate as cli

    snap = SnapshotRequest(namespace="team-a", pod="web", repository="127.0.0.1:1/x")
    done = {"metadata": {"name": "web-1"}, "status": {"phase": "Succeeded", "reference": f"127.0.0.1:1/x@{DIGEST}"}}
    copy = {"metadata": {"name": "web-restored"}}
    monkeypatch.setattr(cli, "snapshot_request", lambda *a, **kw: (object(), snap))
    for warnings, shown in (((), False), (("the restored processes may hold a token",), True)):
        result = MigrateResult(snapshot=done, pod=copy, from_node="n1", to_node="n2", warnings=warnings)
        monkeypatch.setattr(cli, "migrate", lambda req, result=result, **kw: result)
        out = CliRunner().invoke(cli.migrate_cmd, ["pod/web", "--to", "127.0.0.1:1/x"])
        assert out.exit_code == 0, out.output
        assert ("warning: the restored processes may hold a token" in out.stderr) is shown
        assert "pod/web-restored runs on n2" in out.stdout
