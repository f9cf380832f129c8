"""The most a container of a pod spec can be granted by the runtime, known before it is created.

The runtime wrapper checks a restore's CRIU images against the container's real runtime spec
(config.json), which exists only once containerd creates the container. Before that, when the agent
stages a restore (and for `kubectl snapshot restore --dry-run=server`), only the pod spec is known.
From it this module derives an *upper bound* of what containerd's CRI will grant each container, field
by field, and says "unknown" where the pod spec does not decide (a uid that comes from the image, the
groups of the image's /etc/group, LSM labels, mounts resolved in the image). A check against the bound
refuses only what the check at create would refuse for certain, so it can never refuse a restore that
the runtime would let through; it only answers earlier and with the reason.

What containerd's CRI does with a container's securityContext (containerd 1.7 to 2.3, the releases
docs/deploy.md supports):
- capabilities: privileged -> every capability; else its default set (DEFAULT_CAPABILITIES, the same
  in every release), plus `add`, minus `drop` ("ALL" in either means every capability); the effective,
  permitted, inheritable and ambient sets never exceed the bounding set it writes;
- seccomp: a RuntimeDefault or Localhost profile (the container's, else the pod's) gives a filter unless
  the container is privileged; unset follows the kubelet's seccompDefault, so it is "maybe": no bound;
- no_new_privs: set exactly when allowPrivilegeEscalation is false (the kubelet's rule);
- a user namespace exactly when the pod sets hostUsers: false;
- the uid: runAsUser (the container's, else the pod's); unset, the image decides (unknown).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# containerd's default capabilities for an unprivileged container (pkg/oci: defaultUnixCaps), in its order
CONTAINERD_DEFAULT_CAPABILITIES: tuple[str, ...] = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
)
DEFAULT_CAPABILITIES = frozenset(CONTAINERD_DEFAULT_CAPABILITIES)
_PROFILES_WITH_FILTER = ("RuntimeDefault", "Localhost")


@dataclass(frozen=True)
class SpecBound:
    """An upper bound of a container's runtime grant (None / False: the pod spec does not decide)."""

    container: str
    capabilities: frozenset[str]  # "CAP_..." names; meaningless when all_capabilities
    all_capabilities: bool
    uid: int | None
    seccomp: bool  # certainly a seccomp filter
    no_new_privs: bool  # certainly no_new_privs
    user_namespace: bool  # True: maybe a user namespace; False: certainly none

    def allows(self, cap: str) -> bool:
        return self.all_capabilities or cap in self.capabilities


def _cap_name(name: Any) -> str:
    text = str(name).upper()
    return text if text.startswith("CAP_") else f"CAP_{text}"


def _containers(spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [c for key in ("containers", "initContainers") for c in spec.get(key) or () if isinstance(c, Mapping)]


def spec_bound(pod_spec: Mapping[str, Any], container: str) -> SpecBound:
    """The bound for the container (or init container) `container` of `pod_spec`; KeyError if absent."""
    found = [c for c in _containers(pod_spec) if c.get("name") == container]
    if not found:
        raise KeyError(container)
    sc: Mapping[str, Any] = found[0].get("securityContext") or {}
    pod_sc: Mapping[str, Any] = pod_spec.get("securityContext") or {}
    privileged = bool(sc.get("privileged"))
    caps: Mapping[str, Any] = sc.get("capabilities") or {}
    add = {_cap_name(n) for n in caps.get("add") or ()}
    drop = {_cap_name(n) for n in caps.get("drop") or ()}
    all_caps = privileged or "CAP_ALL" in add
    if all_caps:
        names: frozenset[str] = frozenset()
    elif "CAP_ALL" in drop:
        names = frozenset(add)
    else:
        names = frozenset((DEFAULT_CAPABILITIES | add) - drop)
    profile = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
    uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
    return SpecBound(
        container=container,
        capabilities=names,
        all_capabilities=all_caps,
        uid=int(uid) if isinstance(uid, int) and not isinstance(uid, bool) else None,
        seccomp=profile in _PROFILES_WITH_FILTER and not privileged,
        no_new_privs=sc.get("allowPrivilegeEscalation") is False,
        user_namespace=pod_spec.get("hostUsers") is False,
    )


def _spec_caps(spec: Mapping[str, Any]) -> set[str]:
    caps = ((spec.get("process") or {}).get("capabilities")) or {}
    return {
        _cap_name(n)
        for key in ("bounding", "effective", "permitted", "inheritable", "ambient")
        for n in caps.get(key) or ()
    }


def recorded_spec_problems(recorded: Mapping[str, Any], bound: SpecBound) -> list[str]:
    """What a container that ran under the runtime spec `recorded` (a snapshot's record of it) holds that
    the new container's bound cannot grant: the processes of a snapshot hold what their runtime gave
    them (a process may give up a capability or set no_new_privs itself; it cannot gain them), so each
    of these is what the image check at create refuses, unless the process had given it up itself."""
    where = f"container {bound.container}"
    out: list[str] = []
    process = recorded.get("process") or {}
    linux = recorded.get("linux") or {}
    extra = sorted(c for c in _spec_caps(recorded) if not bound.allows(c))
    if extra:
        out.append(f"{where}: ran with capabilities {','.join(extra)} that the new pod's spec does not grant")
    if bound.seccomp and not linux.get("seccomp"):
        out.append(f"{where}: ran without a seccomp filter, the new pod's spec sets a seccomp profile")
    if bound.no_new_privs and not process.get("noNewPrivileges"):
        out.append(
            f"{where}: ran with privilege escalation allowed, the new pod's spec sets allowPrivilegeEscalation: false"
        )
    uid = int((process.get("user") or {}).get("uid") or 0)
    if bound.uid is not None and uid != bound.uid and not (bound.uid == 0 and bound.allows("CAP_SETUID")):
        out.append(f"{where}: ran as uid {uid}, the new pod's spec runs it as uid {bound.uid}")
    userns = any(ns.get("type") == "user" for ns in linux.get("namespaces") or () if isinstance(ns, Mapping))
    if userns and not bound.user_namespace:
        out.append(f"{where}: ran in a user namespace, the new pod's spec sets none (hostUsers)")
    return out


def dry_run_problems(pod_spec: Mapping[str, Any], records: Sequence[tuple[str, Mapping[str, Any]]]) -> list[str]:
    """For each (container name, recorded runtime spec) of a snapshot: what `pod_spec` cannot grant."""
    out: list[str] = []
    for name, recorded in records:
        try:
            bound = spec_bound(pod_spec, name)
        except KeyError:
            out.append(f"container {name}: the new pod has no container of that name")
            continue
        out += recorded_spec_problems(recorded, bound)
    return out
