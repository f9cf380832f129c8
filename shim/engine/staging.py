"""Where the agent keeps its node-local state: work dirs for dumps and staged data for restores.

The runtime wrapper finds staged data only here, by a key it derives itself (the container id, or the
pod uid + container name that containerd's CRI plugin writes into the spec annotations); it never
follows a path named by the container or the snapshot.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import threading
from dataclasses import dataclass

from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.errors import InvalidArgument

_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_key(value: str, what: str) -> str:
    if not _KEY_RE.match(value) or value in (".", ".."):
        raise InvalidArgument(
            f"invalid {what} {value!r}",
            hint="use letters, digits, '.', '_' and '-' (at most 128 characters, not starting with a symbol)",
        )
    return value


@dataclass(frozen=True)
class StatePaths:
    root: str = C.DEFAULT_STATE_DIR

    @classmethod
    def from_env(cls) -> StatePaths:
        return cls(os.environ.get(C.ENV_STATE_DIR) or C.DEFAULT_STATE_DIR)

    def work_dir(self, snapshot_id: str) -> str:
        return os.path.join(self.root, "work", check_key(snapshot_id, "snapshot id"))

    def staged_by_id(self, container_id: str) -> str:
        return os.path.join(self.root, C.STAGING_SUBDIR, "by-id", check_key(container_id, "container id"))

    def staged_by_pod(self, pod_uid: str, container_name: str) -> str:
        return os.path.join(
            self.root,
            C.STAGING_SUBDIR,
            "by-pod",
            check_key(pod_uid, "pod uid"),
            check_key(container_name, "container name"),
        )

    def pod_dir(self, pod_uid: str) -> str:
        """A restored pod's own state (shim.podrestore), beside its containers' staged dirs."""
        return os.path.join(self.root, C.STAGING_SUBDIR, "by-pod", check_key(pod_uid, "pod uid"))

    def staging_gate(self, container_id: str) -> str:
        """Held (flock) by an agent that created this container before its staging finished (see
        StagingGate); the gate's ``.state`` beside it says when the staged data is complete."""
        return os.path.join(self.root, C.STAGING_SUBDIR, "gates", check_key(container_id, "container id"))

    def restored_marker(self, container_id: str) -> str:
        return os.path.join(self.root, "restored", check_key(container_id, "container id"))

    def page_index(self) -> str:
        """The bases of page deltas, one file per repository + container (shim/engine/pageindex.py)."""
        return os.path.join(self.root, "page-index")

    def image_cache(self) -> str:
        """Decoded CRIU images by the SHA-256 of their bytes, written by the agent when it stages a
        restore, read by the wrapper's image check (shim/criu_guard.py, "the decode cache")."""
        return os.path.join(self.root, "image-cache")

    def downloads(self) -> str:
        return os.path.join(self.root, "downloads")


# --- the staging gate -------------------------------------------------------------------------------
# A node-level restore creates its containers while their data downloads: containerd starts the task's
# shim and the runtime hook meanwhile, and the hook's `create` waits here until the agent says the
# staged data is complete (or that staging failed). The agent holds an exclusive flock on the gate until
# it has written its answer (by rename: a hook never reads half of it); the hook blocks on a shared lock
# of the same file, so it wakes the moment the agent lets go, and the kernel lets go for an agent that
# dies (whatever pid namespace either runs in). Got the lock but no answer: the agent is gone.

READY = "ready"
FAILED = "failed"
GATE_WAIT_S = 60.0  # a hook waits at most this long (below containerd's create deadline, 120 s)


class StagingGate:
    """The agent's side: opened (and locked) before the containers are created, answered once."""

    def __init__(self, paths: StatePaths, container_id: str) -> None:
        self.path = paths.staging_gate(container_id)
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: another restore of this id (OSError)
        except OSError:
            os.close(self._fd)
            raise
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path + ".state")  # an answer left by an agent that died

    def answer(self, state: str, message: str = "") -> None:
        """Write the answer, then let go: the waiting hook wakes and reads it."""
        tmp = f"{self.path}.state.{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(f"{state}\n{message}")
        os.replace(tmp, self.path + ".state")
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def close(self) -> None:
        """The containers are created (or given up): nothing waits any more."""
        for p in (self.path + ".state", self.path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        os.close(self._fd)


def wait_staged(paths: StatePaths, container_id: str, *, timeout_s: float = GATE_WAIT_S) -> str | None:
    """The hook's side: None once this container's staged data is complete (at once when no agent
    gated it); otherwise why it will not be (staging failed, the agent is gone, or too slow). The lock
    is taken by a daemon thread, so the wait is bounded without signals; one that times out is left
    blocked in the kernel and ends with the process."""
    try:
        path = paths.staging_gate(container_id)
    except InvalidArgument:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    locked = threading.Event()

    def lock() -> None:  # the lock only says that the agent let go: the file is closed once it is got
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        finally:
            os.close(fd)
        locked.set()

    threading.Thread(target=lock, name="staging-gate", daemon=True).start()
    if not locked.wait(timeout_s):
        return f"the staged data was not complete within {timeout_s:g} s"  # the thread ends with the process
    try:
        with open(path + ".state") as f:
            state, _, message = f.read().partition("\n")
    except FileNotFoundError:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a gate left by an agent that died: the next create is not held up
        return "the agent staging this restore let go before the data was complete"
    return None if state == READY else f"the agent's staging of this restore failed: {message or 'no reason'}"
