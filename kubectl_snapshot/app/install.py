"""`kubectl snapshot install|uninstall`: apply the agent's manifests (kubectl_snapshot.deploy) in order,
then wait until the CRD is Established and the DaemonSet rolled out; remove them in reverse order.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from typing import Any

from kubectl_snapshot.app.ports import Kube, Obj
from kubectl_snapshot.core import kube as K
from kubectl_snapshot.core.errors import FailedPrecondition, Unavailable

StepFn = Callable[[str, int, int], None]  # (what, done, total)


def render(image: str | None, settings: Mapping[str, Any]) -> list[Obj]:
    """The objects to apply, in order; `image` None means the release's default agent image."""
    try:
        from kubectl_snapshot import deploy
    except ImportError as e:
        raise FailedPrecondition(
            "this build of kubectl-snapshot has no deploy manifests (kubectl_snapshot.deploy)",
            hint="reinstall kubectl-snapshot from a release",
        ) from e
    render_fn: Callable[..., list[Obj]] = deploy.render  # type: ignore[attr-defined,unused-ignore]
    return render_fn(image or str(getattr(deploy, "DEFAULT_IMAGE", "")), **settings)


def install(
    objects: list[Obj],
    *,
    kube: Kube,
    timeout_s: float = 300,
    on_step: StepFn | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    step = on_step or (lambda _w, _d, _t: None)
    total = len(objects) + 2
    for i, obj in enumerate(objects):
        step(f"apply {obj.get('kind')} {obj.get('metadata', {}).get('name')}", i, total)
        kube.apply([obj])
        if obj.get("kind") == "CustomResourceDefinition":
            _wait(
                f"CRD {obj['metadata']['name']} Established",
                functools.partial(_crd_ready, kube, str(obj["metadata"]["name"])),
                timeout_s=60,
                sleep=sleep,
                clock=clock,
            )
    for i, obj in enumerate(o for o in objects if o.get("kind") == "DaemonSet"):
        step(f"wait for DaemonSet {obj['metadata']['name']} to roll out", len(objects) + i, total)
        _wait(
            f"DaemonSet {obj['metadata'].get('namespace')}/{obj['metadata']['name']} rolled out",
            functools.partial(_ds_ready, kube, obj),
            timeout_s=timeout_s,
            sleep=sleep,
            clock=clock,
            hint=f"kubectl -n {obj['metadata'].get('namespace')} get pods; kubectl snapshot doctor",
        )
    step("installed", total, total)


def uninstall(
    objects: list[Obj],
    *,
    kube: Kube,
    timeout_s: float = 300,
    on_step: StepFn | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Undo the node installation on every node (a one-shot DaemonSet), then delete the objects."""
    from kubectl_snapshot.deploy.agent import cleanup_daemonset

    step = on_step or (lambda _w, _d, _t: None)
    live = kube.get_daemonset(K.AGENT_NAMESPACE, K.AGENT_NAME)
    if live is not None:
        cleanup = cleanup_daemonset(live)
        step("remove the runtime hook from every node", 0, 2)
        kube.apply([cleanup])
        try:
            _wait(
                "the runtime hook removed from every node",
                functools.partial(_ds_ready, kube, cleanup),
                timeout_s=timeout_s,
                sleep=sleep,
                clock=clock,
                hint=f"kubectl -n {K.AGENT_NAMESPACE} logs ds/{cleanup['metadata']['name']} -c install-node",
            )
        finally:
            kube.delete_objects([cleanup])
    step("delete the objects", 1, 2)
    kube.delete_objects(list(reversed(objects)))


def _wait(
    what: str,
    ready: Callable[[], bool],
    *,
    timeout_s: float,
    sleep: Callable[[float], None],
    clock: Callable[[], float],
    hint: str | None = None,
) -> None:
    deadline = clock() + timeout_s
    while not ready():
        if clock() > deadline:
            raise Unavailable(f"timed out after {timeout_s:.0f}s waiting for {what}", hint=hint, retryable=False)
        sleep(1.0)


def _crd_ready(kube: Kube, name: str) -> bool:
    return _crd_established(kube.get_crd(name))


def _ds_ready(kube: Kube, obj: Obj) -> bool:
    return _rolled_out(kube.get_object(obj))


def _crd_established(crd: Obj | None) -> bool:
    for cond in ((crd or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Established" and cond.get("status") == "True":
            return True
    return False


def _rolled_out(ds: Obj | None) -> bool:
    """Like `kubectl rollout status`: the controller saw this generation and every pod is updated and ready."""
    if not ds:
        return False
    meta, spec, st = ds.get("metadata") or {}, ds.get("spec") or {}, ds.get("status") or {}
    if int(st.get("observedGeneration") or 0) < int(meta.get("generation") or 0):
        return False
    desired = int(st.get("desiredNumberScheduled") or 0)
    strategy = (spec.get("updateStrategy") or {}).get("type", "RollingUpdate")
    updated = int(st.get("updatedNumberScheduled") or 0)
    available = int(st.get("numberAvailable") or 0)
    return desired > 0 and available >= desired and (strategy != "RollingUpdate" or updated >= desired)
