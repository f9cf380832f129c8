"""Threat C13: a restore clones its processes' memory, and with it the old pod's ServiceAccount token where
they read one. That token is bound to the old pod: it stops working once the old pod is deleted, and until then
the new pod can act as the old one. Where the snapshot's processes could read a token (a projected token volume
mounted in their container), the restore warns, the plugin and the agent alike.

The snapshot's own record decides: each container's runtime spec (its mounts, as runc ran it) names the kubelet's
token mount (`/var/run/secrets/kubernetes.io/serviceaccount`) and any projected volume the recorded pod spec
gives a `serviceAccountToken` source. A record without mounts (a save older than format 3) is judged by its pod
spec: the token is mounted unless `automountServiceAccountToken: false`. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from kubectl_snapshot.core.model import ContainerRecord, SnapshotConfig

TOKEN_DIR: Final = "/var/run/secrets/kubernetes.io/serviceaccount"
_PROJECTED: Final = "/volumes/kubernetes.io~projected/"


def token_holders(config: SnapshotConfig) -> list[str]:
    """The snapshot's containers whose processes could have read a bound ServiceAccount token of the old pod."""
    spec: Mapping[str, Any] = config.pod.spec if config.pod is not None else {}
    token_volumes = _token_volumes(spec)
    return [rec.name for rec in config.containers if _could_read_token(rec, spec, token_volumes)]


def cloned_token_warning(config: SnapshotConfig) -> str:
    """The warning a restore gives, one line ("" when no process could have read a token)."""
    holders = token_holders(config)
    if not holders:
        return ""
    pod = config.pod
    old = f"pod {pod.namespace}/{pod.name} (uid {pod.uid})" if pod is not None and pod.uid else "the snapshotted pod"
    return (
        f"the restored processes of container(s) {', '.join(holders)} may hold {old}'s ServiceAccount token in "
        "memory: that token is bound to the old pod and stops working once the old pod is deleted (until then it "
        f"acts as the old pod); the new pod has its own token: re-read the token file under {TOKEN_DIR} (client "
        "libraries that reload it do), or restart the process, and set automountServiceAccountToken: false on pods "
        "that need no token"
    )


def _token_volumes(spec: Mapping[str, Any]) -> set[str]:
    volumes = spec.get("volumes") if isinstance(spec.get("volumes"), list) else []
    out = set()
    for v in volumes or []:
        sources = (v.get("projected") or {}).get("sources") if isinstance(v, dict) else None
        if isinstance(sources, list) and any(isinstance(s, dict) and "serviceAccountToken" in s for s in sources):
            out.add(str(v.get("name", "")))
    return out


def _could_read_token(rec: ContainerRecord, spec: Mapping[str, Any], token_volumes: set[str]) -> bool:
    mounts = rec.spec.get("mounts") if isinstance(rec.spec, Mapping) else None
    if isinstance(mounts, list):
        for m in mounts:
            if not isinstance(m, dict):
                continue
            dest, source = str(m.get("destination", "")).rstrip("/"), str(m.get("source", ""))
            if dest == TOKEN_DIR:
                return True
            if _PROJECTED in source and source.rstrip("/").rsplit("/", 1)[-1] in token_volumes:
                return True
        return False
    # no runtime spec recorded: the pod spec says whether the kubelet mounted its token
    if spec.get("automountServiceAccountToken") is not False:
        return True
    container = next((c for c in _containers(spec) if c.get("name") == rec.name), {})
    return any(m.get("name") in token_volumes for m in container.get("volumeMounts") or [] if isinstance(m, dict))


def _containers(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [c for key in ("containers", "initContainers") for c in spec.get(key) or [] if isinstance(c, dict)]
