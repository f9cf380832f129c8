"""An OCI distribution-spec client sized for multi-GB checkpoint blobs.

Why not oras-py: it reads whole blobs into memory, has no progress hook, ignores DOCKER_CONFIG
and fails against Basic-auth registries (reference/ecosystem.md). This client streams every
blob from/to disk, verifies every digest it reads, and maps every failure to the project's errors.

Uploads: HEAD first (skip what the registry has), then a cross-repository mount from the repositories
named with ``add_mount_sources`` (same registry: ``POST /v2/NAME/blobs/uploads/?mount=DIGEST&from=REPO``,
201 = the registry linked its copy, no byte sent; 202 = it does not have it there, so upload), then
monolithic POST+PUT up to ``monolithic_max``,
chunked POST+PATCH...+PUT above. A failed upload of a re-readable source is restarted from the
beginning (simplest correct behaviour across registries); a failed stream upload raises.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import BinaryIO
from urllib.parse import parse_qsl, urlencode, urljoin, urlsplit, urlunsplit

import requests

from kubectl_snapshot.adapters.registry.auth import CredentialStore
from kubectl_snapshot.adapters.registry.token import TokenAuth
from kubectl_snapshot.adapters.registry.transport import Body, RetryPolicy, Transport, new_session
from kubectl_snapshot.adapters.registry.upload import Progress, ProgressFn, Window
from kubectl_snapshot.core import constants
from kubectl_snapshot.core.errors import (
    DigestMismatch,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    SnapshotError,
    Unavailable,
)
from kubectl_snapshot.core.reference import Reference, validate_digest

log = logging.getLogger(__name__)

MANIFEST_ACCEPT = ", ".join(
    [
        constants.OCI_MANIFEST,
        constants.OCI_INDEX,
        constants.DOCKER_MANIFEST_V2,
        constants.DOCKER_MANIFEST_LIST,
    ]
)
OCTET_STREAM = "application/octet-stream"
DOWNLOAD_PIECE = 1 << 20


def sha256_digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _with_query(url: str, **params: str) -> str:
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True) + list(params.items())
    return urlunsplit(parts._replace(query=urlencode(query)))


def _location(resp: requests.Response, what: str) -> str:
    location = resp.headers.get("Location")
    if not location:
        raise Internal(f"{what}: the registry answered {resp.status_code} without a Location header")
    return urljoin(resp.url, location)


class RegistryClient:
    """Talks to one or more registries; thread-safe enough for parallel blob uploads."""

    def __init__(
        self,
        *,
        credentials: CredentialStore | None = None,
        plain_http: bool = False,
        chunk_size: int = 8 << 20,
        monolithic_max: int = 32 << 20,
        retries: int = 4,
        backoff: float = 0.3,
        timeout: float = 60.0,
        session: requests.Session | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._mount_sources: dict[str, list[str]] = {}
        self.mounted: list[tuple[str, str, str]] = []  # (digest, from repository, to repository)
        if chunk_size <= 0 or monolithic_max < 0 or retries < 0:
            raise InvalidArgument("chunk_size must be > 0, monolithic_max and retries >= 0")
        self.chunk_size = chunk_size
        self.monolithic_max = monolithic_max
        self.retry = RetryPolicy(retries=retries, backoff=backoff)
        self._sleep = sleep
        session = session or new_session()
        self.auth = TokenAuth(credentials or CredentialStore(), session=session, timeout=timeout, plain_http=plain_http)
        self.transport = Transport(
            auth=self.auth,
            plain_http=plain_http,
            retry=self.retry,
            timeout=timeout,
            session=session,
            sleep=sleep,
        )

    # --- small helpers -----------------------------------------------------------------------------

    def _req(
        self,
        method: str,
        ref: Reference,
        url: str,
        *,
        what: str,
        headers: Mapping[str, str] | None = None,
        body: Body | None = None,
        stream: bool = False,
        allow: Collection[int] = (),
        retry: bool = True,
    ) -> requests.Response:
        return self.transport.request(
            method,
            ref.registry,
            url,
            what=what,
            repository=ref.repository,
            headers=headers,
            body=body,
            stream=stream,
            allow=allow,
            retry=retry,
        )

    @staticmethod
    def _path(ref: Reference, tail: str) -> str:
        return f"/v2/{ref.repository}/{tail}"

    # --- reads -------------------------------------------------------------------------------------

    def ping(self, ref: Reference) -> None:
        """GET /v2/: raises Unavailable (with a hint) when the registry cannot be reached."""
        resp = self.transport.request("GET", ref.registry, "/v2/", what=f"ping registry {ref.registry}")
        resp.close()

    def blob_exists(self, ref: Reference, digest: str) -> bool:
        validate_digest(digest)
        resp = self._req(
            "HEAD",
            ref,
            self._path(ref, f"blobs/{digest}"),
            what=f"check blob {digest} in {ref.name}",
            allow={404},
        )
        resp.close()
        return resp.status_code != 404

    def get_manifest(self, ref: Reference, *, max_size: int = 4 << 20) -> tuple[bytes, str, str]:
        """(body, media_type, digest) of the manifest named by ref's digest (preferred) or tag.

        The body always hashes to the returned digest; when ref.digest is set it must match it.
        """
        target = ref.digest or ref.tag
        if not target:
            raise InvalidArgument(f"{ref}: a tag or a digest is needed to get a manifest")
        what = f"get manifest {ref}"
        resp = self._req(
            "GET", ref, self._path(ref, f"manifests/{target}"), what=what,
            headers={"Accept": MANIFEST_ACCEPT}, stream=True,
        )  # fmt: skip
        try:
            declared = resp.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > max_size:
                raise FailedPrecondition(
                    f"{what}: manifest of {declared} bytes exceeds the {max_size}-byte limit",
                    hint="this is not a kubectl-snapshot artifact, or it was tampered with",
                )
            body = resp.raw.read(max_size + 1, decode_content=True)
        except requests.RequestException as exc:
            raise Unavailable(f"{what}: connection lost while reading: {exc}") from exc
        finally:
            resp.close()
        if len(body) > max_size:
            raise FailedPrecondition(
                f"{what}: manifest larger than the {max_size}-byte limit",
                hint="this is not a kubectl-snapshot artifact, or it was tampered with",
            )
        digest = sha256_digest(body)
        if ref.digest and digest != ref.digest:
            raise DigestMismatch(
                f"{what}: the registry returned content with digest {digest}, not {ref.digest}",
                hint="the registry's storage is corrupt or the content was tampered with; it was not used",
            )
        header = resp.headers.get("Docker-Content-Digest")
        if header and header.startswith("sha256:") and header != digest:
            raise DigestMismatch(
                f"{what}: the registry claims digest {header} but the content hashes to {digest}",
                hint="the registry's storage is corrupt or the content was tampered with; it was not used",
            )
        media_type = resp.headers.get("Content-Type", "").split(";")[0].strip()
        if not media_type or media_type in ("application/json", "text/plain"):
            media_type = self._media_type_from_body(body) or media_type
        return body, media_type, digest

    @staticmethod
    def _media_type_from_body(body: bytes) -> str | None:
        import json

        try:
            value = json.loads(body).get("mediaType")
        except (ValueError, AttributeError):
            return None
        return value if isinstance(value, str) else None

    def fetch_blob(
        self,
        ref: Reference,
        digest: str,
        out: BinaryIO,
        *,
        expected_size: int | None = None,
        max_size: int | None = None,
        progress: ProgressFn | None = None,
    ) -> int:
        """Stream blob `digest` into `out` while hashing; returns the bytes written.

        Raises DigestMismatch when the content or size is wrong (the caller must discard `out`).
        A connection lost midway is retried from the start when `out` is seekable.
        """
        validate_digest(digest)
        what = f"fetch blob {digest} from {ref.name}"
        limit = expected_size if expected_size is not None else max_size
        try:
            start: int | None = out.tell() if out.seekable() else None
        except (OSError, AttributeError, ValueError):
            start = None
        prog = Progress(progress)
        attempt = 0
        while True:
            try:
                return self._fetch_once(ref, digest, out, what, expected_size, limit, prog)
            except Unavailable:
                if start is None or attempt >= self.retry.retries:
                    raise
                out.seek(start)
                out.truncate()
                prog.restart()
                self._sleep(self.retry.delay(attempt, None))
                attempt += 1

    def _fetch_once(
        self,
        ref: Reference,
        digest: str,
        out: BinaryIO,
        what: str,
        expected_size: int | None,
        limit: int | None,
        prog: Progress,
    ) -> int:
        resp = self._req("GET", ref, self._path(ref, f"blobs/{digest}"), what=what, stream=True)
        hasher = hashlib.sha256()
        written = 0
        try:
            declared = resp.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and limit is not None and int(declared) > limit:
                raise self._too_big(what, int(declared), expected_size, limit)
            for piece in resp.iter_content(DOWNLOAD_PIECE):
                written += len(piece)
                if limit is not None and written > limit:
                    raise self._too_big(what, written, expected_size, limit)
                hasher.update(piece)
                out.write(piece)
                prog.add(len(piece))
        except requests.RequestException as exc:
            raise Unavailable(f"{what}: connection lost after {written} bytes: {exc}") from exc
        finally:
            resp.close()
        if expected_size is not None and written != expected_size:
            raise DigestMismatch(
                f"{what}: got {written} bytes, expected {expected_size}",
                hint="the registry's storage is corrupt or the content was tampered with; it was not used",
            )
        actual = "sha256:" + hasher.hexdigest()
        if actual != digest:
            raise DigestMismatch(
                f"{what}: content does not match its digest (it hashes to {actual})",
                hint="the registry's storage is corrupt or the content was tampered with; it was not used",
            )
        return written

    @staticmethod
    def _too_big(what: str, size: int, expected: int | None, limit: int) -> SnapshotError:
        if expected is not None:
            return DigestMismatch(
                f"{what}: blob has at least {size} bytes, expected {expected}",
                hint="the registry's storage is corrupt or the content was tampered with; it was not used",
            )
        return FailedPrecondition(
            f"{what}: blob exceeds the {limit}-byte limit",
            hint="this is not a kubectl-snapshot artifact, or it was tampered with",
        )

    def read_blob(self, ref: Reference, digest: str, *, max_size: int = 4 << 20) -> bytes:
        """A small blob (a config), verified, in memory."""
        buf = io.BytesIO()
        self.fetch_blob(ref, digest, buf, max_size=max_size)
        return buf.getvalue()

    def list_tags(self, ref: Reference) -> list[str]:
        """All tags of ref's repository (follows pagination). NotFound when the repository is unknown."""
        what = f"list tags of {ref.name}"
        url: str | None = self._path(ref, "tags/list") + "?n=1000"
        tags: list[str] = []
        while url:
            resp = self._req("GET", ref, url, what=what)
            try:
                payload = resp.json()
            except ValueError as exc:
                raise Internal(f"{what}: the registry sent invalid JSON") from exc
            tags.extend(t for t in (payload.get("tags") or []) if isinstance(t, str))
            nxt = resp.links.get("next", {}).get("url")
            url = urljoin(resp.url, nxt) if nxt else None
        return tags

    # --- writes ------------------------------------------------------------------------------------

    def push_manifest(self, ref: Reference, manifest: bytes, media_type: str) -> str:
        """PUT the manifest under ref's tag (or digest); returns its digest, computed locally."""
        digest = sha256_digest(manifest)
        if ref.digest and ref.digest != digest:
            raise InvalidArgument(f"push manifest {ref}: the manifest's digest is {digest}, not {ref.digest}")
        target = ref.tag or digest
        what = f"push manifest {ref.with_digest(digest) if not ref.tag else ref}"
        resp = self._req(
            "PUT", ref, self._path(ref, f"manifests/{target}"), what=what,
            headers={"Content-Type": media_type}, body=manifest,
        )  # fmt: skip
        resp.close()
        header = resp.headers.get("Docker-Content-Digest")
        if header and header.startswith("sha256:") and header != digest:
            raise DigestMismatch(f"{what}: the registry stored digest {header}, we sent {digest}")
        return digest

    def delete_manifest(self, ref: Reference, digest: str) -> None:
        validate_digest(digest)
        resp = self._req(
            "DELETE", ref, self._path(ref, f"manifests/{digest}"), what=f"delete manifest {ref.name}@{digest}"
        )
        resp.close()

    def push_blob(
        self,
        ref: Reference,
        *,
        digest: str,
        size: int,
        path: str | None = None,
        data: bytes | bytearray | None = None,
        progress: ProgressFn | None = None,
        fresh: bool = False,
    ) -> bool:
        """Upload a blob from `path` or `data` unless the registry has it. True when uploaded.

        `fresh`: content the caller has just made and the registry cannot have yet (a snapshot's config,
        which names its creation time): uploaded without asking first (one round trip less; a blob the
        registry had after all is only sent again)."""
        validate_digest(digest)
        if (path is None) == (data is None):
            raise InvalidArgument("push_blob needs exactly one of path= or data=")
        actual = os.path.getsize(path) if path is not None else len(data or b"")
        if actual != size:
            raise InvalidArgument(f"push blob {digest}: the source has {actual} bytes, not {size}")
        if not fresh and (self.blob_exists(ref, digest) or self._mount(ref, digest)):
            return False
        prog = Progress(progress)
        attempt = 0
        while True:
            try:
                if size <= self.monolithic_max:
                    self._push_monolithic(ref, digest, size, path, data, prog)
                else:
                    self._push_chunked(ref, digest, size, path, data, prog)
                return True
            except SnapshotError as exc:
                if not exc.retryable or attempt >= self.retry.retries:
                    raise
                log.info("push blob %s to %s failed (%s); restarting the upload", digest, ref.name, exc)
                prog.restart()
                self._sleep(self.retry.delay(attempt, None))
                attempt += 1

    def add_mount_sources(self, sources: Iterable[Reference]) -> None:
        """Repositories whose blobs a push to another repository of the same registry may mount instead
        of uploading (e.g. where this pod's previous snapshot went)."""
        for src in sources:
            repos = self._mount_sources.setdefault(src.registry, [])
            if src.repository not in repos:
                repos.append(src.repository)

    def _mount(self, ref: Reference, digest: str) -> bool:
        """Try each mount source of ref's registry; True once one was mounted (201)."""
        for source in self._mount_sources.get(ref.registry, []):
            if source == ref.repository:
                continue
            what = f"mount blob {digest} from {ref.registry}/{source} into {ref.name}"
            url = self._path(ref, "blobs/uploads/") + "?" + urlencode({"mount": digest, "from": source})
            try:
                resp = self._req("POST", ref, url, what=what, headers={"Content-Length": "0"})
            except SnapshotError as exc:  # e.g. no pull access to the source: upload instead
                log.info("%s: %s; uploading instead", what, exc)
                continue
            resp.close()
            if resp.status_code == 201:
                self.mounted.append((digest, source, ref.repository))
                return True
            if resp.status_code == 202 and resp.headers.get("Location"):
                self._cancel(ref, _location(resp, what))  # an upload session we do not need: free it
        return False

    def _start_upload(self, ref: Reference, what: str) -> tuple[str, int]:
        resp = self._req("POST", ref, self._path(ref, "blobs/uploads/"), what=what, headers={"Content-Length": "0"})
        resp.close()
        if resp.status_code != 202:
            raise Internal(f"{what}: the registry answered {resp.status_code} to the upload request, not 202")
        min_len = resp.headers.get("OCI-Chunk-Min-Length", "")
        return _location(resp, what), int(min_len) if min_len.isdigit() else 0

    def _cancel(self, ref: Reference, location: str) -> None:
        """Best effort: free the registry's upload session after a failure."""
        try:
            self._req("DELETE", ref, location, what="cancel upload", retry=False, allow={404}).close()
        except SnapshotError as exc:
            log.debug("cancel upload %s: %s", location, exc)

    def _finish(self, ref: Reference, location: str, digest: str, what: str, body: Body, length: int) -> None:
        resp = self._req(
            "PUT", ref, _with_query(location, digest=digest), what=what,
            headers={"Content-Type": OCTET_STREAM, "Content-Length": str(length)},
            body=body, retry=False,
        )  # fmt: skip
        resp.close()
        if resp.status_code != 201:
            raise Internal(f"{what}: the registry answered {resp.status_code} to the final PUT, not 201")

    def _push_monolithic(
        self, ref: Reference, digest: str, size: int, path: str | None, data: bytes | bytearray | None, prog: Progress
    ) -> None:
        what = f"push blob {digest} ({size} bytes) to {ref.name}"
        location, _ = self._start_upload(ref, what)
        try:
            self._finish(
                ref, location, digest, what,
                lambda: Window(path=path, data=data, length=size, progress=prog), size,
            )  # fmt: skip
        except SnapshotError:
            self._cancel(ref, location)
            raise

    def _patch(self, ref: Reference, location: str, start: int, window: Window | bytes, what: str) -> str:
        """PATCH one chunk; returns the next Location after checking the Range the registry reports."""
        length = len(window)
        end = start + length - 1
        resp = self._req(
            "PATCH", ref, location, what=what,
            headers={"Content-Type": OCTET_STREAM, "Content-Range": f"{start}-{end}",
                     "Content-Length": str(length)},
            body=window if isinstance(window, bytes) else (lambda: window), retry=False,
        )  # fmt: skip
        resp.close()
        if resp.status_code != 202:
            raise Internal(f"{what}: the registry answered {resp.status_code} to a chunk, not 202")
        got = resp.headers.get("Range", "").removeprefix("bytes=")
        if got and got != f"0-{end}":
            raise Unavailable(f"{what}: the registry has bytes {got} after a chunk ending at {end}")
        return _location(resp, what)

    def _push_chunked(
        self, ref: Reference, digest: str, size: int, path: str | None, data: bytes | bytearray | None, prog: Progress
    ) -> None:
        what = f"push blob {digest} ({size} bytes) to {ref.name}"
        location, min_len = self._start_upload(ref, what)
        chunk = max(self.chunk_size, min_len)
        try:
            offset = 0
            while offset < size:
                n = min(chunk, size - offset)
                window = Window(path=path, data=data, offset=offset, length=n, progress=prog)
                location = self._patch(ref, location, offset, window, what)
                offset += n
            self._finish(ref, location, digest, what, b"", 0)
        except SnapshotError:
            self._cancel(ref, location)
            raise

    def push_blob_stream(
        self, ref: Reference, chunks: Iterable[bytes], *, progress: ProgressFn | None = None
    ) -> tuple[str, int]:
        """Chunked upload of a stream whose digest is computed on the fly; returns (digest, size).

        Holds at most one chunk in memory. A failure midway raises (the stream cannot be replayed);
        the caller may retry with a new stream.
        """
        what = f"push blob stream to {ref.name}"
        location, min_len = self._start_upload(ref, what)
        chunk = max(self.chunk_size, min_len)
        hasher = hashlib.sha256()
        buf = bytearray()
        offset = 0
        prog = Progress(progress)
        try:
            for piece in chunks:
                hasher.update(piece)
                buf += piece
                while len(buf) >= chunk:
                    body = bytes(buf[:chunk])
                    del buf[:chunk]
                    location = self._patch(ref, location, offset, body, what)
                    offset += len(body)
                    prog.add(len(body))
            digest = "sha256:" + hasher.hexdigest()
            tail = bytes(buf)
            self._finish(ref, location, digest, what, tail, len(tail))  # the last chunk rides on the PUT
            prog.add(len(tail))
        except SnapshotError:
            self._cancel(ref, location)
            raise
        except BaseException:
            self._cancel(ref, location)
            raise
        return digest, offset + len(tail)
