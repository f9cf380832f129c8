"""Credential sources and WWW-Authenticate parsing (pure logic; the flows run against a real
registry in tests/integration/test_registry_client.py)."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from kubectl_snapshot.adapters.registry.auth import (
    Credentials,
    CredentialStore,
    parse_challenges,
    scope_for,
)
from kubectl_snapshot.adapters.registry.transport import RetryPolicy
from kubectl_snapshot.adapters.registry.upload import Progress
from kubectl_snapshot.core.errors import InvalidArgument, PermissionDenied


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_docker_config_entries(tmp_path: Path) -> None:
    config = {
        "auths": {
            "https://index.docker.io/v1/": {"auth": b64("hub:pw:with:colons")},
            "http://127.0.0.1:5000": {"username": "u", "password": "p"},
            "reg.example": {"auth": b64("x:y"), "identitytoken": "refresh"},
            "tok.example": {"auth": b64("<token>:refresh2")},
            "empty.example": {},
        },
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    store = CredentialStore.from_docker_config(str(path))
    assert store.lookup("docker.io") == Credentials("hub", "pw:with:colons")
    assert store.lookup("registry-1.docker.io") == Credentials("hub", "pw:with:colons")
    assert store.lookup("127.0.0.1:5000") == Credentials("u", "p")
    assert store.lookup("reg.example") == Credentials(username="x", identity_token="refresh")
    assert store.lookup("tok.example") == Credentials(identity_token="refresh2")
    assert store.lookup("empty.example") is None
    assert store.lookup("other.example") is None
    assert "pw" not in repr(store.lookup("docker.io"))  # secrets stay out of logs


def test_docker_config_env_and_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    assert CredentialStore.from_docker_config().registries() == []
    (tmp_path / "config.json").write_text(json.dumps({"auths": {"r.example": {"auth": b64("a:b")}}}))
    assert CredentialStore.from_docker_config().lookup("r.example") == Credentials("a", "b")
    monkeypatch.delenv("DOCKER_CONFIG")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert CredentialStore.from_docker_config().registries() == []


@pytest.mark.parametrize(
    "payload",
    [b"not json", b'{"auths": []}', json.dumps({"auths": {"r": {"auth": b64("nocolon")}}}).encode()],
)
def test_bad_configs_are_invalid_argument(payload: bytes) -> None:
    with pytest.raises(InvalidArgument) as info:
        CredentialStore.from_dockerconfigjson(payload)
    assert info.value.hint


def test_dockerconfigjson_legacy_and_explicit() -> None:
    legacy = CredentialStore.from_dockerconfigjson(json.dumps({"r.example": {"auth": b64("a:b")}}).encode())
    assert legacy.lookup("r.example") == Credentials("a", "b")
    explicit = legacy.with_explicit("R.Example", "c", "d")
    assert explicit.lookup("r.example") == Credentials("c", "d")
    assert legacy.lookup("r.example") == Credentials("a", "b")  # immutable


def test_parse_challenges() -> None:
    (basic,) = parse_challenges('Basic realm="basic-realm"')
    assert basic.scheme == "basic" and basic.params["realm"] == "basic-realm"
    (bearer,) = parse_challenges(
        'Bearer realm="https://auth.example/token",service="registry.example",'
        'scope="repository:a/b:pull,push",error="insufficient_scope"'
    )
    assert bearer.scheme == "bearer"
    assert dict(bearer.params) == {
        "realm": "https://auth.example/token",
        "service": "registry.example",
        "scope": "repository:a/b:pull,push",
        "error": "insufficient_scope",
    }
    both = parse_challenges('Basic realm="x", Bearer realm="y", service=svc')
    assert [c.scheme for c in both] == ["basic", "bearer"]
    assert dict(both[1].params) == {"realm": "y", "service": "svc"}
    assert parse_challenges('Bearer realm="a \\"quoted\\" b"')[0].params["realm"] == 'a "quoted" b'
    assert parse_challenges("") == []


def test_scope_for() -> None:
    assert scope_for("a/b", "GET") == "repository:a/b:pull"
    assert scope_for("a/b", "head") == "repository:a/b:pull"
    assert scope_for("a/b", "PATCH") == "repository:a/b:pull,push"
    assert scope_for("a/b", "DELETE") == "repository:a/b:delete"


def test_retry_policy_backoff_and_retry_after() -> None:
    policy = RetryPolicy(retries=4, backoff=0.5, max_backoff=3.0)
    assert [policy.delay(i, None) for i in range(4)] == [0.5, 1.0, 2.0, 3.0]
    assert policy.delay(0, 7.0) == 7.0
    assert policy.delay(0, 3600.0) == 30.0  # capped


def test_progress_never_double_counts_after_restart() -> None:
    seen: list[int] = []
    progress = Progress(seen.append)
    progress.add(10)
    progress.add(5)
    progress.restart()
    progress.add(12)  # below the high-water mark: nothing reported
    progress.add(8)
    assert seen == [10, 5, 5]
    assert sum(seen) == 20


# --- docker credential helpers -------------------------------------------------------------------------


def write_helper(bin_dir: Path, name: str, answers: dict[str, str], log: Path) -> None:
    """A docker-credential-NAME that logs what it was asked and answers from a table (like a keychain)."""
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / f"docker-credential-{name}"
    exe.write_text(
        "#!/usr/bin/env python3\n"
        "import json, sys\n"
        f"answers = {answers!r}\n"
        "server = sys.stdin.read().strip()\n"
        f"open({str(log)!r}, 'a').write(sys.argv[1] + ' ' + server + '\\n')\n"
        "if server not in answers:\n"
        "    print('credentials not found in native keychain'); sys.exit(1)\n"
        "if answers[server] == 'BROKEN':\n"
        "    print('keychain is locked', file=sys.stderr); sys.exit(3)\n"
        "user, _, secret = answers[server].partition(':')\n"
        "print(json.dumps({'ServerURL': server, 'Username': user, 'Secret': secret}))\n"
    )
    exe.chmod(0o755)


def test_credential_helpers_as_docker_runs_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "helper.log"
    bins = tmp_path / "bin"
    write_helper(bins, "ecr-login", {"123.dkr.ecr.example:443": "AWS:ecr-pass"}, log)
    write_helper(
        bins,
        "store",
        {"https://index.docker.io/v1/": "hub:hub-pass", "acr.example": "<token>:refresh-tok", "bad.example": "BROKEN"},
        log,
    )
    monkeypatch.setenv("PATH", f"{bins}:/usr/bin:/bin")
    config = {
        "auths": {"plain.example": {"auth": b64("p:q")}, "acr.example": {}},
        "credHelpers": {"123.dkr.ecr.example:443": "ecr-login", "missing.example": "nothere"},
        "credsStore": "store",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    store = CredentialStore.from_docker_config(str(tmp_path / "config.json"))
    # credHelpers[registry] first
    assert store.lookup("123.dkr.ecr.example:443") == Credentials("AWS", "ecr-pass")
    # credsStore for the rest; Docker Hub is asked by its legacy URL; <token> is an identity token
    assert store.lookup("docker.io") == Credentials("hub", "hub-pass")
    assert store.lookup("acr.example") == Credentials(identity_token="refresh-tok")
    # the store has nothing: the auths entry, else anonymous
    assert store.lookup("plain.example") == Credentials("p", "q")
    assert store.lookup("anon.example") is None
    # each registry asked once, with `get`
    store.lookup("docker.io")
    asked = log.read_text().splitlines()
    assert asked.count("get https://index.docker.io/v1/") == 1 and "get 123.dkr.ecr.example:443" in asked
    with pytest.raises(PermissionDenied) as failed:
        store.lookup("bad.example")
    assert "keychain is locked" in failed.value.message and "docker-credential-store" in failed.value.message
    with pytest.raises(PermissionDenied) as missing:
        store.lookup("missing.example")
    assert "docker-credential-nothere" in missing.value.message and missing.value.hint
    # flags beat helpers
    assert store.with_explicit("docker.io", "flag", "pw").lookup("docker.io") == Credentials("flag", "pw")


def test_stale_creds_store_falls_back_to_auths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    config = {"auths": {"r.example": {"auth": b64("a:b")}}, "credsStore": "desktop"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    store = CredentialStore.from_docker_config(str(tmp_path / "config.json"))
    assert store.lookup("r.example") == Credentials("a", "b") and store.lookup("o.example") is None


def test_secrets_never_run_helpers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dockerconfigjson Secret is tenant data: the agent (root) must not run a program it names."""
    log = tmp_path / "helper.log"
    write_helper(tmp_path / "bin", "evil", {"r.example": "x:y"}, log)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    secret = json.dumps({"auths": {}, "credsStore": "evil", "credHelpers": {"r.example": "evil"}}).encode()
    assert CredentialStore.from_dockerconfigjson(secret).lookup("r.example") is None
    assert not log.exists()
