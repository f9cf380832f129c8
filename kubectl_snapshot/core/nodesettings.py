"""One schema for a node's settings: what the agent, `kubectl snapshot install` and the manifests share.

`NodeSettings` is the single declaration. Each field carries its help text and where it surfaces
(its metadata, read with `option()`):

- ``cli``: an option of the agent's node commands (`ks-agent run|install-node|uninstall-node`,
  shim/agent_cli.py builds them from here), with an environment variable where the DaemonSet sets one;
- ``install``: an option of `kubectl snapshot install` and a keyword of `deploy.render()`, passed to
  the agent by the DaemonSet (kubectl_snapshot/deploy/agent.py) and a value of the Helm chart;
- ``per_node``: may differ per node in the node map (`--node-config`, several nodes on one machine);
- ``kind``: ``path`` (a normalized absolute host path), ``address`` (HOST:PORT), ``command``, ``text``,
  ``threshold`` (a percentage or a quantity of bytes), ``share`` (a percentage) or ``count`` (a positive
  whole number; empty for the default).

Adding a setting here adds it everywhere it belongs; nothing else lists them.
"""

from __future__ import annotations

import os
import posixpath
import re
from dataclasses import Field, dataclass, field, fields
from typing import Any, Final

from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.diskspace import (
    DEFAULT_EVICTION_THRESHOLD,
    DEFAULT_NAMESPACE_SHARE,
    DiskPolicy,
    parse_share,
    parse_threshold,
)
from kubectl_snapshot.core.errors import InvalidArgument


@dataclass(frozen=True)
class Option:
    help: str
    kind: str = "path"  # path | address | command | text | threshold | share | count
    cli: bool = True
    install: bool = False
    per_node: bool = False
    env: str | None = None
    aliases: tuple[str, ...] = ()  # older option names still accepted by `kubectl snapshot install`


def _opt(default: str, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"option": Option(help=help, **kw)})


@dataclass(frozen=True)
class NodeSettings:
    node: str = _opt("", "This node's name ($NODE_NAME).", kind="text", env="NODE_NAME")
    state_root: str = _opt(
        C.DEFAULT_STATE_DIR,
        "Agent state on each node (one directory per node below it).",
        install=True,
        aliases=("--state-dir",),
    )
    opt_root: str = _opt(
        "/opt/kubectl-snapshot", "Where install-node puts the runtime wrapper and node bundle.", install=True
    )
    kubelet_root: str = _opt("/var/lib/kubelet", "The kubelet's --root-dir.", install=True, per_node=True)
    containerd_socket: str = _opt(
        "/run/containerd/containerd.sock",
        "The node's containerd socket.",
        install=True,
        per_node=True,
        env="CONTAINERD_ADDRESS",
    )
    containerd_dropin_dir: str = _opt(
        "/etc/containerd/conf.d",
        "A directory the node's containerd imports *.toml config drop-ins from (containerd 2.x's default).",
        install=True,
        per_node=True,
    )
    restart_command: str = _opt(
        "",
        "Host shell command that restarts containerd after the runtime wrapper is added ({node} = node name).",
        kind="command",
        install=True,
    )
    criu_path: str = _opt(
        "",
        "CRIU runc is handed (default: the one install-node puts in the node's directory, never the host's).",
        per_node=True,
    )
    runc_path: str = _opt("", "The node's runc (default: the one containerd's shim finds on the host).", per_node=True)
    criu_config: str = _opt(
        "/etc/criu/runc.conf",
        "The runc-specific CRIU configuration file on the host (written by install-node where safe).",
    )
    criu_kdat: str = _opt(
        "/run/criu.kdat",
        "CRIU's kernel-feature cache file (RUNDIR/criu.kdat of its build). Where its directory is not a tmpfs, "
        "install-node keeps it on a small tmpfs so that CRIU skips its probes (shim/criu/kdat.py); empty: leave it.",
    )
    metrics_bind_address: str = _opt(
        "",
        "HOST:PORT to serve Prometheus metrics on, over HTTPS, to scrapers the API server authorises "
        "(TokenReview + SubjectAccessReview on GET /metrics); empty: no metrics. A node map's entry wins.",
        kind="address",
        per_node=True,
    )
    metrics_token_audiences: str = _opt(
        "kubectl-snapshot-metrics",
        "Comma-separated audiences a metrics scraper's token must be issued for (the TokenReview's "
        "spec.audiences; e.g. kubectl create token SA --audience kubectl-snapshot-metrics); "
        "empty: the API server's own (any API token of an authorised identity).",
        kind="text",
        env="KUBECTL_SNAPSHOT_METRICS_AUDIENCES",
    )
    guard_socket: str = _opt(
        "",
        "The freeze guard's socket (the guard container of the agent's pod); default: a private guard.",
        env="KUBECTL_SNAPSHOT_GUARD_SOCKET",
    )
    disk_eviction_threshold: str = _opt(
        DEFAULT_EVICTION_THRESHOLD,
        "Available space the node filesystem keeps, as the kubelet's evictionHard nodefs.available (10% or 5Gi): "
        "the agent refuses a dump or a restore's staging that would take its state dir's filesystem below it, "
        "counting what the snapshots and restores in flight reserved.",
        kind="threshold",
        per_node=True,
        env="KUBECTL_SNAPSHOT_DISK_EVICTION_THRESHOLD",
    )
    staging_namespace_share: str = _opt(
        DEFAULT_NAMESPACE_SHARE,
        "The most one namespace's restores in flight may reserve of the node's staging room (its available "
        "space above the eviction threshold), so one tenant cannot fill a node's disk; 100% lifts it.",
        kind="share",
        env="KUBECTL_SNAPSHOT_STAGING_NAMESPACE_SHARE",
    )
    save_concurrency: str = _opt(
        "",
        "How many saves the agent runs at once (each compresses, seals and uploads on its own); final saves of "
        "pods being terminated go first and one worker is kept for them (issue 43). Empty: one per CPU, at least 2.",
        kind="count",
        per_node=True,
        env="KUBECTL_SNAPSHOT_SAVE_CONCURRENCY",
    )
    dump_concurrency: str = _opt(
        "",
        "How many of those saves freeze and dump at once (CRIU dumps share the CPUs and memory bandwidth: "
        "overlapping ones make every freeze longer). Empty: 1.",
        kind="count",
        per_node=True,
        env="KUBECTL_SNAPSHOT_DUMP_CONCURRENCY",
    )
    namespace_backlog: str = _opt(
        "",
        "How many snapshots, and how many restores, one namespace may have queued or running on this node; one "
        "more fails at once (TooManyRequests) instead of waiting (threat E2). Final saves and resumes are never "
        "refused. Empty: 20.",
        kind="count",
        per_node=True,
        env="KUBECTL_SNAPSHOT_NAMESPACE_BACKLOG",
    )
    # mounted by the DaemonSet at fixed places (deploy/agent.py provenance_mounts): not options
    trust_dir: str = K.TRUST_DIR
    # install-node's tmpfs for the memory work area (shim/host/workfs.py; KUBECTL_SNAPSHOT_MEMORY_WORK_MIB=0
    # turns dumps in memory off, and it with them): not an option; False only where nothing may be mounted
    memory_work_fs: bool = True

    @property
    def disk(self) -> DiskPolicy:
        """The agent's disk ledger's policy (shim/host/diskspace.py); an empty setting is its default."""
        return DiskPolicy.parse(
            self.disk_eviction_threshold or DEFAULT_EVICTION_THRESHOLD,
            self.staging_namespace_share or DEFAULT_NAMESPACE_SHARE,
        )

    @property
    def state_dir(self) -> str:
        """Per node, so that several nodes on one machine (the local test cluster) never share state."""
        return os.path.join(self.state_root, self.node)

    @property
    def wrapper_dir(self) -> str:
        return os.path.join(self.opt_root, self.node)

    @property
    def wrapper_launcher(self) -> str:
        return os.path.join(self.wrapper_dir, "kubectl-snapshot-runc")

    @property
    def criu(self) -> str:
        """The CRIU runc is handed (`runc --criu`) for every checkpoint and restore on this node."""
        return self.criu_path or os.path.join(self.wrapper_dir, "criu")


