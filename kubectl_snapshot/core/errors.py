"""One error tree for the whole project.

    SnapshotError                 root; carries `hint`, `details` (e.g. a CRIU log tail), `retryable`
    +-- InvalidArgument           bad input from the user (exit 2 at the CLI)
    +-- NotFound                  unknown pod, container, reference, blob
    +-- FailedPrecondition        the world is not in a state that allows the operation
    |   +-- Expired               a resourceVersion the API server no longer has (410): list again
    |   +-- DigestMismatch        content does not match its digest: never trusted, never extracted
    |   +-- UnsafeArchive         an archive member would escape its staging dir, or is a device, ...
    |   +-- SourcePodReplaced     the pod a PodSnapshot was made for is gone; one of its name runs now
    |   +-- TooManyRequests       a namespace's backlog on a node is full: refused at once, not queued
    +-- PermissionDenied          credentials missing or refused
    +-- Unavailable               a service cannot be reached (retryable by default)
    +-- Internal                  a bug or an unexpected answer
        +-- CriuFailed            CRIU (through runc/containerd) failed; `details` has the log tail

The CLI prints ``error: <message>`` and ``hint: <hint>`` and exits 1 (2 for InvalidArgument);
tracebacks only with ``-v``.
"""

from __future__ import annotations


class SnapshotError(Exception):
    """Root of every error kubectl-snapshot raises on purpose."""

    category = "internal"
    default_retryable = False
    exit_code = 1

    def __init__(
        self,
        message: str,
        *,
        hint: str | None = None,
        details: str | None = None,
        retryable: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.details = details
        self.retryable = self.default_retryable if retryable is None else retryable

    def __str__(self) -> str:
        return self.message

    def with_context(self, prefix: str) -> SnapshotError:
        """Return a copy of this error whose message is prefixed (same class, hint, details)."""
        err = type(self)(f"{prefix}: {self.message}", hint=self.hint, details=self.details, retryable=self.retryable)
        err.__cause__ = self
        return err


class InvalidArgument(SnapshotError):
    category = "invalid-argument"
    exit_code = 2


class NotFound(SnapshotError):
    category = "not-found"


class FailedPrecondition(SnapshotError):
    category = "failed-precondition"


class AlreadyExists(FailedPrecondition):
    """The object to create exists already (HTTP 409, reason AlreadyExists)."""

    category = "already-exists"


class Expired(FailedPrecondition):
    """A watch or list resourceVersion the API server no longer has (HTTP 410 Gone): list again."""

    category = "expired"
    default_retryable = True


class DigestMismatch(FailedPrecondition):
    category = "digest-mismatch"


class UnsafeArchive(FailedPrecondition):
    category = "unsafe-archive"


class SourcePodReplaced(FailedPrecondition):
    """The pod a PodSnapshot names (spec.podUID) was deleted and another pod of its name runs now."""

    category = "source-pod-replaced"


class TooManyRequests(FailedPrecondition):
    """A namespace already has as many snapshots (or restores) queued or running on the node as it may
    (core/backlog.py): the request fails at once instead of waiting behind them."""

    category = "too-many-requests"


class PermissionDenied(SnapshotError):
    category = "permission-denied"


class Unavailable(SnapshotError):
    category = "unavailable"
    default_retryable = True


class Internal(SnapshotError):
    category = "internal"


class CriuFailed(Internal):
    category = "criu-failed"


def render(err: SnapshotError) -> str:
    """The plain-text form of an error: ``error: <message>``, the details indented, ``hint: <hint>``.

    What both programs print (the plugin and the agent CLI on stderr), and what the agent writes where a
    person reads it (Events, a restore gate's failure file)."""
    lines = [f"error: {err.message}"]
    if err.details:
        lines.append("  " + err.details.replace("\n", "\n  "))
    if err.hint:
        lines.append(f"hint: {err.hint}")
    return "\n".join(lines)


def log_tail(text: str, lines: int = 25) -> str:
    """The last `lines` lines of a log, for error details."""
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


# CRIU errors that follow any failure (or none): never the cause
_CRIU_AFTERMATH = ("Restoring FAILED", "Dumping FAILED", "cgroupd: recv req error", "exited, status=", "rlimit:")


def criu_first_error(text: str) -> str:
    """The first ``Error (...)`` line of a CRIU log that is not an aftermath of another failure ("")."""
    for line in text.splitlines():
        if "Error (" in line and not any(a in line for a in _CRIU_AFTERMATH):
            return line.strip()
    return ""
