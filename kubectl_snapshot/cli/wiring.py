"""The plugin's wiring: the flags that say which cluster (kept on click's root context) and the adapters
built from them. Every command module and the completion reach the cluster through here; tests replace
`kube_client` to run a command against a fake API.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import click

from kubectl_snapshot.app.ports import ArtifactStore, Kube
from kubectl_snapshot.core.reference import Reference

if TYPE_CHECKING:  # the client library loads only when a command talks to the cluster
    from kubectl_snapshot.adapters.kube import KubeClient


@dataclass
class KubeOpts:
    kubeconfig: str | None = None
    context: str | None = None
    namespace: str | None = None
    verbose: bool = False
    server: str | None = None
    token: str | None = None
    impersonate: str | None = None
    impersonate_groups: tuple[str, ...] = ()


def kube_opts(ctx: click.Context) -> KubeOpts:
    root = ctx.find_root()
    opts = root.meta.setdefault("kubectl_snapshot.opts", KubeOpts())
    assert isinstance(opts, KubeOpts)
    return opts


def kube_client(ctx: click.Context | None = None) -> KubeClient:
    from kubectl_snapshot.adapters.kube import KubeClient

    opts = kube_opts(ctx or click.get_current_context())
    return KubeClient.from_config(
        opts.kubeconfig,
        opts.context,
        server=opts.server,
        token=opts.token,
        impersonate=opts.impersonate,
        impersonate_groups=opts.impersonate_groups,
    )


def namespace_of(kube: Kube, ctx: click.Context | None = None) -> str:
    return kube_opts(ctx or click.get_current_context()).namespace or kube.namespace or "default"


def artifact_store(ref: Reference, insecure: bool) -> ArtifactStore:
    """Credentials from the docker config; loopback registries are plain HTTP anyway."""
    from kubectl_snapshot.adapters.registry import CredentialStore, RegistryClient

    return RegistryClient(credentials=CredentialStore.from_docker_config(), plain_http=insecure)
