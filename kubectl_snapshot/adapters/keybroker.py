"""`BrokerKeyProvider`: the `KeyProvider` port of core/sealing.py answered by the key broker
(shim/service/keybroker.py, deployed by `kubectl snapshot install` unless --no-key-broker).

The agent never holds a namespace key: each operation is one HTTPS request (wire format:
core/keyaccess.py) carrying the agent pod's projected token for audience ``kubectl-snapshot-keys``
(read again for every request: the kubelet rotates it), the pod whose save or restore it is for
(`KeyUse`) and, for a restore, the snapshot opened. The broker's certificate is pinned (the install's
ConfigMap). Errors: the broker unreachable or failing -> Unavailable ("keys unavailable", retryable);
refused -> PermissionDenied with the broker's reason; no such key -> NotFound; a wrapped key that does
not open -> DecryptionFailed.
"""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from kubectl_snapshot.core import keyaccess as KA
from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, Unavailable
from kubectl_snapshot.core.sealing import DecryptionFailed, KeyUse, NamespaceKey

TIMEOUT_S = 30.0
BUSY_RETRIES = 30  # a save of many chunks waits for the broker's rate bound rather than failing
BUSY_WAIT_S = 1.0
# a broker that cannot be reached is asked again for this long (a replica restarting or rescheduled, say
# by a drain of its node) before a save or restore fails as "keys unavailable"
UNREACHABLE_WAIT_S = 15.0
UNREACHABLE_RETRY_S = 1.0


class _NotOpened(Exception):
    """The broker holds no opened snapshot for this restore (it restarted, or forgot it): open it again."""


class _Busy(Exception):
    """The broker answered 429 (too many requests): wait and ask again."""


class _Unreachable(Exception):
    """No connection to the broker (refused, reset, timed out): wait and ask again, for a while."""


_HINT = (
    "the key broker answers the agents' key requests: kubectl -n kubectl-snapshot-system get pods"
    " -l app.kubernetes.io/name=kubectl-snapshot-key-broker (and its logs)"
)


