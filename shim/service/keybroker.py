"""The namespace-key broker (`ks-agent key-broker`, a Deployment of `kubectl snapshot install`).

The only reader of the namespace keys Secret (through `SecretKeyProvider`); it answers the operations of
core/sealing's `NamespaceKey` (``key``: the key's id, made on a save's first use; ``wrap`` and ``unwrap``,
one or a list of items; ``mac``, a list) for the agents, and ``open`` (a restore's snapshot: its manifest
and config, checked against the digest the pod names; that restore's ``unwrap`` then opens only the data
keys that config lists, kept per node, pod and snapshot for `OPENED_S`), one JSON request each (wire
format: core/keyaccess.py),
and never sends a key out. Who gets an answer is core/keyaccess.decide's: the caller's bound token
(TokenReview with audience ``kubectl-snapshot-keys``) gives its node, the pod named by the request,
read from the API server, must be on that node (and for a restore name the snapshot asked for; a restore
into another namespace needs a SnapshotGrant of the key's namespace, read here).

Costs bounded as the metrics port's (shim/service/metrics_server.py, whose TLS server it uses): each
connection's handshake and request in a thread of its own under one deadline, at most a few connections
at once; bodies of at most `MAX_REQUEST_BYTES`; TokenReviews of tokens not seen lately at most
`REVIEWS_PER_S` a second and answered requests at most `REQUESTS_PER_S` (then 429, Retry-After). Answers
of reviews are cached by the token's sha256 for `TOKEN_CACHE_S` (a stolen token stops working when its
pod is deleted: at most that much later here).

Status codes: 200; 400 a malformed request; 401 no valid agent token; 403 refused (the reason in
``error``); 404 no such key; 409 an ``unwrap`` of a restore whose snapshot was not opened (again); 413 too
large; 422 a wrapped key that does not open; 429 too many; 503 the API server or the keys Secret
unavailable. A body larger than `MAX_REQUEST_BYTES` (an ``open``, up to `MAX_OPEN_BYTES`) is read only
once its token is known to be an agent's. An ``unwrap`` may carry the ``open``'s manifest and config
itself (what agents send: no replica then needs to have seen the open).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import json
import logging
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from kubectl_snapshot.core import keyaccess as KA
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import InvalidArgument, NotFound, SnapshotError
from kubectl_snapshot.core.provenance import Grant, parse_grant
from kubectl_snapshot.core.sealing import DecryptionFailed, KeyProvider
from shim.service.metrics_auth import RateLimit
from shim.service.metrics_server import TlsServer

log = logging.getLogger(__name__)
PORT = 8443
DEADLINE_S = 10.0
MAX_CONNECTIONS = 32
MAX_REQUEST_BYTES = KA.MAX_REQUEST_BYTES
PATH = KA.PATH
REVIEWS_PER_S, REVIEW_BURST = 10.0, 20
REQUESTS_PER_S, REQUEST_BURST = 200.0, 400
TOKEN_CACHE_S = 30.0
TOKEN_CACHE_MAX = 1024
OPENED_S = 3600.0  # an opened snapshot's data keys, kept for its restore (a lazy one reads for long)
OPENED_MAX = 256
DRAIN_S = 0.2


class BrokerApi(Protocol):
    """The API calls the broker makes (kubectl_snapshot.adapters.kube.KubeClient has them)."""

    def token_review(self, token: str, *, audiences: Sequence[str] = ()) -> dict[str, Any]: ...
    def get_pod(self, ns: str, name: str) -> dict[str, Any]: ...
    def list_snapshots(self, ns: str | None, *, label_selector: str | None = None) -> list[dict[str, Any]]: ...
    def list_snapshot_grants(self, ns: str) -> list[dict[str, Any]]: ...


@dataclass(frozen=True)
class Answer:
    code: int
    body: dict[str, Any]


def _error(code: int, message: str) -> Answer:
    return Answer(code, {"error": message})


class Broker:
    """Decides and answers one request (no HTTP here: `serve` puts it behind TLS)."""

    def __init__(
        self,
        kube: BrokerApi,
        keys: KeyProvider,
        *,
        agent_user: str = K.AGENT_USER,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kube, self.keys, self.agent_user, self.clock = kube, keys, agent_user, clock
        self._reviews = RateLimit(REVIEWS_PER_S, REVIEW_BURST, clock)
        self._requests = RateLimit(REQUESTS_PER_S, REQUEST_BURST, clock)
        self._lock = threading.Lock()
        self._callers: OrderedDict[str, tuple[float, KA.Caller]] = OrderedDict()
        # (node, pod uid, snapshot digest) -> (when opened, the snapshot's wrapped data keys)
        self._opened: OrderedDict[tuple[str, str, str], tuple[float, dict[str, str]]] = OrderedDict()

    def answer(self, authorization: str | None, raw: bytes) -> Answer:
        if not self._requests.take():
            return _error(429, "too many key requests, retry")
        token = _bearer(authorization)
        if token is None:
            return _error(401, "no bearer token (the agent's token for audience kubectl-snapshot-keys)")
        caller = self._caller(token)
        if not isinstance(caller, KA.Caller):
            return caller
        try:
            body = json.loads(raw)
            req = KA.parse_request(body)
        except (ValueError, InvalidArgument) as e:
            return _error(400, f"bad key request: {e}")
        if len(raw) > MAX_REQUEST_BYTES and req.op not in ("open", "unwrap"):
            return _error(413, f"a {req.op} request has at most {MAX_REQUEST_BYTES} bytes")
        try:
            verdict = self._decide(caller, req)
        except SnapshotError as e:
            log.warning("key request of node %s: cannot check it: %s", caller.node, e)
            return _error(503, f"cannot check the request with the API server: {e.message}")
        if not verdict.allowed:
            log.warning(
                "refused node %s %s/%s for %s: %s", caller.node, req.purpose, req.op, req.namespace, verdict.reason
            )
            return _error(403, verdict.reason)
        try:
            if req.op == "open":
                return self._open(caller, req, body)
            unwraps = _unwraps(body) if req.op == "unwrap" else None  # decoded once, checked, then answered
            if unwraps is not None:
                refused = self._unwrap_refused(caller, req, body, unwraps)
                if refused is not None:
                    return refused
            return self._operate(req, body, unwraps)
        except (InvalidArgument, binascii.Error, TypeError, ValueError) as e:
            return _error(400, f"bad {req.op} request: {e}")

    def agent(self, authorization: str | None) -> bool:
        """Whether `authorization` carries a valid agent token (before a large body is read)."""
        token = _bearer(authorization)
        return token is not None and isinstance(self._caller(token), KA.Caller)

    def _open(self, caller: KA.Caller, req: KA.KeyRequest, body: dict[str, Any]) -> Answer:
        asked = KA.snapshot_of(req.snapshot)
        keys = KA.opened_keys(asked, req.namespace, _unb64(body, "manifest"), _unb64(body, "config"))
        with self._lock:
            self._opened[(caller.node, req.pod_uid, str(asked.digest))] = (self.clock(), keys)
            while len(self._opened) > OPENED_MAX:
                self._opened.popitem(last=False)
        return Answer(200, {"blobs": len(keys)})

    def _unwrap_refused(
        self, caller: KA.Caller, req: KA.KeyRequest, body: dict[str, Any], unwraps: list[tuple[bytes, bytes]]
    ) -> Answer | None:
        """None when every (wrapped key, aad) of the unwrap is one of the restore's snapshot's own data keys,
        else the answer. The snapshot is the one the unwrap shows (its manifest and config: any replica
        answers it) or, for an agent of an earlier release, the one it opened before."""
        if "manifest" in body or "config" in body:
            keys = KA.opened_keys(
                KA.snapshot_of(req.snapshot), req.namespace, _unb64(body, "manifest"), _unb64(body, "config")
            )
        else:
            at = (caller.node, req.pod_uid, str(KA.snapshot_of(req.snapshot).digest))
            with self._lock:
                hit = self._opened.get(at)
            if hit is None or self.clock() - hit[0] > OPENED_S:
                return _error(409, f"open {req.snapshot} first (op open, with its manifest and config)")
            keys = hit[1]
        for wrapped, aad in unwraps:
            verdict = KA.may_unwrap(keys, req.namespace, _b64(wrapped), aad)
            if not verdict.allowed:
                where = f"{req.pod_ns}/{req.pod_name}"
                log.warning("refused node %s unwrap for %s: %s", caller.node, where, verdict.reason)
                return _error(403, verdict.reason)
        return None

    def _caller(self, token: str) -> KA.Caller | Answer:
        digest = hashlib.sha256(token.encode()).hexdigest()
        now = self.clock()
        with self._lock:
            hit = self._callers.get(digest)
            if hit is not None and now - hit[0] < TOKEN_CACHE_S:
                return hit[1]
        if not self._reviews.take():
            return _error(429, "too many new tokens, retry")
        try:
            review = self.kube.token_review(token, audiences=[KA.AUDIENCE])
        except SnapshotError as e:
            return _error(503, f"cannot review the token: {e.message}")
        caller = KA.caller_of(review, agent_user=self.agent_user)
        if not isinstance(caller, KA.Caller):
            return _error(401, caller.reason)
        with self._lock:
            self._callers[digest] = (now, caller)
            while len(self._callers) > TOKEN_CACHE_MAX:
                self._callers.popitem(last=False)
        return caller

    def _decide(self, caller: KA.Caller, req: KA.KeyRequest) -> KA.Verdict:
        try:
            pod: dict[str, Any] | None = self.kube.get_pod(req.pod_ns, req.pod_name)
        except NotFound:
            pod = None
        claimed: list[dict[str, Any]] = []
        annotations = ((pod or {}).get("metadata") or {}).get("annotations") or {}
        if (
            req.purpose == "restore"
            and not annotations.get(K.ANN_RESTORE_FROM)
            and annotations.get(K.ANN_RESUME_POLICY)
        ):
            claimed = self.kube.list_snapshots(req.pod_ns)
        grants: list[Grant] = []
        if pod is not None and req.pod_ns != req.namespace:  # a restore into another namespace: granted?
            grants = [g for g in map(parse_grant, self.kube.list_snapshot_grants(req.namespace)) if g is not None]
        return KA.decide(caller, req, pod, claimed, grants)

    def _operate(
        self, req: KA.KeyRequest, body: dict[str, Any], unwraps: list[tuple[bytes, bytes]] | None = None
    ) -> Answer:
        key_id = body.get("keyId")
        if key_id is not None and not isinstance(key_id, str):
            raise InvalidArgument("keyId is a string")
        try:
            key = self.keys.namespace_key(req.namespace, create=req.create, key_id=key_id or None)
        except NotFound as e:
            return _error(404, e.message)
        except SnapshotError as e:
            return _error(503, e.message)
        if req.op == "key":
            return Answer(200, {"keyId": key.key_id})
        if req.op == "wrap":
            items = KA.items_of(body, ("dek", "aad"))
            if items is not None:
                return Answer(200, {"keyId": key.key_id, "wrapped": [_b64(w) for w in key.wrap_many(items)]})
            return Answer(
                200, {"keyId": key.key_id, "wrapped": _b64(key.wrap(_unb64(body, "dek"), _unb64(body, "aad")))}
            )
        if req.op == "unwrap":
            try:
                deks = key.unwrap_many(unwraps if unwraps is not None else _unwraps(body))
            except DecryptionFailed as e:
                return _error(422, e.message)
            if "items" in body:
                return Answer(200, {"keyId": key.key_id, "deks": [_b64(d) for d in deks]})
            return Answer(200, {"keyId": key.key_id, "dek": _b64(deks[0])})
        data = body.get("data")
        if not isinstance(data, list) or not 0 < len(data) <= KA.MAX_MACS:
            raise InvalidArgument(f"data is a list of 1 to {KA.MAX_MACS} base64 strings")
        macs = [_b64(key.mac(base64.b64decode(str(d), validate=True))) for d in data]
        return Answer(200, {"keyId": key.key_id, "macs": macs})


def _bearer(authorization: str | None) -> str | None:
    if not authorization or not authorization.startswith("Bearer "):
        return None
    token = authorization[len("Bearer ") :].strip()
    return token if token and len(token) < 16384 else None


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _unwraps(body: dict[str, Any]) -> list[tuple[bytes, bytes]]:
    """An unwrap's (wrapped key, aad) pairs: its list of items, or the one at the top of the request."""
    items = KA.items_of(body, ("wrapped", "aad"))
    return items if items is not None else [(_unb64(body, "wrapped"), _unb64(body, "aad"))]


