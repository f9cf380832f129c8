"""The conformance suite's cases: real workloads (tests/support/workloads.py) crossed with the settings
real clusters use and the operations users run (issue 41). Pure data and pod manifests; the e2e test
(tests/e2e/test_conformance.py) runs them and hack/gen-conformance-doc.py writes docs/conformance.md
from the same table, so the documented coverage is what the suite runs.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests.support.workloads import (
    ALL,
    BUSYBOX_WL,
    FLASK,
    JVM,
    NGINX,
    NODE,
    PORT,
    SHM,
    STATIC,
    Workload,
    manifest_container,
)

CONFIG_MAP = "conformance-config"
SECRET = "conformance-secret"
LOCALHOST_PROFILE = "profiles/ks-conformance.json"
# A Localhost profile as a cluster's security team writes one: allow, but refuse what a service never
# needs (kernel modules, kexec, accounting, swap, reboot).
LOCALHOST_PROFILE_JSON = {
    "defaultAction": "SCMP_ACT_ALLOW",
    "syscalls": [
        {
            "names": ["acct", "init_module", "finit_module", "delete_module", "kexec_load", "reboot", "swapon"],
            "action": "SCMP_ACT_ERRNO",
        }
    ],
}
PROJECTED_AUDIENCE = "conformance.example"


@dataclass(frozen=True)
class Setting:
    name: str
    what: str
    apply: Callable[[dict[str, Any], Workload, str], None]  # (pod manifest, workload, busybox image)


def _set_app(pod: dict[str, Any], **fields: Any) -> None:
    pod["spec"]["containers"][0].update(fields)


def _sc(pod: dict[str, Any]) -> dict[str, Any]:
    c = pod["spec"]["containers"][0]
    return c.setdefault("securityContext", {})  # type: ignore[no-any-return]


def _mount(pod: dict[str, Any], volume: dict[str, Any], path: str, **extra: Any) -> None:
    vols = pod["spec"].setdefault("volumes", [])
    if not any(v["name"] == volume["name"] for v in vols):
        vols.append(volume)
    pod["spec"]["containers"][0].setdefault("volumeMounts", []).append(
        {"name": volume["name"], "mountPath": path, **extra}
    )


def _plain(pod: dict[str, Any], w: Workload, bb: str) -> None:
    return None


def _seccomp_pod(pod: dict[str, Any], w: Workload, bb: str) -> None:
    pod["spec"].setdefault("securityContext", {})["seccompProfile"] = {"type": "RuntimeDefault"}


def _seccomp_container(pod: dict[str, Any], w: Workload, bb: str) -> None:
    _sc(pod)["seccompProfile"] = {"type": "RuntimeDefault"}


def _seccomp_localhost(pod: dict[str, Any], w: Workload, bb: str) -> None:
    _sc(pod)["seccompProfile"] = {"type": "Localhost", "localhostProfile": LOCALHOST_PROFILE}


def _caps(pod: dict[str, Any], w: Workload, bb: str) -> None:
    _sc(pod)["capabilities"] = {"drop": ["ALL"], "add": ["NET_BIND_SERVICE", *w.needs_caps]}


def _no_privesc(pod: dict[str, Any], w: Workload, bb: str) -> None:
    _sc(pod)["allowPrivilegeEscalation"] = False


def _read_only_root(pod: dict[str, Any], w: Workload, bb: str) -> None:
    _sc(pod)["readOnlyRootFilesystem"] = True
    for i, path in enumerate(w.writes):
        _mount(pod, {"name": f"scratch{i}", "emptyDir": {}}, path)


def _restricted(pod: dict[str, Any], w: Workload, bb: str) -> None:
    """Pod Security "restricted" but runAsNonRoot (these VMs cannot dump another uid's process)."""
    _seccomp_pod(pod, w, bb)
    _caps(pod, w, bb)
    _no_privesc(pod, w, bb)
    _read_only_root(pod, w, bb)


def _no_token(pod: dict[str, Any], w: Workload, bb: str) -> None:
    pod["spec"]["automountServiceAccountToken"] = False


def _projected_token(pod: dict[str, Any], w: Workload, bb: str) -> None:
    source = {"serviceAccountToken": {"audience": PROJECTED_AUDIENCE, "expirationSeconds": 3600, "path": "token"}}
    _mount(pod, {"name": "vault-token", "projected": {"sources": [source]}}, "/var/run/secrets/tokens", readOnly=True)


def _volumes(pod: dict[str, Any], w: Workload, bb: str) -> None:
    _mount(pod, {"name": "cfg", "configMap": {"name": CONFIG_MAP}}, "/etc/conformance/config")
    _mount(pod, {"name": "sec", "secret": {"secretName": SECRET}}, "/etc/conformance/secret", readOnly=True)
    field = {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}
    _mount(pod, {"name": "info", "downwardAPI": {"items": [field]}}, "/etc/conformance/info")
    sources = [
        {"configMap": {"name": CONFIG_MAP, "items": [{"key": "app.conf", "path": "app.conf"}]}},
        {"secret": {"name": SECRET}},
        {"downwardAPI": {"items": [{"path": "name", "fieldRef": {"fieldPath": "metadata.name"}}]}},
    ]
    _mount(pod, {"name": "all", "projected": {"sources": sources}}, "/etc/conformance/projected")


def _subpath(pod: dict[str, Any], w: Workload, bb: str) -> None:
    _mount(pod, {"name": "cfg", "configMap": {"name": CONFIG_MAP}}, "/etc/app.conf", subPath="app.conf")
    _mount(pod, {"name": "work", "emptyDir": {}}, "/work", subPath="data")


def _host_aliases(pod: dict[str, Any], w: Workload, bb: str) -> None:
    pod["spec"]["hostAliases"] = [{"ip": "127.0.0.1", "hostnames": ["db.conformance", "cache.conformance"]}]


def _limits(pod: dict[str, Any], w: Workload, bb: str) -> None:
    res = {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"cpu": "500m", "memory": "384Mi"}}
    _set_app(pod, resources=res)


