"""Registry login and cross-repository mounts against the real registry (Debian's docker-registry):

* credentials from a docker credential helper (an executable this test writes), as docker/oras/crane
  get them: Basic auth (htpasswd) and the token flow with an identity token (`Username: <token>`);
* a blob pushed to another repository of the same registry is mounted, not uploaded: the proxy in
  front of the registry sees no request body bytes, and the registry serves the blob under the new name;
  a blob the source lacks falls back to an upload (202).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from kubectl_snapshot.adapters.registry import CredentialStore, RegistryClient, sha256_digest
from kubectl_snapshot.core.errors import PermissionDenied
from kubectl_snapshot.core.reference import Reference
from tests.support.faulty_proxy import FaultyProxy
from tests.support.registry import RegistryServer, registry_server, registry_server_factory

pytestmark = pytest.mark.integration
MiB = 1 << 20


def client(**kwargs: object) -> RegistryClient:
    return RegistryClient(retries=1, backoff=0.01, timeout=30, **kwargs)  # type: ignore[arg-type]


def write_helper(bin_dir: Path, name: str, answers: dict[str, dict[str, str]], log: Path) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    exe = bin_dir / f"docker-credential-{name}"
    exe.write_text(
        "#!/usr/bin/env python3\n"
        "import json, sys\n"
        f"answers = {answers!r}\n"
        "server = sys.stdin.read().strip()\n"
        f"open({str(log)!r}, 'a').write(sys.argv[1] + ' ' + server + '\\n')\n"
        "if server not in answers:\n"
        "    print('credentials not found in native keychain'); sys.exit(1)\n"
        "print(json.dumps({'ServerURL': server, **answers[server]}))\n"
    )
    exe.chmod(0o755)


def docker_config(tmp_path: Path, config: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> CredentialStore:
    cfg_dir = tmp_path / "docker"
    cfg_dir.mkdir(exist_ok=True)
    (cfg_dir / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("DOCKER_CONFIG", str(cfg_dir))
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}")
    return CredentialStore.from_docker_config()


def test_basic_auth_with_a_credential_helper(
    registry_factory: Callable[..., RegistryServer], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = registry_factory(auth="htpasswd", users={"alice": "s3cret"})
    log = tmp_path / "helper.log"
    write_helper(tmp_path / "bin", "test-keychain", {server.host: {"Username": "alice", "Secret": "s3cret"}}, log)
    store = docker_config(tmp_path, {"credHelpers": {server.host: "test-keychain"}}, monkeypatch)
    ref = Reference.parse(server.ref("team/app", "v1"))
    data = os.urandom(4096)
    assert client(credentials=store).push_blob(ref, digest=sha256_digest(data), size=len(data), data=data)
    assert client(credentials=store).blob_exists(ref, sha256_digest(data))
    assert log.read_text().splitlines()[0] == f"get {server.host}"
    # the same registry without the helper: refused (the test can fail)
    with pytest.raises(PermissionDenied):
        client().blob_exists(ref, sha256_digest(data))


def test_identity_token_from_a_creds_store(
    registry_factory: Callable[..., RegistryServer], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = registry_factory(auth="token", users={"bob": "pw"}, refresh_tokens={"refresh-123": "bob"})
    log = tmp_path / "helper.log"
    write_helper(tmp_path / "bin", "store", {server.host: {"Username": "<token>", "Secret": "refresh-123"}}, log)
    store = docker_config(tmp_path, {"credsStore": "store", "auths": {server.host: {}}}, monkeypatch)
    ref = Reference.parse(server.ref("team/app", "v1"))
    data = os.urandom(2048)
    assert client(credentials=store).push_blob(ref, digest=sha256_digest(data), size=len(data), data=data)
    assert server.token_server is not None
    grants = [r for r in server.token_server.requests if r["method"] == "POST"]  # refresh_token grants
    assert grants and all(r["ok"] and r["user"] == "bob" for r in grants)
    assert log.read_text().splitlines() == [f"get {server.host}"]


def settled(read: Callable[[], list[tuple[str, str, int]]]) -> list[tuple[str, str, int]]:
    """The proxy records a request once it relayed the answer: give it a moment to catch up."""
    deadline = time.monotonic() + 5
    while not read() and time.monotonic() < deadline:
        time.sleep(0.05)
    return read()


def test_cross_repository_mount_sends_no_bytes(registry: RegistryServer) -> None:
    base = f"mount-{uuid.uuid4().hex[:8]}"
    src = Reference.parse(registry.ref(f"{base}/previous", "v1"))
    data = os.urandom(3 * MiB)
    digest = sha256_digest(data)
    assert client().push_blob(src, digest=digest, size=len(data), data=data)

    host, port = registry.host.split(":")
    with FaultyProxy(host, int(port)) as proxy:
        dst = Reference.parse(f"{proxy.host}/{base}/moved:v2")
        pusher = client()
        pusher.add_mount_sources([Reference.parse(f"{proxy.host}/{base}/previous:v1")])
        sent: list[int] = []
        uploaded = pusher.push_blob(dst, digest=digest, size=len(data), data=data, progress=sent.append)
        assert uploaded is False and sum(sent) == 0
        assert pusher.mounted == [(digest, f"{base}/previous", f"{base}/moved")]
        assert proxy.body_bytes == 0  # not one byte of the blob went over the wire
        mounts = settled(lambda: [r for r in proxy.requests if r[0] == "POST"])
        assert len(mounts) == 1 and "mount=" in mounts[0][1] and mounts[0][2] == 201
        assert not [r for r in proxy.requests if r[0] in ("PATCH", "PUT")]
        # a blob the source does not have: 202, the session is dropped and the blob uploaded
        other = os.urandom(MiB)
        assert pusher.push_blob(dst, digest=sha256_digest(other), size=len(other), data=other)
        assert proxy.body_bytes == len(other)
    fetched = client().read_blob(Reference.parse(registry.ref(f"{base}/moved", "v2")), digest, max_size=4 * MiB)
    assert fetched == data