def _unb64(body: dict[str, Any], name: str) -> bytes:
    value = body.get(name)
    if not isinstance(value, str):
        raise InvalidArgument(f"{name} is a base64 string")
    return base64.b64decode(value, validate=True)


def serve(
    broker: Broker,
    *,
    host: str,
    port: int,
    cert_file: str,
    key_file: str,
    deadline_s: float = DEADLINE_S,
    max_connections: int = MAX_CONNECTIONS,
) -> ThreadingHTTPServer:
    """Start the HTTPS server in a daemon thread; returns it (``.shutdown()`` stops it)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            if self.path != KA.PATH:
                self._reply(_error(404, "not found"))
                return
            try:
                length = int(self.headers.get("Content-Length") or "-1")
            except ValueError:
                length = -1
            authorization = self.headers.get("Authorization")
            large = MAX_REQUEST_BYTES < length <= KA.MAX_OPEN_BYTES
            if not (0 <= length <= MAX_REQUEST_BYTES or large):
                self.close_connection = True
                self._reply(_error(413, f"a key request has a Content-Length of at most {KA.MAX_OPEN_BYTES} bytes"))
                self._drain()
                return
            if large and not broker.agent(authorization):  # a large body is read for an agent only
                self.close_connection = True
                self._reply(_error(401, "no valid agent token for a request of this size"))
                self._drain()
                return
            self._reply(broker.answer(authorization, self.rfile.read(length)))

        def _reply(self, answer: Answer) -> None:
            data = json.dumps(answer.body).encode()
            self.send_response(answer.code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if answer.code == 429:
                self.send_header("Retry-After", "1")
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("key broker: " + format, *args)

        def _drain(self) -> None:
            """What the client sent already, read (a little, briefly) and dropped: closing with unread bytes
            would reset the connection, and the client might lose the answer."""
            self.wfile.flush()
            self.connection.settimeout(DRAIN_S)
            with contextlib.suppress(OSError, ValueError):
                left = MAX_REQUEST_BYTES
                while left > 0 and (chunk := self.connection.recv(min(left, 16384))):
                    left -= len(chunk)

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert_file, key_file)
    server = TlsServer((host, port), Handler, ctx, deadline_s=deadline_s, max_connections=max_connections)
    threading.Thread(target=server.serve_forever, name="key-broker", daemon=True).start()
    return server
