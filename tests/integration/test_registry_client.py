"""RegistryClient against a real docker-registry (distribution 2.8) on loopback."""

from __future__ import annotations

import hashlib
import io
import json
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from kubectl_snapshot.adapters.registry import CredentialStore, RegistryClient, sha256_digest
from kubectl_snapshot.core import constants
from kubectl_snapshot.core.errors import (
    DigestMismatch,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from kubectl_snapshot.core.reference import Reference
from tests.support.faulty_proxy import FaultyProxy
from tests.support.registry import RegistryServer, free_port, registry_server, registry_server_factory

pytestmark = pytest.mark.integration

MiB = 1 << 20


def fast_client(**kwargs: object) -> RegistryClient:
    kwargs.setdefault("backoff", 0.01)
    return RegistryClient(**kwargs)  # type: ignore[arg-type]


def unique_ref(server: RegistryServer | str, tag: str | None = "v1") -> Reference:
    host = server if isinstance(server, str) else server.host
    return Reference.parse(f"{host}/test/{uuid.uuid4().hex[:12]}" + (f":{tag}" if tag else ""))


def blob(size: int, seed: int = 0) -> tuple[bytes, str]:
    data = (hashlib.sha256(str(seed).encode()).digest() * (size // 32 + 1))[:size]
    # make it less regular so a chunk-order bug changes the digest
    data = bytes(b ^ (i // 4096 & 0xFF) for i, b in enumerate(data[: min(size, 1 << 16)])) + data[1 << 16 :]
    return data, sha256_digest(data)


def manifest_for(config: bytes, layers: list[tuple[str, int]]) -> bytes:
    return json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": constants.OCI_MANIFEST,
            "artifactType": constants.ARTIFACT_TYPE,
            "config": {
                "mediaType": constants.CONFIG_MEDIA_TYPE,
                "digest": sha256_digest(config),
                "size": len(config),
            },
            "layers": [{"mediaType": constants.CHECKPOINT_LAYER_MEDIA_TYPE, "digest": d, "size": s} for d, s in layers],
        },
        sort_keys=True,
    ).encode()


def push_artifact(client: RegistryClient, ref: Reference, layer: bytes) -> tuple[str, bytes]:
    config = b'{"pod":"x"}'
    client.push_blob(ref, digest=sha256_digest(config), size=len(config), data=config)
    client.push_blob(ref, digest=sha256_digest(layer), size=len(layer), data=layer)
    manifest = manifest_for(config, [(sha256_digest(layer), len(layer))])
    return client.push_manifest(ref, manifest, constants.OCI_MANIFEST), manifest


def test_small_blob_round_trip_and_skip(registry: RegistryServer) -> None:
    client = fast_client()
    ref = unique_ref(registry)
    data, digest = blob(1000)
    assert not client.blob_exists(ref, digest)
    seen: list[int] = []
    assert client.push_blob(ref, digest=digest, size=len(data), data=data, progress=seen.append) is True
    assert sum(seen) == len(data)
    assert client.blob_exists(ref, digest)
    assert client.push_blob(ref, digest=digest, size=len(data), data=data) is False
    assert client.read_blob(ref, digest) == data


def test_fresh_blob_is_sent_without_asking(registry: RegistryServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """fresh=True (a config just made): no existence check, one upload; sent again if it was there after all."""
    client = fast_client()
    ref = unique_ref(registry)
    data, digest = blob(3000, seed=7)

    def no_lookup(*_a: object, **_k: object) -> bool:
        raise AssertionError("a fresh blob was looked up")

    monkeypatch.setattr(client, "blob_exists", no_lookup)
    assert client.push_blob(ref, digest=digest, size=len(data), data=data, fresh=True) is True
    assert client.push_blob(ref, digest=digest, size=len(data), data=data, fresh=True) is True
    monkeypatch.undo()
    assert client.blob_exists(ref, digest)
    assert client.read_blob(ref, digest) == data
    bad = sha256_digest(b"other")
    with pytest.raises(DigestMismatch):  # the registry still checks what it is given
        client.push_blob(ref, digest=bad, size=len(data), data=data, fresh=True)


def test_large_file_chunked_round_trip(registry: RegistryServer, tmp_path: Path) -> None:
    client = fast_client(chunk_size=8 * MiB, monolithic_max=4 * MiB)
    ref = unique_ref(registry)
    data, digest = blob(40 * MiB + 123, seed=1)
    src = tmp_path / "layer"
    src.write_bytes(data)
    seen: list[int] = []
    assert client.push_blob(ref, digest=digest, size=len(data), path=str(src), progress=seen.append)
    assert sum(seen) == len(data)
    out = tmp_path / "out"
    got: list[int] = []
    with open(out, "wb") as fh:
        n = client.fetch_blob(ref, digest, fh, expected_size=len(data), progress=got.append)
    assert n == len(data) == sum(got)
    assert out.read_bytes() == data


def test_monolithic_file_push(registry: RegistryServer, tmp_path: Path) -> None:
    client = fast_client()
    ref = unique_ref(registry)
    data, digest = blob(3 * MiB + 7, seed=2)
    src = tmp_path / "layer"
    src.write_bytes(data)
    assert client.push_blob(ref, digest=digest, size=len(data), path=str(src))
    assert client.read_blob(ref, digest, max_size=len(data)) == data


def test_push_blob_stream(registry: RegistryServer) -> None:
    client = fast_client(chunk_size=1 * MiB)
    ref = unique_ref(registry)
    data, digest = blob(5 * MiB + 11, seed=3)
    pieces = (data[i : i + 300_000] for i in range(0, len(data), 300_000))
    seen: list[int] = []
    assert client.push_blob_stream(ref, pieces, progress=seen.append) == (digest, len(data))
    assert sum(seen) == len(data)
    assert client.read_blob(ref, digest, max_size=len(data)) == data
    # an empty stream is a valid (empty) blob
    assert client.push_blob_stream(ref, iter([])) == (sha256_digest(b""), 0)


def test_manifest_by_tag_and_digest_then_delete(registry: RegistryServer) -> None:
    client = fast_client()
    ref = unique_ref(registry, tag="snap-1")
    layer, _ = blob(2048, seed=4)
    digest, manifest = push_artifact(client, ref, layer)
    assert digest == sha256_digest(manifest)
    body, media_type, got = client.get_manifest(ref)
    assert (body, media_type, got) == (manifest, constants.OCI_MANIFEST, digest)
    by_digest = Reference(ref.registry, ref.repository, digest=digest)
    assert client.get_manifest(by_digest)[0] == manifest
    assert client.list_tags(ref) == ["snap-1"]
    client.delete_manifest(ref, digest)
    with pytest.raises(NotFound, match="MANIFEST_UNKNOWN"):
        client.get_manifest(by_digest)


def test_missing_manifest_and_repository_are_not_found(registry: RegistryServer) -> None:
    client = fast_client()
    ref = unique_ref(registry)
    with pytest.raises(NotFound) as info:
        client.get_manifest(ref)
    assert info.value.hint
    with pytest.raises(NotFound):
        client.list_tags(ref)


def test_tampered_blob_is_detected(registry: RegistryServer, tmp_path: Path) -> None:
    client = fast_client()
    ref = unique_ref(registry)
    data, digest = blob(4096, seed=5)
    client.push_blob(ref, digest=digest, size=len(data), data=data)
    path = registry.blob_path(digest)
    stored = bytearray(path.read_bytes())
    stored[100] ^= 0x01
    path.write_bytes(bytes(stored))
    with pytest.raises(DigestMismatch, match="hashes to"):
        client.read_blob(ref, digest)
    with open(tmp_path / "x", "wb") as fh, pytest.raises(DigestMismatch):
        client.fetch_blob(ref, digest, fh, expected_size=len(data))


def test_tampered_manifest_is_detected(registry: RegistryServer) -> None:
    client = fast_client()
    ref = unique_ref(registry)
    digest, manifest = push_artifact(client, ref, b"layer-bytes")
    path = registry.blob_path(digest)
    path.write_bytes(manifest.replace(b"snapshot.pod.v1", b"snapshot.pox.v1"))
    with pytest.raises(DigestMismatch):
        client.get_manifest(ref.with_digest(digest))
    with pytest.raises(DigestMismatch):  # by tag: the registry's Docker-Content-Digest disagrees
        client.get_manifest(ref)


def test_corrupted_transfer_is_detected(registry: RegistryServer) -> None:
    client = fast_client()
    ref = unique_ref(registry)
    data, digest = blob(10_000, seed=6)
    client.push_blob(ref, digest=digest, size=len(data), data=data)
    with FaultyProxy("127.0.0.1", registry.port, corrupt_on=("GET", "/blobs/")) as proxy:
        proxied = Reference(proxy.host, ref.repository, tag="v1")
        with pytest.raises(DigestMismatch):
            client.read_blob(proxied, digest)


def test_blob_download_follows_redirects(registry: RegistryServer, tmp_path: Path) -> None:
    client = fast_client()
    ref = unique_ref(registry)
    data, digest = blob(2 * MiB, seed=13)
    client.push_blob(ref, digest=digest, size=len(data), data=data)
    with FaultyProxy("127.0.0.1", registry.port, redirect_on=("GET", "/blobs/sha256:")) as proxy:
        proxied = Reference(proxy.host, ref.repository)
        with open(tmp_path / "out", "wb") as fh:
            assert client.fetch_blob(proxied, digest, fh, expected_size=len(data)) == len(data)
        assert [s for _, _, s in proxy.requests] == [307]
    assert (tmp_path / "out").read_bytes() == data


def test_a_redirect_to_another_host_does_not_carry_the_credentials(
    registry_factory: Callable[..., RegistryServer], tmp_path: Path
) -> None:
    """Threat B10: a registry with an object-storage backend answers blob GETs with a 307 to another
    host; the client follows it (the legitimate case: the blob downloads) without sending that host
    the registry's Authorization header."""
    authed = registry_factory(auth="htpasswd", users={"alice": "s3cret"})
    storage = registry_factory()  # the "object storage": serves the blob to anyone
    data, digest = blob(1 * MiB, seed=21)
    ref = unique_ref(authed)
    with (
        FaultyProxy("127.0.0.1", storage.port) as store,
        FaultyProxy(
            "127.0.0.1", authed.port, redirect_on=("GET", "/blobs/sha256:"), redirect_to=("127.0.0.1", store.port)
        ) as front,
    ):
        client = fast_client(credentials=CredentialStore().with_explicit(front.host, "alice", "s3cret"))
        fronted = Reference(front.host, ref.repository)
        client.push_blob(fronted, digest=digest, size=len(data), data=data)
        fast_client().push_blob(Reference(storage.host, ref.repository), digest=digest, size=len(data), data=data)
        with open(tmp_path / "out", "wb") as fh:
            assert client.fetch_blob(fronted, digest, fh, expected_size=len(data)) == len(data)
        assert ("GET", f"/v2/{ref.repository}/blobs/{digest}", 307) in front.requests
        assert front.authorized, "the registry itself was never sent the credentials: the test proves nothing"
        assert any(m == "GET" and digest in p for m, p, _ in store.requests), "the redirect was not followed"
        assert not [a for a in store.authorized if digest in a[1]], "the credentials went to the redirect's host"
    assert (tmp_path / "out").read_bytes() == data


def test_size_limits(registry: RegistryServer) -> None:
    client = fast_client()
    ref = unique_ref(registry)
    data, digest = blob(10_000, seed=7)
    client.push_blob(ref, digest=digest, size=len(data), data=data)
    with pytest.raises(DigestMismatch, match="expected 9999"):
        client.fetch_blob(ref, digest, io.BytesIO(), expected_size=9999)
    with pytest.raises(Exception, match="limit"):
        client.read_blob(ref, digest, max_size=1000)
    push_artifact(client, ref, b"l")
    with pytest.raises(Exception, match="limit"):
        client.get_manifest(ref, max_size=100)


def test_basic_auth(registry_factory: Callable[..., RegistryServer]) -> None:
    server = registry_factory(auth="htpasswd", users={"alice": "s3cret"})
    ref = unique_ref(server)
    data, digest = blob(5000, seed=8)
    good = fast_client(credentials=CredentialStore().with_explicit(server.host, "alice", "s3cret"))
    good.ping(ref)
    assert good.push_blob(ref, digest=digest, size=len(data), data=data)
    assert good.read_blob(ref, digest) == data

    with pytest.raises(PermissionDenied) as missing:
        fast_client().blob_exists(ref, digest)
    assert "docker login" in (missing.value.hint or "")

    wrong = fast_client(credentials=CredentialStore().with_explicit(server.host, "alice", "nope"))
    with pytest.raises(PermissionDenied) as refused:
        wrong.push_blob(ref, digest=sha256_digest(b"x"), size=1, data=b"x")
    assert "401" in refused.value.message


def test_docker_config_is_honoured(
    registry_factory: Callable[..., RegistryServer], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import base64

    server = registry_factory(auth="htpasswd", users={"bob": "pw"})
    config_dir = tmp_path / "docker"
    config_dir.mkdir()
    auth = base64.b64encode(b"bob:pw").decode()
    (config_dir / "config.json").write_text(json.dumps({"auths": {f"http://{server.host}": {"auth": auth}}}))
    monkeypatch.setenv("DOCKER_CONFIG", str(config_dir))
    client = fast_client(credentials=CredentialStore.from_docker_config())
    ref = unique_ref(server)
    assert client.push_blob(ref, digest=sha256_digest(b"abc"), size=3, data=b"abc")
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "nowhere"))
    with pytest.raises(PermissionDenied):
        fast_client(credentials=CredentialStore.from_docker_config()).ping(ref)


def test_bearer_token_auth(registry_factory: Callable[..., RegistryServer], tmp_path: Path) -> None:
    server = registry_factory(auth="token", users={"carol": "pw"}, refresh_tokens={"refresh-1": "carol"})
    assert server.token_server is not None
    ref = unique_ref(server, tag="t")
    client = fast_client(credentials=CredentialStore().with_explicit(server.host, "carol", "pw"))
    layer, _ = blob(3 * MiB, seed=9)
    digest, manifest = push_artifact(client, ref, layer)
    assert client.get_manifest(ref)[0] == manifest
    token_calls = len(server.token_server.requests)
    assert token_calls <= 4  # cached per scope, not fetched per request
    client.read_blob(ref, sha256_digest(layer), max_size=len(layer))
    assert len(server.token_server.requests) <= token_calls + 1

    identity = CredentialStore.from_dockerconfigjson(
        json.dumps({"auths": {server.host: {"identitytoken": "refresh-1"}}}).encode()
    )
    assert fast_client(credentials=identity).get_manifest(ref)[2] == digest
    assert any(r["method"] == "POST" and r["ok"] for r in server.token_server.requests)

    with pytest.raises(PermissionDenied) as anonymous:
        fast_client().get_manifest(ref)
    assert "docker login" in (anonymous.value.hint or "")
    wrong = fast_client(credentials=CredentialStore().with_explicit(server.host, "carol", "bad"))
    with pytest.raises(PermissionDenied, match="refused"):
        wrong.get_manifest(ref)


def test_a_token_that_expires_mid_push_is_renewed_once(
    registry_factory: Callable[..., RegistryServer], caplog: pytest.LogCaptureFixture
) -> None:
    """Threat B5: the registry refuses the token the client holds in the middle of a push (it expired, or
    was revoked): one renewal from the token service, the upload carries on and the push completes (the
    legitimate case); a registry that keeps refusing ends it cleanly with no tag. No token in the logs."""
    import logging

    from tests.support.registry import SERVICE

    server = registry_factory(auth="token", users={"carol": "pw"})
    tokens = server.token_server
    assert tokens is not None
    ref = unique_ref(server, tag="t")
    challenge = (
        f'Bearer realm="{tokens.realm}",service="{SERVICE}",'
        f'scope="repository:{ref.repository}:pull,push",error="invalid_token"'
    )
    layer, _ = blob(2 * MiB, seed=31)
    caplog.set_level(logging.DEBUG)
    session = ("*", "/blobs/uploads/[0-9a-f-]{8,}")  # an upload session already begun, not its POST
    with FaultyProxy("127.0.0.1", server.port, fail_on=session, status=401, times=1,
                     fail_headers={"WWW-Authenticate": challenge}) as proxy:  # fmt: skip
        client = fast_client(credentials=CredentialStore().with_explicit(proxy.host, "carol", "pw"))
        fronted = Reference(proxy.host, ref.repository, tag="t")
        client.ping(fronted)
        before = len(tokens.requests)
        digest, _ = push_artifact(client, fronted, layer)
        assert proxy.failures == 1, "no token was refused: the test proves nothing"
        pushes = [r for r in tokens.requests[before:] if any(x.endswith(":pull,push") for x in r.get("scope", []))]
        assert len(pushes) == 2, tokens.requests  # the push scope's token, then exactly one renewal
        assert client.get_manifest(fronted)[2] == digest
    issued = [t for t in caplog.text.split() if t.count(".") == 2 and len(t) > 200]
    assert not issued, "a token reached the logs"
    assert "Bearer ey" not in caplog.text

    other = Reference(server.host, ref.repository + "-refused", tag="t")
    with FaultyProxy("127.0.0.1", server.port, fail_on=session, status=401,
                     fail_headers={"WWW-Authenticate": challenge}) as proxy:  # fmt: skip
        client = fast_client(credentials=CredentialStore().with_explicit(proxy.host, "carol", "pw"))
        fronted = Reference(proxy.host, other.repository, tag="t")
        with pytest.raises(PermissionDenied):
            push_artifact(client, fronted, layer)
    owner = fast_client(credentials=CredentialStore().with_explicit(server.host, "carol", "pw"))
    with pytest.raises(NotFound):
        owner.get_manifest(other)


def test_registry_down_is_unavailable() -> None:
    port = free_port()
    client = fast_client(retries=2)
    ref = Reference.parse(f"127.0.0.1:{port}/a/b:c")
    with pytest.raises(Unavailable) as info:
        client.ping(ref)
    assert f"cannot reach registry 127.0.0.1:{port}: connection refused" in info.value.message
    assert "--plain-http" in (info.value.hint or "")
    with pytest.raises(Unavailable):
        client.push_blob(ref, digest=sha256_digest(b"x"), size=1, data=b"x")


def test_registry_restart_keeps_content(registry: RegistryServer) -> None:
    client = fast_client()
    ref = unique_ref(registry)
    client.push_blob(ref, digest=sha256_digest(b"keep"), size=4, data=b"keep")
    registry.stop()
    try:
        with pytest.raises(Unavailable):
            fast_client(retries=0).blob_exists(ref, sha256_digest(b"keep"))
    finally:
        registry.start()
    assert client.blob_exists(ref, sha256_digest(b"keep"))


def test_failure_mid_push_leaves_no_tag(registry: RegistryServer, tmp_path: Path) -> None:
    data, digest = blob(6 * MiB, seed=10)
    src = tmp_path / "layer"
    src.write_bytes(data)
    with FaultyProxy("127.0.0.1", registry.port, fail_after_bytes=2 * MiB) as proxy:
        client = fast_client(retries=2, chunk_size=1 * MiB, monolithic_max=1 * MiB)
        ref = unique_ref(proxy.host, tag="broken")
        with pytest.raises(Unavailable, match="reset"):
            client.push_blob(ref, digest=digest, size=len(data), path=str(src))
        assert proxy.failures == 3  # first try + 2 restarts
    direct = Reference(registry.host, ref.repository, tag="broken")
    with pytest.raises(NotFound):
        client.get_manifest(direct)
    with pytest.raises(NotFound):
        client.list_tags(direct)
    assert not client.blob_exists(direct, digest)


def test_failure_mid_stream_raises(registry: RegistryServer) -> None:
    data, _ = blob(3 * MiB, seed=11)
    with FaultyProxy("127.0.0.1", registry.port, fail_after_bytes=int(1.5 * MiB)) as proxy:
        client = fast_client(chunk_size=1 * MiB)
        ref = unique_ref(proxy.host)
        with pytest.raises(Unavailable):
            client.push_blob_stream(ref, [data[i : i + MiB] for i in range(0, len(data), MiB)])
        assert proxy.failures == 1


def test_upload_restarts_after_one_failure(registry: RegistryServer, tmp_path: Path) -> None:
    data, digest = blob(3 * MiB, seed=12)
    src = tmp_path / "layer"
    src.write_bytes(data)
    with FaultyProxy("127.0.0.1", registry.port, fail_after_bytes=MiB, times=1) as proxy:
        client = fast_client(chunk_size=1 * MiB, monolithic_max=0)
        ref = unique_ref(proxy.host)
        seen: list[int] = []
        assert client.push_blob(ref, digest=digest, size=len(data), path=str(src), progress=seen.append)
        assert sum(seen) == len(data)  # a restart never double counts
        assert proxy.failures == 1
    assert fast_client().read_blob(Reference(registry.host, ref.repository), digest, max_size=len(data)) == data


def test_retry_on_503_then_success(registry: RegistryServer) -> None:
    client = fast_client()
    ref = unique_ref(registry)
    client.push_blob(ref, digest=sha256_digest(b"hello"), size=5, data=b"hello")
    with FaultyProxy("127.0.0.1", registry.port, fail_on=("GET", "/blobs/"), status=503, times=2) as proxy:
        proxied = Reference(proxy.host, ref.repository)
        assert client.read_blob(proxied, sha256_digest(b"hello")) == b"hello"
        assert [s for _, _, s in proxy.requests] == [503, 503, 200]
    with FaultyProxy("127.0.0.1", registry.port, fail_on=("GET", "/manifests/"), status=429, retry_after=0) as proxy:
        with pytest.raises(Unavailable, match="429"):
            fast_client(retries=1).get_manifest(Reference(proxy.host, ref.repository, tag="v1"))
        assert len(proxy.requests) == 2


def test_no_retry_on_client_errors(registry: RegistryServer) -> None:
    with FaultyProxy("127.0.0.1", registry.port, fail_on=("GET", "/manifests/"), status=400) as proxy:
        ref = Reference(proxy.host, "test/x", tag="v1")
        with pytest.raises(Exception, match="400"):
            fast_client().get_manifest(ref)
        assert len(proxy.requests) == 1