def _probes(pod: dict[str, Any], w: Workload, bb: str) -> None:
    """Probes that run every second, across the freeze and the restore."""
    live: dict[str, Any] = {"exec": {"command": list(w.read)}, "periodSeconds": 1, "failureThreshold": 30}
    ready: dict[str, Any] = {"periodSeconds": 1, "failureThreshold": 3}
    if w is BUSYBOX_WL:
        ready["exec"] = {"command": ["cat", "/tmp/count"]}
    else:
        ready["httpGet"] = {"path": "/", "port": PORT}
    _set_app(pod, livenessProbe=live, readinessProbe=ready)


def _shm_volume(pod: dict[str, Any], w: Workload, bb: str) -> None:
    """/dev/shm as an emptyDir in memory: how pods that need more than the runtime's 64 MiB (databases,
    ML data loaders) get it, and a volume the snapshot captures."""
    _mount(pod, {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}}, "/dev/shm")


def _sidecar(pod: dict[str, Any], w: Workload, bb: str) -> None:
    """A completed init container and a native sidecar (an init container with restartPolicy Always)."""
    done: dict[str, Any] = {"name": "setup", "image": bb, "command": ["sh", "-c", "echo ready > /shared/setup"]}
    side: dict[str, Any] = {
        "name": "sidecar",
        "image": bb,
        "restartPolicy": "Always",
        "command": ["sh", "-c", "i=0; while true; do i=$((i+1)); echo $i > /shared/side; sleep 0.5; done"],
    }
    vol = {"name": "shared", "emptyDir": {}}
    for c in (done, side):
        c["volumeMounts"] = [{"name": "shared", "mountPath": "/shared"}]
    pod["spec"]["initContainers"] = [done, side]
    _mount(pod, vol, "/shared")


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting("plain", "root, no seccomp profile, the runtime's default capabilities", _plain),
        Setting("seccomp-pod", "seccompProfile RuntimeDefault on the pod", _seccomp_pod),
        Setting("seccomp-container", "seccompProfile RuntimeDefault on the container", _seccomp_container),
        Setting("seccomp-localhost", "a Localhost seccomp profile from the kubelet's seccomp dir", _seccomp_localhost),
        Setting("caps", "capabilities: drop ALL, add NET_BIND_SERVICE (and what the workload needs)", _caps),
        Setting("no-privesc", "allowPrivilegeEscalation: false (no_new_privs)", _no_privesc),
        Setting("read-only-root", "readOnlyRootFilesystem, emptyDir scratch where it writes", _read_only_root),
        Setting("restricted", "Pod Security restricted but runAsNonRoot: the four above together", _restricted),
        Setting("no-token", "automountServiceAccountToken: false", _no_token),
        Setting("projected-token", "a projected service-account token with an audience", _projected_token),
        Setting("volumes", "configMap, secret, downwardAPI and projected volumes", _volumes),
        Setting("subpath", "subPath mounts of a configMap key and an emptyDir directory", _subpath),
        Setting("host-aliases", "hostAliases (the kubelet's /etc/hosts)", _host_aliases),
        Setting("limits", "CPU and memory requests and limits", _limits),
        Setting("probes", "exec liveness and HTTP readiness probes every second, across the freeze", _probes),
        Setting("sidecar", "a completed init container and a native sidecar", _sidecar),
        Setting("shm-volume", "/dev/shm an emptyDir in memory", _shm_volume),
    )
}

