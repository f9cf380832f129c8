"""The registry client's HTTP session: a connection per chunk worker kept alive, and the environment
read once where requests would find the same on every request (tests/support/registry.py's registry
answers the requests end to end in tests/integration)."""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from kubectl_snapshot.adapters.registry import RegistryClient
from kubectl_snapshot.adapters.registry.transport import POOL_SIZE, read_environment_once

PROXY_VARS = (
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "no_proxy",
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "ALL_PROXY",
    "NO_PROXY",
)


@pytest.fixture
def plain_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    for v in (*PROXY_VARS, "NETRC", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    return monkeypatch


def test_the_clients_session_keeps_a_connection_per_worker_and_reads_no_environment(
    plain_env: pytest.MonkeyPatch,
) -> None:
    session = RegistryClient(plain_http=True).transport.session
    assert session.trust_env is False and session.verify is True
    for prefix in ("http://", "https://"):
        assert session.get_adapter(prefix + "registry.example")._pool_maxsize == POOL_SIZE  # type: ignore[attr-defined]


def test_a_ca_bundle_from_the_environment_still_verifies(plain_env: pytest.MonkeyPatch) -> None:
    plain_env.setenv("REQUESTS_CA_BUNDLE", "/etc/ssl/corp.pem")
    session = requests.Session()
    read_environment_once(session)
    assert session.trust_env is False and session.verify == "/etc/ssl/corp.pem"


@pytest.mark.parametrize("var", ["HTTPS_PROXY", "https_proxy", "NO_PROXY", "ALL_PROXY"])
def test_proxy_settings_keep_requests_reading_them_per_request(plain_env: pytest.MonkeyPatch, var: str) -> None:
    """no_proxy is decided per host, redirects included: requests keeps doing that."""
    plain_env.setenv(var, "http://proxy.corp:3128" if "NO" not in var else "registry.corp")
    session = requests.Session()
    read_environment_once(session)
    assert session.trust_env is True


def test_a_netrc_file_keeps_requests_reading_it(plain_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / ".netrc").write_text("machine registry.corp login u password p\n")
    session = requests.Session()
    read_environment_once(session)
    assert session.trust_env is True
