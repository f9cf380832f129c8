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
import time

from kubectl_snapshot.core import constants as C
from kubectl_snapshot.core.errors import InvalidArgument
from shim.host import private

# The runtime wrapper imports this at every container create: no dataclasses, no typing at run time
# (shim/runtime_wrapper.py, "what it imports at start").
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable

_KEY_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def check_key(value: str, what: str) -> str:
    if not _KEY_RE.match(value) or value in (".", ".."):
        raise InvalidArgument(
            f"invalid {what} {value!r}",
            hint="use letters, digits, '.', '_' and '-' (at most 128 characters, not starting with a symbol)",
        )
    return value


class StatePaths:
    """The agent's state dir (`root`) and the paths under it, each from a key checked here."""

    __slots__ = ("root",)

    def __init__(self, root: str = C.DEFAULT_STATE_DIR) -> None:
        self.root = root

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StatePaths) and other.root == self.root

    def __hash__(self) -> int:
        return hash(self.root)

    def __repr__(self) -> str:
        return f"StatePaths(root={self.root!r})"

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
        """A restored pod's own state (shim.net.podrestore), beside its containers' staged dirs."""
        return os.path.join(self.root, C.STAGING_SUBDIR, "by-pod", check_key(pod_uid, "pod uid"))

    def hot_trace(self, pod_uid: str, container_name: str) -> str:
        """The pages a restored container's processes asked for first (shim/engine/hottraces.py), in its
        pod's state dir: gone with the pod (container names never start with a dot)."""
        return os.path.join(self.pod_dir(pod_uid), f".hot-{check_key(container_name, 'container name')}.json")

    def staging_gate(self, container_id: str) -> str:
        """Held (flock) by an agent that created this container before its staging finished (see
        StagingGate); the gate's ``.state`` beside it says when the staged data is complete."""
        return os.path.join(self.root, C.STAGING_SUBDIR, "gates", check_key(container_id, "container id"))

    def pod_gates(self, pod_uid: str) -> str:
        """The staging gates of a Kubernetes pod's containers (StagingGate, "pod gates" below)."""
        return os.path.join(self.root, C.STAGING_SUBDIR, "pod-gates", check_key(pod_uid, "pod uid"))

    def pod_gate(self, pod_uid: str, container_name: str) -> str:
        return os.path.join(self.pod_gates(pod_uid), check_key(container_name, "container name"))

    def restored_marker(self, container_id: str) -> str:
        return os.path.join(self.root, "restored", check_key(container_id, "container id"))

    def page_index(self) -> str:
        """The bases of page deltas, one file per pod + container + repository, and the node's page hash
        key (shim/engine/pageindex.py)."""
        return os.path.join(self.root, "page-index")

    def image_cache(self) -> str:
        """Decoded CRIU images by the SHA-256 of their bytes, written by the agent when it stages a
        restore, read by the wrapper's image check (shim/criu/guard.py, "the decode cache")."""
        return os.path.join(self.root, "image-cache")

    def downloads(self) -> str:
        return os.path.join(self.root, "downloads")


# --- the staging gate -------------------------------------------------------------------------------
# A restore creates its containers while their data downloads: containerd starts the task's shim and the
# runtime wrapper meanwhile, and the hook's `create` waits here until the agent says the staged data is
# complete (or that staging failed). The agent holds an exclusive flock on the gate until it has written
# its answer (by rename: a hook never reads half of it); the hook blocks on a shared lock of the same
# file, so it wakes the moment the agent lets go, and the kernel lets go for an agent that dies
# (whatever pid namespace either runs in).
#
# Two kinds, one mechanism:
# - node-level (`ks-agent restore`): keyed by the new container's id; the agent creates the containers
#   itself, and removes the gate once they are created. Lock got but no answer: the agent is gone, the
#   create is refused (nobody would create it again).
# - pod gates (Kubernetes): keyed by pod uid + container name, taken for every container of the pod
#   (but the gate init container) before the pod's gate volume says "go", so the kubelet creates the
#   containers while the save downloads. A resuming pod (the resume-policy annotation, which containerd
#   passes to the runtime) and a restore pod (the restore-from annotation, passed the same way) have
#   no gate init container: the agent takes their gates as soon as it sees the pod, and the hook waits
#   for them to appear. They stay as long as the pod (`.pod` beside them
#   names it for garbage collection): the kubelet may create a container again (after a refused
#   create, or a restart), and each create reads the same answer. Lock got but no answer: the agent
#   died while staging, and its successor stages the pod again and takes the gate again, so the hook
#   keeps waiting (up to its bound) for an answer.
#
# Two phases (node-level gates): CRIU reads a container's page files only after it restored the
# container's namespaces and mounts, which takes runc and CRIU about as long as a small pod's pages take
# to download. So the agent answers IMAGES on the gate once every layer is extracted (the CRIU images,
# the rootfs diff, the volumes: everything but the page files) and keeps a second lock, the pages gate
# (`<gate>.pages`), until the page files are in place, then answers there. The hook checks the images and
# starts `runc restore` at once, with the node bundle's launcher as runc's CRIU: it relays runc's RPC
# socket to the real CRIU and holds CRIU's "post-setup-namespaces" notification, before any page file is
# opened, at the pages gate (launcher/criurelay.go); CRIU aborts the restore (and kills what it
# restored) unless the answer there is READY. A hook without that relay waits for the pages gate itself
# before `runc restore`.