RESTORE = "restore"  # snapshot, delete, restore on the other node
MIGRATE = "migrate"  # kubectl snapshot migrate --node
# a StatefulSet pod protected by a SnapshotPolicy (interval 10m: one periodic save when it starts)
RESUME = "resume"  # its node cordoned, the pod deleted: the replacement on the other node resumes the save
DRAIN = "drain"  # its node drained: a final save, and the replacement on the other node resumes from it
PROTECTED_OPERATIONS = (RESUME, DRAIN)


@dataclass(frozen=True)
class Case:
    workload: Workload
    settings: tuple[str, ...]
    operation: str = RESTORE
    # a case the project refuses up front: the words the refusal must say (the pod keeps running)
    refused: str = ""

    @property
    def id(self) -> str:
        return f"{self.workload.name}-{'+'.join(self.settings)}-{'refused' if self.refused else self.operation}"


def _cases() -> list[Case]:
    per_workload: list[tuple[Workload, list[tuple[str, ...]]]] = [
        (BUSYBOX_WL, [("plain",), ("seccomp-pod",), ("seccomp-container",), ("seccomp-localhost",), ("sidecar",)]),
        (JVM, [("restricted",), ("limits",), ("probes",), ("volumes",)]),
        (NODE, [("restricted",), ("projected-token",), ("subpath",), ("probes",)]),
        (FLASK, [("restricted",), ("volumes",), ("no-token",), ("caps",), ("sidecar", "seccomp-pod")]),
        (SHM, [("shm-volume",), ("shm-volume", "seccomp-pod"), ("shm-volume", "limits")]),
        (NGINX, [("seccomp-pod",), ("no-privesc",), ("read-only-root",), ("caps",)]),
        (STATIC, [("restricted",), ("no-token",), ("seccomp-localhost",), ("host-aliases",), ("subpath",)]),
    ]
    out = [Case(w, s) for w, settings in per_workload for s in settings]
    out += [
        Case(FLASK, ("restricted",), MIGRATE),
        Case(STATIC, ("restricted",), MIGRATE),
        Case(JVM, ("seccomp-pod",), MIGRATE),
    ]
    out += [
        Case(NODE, ("restricted",), RESUME),
        Case(STATIC, ("restricted",), RESUME),
        Case(JVM, ("restricted",), DRAIN),
        Case(SHM, ("shm-volume", "seccomp-pod"), DRAIN),
        Case(FLASK, ("restricted",), DRAIN),
    ]
    # the runtime's /dev/shm (the sandbox's tmpfs) is not captured: refused before a save that could not
    # be restored; with /dev/shm an emptyDir (the cases above) the same server is restored
    out += [Case(SHM, ("plain",), refused="keeps files in the container runtime's /dev/shm (app-counter)")]
    return out