class BrokerKeyProvider:
    """Namespace keys held by the key broker; each key operation is a request to it."""

    def __init__(
        self,
        url: str,
        *,
        token_file: str = f"{K.KEY_BROKER_TOKEN_DIR}/token",
        ca_file: str = f"{K.KEY_BROKER_CA_DIR}/ca.crt",
        timeout_s: float = TIMEOUT_S,
        unreachable_s: float = UNREACHABLE_WAIT_S,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme != "https" or not parts.hostname:
            raise InvalidArgument(f"the key broker's URL must be https://HOST:PORT, got {url!r}")
        self.url, self.host, self.port = url, parts.hostname, parts.port or 443
        self.token_file, self.ca_file, self.timeout_s, self.sleep = token_file, ca_file, timeout_s, sleep
        self.unreachable_s, self.clock = unreachable_s, clock

    def namespace_key(
        self, namespace: str, *, create: bool, key_id: str | None = None, use: KeyUse | None = None
    ) -> NamespaceKey:
        if use is None:
            raise FailedPrecondition(
                f"the key of namespace {namespace!r} is asked for no pod's save or restore",
                hint="with the key broker, keys are released only for a save or restore of a pod on this node",
            )
        key = BrokerNamespaceKey(self, namespace, use, key_id)
        answer = key.call("key", create=create and use.purpose == "save")
        key.bind(str(answer.get("keyId") or ""))
        return key

    def post(self, body: dict[str, Any]) -> dict[str, Any]:
        """One request; a 429 (the broker's rate bound) is waited out and sent again, `BUSY_RETRIES` times,
        and a broker that cannot be reached is asked again for `unreachable_s`."""
        busy = 0
        give_up_at = self.clock() + self.unreachable_s
        while True:
            try:
                return self._post(body, last=busy >= BUSY_RETRIES, reachable_only=self.clock() >= give_up_at)
            except _Busy:
                busy += 1
                self.sleep(BUSY_WAIT_S)
            except _Unreachable:
                self.sleep(UNREACHABLE_RETRY_S)

    def _post(self, body: dict[str, Any], *, last: bool = False, reachable_only: bool = True) -> dict[str, Any]:
        """`reachable_only`: a connection that fails is the caller's error (else _Unreachable: ask again)."""
        who = body.get("pod") or {}
        pod = f"{who.get('namespace') or body.get('namespace')}/{who.get('name')}"
        what = f"{body.get('op')} for the {body.get('purpose')} of pod {pod}"
        try:
            with open(self.token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as e:
            raise Unavailable(
                f"keys unavailable: cannot read the agent's token for the key broker ({self.token_file}): {e.strerror}",
                hint="an install with the key broker mounts it into the agent; reinstall, or check the DaemonSet",
            ) from None
        data = json.dumps(body).encode()
        try:
            ctx = ssl.create_default_context(cafile=self.ca_file)
            conn = http.client.HTTPSConnection(self.host, self.port, timeout=self.timeout_s, context=ctx)
            try:
                conn.request(
                    "POST",
                    KA.PATH,
                    body=data,
                    headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
                )
                resp = conn.getresponse()
                raw = resp.read(KA.MAX_REQUEST_BYTES * 2)
                code = resp.status
            finally:
                conn.close()
        except (OSError, ssl.SSLError, http.client.HTTPException) as e:
            if not reachable_only and not isinstance(e, ssl.SSLCertVerificationError):  # not trusted: at once
                raise _Unreachable() from None
            raise Unavailable(
                f"keys unavailable: the key broker at {self.url} cannot be reached ({what}): {e}",
                hint=_HINT,
                retryable=True,
            ) from None
        try:
            answer = json.loads(raw) if raw else {}
        except ValueError:
            answer = {}
        if not isinstance(answer, dict):
            answer = {}
        message = str(answer.get("error") or f"HTTP {code}")
        if code == 200:
            return answer
        if code == 403:
            raise PermissionDenied(f"the key broker refused the {what}: {message}", hint="a node's agent gets the "
                                   "keys of its own node's pods only, for their save or restore")  # fmt: skip
        if code == 404:
            raise NotFound(f"the key broker has no such key ({what}): {message}")
        if code == 429 and not last:
            raise _Busy()
        if code == 409 and body.get("op") == "unwrap":
            raise _NotOpened()
        if code == 422:
            raise DecryptionFailed(message, hint="the snapshot was tampered with or sealed with another key")
        raise Unavailable(
            f"keys unavailable: the key broker answered {code} to the {what}: {message}",
            hint=_HINT,
            retryable=code in (429, 503),
        )


class _Slot:
    def __init__(self, item: bytes) -> None:
        self.item = item
        self.woken = threading.Event()
        self.lead = False
        self.result: bytes | None = None
        self.error: BaseException | None = None

    def outcome(self) -> bytes:
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


class _Coalesced:
    """One item's call of `many` (a list's request) from several threads at once, made in as few requests
    as they allow: while a request is in flight, the items other threads ask for wait, and go together
    in the next (at most `limit`), sent by one of them; a caller with no request in flight sends at once.
    A save seals its chunks on several workers, each chunk's key a `mac` of the broker: one request per
    chunk before, one per wave of workers now. A failed request fails the calls whose items it held."""

    def __init__(self, many: Callable[[Sequence[bytes]], list[bytes]], limit: int) -> None:
        self._many, self._limit = many, max(1, limit)
        self._lock = threading.Lock()
        self._waiting: list[_Slot] = []
        self._busy = False
        self.requests = 0  # sent so far (for the tests and the curious)

    def __call__(self, item: bytes) -> bytes:
        slot = _Slot(item)
        with self._lock:
            self._waiting.append(slot)
            lead, self._busy = not self._busy, True
        if not lead:
            slot.woken.wait()  # its result came, or the request before it ended and it sends the next
            if not slot.lead:
                return slot.outcome()
        with self._lock:  # the first waiting slot is this one: nothing is taken from the list but here
            batch, self._waiting = self._waiting[: self._limit], self._waiting[self._limit :]
            self.requests += 1
        try:
            results = self._many([s.item for s in batch])  # as many as asked (mac_many checks the answer)
            for s, r in zip(batch, results, strict=True):
                s.result = r
        except BaseException as e:
            for s in batch:
                s.error = e
        finally:
            with self._lock:
                nxt = self._waiting[0] if self._waiting else None
                self._busy = nxt is not None
            for s in batch:
                if s is not slot:
                    s.woken.set()
            if nxt is not None:  # the next request goes from a thread that waits for it
                nxt.lead = True
                nxt.woken.set()
        return slot.outcome()


class BrokerNamespaceKey:
    """One namespace's key as the broker holds it, for one pod's save or restore."""

    def __init__(self, provider: BrokerKeyProvider, namespace: str, use: KeyUse, key_id: str | None) -> None:
        self.provider, self.namespace, self.use = provider, namespace, use
        self._key_id = key_id or ""
        self._mac = _Coalesced(self.mac_many, KA.MAX_MACS)

    def bind(self, key_id: str) -> None:
        if not key_id:
            raise Unavailable("keys unavailable: the key broker named no key id", hint=_HINT)
        self._key_id = key_id

    @property
    def key_id(self) -> str:
        return self._key_id

    def call(self, op: str, *, create: bool = False, **payload: Any) -> dict[str, Any]:
        use = self.use
        req = KA.KeyRequest(
            purpose=use.purpose,
            op=op,
            namespace=self.namespace,
            pod_name=use.pod_name,
            pod_uid=use.pod_uid,
            snapshot=use.snapshot,
            create=create,
            pod_namespace=use.namespace if use.namespace != self.namespace else "",
        )
        if self._key_id:
            payload["keyId"] = self._key_id
        return self.provider.post(KA.request_body(req, **payload))

    def wrap(self, dek: bytes, aad: bytes) -> bytes:
        return _bytes(self.call("wrap", dek=_b64(dek), aad=_b64(aad)), "wrapped")

    def wrap_many(self, items: Sequence[tuple[bytes, bytes]]) -> list[bytes]:
        """Several data keys wrapped, `KA.MAX_ITEMS` to a request."""
        out: list[bytes] = []
        for i in range(0, len(items), KA.MAX_ITEMS):
            batch = items[i : i + KA.MAX_ITEMS]
            answer = self.call("wrap", items=[{"dek": _b64(d), "aad": _b64(a)} for d, a in batch])
            out += _list(answer, "wrapped", len(batch))
        return out

    def unwrap_many(self, items: Sequence[tuple[bytes, bytes]]) -> list[bytes]:
        """Several of the restore's data keys, `KA.MAX_ITEMS` to a request."""
        out: list[bytes] = []
        for i in range(0, len(items), KA.MAX_ITEMS):
            batch = [{"wrapped": _b64(w), "aad": _b64(a)} for w, a in items[i : i + KA.MAX_ITEMS]]
            out += _list(self._unwrap_call(items=batch), "deks", len(batch))
        return out

    def unwrap(self, wrapped: bytes, aad: bytes) -> bytes:
        return _bytes(self._unwrap_call(wrapped=_b64(wrapped), aad=_b64(aad)), "dek")

    def _unwrap_call(self, **payload: Any) -> dict[str, Any]:
        """An ``unwrap`` carries the restore's snapshot as read (manifest and config: the broker checks them
        against the digest the pod names and unwraps only the data keys that config lists), so that any
        replica of the broker answers it, holding nothing. A broker that wants ``open`` first (409: an
        earlier release) is shown it, once, and asked again."""
        use = self.use
        if not (use.manifest and use.config):
            raise FailedPrecondition(
                f"the restore of {use.snapshot} did not pass its manifest and config to the key broker",
                hint="a bug in the agent: report it",
            )
        shown: dict[str, Any] = {"manifest": _b64(use.manifest), "config": _b64(use.config)}
        try:
            return self.call("unwrap", **shown, **payload)
        except _NotOpened:
            self.call("open", **shown)
        try:
            return self.call("unwrap", **shown, **payload)
        except _NotOpened:
            raise Unavailable("keys unavailable: the key broker forgot the opened snapshot", hint=_HINT) from None

    def mac(self, data: bytes) -> bytes:
        """One MAC; the calls of several threads at once share requests (`_Coalesced`)."""
        return self._mac(data)

    def mac_many(self, items: Sequence[bytes]) -> list[bytes]:
        """Several MACs, at most `MAX_MACS` a request."""
        out: list[bytes] = []
        for i in range(0, len(items), KA.MAX_MACS):
            batch = items[i : i + KA.MAX_MACS]
            out += _list(self.call("mac", data=[_b64(d) for d in batch]), "macs", len(batch))
        return out


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _list(answer: dict[str, Any], name: str, n: int) -> list[bytes]:
    values = answer.get(name)
    if not isinstance(values, list) or len(values) != n:
        raise Unavailable(f"keys unavailable: the key broker's answer has no {n} {name}", hint=_HINT)
    try:
        return [base64.b64decode(str(v), validate=True) for v in values]
    except ValueError:
        raise Unavailable(f"keys unavailable: the key broker's {name} are not base64", hint=_HINT) from None


def _bytes(answer: dict[str, Any], name: str) -> bytes:
    try:
        return base64.b64decode(str(answer[name]), validate=True)
    except (KeyError, ValueError):
        raise Unavailable(f"keys unavailable: the key broker's answer has no {name}", hint=_HINT) from None