READY = "ready"
FAILED = "failed"
IMAGES = "images"  # phase one of a two-phase gate: all but the page files staged; they follow at its pages gate
GATE_WAIT_S = 60.0  # a hook waits at most this long (below containerd's create deadline, 120 s)
POD_GATE_WAIT_S = 100.0  # the kubelet's runtime-request-timeout (2 min) bounds its StartContainer
_RETAKE_POLL_S = 0.25  # a pod gate whose agent died: how often the hook looks for its successor
_APPEAR_POLL_S = 0.05  # a resuming pod's container, created before the agent took its gate


class StagingGate:
    """The agent's side: opened (and locked) before the containers are created, answered once."""

    def __init__(self, path: str, *, two_phase: bool = False) -> None:
        self.path = path
        private.makedirs(os.path.dirname(self.path))  # staged/ and its gates/ too: root's alone
        self._fd = self._pages_fd = -1
        try:
            if two_phase:  # first: a gate whose images are answered still holds it (and keeps its answer)
                self._pages_fd = _take(pages_gate(self.path))
            self._fd = _take(self.path)  # held: another restore of this id (OSError)
        except OSError:
            self.release()
            raise
        self.answered = self.images_answered = False

    def answer_images(self) -> None:
        """Phase one (a two-phase gate; otherwise nothing): everything but the page files is staged. The
        hook may check the images and start `runc restore`; its CRIU waits at the pages gate."""
        if self._pages_fd < 0 or self.answered or self.images_answered:
            return
        _answer(self.path, self._fd, IMAGES)
        self.images_answered = True

    def answer(self, state: str, message: str = "") -> None:
        """Write the answer, then let go: the waiting hook wakes and reads it (after answer_images, at
        the pages gate, which the launcher's relay or the hook waits at)."""
        if not self.images_answered:
            _answer(self.path, self._fd, state, message)
        if self._pages_fd >= 0:
            _answer(pages_gate(self.path), self._pages_fd, state, message)
        self.answered = True

    def release(self) -> None:
        """Close without removing (a pod gate: later creates of the container read the same answer)."""
        for fd in (self._fd, self._pages_fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._pages_fd = -1

    def close(self) -> None:
        """The containers are created (or given up): nothing waits any more."""
        for gate in (pages_gate(self.path), self.path):
            for p in (gate + ".state", gate):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)
        self.release()


LAZY_PREFIX = ".lazy-"


def lazy_used_dir(staged: str) -> str:
    """Where the runtime wrapper moves a lazily restored container's staged dir once `runc restore` returned:
    out of the way of a later create (a restart starts afresh), in place for CRIU's lazy-pages daemon,
    which reads its images and logs there until every page is in; its session removes it then
    (shim/engine/lazyrestore.py). No staged dir has a leading dot (check_key)."""
    return os.path.join(os.path.dirname(staged), LAZY_PREFIX + os.path.basename(staged))


def pages_gate(gate: str) -> str:
    """The second lock of a two-phase gate: held by the agent until the page files are in place."""
    return gate + ".pages"