DEFAULTS: Final = NodeSettings()


def option(f: Field[Any]) -> Option | None:
    opt = f.metadata.get("option")
    return opt if isinstance(opt, Option) else None


def options() -> list[tuple[str, Option, str]]:
    """(field name, option, default) of every declared option, in declaration order."""
    out = []
    for f in fields(NodeSettings):
        opt = option(f)
        if opt is not None:
            out.append((f.name, opt, str(f.default)))
    return out


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def camel(name: str) -> str:
    """The spelling of a node map entry or a Helm value: kubelet_root -> kubeletRoot."""
    head, *rest = name.split("_")
    return head + "".join(p.capitalize() for p in rest)


INSTALL_KEYS: Final = tuple(n for n, o, _ in options() if o.install)
PER_NODE_KEYS: Final = tuple(n for n, o, _ in options() if o.per_node)
_KINDS: Final = {n: o.kind for n, o, _ in options()}


def check_path(value: str, what: str) -> str:
    if not value.startswith("/") or "\n" in value or posixpath.normpath(value) != value.rstrip("/") or value == "/":
        raise InvalidArgument(f"{what} must be a normalized absolute path below /, got {value!r}")
    return value


def check_value(name: str, value: str, what: str | None = None) -> str:
    """`value` for setting `name`, validated by its kind (InvalidArgument names `what`)."""
    what = what or name
    kind = _KINDS[name]
    if kind == "path":
        return check_path(value, what)
    if kind == "address" and value and not re.fullmatch(r"[0-9A-Za-z.\[\]:-]{0,253}:[0-9]{1,5}", value):
        raise InvalidArgument(f"{what}: {value!r} is not HOST:PORT")
    try:
        if kind == "threshold":
            parse_threshold(value)
        if kind == "share":
            parse_share(value)
    except InvalidArgument as e:
        raise e.with_context(what) from None
    if kind == "count" and value and not (value.isdigit() and int(value) >= 1):
        raise InvalidArgument(
            f"{what} must be a positive whole number, got {value!r}", hint="leave it empty for the default"
        )
    if "\n" in value:
        raise InvalidArgument(f"{what} must be one line")
    return value


def option_of(name: str) -> Option:
    return next(o for n, o, _ in options() if n == name)


def per_node_key(key: str) -> str | None:
    """The setting a node map key names (snake_case or camelCase), if it may differ per node."""
    for name in PER_NODE_KEYS:
        if key in (name, camel(name)):
            return name
    return None
