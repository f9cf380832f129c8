"""Threat B3 with the real registry (distribution) behind a proxy that acknowledges and drops (tests/support/
faulty_proxy.py `swallow_on`): a real `ks-agent checkpoint` of a running container pushes no manifest for a
snapshot whose layer the registry did not keep, and fails saying so; a real `ks-agent restore` of a manifest
whose layer the registry lost is refused before any layer is downloaded. Beside each: the same save or restore
through the same proxy, let through."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable

import pytest

from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.core.errors import NotFound
from kubectl_snapshot.core.oci import parse_manifest
from kubectl_snapshot.core.reference import Reference
from shim.containerd.client import ContainerdClient
from tests.integration.test_agent_roundtrip import (
    agent,
    cleanup,
    client,
    on,
    restore_on,
    start_counter,
    task_status,
    unique,
)
from tests.support.containerd import ContainerdDaemon, containerd_a
from tests.support.faulty_proxy import FaultyProxy
from tests.support.images import busybox_image
from tests.support.registry import RegistryServer, registry

pytestmark = pytest.mark.integration
__all__ = ["cleanup", "containerd_a", "registry"]  # fixtures

UPLOAD_DONE = r"/blobs/uploads/.*[?&]digest="


@pytest.fixture
def running(containerd_a: ContainerdDaemon, cleanup: Callable[[ContainerdClient, str], None]) -> str:
    a = client(containerd_a)
    cid = unique("b3")
    cleanup(a, cid)
    start_counter(a, containerd_a, cid, busybox_image(containerd_a))
    return cid


def proxy_for(registry: RegistryServer, **kw: object) -> FaultyProxy:
    host, port = registry.host.split(":")
    return FaultyProxy(host, int(port), **kw)  # type: ignore[arg-type]


def save(d: ContainerdDaemon, to: str, cid: str) -> Reference:
    return Reference.parse(agent("checkpoint", *on(d), "--to", to, cid).stdout.strip())


def tag_exists(ref: str) -> bool:
    try:
        RegistryClient().get_manifest(Reference.parse(ref))
    except NotFound:
        return False
    return True


def test_a_layer_the_registry_did_not_keep_gets_no_manifest_and_fails_the_save(  # type: ignore[no-untyped-def]
    containerd_a, registry, running
):
    repo, tag = unique("b3-save"), unique("t")
    with proxy_for(registry, swallow_on=("PUT", UPLOAD_DONE), times=1) as proxy:
        proc = agent("checkpoint", *on(containerd_a), "--to", f"{proxy.host}/{repo}:{tag}", running, check=False)
        puts = [(m, p) for m, p, _ in proxy.requests if m == "PUT" and "/manifests/" in p]
    assert proc.returncode != 0, proc.stdout
    assert "the registry lacks 1 of the" in proc.stderr and "no manifest or tag was pushed" in proc.stderr
    assert "hint: check the registry's storage" in proc.stderr
    assert puts == [], "a manifest naming a blob the registry lacks was pushed"
    assert not tag_exists(registry.ref(repo, tag))
    # the container was thawed and runs on
    assert task_status(client(containerd_a), running) == "running"


def test_the_same_save_through_a_proxy_that_keeps_everything_is_tagged(containerd_a, registry, running):  # type: ignore[no-untyped-def]
    repo, tag = unique("b3-save"), unique("t")
    with proxy_for(registry) as proxy:
        agent("checkpoint", *on(containerd_a), "--to", f"{proxy.host}/{repo}:{tag}", running)
    assert tag_exists(registry.ref(repo, tag))


def test_a_manifest_the_registry_did_not_keep_fails_the_save(containerd_a, registry, running):  # type: ignore[no-untyped-def]
    repo, tag = unique("b3-save"), unique("t")
    with proxy_for(registry, swallow_on=("PUT", r"/manifests/")) as proxy:
        proc = agent("checkpoint", *on(containerd_a), "--to", f"{proxy.host}/{repo}:{tag}", running, check=False)
    assert proc.returncode != 0, proc.stdout
    assert "but serves nothing there" in proc.stderr, proc.stderr
    assert not tag_exists(registry.ref(repo, tag))


def test_a_restore_of_a_manifest_whose_layer_the_registry_lost_is_refused_before_downloading(  # type: ignore[no-untyped-def]
    containerd_a, registry, running
):
    repo = unique("b3-restore")
    complete, broken = (save(containerd_a, registry.ref(repo, unique("t")), running) for _ in range(2))
    body, _, _ = RegistryClient().get_manifest(broken)
    shared = {layer.digest for layer in parse_manifest(RegistryClient().get_manifest(complete)[0]).layers}
    lost = next(layer.digest for layer in parse_manifest(body).layers if layer.digest not in shared)
    req = urllib.request.Request(f"{registry.url}/v2/{repo}/blobs/{lost}", method="DELETE")
    with urllib.request.urlopen(req) as resp:  # the registry's storage loses one layer of the second snapshot
        assert resp.status == 202
    with proxy_for(registry) as proxy:
        via = f"{proxy.host}/{repo}@{broken.digest}"
        proc = agent(*restore_on(containerd_a), via, unique("never"), check=False)
        fetched = [p for m, p, _ in proxy.requests if m == "GET" and "/blobs/" in p]
    assert proc.returncode != 0, proc.stdout
    assert "is incomplete: the registry lacks 1 of its" in proc.stderr and lost in proc.stderr, proc.stderr
    assert "nothing was staged" in proc.stderr and "hint: the registry lost part of this snapshot" in proc.stderr
    layers = {layer.digest for layer in parse_manifest(body).layers}
    assert not [p for p in fetched if p.rsplit("/", 1)[-1] in layers], f"a layer was downloaded: {fetched}"
    # the complete one, through the same proxy, restores
    new = unique("b3-ok")
    a = client(containerd_a)
    try:
        with proxy_for(registry) as proxy:
            agent(*restore_on(containerd_a), f"{proxy.host}/{repo}@{complete.digest}", new)
        assert task_status(a, new) == "running"
    finally:
        a.remove_container(new)