def _take(path: str) -> int:
    """Open and lock (exclusively, at once or OSError) a gate file; an answer left beside it by an agent
    that died (or an earlier staging) is removed."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path + ".state")
    return fd


def _answer(path: str, fd: int, state: str, message: str = "") -> None:
    tmp = f"{path}.state.{os.getpid()}"
    with private.create(tmp) as f:
        f.write(f"{state}\n{message}")
    os.replace(tmp, path + ".state")  # a hook never reads half of it
    fcntl.flock(fd, fcntl.LOCK_UN)


def _read_answer(path: str) -> tuple[str, str] | None:
    try:
        with open(path + ".state") as f:
            state, _, message = f.read().partition("\n")
    except FileNotFoundError:
        return None
    return state, message


def _wait_unlocked(path: str, timeout_s: float, meanwhile: Callable[[], object] | None = None) -> bool | None:
    """Wait until nobody holds the gate: None when there is no gate, False when the wait timed out.
    The lock is taken by a daemon thread, so the wait is bounded without signals; one that times out
    is left blocked in the kernel and ends with the process. `meanwhile` runs while the lock is waited
    for (only where the gate is held; its errors are ignored: what it prepares is done again later)."""
    deadline = time.monotonic() + max(timeout_s, 0.0)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:  # a gate nobody holds (answered long ago: a restarted container reads it again) is passed at once
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        pass
    else:
        os.close(fd)
        return True
    locked = threading.Event()

    def lock() -> None:  # the lock only says that the agent let go: the file is closed once it is got
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        finally:
            os.close(fd)
        locked.set()

    threading.Thread(target=lock, name="staging-gate", daemon=True).start()
    if meanwhile is not None:
        with contextlib.suppress(Exception):
            meanwhile()
    return locked.wait(max(deadline - time.monotonic(), 0.0))


def _verdict(answer: tuple[str, str]) -> str | None:
    state, message = answer
    return None if state == READY else f"the agent's staging of this restore failed: {message or 'no reason'}"


class PendingPages:
    """Phase two of a node-level gate, as the hook sees it: the CRIU images are staged, the page files
    are not yet. `gate`: the pages gate (held by the agent until it answers there); `deadline`: the
    POSIX time by which the hook's whole wait ends (the first phase's bound)."""

    __slots__ = ("deadline", "gate")

    def __init__(self, gate: str, deadline: float) -> None:
        self.gate, self.deadline = gate, deadline

    def settled(self) -> bool:
        """Whether the agent has let go of the pages gate already (answered, or gone): then wait() returns
        at once, and the hook starts `runc restore` without the relay (a process between runc and
        CRIU)."""
        try:
            fd = os.open(self.gate, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)
        return True

    def wait(self) -> str | None:
        """Wait here (a hook without the launcher's relay): None once the page files are in place."""
        unlocked = _wait_unlocked(self.gate, self.deadline - time.time())
        if not unlocked:
            return (
                "the staged page files were not complete in time"
                if unlocked is not None
                else "the agent staging this restore let go before the page files were complete"
            )
        answer = _read_answer(self.gate)
        if answer is None:
            return "the agent staging this restore let go before the page files were complete"
        return _verdict(answer)

    def failure(self, wait_s: float = 0.0) -> str | None:
        """The agent's answer, where it says that staging failed (why a restore was aborted); waited for
        up to `wait_s` while the agent still holds the gate (a failed staging removes the staged dir
        before it answers, so CRIU may fail first)."""
        if wait_s > 0:
            _wait_unlocked(self.gate, min(wait_s, max(self.deadline - time.time(), 0.0)))
        answer = _read_answer(self.gate)
        return _verdict(answer) if answer is not None and answer[0] != IMAGES else None


def wait_staged_images(
    paths: StatePaths,
    container_id: str,
    *,
    timeout_s: float = GATE_WAIT_S,
    meanwhile: Callable[[], object] | None = None,
) -> tuple[str | None, PendingPages | None]:
    """The hook's side of a node-level gate: (None, None) once this container's staged data is complete
    (at once when no agent gated it); (None, pending) once all but its page files is (two phases: the
    pages follow at `pending`); (why, None) when it will not be (staging failed, the agent is gone, or
    too slow). `meanwhile`: what the hook can do while it waits (run only where there is a gate)."""
    try:
        path = paths.staging_gate(container_id)
    except InvalidArgument:
        return None, None
    deadline = time.time() + max(timeout_s, 0.0)
    unlocked = _wait_unlocked(path, timeout_s, meanwhile)
    if unlocked is None:
        return None, None
    if not unlocked:
        return f"the staged data was not complete within {timeout_s:g} s", None
    answer = _read_answer(path)
    if answer is None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a gate left by an agent that died: the next create is not held up
        return "the agent staging this restore let go before the data was complete", None
    if answer[0] == IMAGES:
        return None, PendingPages(pages_gate(path), deadline)
    return _verdict(answer), None


def wait_staged(
    paths: StatePaths,
    container_id: str,
    *,
    timeout_s: float = GATE_WAIT_S,
    meanwhile: Callable[[], object] | None = None,
) -> str | None:
    """wait_staged_images, then the page files too: None once all of the staged data is complete."""
    why, pending = wait_staged_images(paths, container_id, timeout_s=timeout_s, meanwhile=meanwhile)
    return pending.wait() if pending is not None else why


def wait_pod_staged(
    paths: StatePaths,
    pod_uid: str,
    container_name: str,
    *,
    expected: bool = False,
    timeout_s: float = POD_GATE_WAIT_S,
    meanwhile: Callable[[], object] | None = None,
) -> str | None:
    """The hook's side of a pod gate: None once the agent answered "ready" (at once when no agent gated
    this container, unless the gate is `expected`: a resuming pod's, which the agent takes when it
    sees the pod, so the hook waits for it to appear); otherwise why the create is refused. An agent
    that died while staging is waited for: its successor takes the gate again."""
    try:
        path = paths.pod_gate(pod_uid, container_name)
    except InvalidArgument:
        return None
    deadline = time.monotonic() + timeout_s
    if expected:
        while not os.path.exists(path):
            if time.monotonic() >= deadline:
                return (
                    f"the node's agent did not take up this pod's restore within {timeout_s:g} s "
                    "(is the kubectl-snapshot agent running on this node?)"
                )
            time.sleep(_APPEAR_POLL_S)
    while True:
        unlocked = _wait_unlocked(path, max(deadline - time.monotonic(), 0.05), meanwhile)  # a free lock: at once
        meanwhile = None
        if unlocked is None:
            return None
        answer = _read_answer(path) if unlocked else None
        if answer is not None:
            return _verdict(answer)
        if time.monotonic() >= deadline:
            return (
                f"the staged data was not complete within {timeout_s:g} s"
                if not unlocked
                else "the agent staging this pod's restore let go before the data was complete, and no "
                "agent took it up again"
            )
        time.sleep(_RETAKE_POLL_S)
