"""SnapshotPolicy objects as the plugin builds and shows them (`kubectl snapshot policy ...`), pure."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.autosave import parse_duration
from kubectl_snapshot.core.errors import InvalidArgument
from kubectl_snapshot.core.podspec import validate_name
from kubectl_snapshot.core.reference import Reference

_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


def parse_selector(text: str) -> dict[str, str]:
    """`k=v[,k=v]` (equality only: a policy's matchLabels) -> {k: v}."""
    out: dict[str, str] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, value = part.partition("=")
        key, value = key.strip(), value.strip().lstrip("=")
        if not sep or not _LABEL_KEY.match(key) or not _LABEL_VALUE.match(value) or key.endswith("!"):
            raise InvalidArgument(
                f"--selector {part!r} is not KEY=VALUE",
                hint="a policy selects pods by labels that all must match: --selector app=web,tier=cache",
            )
        out[key] = value
    if not out:
        raise InvalidArgument("--selector is empty", hint="select pods by label: --selector app=web")
    return out


def parse_workload(text: str) -> dict[str, str]:
    """`KIND/NAME` (KIND as the API spells it, any case: statefulset/web) -> {kind, name}."""
    kind, sep, name = text.partition("/")
    kinds = {k.lower(): k for k in K.WORKLOAD_KINDS}
    if not sep or kind.lower() not in kinds or not name:
        raise InvalidArgument(
            f"--workload {text!r} is not KIND/NAME", hint=f"KIND is one of {', '.join(K.WORKLOAD_KINDS)}"
        )
    return {"kind": kinds[kind.lower()], "name": validate_name(name, "workload")}


def policy_object(
    *,
    name: str,
    namespace: str,
    selector: Mapping[str, str],
    interval: str,
    destination: str,
    workload: Mapping[str, str] | None = None,
    keep_last: int | None = None,
    max_age: str | None = None,
    registry_secret: str | None = None,
    insecure: bool = False,
    resume: bool = True,
    include_volumes: bool = True,
    suspend: bool = False,
    restore_mode: str = K.RESTORE_MODE_EAGER,
) -> dict[str, Any]:
    """The SnapshotPolicy to create; checked here as the CRD and admission would (clear errors before any call)."""
    validate_name(name, "policy")
    seconds = parse_duration(interval, "--interval")
    if seconds < K.POLICY_MIN_INTERVAL_S:
        raise InvalidArgument(
            f"--interval {interval} is shorter than {K.POLICY_MIN_INTERVAL_S}s",
            hint=f"save at most every {K.POLICY_MIN_INTERVAL_S}s",
        )
    ref = Reference.parse(destination, default_tag=None)
    if ref.tag or ref.digest:
        raise InvalidArgument(
            f"--to {destination!r} names a tag or digest",
            hint="give REGISTRY/REPO: every save is pushed under a tag of its own",
        )
    retention: dict[str, Any] = {}
    if keep_last is not None:
        if keep_last < 1:
            raise InvalidArgument(f"--keep {keep_last} must be at least 1", hint="keep at least the last save")
        retention["keepLast"] = keep_last
    if max_age:
        parse_duration(max_age, "--max-age")
        retention["maxAge"] = max_age
    if restore_mode not in K.RESTORE_MODES:
        raise InvalidArgument(
            f"--restore-mode {restore_mode!r} is not one of {', '.join(K.RESTORE_MODES)}",
            hint="eager (the default) stages all memory before the pod runs; lazy runs it first (docs/lazy-restore.md)",
        )
    spec: dict[str, Any] = {
        "selector": {"matchLabels": dict(selector)},
        "interval": interval,
        "destination": f"{ref.registry}/{ref.repository}",
        "insecure": insecure,
        "includeVolumes": include_volumes,
        "resume": resume,
        "restoreMode": restore_mode,
        "suspend": suspend,
    }
    if workload:
        spec["workload"] = dict(workload)
    if retention:
        spec["retention"] = retention
    if registry_secret:
        spec["registrySecret"] = validate_name(registry_secret, "secret")
    return {
        "apiVersion": K.API_VERSION,
        "kind": K.POLICY_KIND,
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def selector_text(spec: Mapping[str, Any]) -> str:
    labels = ((spec.get("selector") or {}).get("matchLabels")) or {}
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def policy_row(obj: Mapping[str, Any], age: str) -> dict[str, Any]:
    meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
    pods = ((obj.get("status") or {}).get("pods")) or []
    failing = sum(1 for p in pods if int(p.get("consecutiveFailures") or 0) > 0)
    last = max((str(p.get("lastSaveTime") or "") for p in pods), default="")
    workload = spec.get("workload") or {}
    return {
        "namespace": str(meta.get("namespace") or ""),
        "name": str(meta.get("name") or ""),
        "selector": selector_text(spec),
        "workload": f"{workload.get('kind')}/{workload.get('name')}" if workload else "",
        "interval": str(spec.get("interval") or ""),
        "keep": int(((spec.get("retention") or {}).get("keepLast")) or 3),
        "destination": str(spec.get("destination") or ""),
        "suspend": bool(spec.get("suspend")),
        "pods": len(pods),
        "failing": failing,
        "lastSave": last,
        "age": age,
    }
