"""Who may read the agent's metrics: the API server decides, at a bounded cost to it.

As controller-runtime's secure metrics serving does: the scraper presents a bearer token; the API
server says who it is (TokenReview) and whether that identity may ``get`` the non-resource URL
``/metrics`` (SubjectAccessReview). The agent decides nothing itself, except what it asks and how often:

- **Audiences.** The TokenReview names the audiences a scraper's token must be issued for
  (`DEFAULT_AUDIENCES`, the agent's ``--metrics-token-audiences``), and the answer must name one of
  them. A token made for the agent's metrics is then refused by the API server itself, so neither
  the agent nor whoever reads its traffic (its certificate is self-signed) can replay it there, and
  an ordinary API token a pod leaks does not read metrics. An empty list asks for the API server's
  own audiences (any API token of an authorised identity).
- **Cost.** Answers are cached by the token's sha256, never the token: those for a known identity
  (200 or 403) for `KNOWN_S`, unauthenticated ones for `UNKNOWN_S`, in two bounded maps so that a
  flood of made-up tokens cannot push a scraper's answer out. Tokens not in the cache are reviewed
  at most `REVIEWS_PER_S` a second (burst `REVIEW_BURST`); beyond that the answer is 429 and the API
  server is not asked. A failed review is not cached (an API server outage must not lock a scraper
  out for a minute).

Status codes: 401 without a valid token, 403 when the identity may not read metrics, 429 when too
many unknown tokens arrive at once, 200 otherwise.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kubectl_snapshot.core.errors import SnapshotError

log = logging.getLogger(__name__)
METRICS_PATH = "/metrics"
DEFAULT_AUDIENCES = ("kubectl-snapshot-metrics",)
KNOWN_S = 60.0  # a scrape every few seconds costs the API server two requests a minute
UNKNOWN_S = 10.0
KNOWN_MAX = 256
UNKNOWN_MAX = 4096
REVIEWS_PER_S = 5.0
REVIEW_BURST = 10


class ReviewApi(Protocol):
    """The two API calls the server needs (kubectl_snapshot.adapters.kube.KubeClient has them)."""

    def token_review(self, token: str, *, audiences: Sequence[str] = ()) -> dict[str, Any]: ...
    def subject_access_review(self, user: dict[str, Any], *, path: str, verb: str) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Decision:
    code: int  # 200, 401, 403 or 429
    who: str


class RateLimit:
    """A token bucket: `rate` a second, at most `burst` at once."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float]) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self._tokens, self._at = float(burst), clock()
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            now = self.clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.rate)
            self._at = now
            if self._tokens < 1:
                return False
            self._tokens -= 1
            return True


class _Answers:
    """At most `size` answers, each for `ttl` seconds; the least recently used goes first."""

    def __init__(self, size: int, ttl: float) -> None:
        self.size, self.ttl = size, ttl
        self._items: OrderedDict[str, tuple[float, Decision]] = OrderedDict()

    def get(self, key: str, now: float) -> Decision | None:
        hit = self._items.get(key)
        if hit is None or now - hit[0] >= self.ttl:
            return None
        self._items.move_to_end(key)
        return hit[1]

    def put(self, key: str, now: float, decision: Decision) -> None:
        self._items[key] = (now, decision)
        self._items.move_to_end(key)
        while len(self._items) > self.size:
            self._items.popitem(last=False)


class Authorizer:
    def __init__(
        self,
        api: ReviewApi,
        *,
        audiences: Sequence[str] = DEFAULT_AUDIENCES,
        reviews_per_s: float = REVIEWS_PER_S,
        burst: int = REVIEW_BURST,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api, self.audiences, self.clock = api, tuple(audiences), clock
        self._known = _Answers(KNOWN_MAX, KNOWN_S)
        self._unknown = _Answers(UNKNOWN_MAX, UNKNOWN_S)
        self._limit = RateLimit(reviews_per_s, burst, clock)
        self._lock = threading.Lock()

    def check(self, authorization: str | None) -> Decision:
        if not authorization or not authorization.startswith("Bearer ") or len(authorization) < 8:
            return Decision(401, "")
        token = authorization[len("Bearer ") :].strip()
        key = hashlib.sha256(token.encode()).hexdigest()
        now = self.clock()
        with self._lock:
            hit = self._known.get(key, now) or self._unknown.get(key, now)
        if hit is not None:
            return hit
        if not self._limit.take():
            return Decision(429, "")
        decision = self._review(token)
        if decision is None:
            return Decision(401, "")
        with self._lock:
            (self._unknown if decision.code == 401 else self._known).put(key, now, decision)
        return decision

    def _review(self, token: str) -> Decision | None:
        """The API server's answer; None when it could not be asked."""
        try:
            tr = self.api.token_review(token, audiences=self.audiences)
        except SnapshotError as e:
            log.warning("metrics: TokenReview failed: %s", e)
            return None
        status = tr.get("status") or {}
        if not status.get("authenticated"):
            return Decision(401, "")
        # an authenticator that ignores audiences answers without them: not good enough
        if self.audiences and not set(self.audiences) & set(status.get("audiences") or ()):
            return Decision(401, "")
        user = status.get("user") or {}
        who = str(user.get("username") or "")
        try:
            sar = self.api.subject_access_review(user, path=METRICS_PATH, verb="get")
        except SnapshotError as e:
            log.warning("metrics: SubjectAccessReview for %s failed: %s", who, e)
            return None
        return Decision(200 if (sar.get("status") or {}).get("allowed") else 403, who)
