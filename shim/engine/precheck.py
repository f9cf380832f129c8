"""The runtime wrapper's image check, run by the agent when it stages a restore.

The wrapper checks the CRIU images against the container's config.json at create; a refusal there
surfaces as a container create error. The agent knows the pod spec before that: it checks the staged
images against the most the runtime can grant each container (kubectl_snapshot/core/runtimegrant.py),
with the wrapper's own rules (shim/criu/guard.py), so a restore that create would certainly refuse fails
at staging with its reason (the pod's restore-status, a RestoreRefused Event) and a resume starts fresh
before any container is created. What the bound leaves unknown (the image's uid and groups, LSM labels,
mounts) is left to the check at create, which still runs on every restore.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.runtimegrant import SpecBound, spec_bound
from shim.criu import guard as criu_guard


def bound_grant(bound: SpecBound) -> criu_guard.BundleGrant:
    """The bound as the wrapper's check reads a bundle: every capability set at most the bounding set,
    unknown fields as "any", no LSM label or mount compared."""
    caps = (
        (1 << len(criu_guard.CAPABILITIES)) - 1 if bound.all_capabilities else criu_guard.cap_mask(bound.capabilities)
    )
    return criu_guard.BundleGrant(
        uid=bound.uid,
        gids=None,
        bounding=caps,
        effective=caps,
        permitted=caps,
        inheritable=caps,
        ambient=caps,
        seccomp=bound.seccomp,
        no_new_privs=bound.no_new_privs,
        apparmor="",
        selinux="",
        user_namespace=bound.user_namespace,
        mounts=None,
        masked=frozenset(),
        readonly=frozenset(),
    )


def staged_problems(
    pod_spec: Mapping[str, Any], staged: Sequence[tuple[str, str]], *, reader: criu_guard.ImageReader
) -> list[str]:
    """For each (container name, its staged directory): what its images hold beyond the bound."""
    out: list[str] = []
    for name, staged_dir in staged:
        grant = bound_grant(spec_bound(pod_spec, name))
        image_dir = os.path.join(staged_dir, C.CHECKPOINT_DIRECTORY)
        problems = criu_guard.image_problems(image_dir, {}, grant=grant, lsms=frozenset(), reader=reader)
        out += [f"container {name}: {p}" for p in problems]
    return out


def check_staged(pod_spec: Mapping[str, Any], staged: Sequence[tuple[str, str]], *, cache_dir: str) -> None:
    """Raise criu_guard.ImageGrantsMore when the create-time check would certainly refuse the restore."""
    problems = staged_problems(pod_spec, staged, reader=criu_guard.ImageReader(cache_dir))
    if problems:
        raise criu_guard.refusal(problems)
