"""The agent's metrics and who may read them (shim/metrics.py, shim/metrics_server.py).

The review API is a fake here (the decisions are the API server's; tests/e2e/test_operability.py
scrapes the real agent with real tokens); the HTTPS server, its certificate and the exposition are real.
"""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request
from typing import Any

import pytest

from shim.metrics import AgentMetrics
from shim.metrics_server import Authorizer, serve


class FakeReviews:
    def __init__(self) -> None:
        self.users = {"good": "system:serviceaccount:mon:prometheus", "nosy": "system:serviceaccount:t:app"}
        self.allowed = {"system:serviceaccount:mon:prometheus"}
        self.calls = 0

    def token_review(self, token: str) -> dict[str, Any]:
        self.calls += 1
        user = self.users.get(token)
        return {"status": {"authenticated": bool(user), "user": {"username": user or "", "groups": ["g"]}}}

    def subject_access_review(self, user: dict[str, Any], *, path: str, verb: str) -> dict[str, Any]:
        self.calls += 1
        assert (path, verb) == ("/metrics", "get")
        return {"status": {"allowed": user["username"] in self.allowed}}


def test_decisions_and_their_cache() -> None:
    api, now = FakeReviews(), [0.0]
    auth = Authorizer(api, clock=lambda: now[0])
    assert auth.check(None).code == 401
    assert auth.check("Basic abc").code == 401
    assert auth.check("Bearer unknown").code == 401
    assert auth.check("Bearer nosy").code == 403
    assert auth.check("Bearer good").code == 200
    calls = api.calls
    assert auth.check("Bearer good").code == 200 and api.calls == calls  # cached
    api.allowed.clear()  # the binding was removed: within a minute the scraper is refused
    now[0] += 61
    assert auth.check("Bearer good").code == 403


def test_metrics_record_saves_restores_and_ages() -> None:
    now = [1000.0]
    m = AgentMetrics(clock=lambda: now[0])
    m.saved("a", "p", timings_ms={"freeze_ms": 120, "dump_ms": 300, "upload_ms": 900}, size=1000, uploaded=400)
    m.save_failed()
    m.restored(2.5)
    now[0] += 30
    r = m.registry
    assert r.get_sample_value("kubectl_snapshot_saves_total", {"result": "succeeded"}) == 1
    assert r.get_sample_value("kubectl_snapshot_saves_total", {"result": "failed"}) == 1
    assert r.get_sample_value("kubectl_snapshot_restores_total", {"result": "succeeded"}) == 1
    assert r.get_sample_value("kubectl_snapshot_freeze_seconds_sum") == pytest.approx(0.12)
    assert r.get_sample_value("kubectl_snapshot_uploaded_bytes_total") == 400
    assert r.get_sample_value("kubectl_snapshot_skipped_bytes_total") == 600
    assert r.get_sample_value("kubectl_snapshot_last_save_age_seconds", {"namespace": "a", "pod": "p"}) == 30


def _get(port: int, token: str | None) -> tuple[int, str]:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # self-signed, as scrapers are told
    req = urllib.request.Request(f"https://127.0.0.1:{port}/metrics")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


def test_https_server_serves_only_authorised_scrapers() -> None:
    m = AgentMetrics()
    m.saved("a", "p", timings_ms={}, size=1, uploaded=1)
    server = serve(m.registry, Authorizer(FakeReviews()), host="127.0.0.1", port=0, names=["n1", "127.0.0.1"])
    port = server.server_address[1]
    try:
        assert _get(port, None)[0] == 401
        assert _get(port, "nosy")[0] == 403
        code, text = _get(port, "good")
        assert code == 200 and "kubectl_snapshot_saves_total" in text
        cert = ssl.get_server_certificate(("127.0.0.1", port))
        assert "BEGIN CERTIFICATE" in cert
    finally:
        server.shutdown()