CASES: tuple[Case, ...] = tuple(_cases())
assert {c.workload.name for c in CASES} == {w.name for w in ALL}


def pod_name(case: Case) -> str:
    """A short DNS-1123 name, stable for the case."""
    return f"c-{case.workload.name[:8].rstrip('-')}-{hashlib.sha256(case.id.encode()).hexdigest()[:6]}"


def manifest(case: Case, ns: str, image: str, node: str, busybox_image: str) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name(case),
            "namespace": ns,
            "labels": {"app": pod_name(case), "suite": "conformance"},
        },
        "spec": {
            "containers": [manifest_container(case.workload, image)],
            "nodeSelector": {"kubernetes.io/hostname": node},
            "terminationGracePeriodSeconds": 1,
        },
    }
    for name in case.settings:
        SETTINGS[name].apply(pod, case.workload, busybox_image)
    return copy.deepcopy(pod)


@dataclass(frozen=True)
class Refused:
    what: str
    why: str
    said: str
    test: str


REFUSED: tuple[Refused, ...] = (
    Refused(
        "two containers of a pod connected by a Unix stream socket",
        "CRIU cannot dump a connection whose peer is in another container's dump",
        "`kubectl snapshot` fails before anything is frozen; the pod runs on",
        "tests/e2e/test_whole_pod.py::test_unix_stream_socket_between_containers_is_refused_up_front",
    ),
    Refused(
        "a snapshot whose freeze would outlast a liveness probe's failure budget",
        "the kubelet would kill the frozen container",
        "`kubectl snapshot` fails with the probe named; the pod runs on",
        "tests/e2e/test_freeze_guard.py::test_a_snapshot_that_would_outlast_a_liveness_probe_is_refused",
    ),
    Refused(
        "CRIU images that grant more than the new pod's spec (capabilities, ids, seccomp, masks, mounts)",
        "an edited snapshot must not give a process more than its pod spec grants",
        "restore-from: the restore fails with the reason (pod status, Events); a resume starts fresh (ResumeSkipped)",
        "tests/e2e/test_tenant_node.py::test_edited_criu_images_cannot_restore_more_capabilities_than_the_pod_has",
    ),
    Refused(
        "a resume the runtime wrapper cannot restore (refused images, CRIU failure)",
        "a workload's replacement is never held down by its save",
        "the pod starts fresh from its images; ResumeSkipped names the reason",
        "tests/integration/test_whole_pod_wrapper.py::test_a_resume_that_cannot_be_restored_starts_the_pod_fresh",
    ),
    Refused(
        "a pod of which one container cannot be restored (restore-from)",
        "a pod comes back whole or not at all, never half fresh",
        "the restore fails; the restored containers are stopped",
        "tests/e2e/test_whole_pod.py::test_a_pod_that_cannot_be_restored_whole_fails_and_nothing_starts_fresh",
    ),
    Refused(
        "a resume annotation on a pod no SnapshotPolicy of its namespace selects",
        "someone who may create Deployments must not reach a policy's saves and registry Secret",
        "admission refuses the pod, naming the policy",
        "tests/e2e/test_autosave_resume.py::test_a_resume_annotation_forged_in_a_template_is_refused_at_admission",
    ),
    Refused(
        "processes running as another uid than root (runAsUser), on this project's VMs only",
        "CRIU needs CAP_SYS_RESOURCE for another uid's rlimits, which these VMs' bounding set lacks "
        "(../shared/docs/PLATFORM.md); ordinary nodes have it",
        "`kubectl snapshot` fails with CRIU's dump.log tail; the pod runs on",
        "tests/unit/test_criu_guard.py (the restore side's uid/gid rules, on edited images)",
    ),
)
