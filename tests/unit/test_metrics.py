"""The agent's metrics and who may read them (shim/service/metrics.py, shim/service/metrics_server.py).

The review API is a fake here (the decisions are the API server's; tests/e2e/test_operability.py
scrapes the real agent with real tokens); the HTTPS server, its certificate and the exposition are real.
"""

from __future__ import annotations

import secrets
import socket
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest

from shim.service.metrics import AgentMetrics
from shim.service.metrics_auth import DEFAULT_AUDIENCES, REVIEW_BURST, REVIEWS_PER_S
from shim.service.metrics_server import Authorizer, audiences_of, serve

API_AUDIENCE = "https://kubernetes.default.svc"  # what a token is issued for unless asked otherwise


class FakeReviews:
    """The API server's answers: a token is its identity and the audiences it was issued for."""

    def __init__(self) -> None:
        self.tokens = {
            "good": ("system:serviceaccount:mon:prometheus", {"kubectl-snapshot-metrics"}),
            "nosy": ("system:serviceaccount:t:app", {"kubectl-snapshot-metrics"}),
            "api-only": ("system:serviceaccount:mon:prometheus", {API_AUDIENCE}),  # an ordinary API token
        }
        self.allowed = {"system:serviceaccount:mon:prometheus"}
        self.calls = 0
        self.reviews: list[tuple[str, ...]] = []  # the audiences each TokenReview asked for

    def token_review(self, token: str, *, audiences: Sequence[str] = ()) -> dict[str, Any]:
        self.calls += 1
        self.reviews.append(tuple(audiences))
        user, issued_for = self.tokens.get(token, ("", set()))
        valid_for = issued_for & set(audiences or [API_AUDIENCE])
        status = {"authenticated": bool(user and valid_for), "audiences": sorted(valid_for)}
        return {"status": {**status, "user": {"username": user, "groups": ["g"]} if status["authenticated"] else {}}}

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


def _get(port: int, token: str | None, timeout: float = 10) -> tuple[int, str]:
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE  # self-signed, as scrapers are told
    req = urllib.request.Request(f"https://127.0.0.1:{port}/metrics")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=timeout) as resp:
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


def test_token_reviews_ask_for_the_metrics_audience_and_an_api_token_is_refused() -> None:
    """A token made for the agent's metrics is worthless to the API server, and an ordinary API token
    (a pod's, leaked) reads no metrics, even of an identity allowed to."""
    api = FakeReviews()
    auth = Authorizer(api)
    assert auth.check("Bearer good").code == 200
    assert auth.check("Bearer api-only").code == 401
    assert api.reviews == [DEFAULT_AUDIENCES, DEFAULT_AUDIENCES] == [("kubectl-snapshot-metrics",)] * 2
    # configurable; empty: the API server's own audiences (the API token is then enough)
    api = FakeReviews()
    assert Authorizer(api, audiences=audiences_of("")).check("Bearer api-only").code == 200
    assert api.reviews == [()]
    assert audiences_of(" a, b,,") == ("a", "b")


def test_an_authenticator_that_ignores_audiences_is_not_trusted_with_them() -> None:
    class Deaf(FakeReviews):
        def token_review(self, token: str, *, audiences: Sequence[str] = ()) -> dict[str, Any]:
            answer = super().token_review(token, audiences=())  # validated as an API token
            answer["status"].pop("audiences")
            return answer

    assert Authorizer(Deaf()).check("Bearer api-only").code == 401


def test_a_flood_of_made_up_tokens_costs_a_bounded_number_of_reviews() -> None:
    api, now = FakeReviews(), [0.0]
    auth = Authorizer(api, clock=lambda: now[0])
    assert auth.check("Bearer good").code == 200  # a scraper known before the flood
    api.reviews.clear()
    codes = [auth.check(f"Bearer {secrets.token_hex(16)}").code for _ in range(1000)]
    assert len(api.reviews) <= REVIEW_BURST and codes.count(429) >= 1000 - REVIEW_BURST
    assert auth.check("Bearer good").code == 200  # its answer is cached apart: the flood did not push it out
    now[0] += 1.0  # a second later: a few more reviews, not a thousand
    for _ in range(1000):
        auth.check(f"Bearer {secrets.token_hex(16)}")
    assert len(api.reviews) <= REVIEW_BURST + REVIEWS_PER_S
    # the same bad token again within a few seconds costs nothing; after the short negative TTL, one review
    reviewed = len(api.reviews)
    now[0] += 10.0
    assert auth.check("Bearer nobody").code == 401 and auth.check("Bearer nobody").code == 401
    assert len(api.reviews) == reviewed + 1
    now[0] += 11.0
    assert auth.check("Bearer nobody").code == 401 and len(api.reviews) == reviewed + 2


@contextmanager
def _server(**kw: Any) -> Iterator[int]:
    server = serve(AgentMetrics().registry, Authorizer(FakeReviews()), host="127.0.0.1", port=0, names=["n1"], **kw)
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_a_client_that_connects_and_says_nothing_does_not_hold_up_another_scrape() -> None:
    with _server() as port, socket.create_connection(("127.0.0.1", port), timeout=5):
        time.sleep(0.2)  # the silent connection is accepted first
        assert _get(port, "good", timeout=5)[0] == 200


def test_a_silent_connection_is_cut_at_the_deadline_and_extra_ones_at_once() -> None:
    with _server(deadline_s=1.0, max_connections=2) as port:
        silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
        time.sleep(0.2)
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as extra:
            assert extra.recv(1) == b""  # no slot left: closed at once, without a handshake
        assert time.monotonic() - started < 0.9
        for s in silent:
            assert s.recv(1) == b""  # cut by the watchdog
            s.close()
        assert time.monotonic() - started < 3
        assert _get(port, "good", timeout=5)[0] == 200  # their slots are free again
