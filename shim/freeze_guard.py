"""The freeze guard: a frozen container is thawed within moments of whoever froze it going away.

A freeze is a *hold* on a connection to the guard. The agent connects to the guard's Unix socket once
per container, sends one JSON line ``{"op": "freeze", "pid": TASK_PID, "deadline_s": N, "report": {...}}``
and the guard (root, like the agent) freezes that task's cgroup itself and answers ``{"ok": true}``. The
container thaws when the agent sends ``{"op": "thaw"}`` (normal end), and also, at once, when:

- the connection closes without it: the agent process died (SIGKILL, OOM, its container restarted:
  the kernel closes its sockets), or
- the deadline passes (the agent hangs, or the dump is far slower than expected): the guard thaws and
  answers the agent's later ``thaw`` with ``"expired": true``, so the snapshot fails instead of
  packaging a dump that was not consistent to the end.

In both cases the guard marks the PodSnapshot named in ``report`` Failed with the reason, with a few
lines of stdlib HTTPS against the API server (its pod's service account), so the object never stays
Running while the agent is down. Holds are also written to ``--state-dir``; a guard that starts and
finds some (it was killed while holding) thaws them first.

Where the guard runs: in the agent's DaemonSet, as its own container of the agent's pod (same image,
its own process tree and restart: nothing that kills or hangs the agent container touches it), on a
socket in an emptyDir both containers mount. The standalone ``ks-agent checkpoint``
starts a private guard per run instead: a child in its own session that outlives a killed CLI and
exits once its last hold ended.

What it accepts: only a peer with its own uid (the socket's directory is 0700 too); only a task pid,
never a path, whose cgroup it places itself under the host's cgroupfs (shim/host/freezer.py); never its own
cgroup, the peer's, host init's, or an ancestor of any of them. Pure stdlib (no grpc, no Kubernetes
client), so it starts fast and has little that can break.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from kubectl_snapshot.core import kubenames as K
from kubectl_snapshot.core import status as S
from kubectl_snapshot.core import timestamps as T
from kubectl_snapshot.core.errors import FailedPrecondition
from shim.host import freezer, safefs

if TYPE_CHECKING:
    import argparse

log = logging.getLogger("kubectl-snapshot-guard")

MAX_DEADLINE_S = 600.0  # whatever the agent asks for (kubectl_snapshot.core.freeze caps at this too)
FREEZE_REPLY_S = freezer.FREEZE_TIMEOUT + 5.0  # the guard answers a freeze within this
EXPIRED_WAIT_S = 3600.0  # after a deadline, how long a silent (stopped) agent's connection is kept
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
API_PATH = f"/apis/{K.API_VERSION}/namespaces/{{ns}}/{K.PLURAL}/{{name}}/status"
ENV_SOCKET = "KUBECTL_SNAPSHOT_GUARD_SOCKET"


class GuardError(FailedPrecondition):
    """The guard refused or could not do what it was asked, or thawed early (the snapshot fails)."""


# --- the server ------------------------------------------------------------------------------------


def _cgroup_of(pid: int) -> str | None:
    fz = freezer.lookup(pid)
    return fz.directory if fz is not None else None


_PROC_ROOT = re.compile(r"^/proc/[0-9]+/root(?=/)")


def _rebase(directory: str, root: str) -> str:
    """`directory` as seen through the current host process: cgroup paths carry the /proc/PID/root of
    the host process they were looked up through (hostfacts.host_pid, a containerd where PID 1 is out of
    reach), and that process may have been replaced since (containerd restarted by install-node)."""
    current = _PROC_ROOT.match(root)
    return _PROC_ROOT.sub(current.group(0) if current else "", directory, count=1)


def _is_within(child: str, parent: str) -> bool:
    return child == parent or child.startswith(parent.rstrip("/") + "/")


def check_target(fz: freezer.CgroupFreezer, *, protected: list[str], root: str) -> None:
    """Refuse a cgroup that is not a container's: outside the cgroupfs, its root, or one holding (or above)
    a protected cgroup (the guard's, the agent's, host init's)."""
    directory, root = os.path.normpath(fz.directory), os.path.normpath(root)
    if "/../" in fz.directory + "/" or not os.path.isabs(directory):
        raise GuardError(f"cgroup {fz.directory} is not a plain path")
    if not _is_within(directory, root) or directory.rstrip("/") == root.rstrip("/"):
        raise GuardError(f"cgroup {directory} is not a container cgroup below {root}")
    if os.path.basename(directory) in ("freezer", "unified"):
        raise GuardError(f"cgroup {directory} is a hierarchy's root")
    for p in protected:
        if _is_within(os.path.normpath(p), directory):
            raise GuardError(f"cgroup {directory} holds the guard, the agent or the host's init")


def report_failed(report: dict[str, Any], reason: str) -> None:
    """Mark a PodSnapshot Failed: one merge patch of its status, with the pod's service account."""
    ns, name = str(report.get("namespace", "")), str(report.get("name", ""))
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not (ns and name and host):
        return
    when = T.rfc3339(time.time())
    status = S.failed(
        node=os.environ.get("NODE_NAME", ""),
        now=when,
        generation=None,
        reason="Interrupted",
        message=reason,
        hint="the pod was thawed and keeps running; create a new PodSnapshot",
    )
    status.pop("observedGeneration", None)  # unknown here: keep what the agent wrote
    body = json.dumps({"status": status})
    for attempt in range(5):
        try:
            with open(os.path.join(SA_DIR, "token")) as f:
                token = f.read().strip()
            ctx = ssl.create_default_context(cafile=os.path.join(SA_DIR, "ca.crt"))
            conn = http.client.HTTPSConnection(host, int(port), context=ctx, timeout=5)
            try:
                conn.request(
                    "PATCH",
                    API_PATH.format(ns=quote(ns, safe=""), name=quote(name, safe="")),
                    body=body,
                    headers={"Authorization": f"Bearer {token}", "Content-Type": "application/merge-patch+json"},
                )
                resp = conn.getresponse()
                resp.read()
            finally:
                conn.close()
            if resp.status < 300:
                log.info("podsnapshot %s/%s marked Failed", ns, name)
                return
            log.warning("marking podsnapshot %s/%s Failed: HTTP %s", ns, name, resp.status)
            if resp.status in (401, 403, 404):
                return
        except (OSError, http.client.HTTPException) as e:
            log.warning("marking podsnapshot %s/%s Failed: %s", ns, name, e)
        time.sleep(min(2**attempt, 5))


@dataclass
class _Hold:
    fz: freezer.CgroupFreezer
    report: dict[str, Any] | None
    path: str  # the hold's record in the state dir


class Guard:
    def __init__(
        self, socket_path: str, state_dir: str, *, once: bool = False, idle_exit_s: float = 0, owner_pid: int = 0
    ) -> None:
        self.socket_path = socket_path
        self.state_dir = state_dir
        self.once = once
        self.idle_exit_s = idle_exit_s
        self.owner_pid = owner_pid  # a persistent private guard's process: exit, idle, once it is gone
        self.root = freezer.cgroupfs_root(_host_pid())  # refreshed before each check (_current_root)
        self._lock = threading.Lock()
        self._active = 0
        self._served = 0
        self._last_end = time.monotonic()
        self._reported: set[str] = set()
        self._reports: list[threading.Thread] = []
        self._held: dict[str, _Hold] = {}
        self._stop = threading.Event()

    def _current_root(self) -> str:
        """The cgroupfs root through the host process of now (a root not reached through /proc/PID/root,
        the agent's own or a test's, stays as it is)."""
        if _PROC_ROOT.match(self.root):
            self.root = freezer.cgroupfs_root(_host_pid())
        return self.root

    # Holds survive in the state dir: a guard killed while holding thaws them when it comes back.
    def recover(self) -> list[str]:
        thawed = []
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        for entry in sorted(os.listdir(self.state_dir)):
            if not entry.endswith(".hold"):
                continue
            path = os.path.join(self.state_dir, entry)
            try:
                with open(path) as f:
                    rec = json.load(f)
                root = self._current_root()
                fz = freezer.CgroupFreezer(_rebase(str(rec["directory"]), root), bool(rec["v2"]))
                check_target(fz, protected=[], root=root)
                fz.thaw()
                thawed.append(fz.directory)
                if rec.get("report"):
                    self._report(rec["report"], "the freeze guard restarted while the pod was frozen; it thawed it")
            except (OSError, ValueError, KeyError, TypeError, GuardError) as e:
                log.warning("hold %s: %s", entry, e)
            with contextlib.suppress(OSError):
                os.unlink(path)
        return thawed

    def serve(self) -> None:
        os.makedirs(os.path.dirname(self.socket_path) or ".", exist_ok=True)
        srv = safefs.listen_unix(self.socket_path, 64)
        srv.settimeout(0.5)
        log.info("freeze guard listening on %s (cgroupfs %s)", self.socket_path, self.root)
        with srv:
            while not self._stop.is_set():
                try:
                    conn, _ = srv.accept()
                except TimeoutError:
                    if self._should_exit():
                        break
                    continue
                with self._lock:
                    self._active += 1
                    self._served += 1
                threading.Thread(target=self._handle, args=(conn,), daemon=True).start()
        with contextlib.suppress(OSError):
            os.unlink(self.socket_path)

    def _should_exit(self) -> bool:
        with self._lock:
            idle = self._active == 0
            if self.once and idle and self._served:
                return True
            if idle and self.owner_pid and not _alive(self.owner_pid):
                return True
            return bool(self.idle_exit_s and idle and time.monotonic() - self._last_end > self.idle_exit_s)

    def _report(self, report: dict[str, Any], reason: str) -> None:
        key = f"{report.get('namespace')}/{report.get('name')}/{report.get('uid')}"
        with self._lock:
            if key in self._reported:
                return
            self._reported.add(key)
            t = threading.Thread(target=report_failed, args=(report, reason), daemon=True)
            self._reports.append(t)
        t.start()

    def shutdown(self, reason: str) -> None:
        """Thaw everything held now and report it (SIGTERM: the agent's pod is being stopped)."""
        with self._lock:
            held = list(self._held.values())
            self._held.clear()
        for h in held:
            with contextlib.suppress(OSError):
                h.fz.thaw()
            with contextlib.suppress(OSError):
                os.unlink(h.path)
            log.warning("%s: %s", h.fz.directory, reason)
        for h in held:
            if h.report:
                self._report(h.report, reason)
        self.wait_reports(15)

    def wait_reports(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        with self._lock:
            reports = list(self._reports)
        for t in reports:
            t.join(max(0.0, end - time.monotonic()))

    def _handle(self, conn: socket.socket) -> None:
        try:
            with conn:
                self._session(conn)
        except Exception:
            log.exception("freeze guard connection failed")
        finally:
            with self._lock:
                self._active -= 1
                self._last_end = time.monotonic()

    def _session(self, conn: socket.socket) -> None:
        peer_pid, peer_uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        reader = _Lines(conn)
        conn.settimeout(FREEZE_REPLY_S)
        try:
            req = json.loads(reader.readline(65536) or b"null")
        except (ValueError, OSError):
            return
        if req is None:  # an empty connection (a private guard's wake-up call)
            return
        if peer_uid != os.geteuid():
            _send(conn, {"ok": False, "error": f"uid {peer_uid} may not use the freeze guard"})
            return
        if not isinstance(req, dict) or req.get("op") != "freeze":
            _send(conn, {"ok": False, "error": "expected a freeze request"})
            return
        try:
            deadline_s = _deadline(req.get("deadline_s"))
            hold = self._freeze(req, peer_pid)
        except (GuardError, OSError, ValueError, TypeError) as e:
            _send(conn, {"ok": False, "error": str(e)})
            return
        with self._lock:
            self._held[hold.path] = hold
        try:
            self._hold(conn, reader, hold, deadline_s)
        finally:
            with self._lock:
                self._held.pop(hold.path, None)
            with contextlib.suppress(OSError):
                hold.fz.thaw()
            with contextlib.suppress(OSError):
                os.unlink(hold.path)

    def _freeze(self, req: dict[str, Any], peer_pid: int) -> _Hold:
        pid = req.get("pid")
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 1 or pid in (os.getpid(), peer_pid):
            raise GuardError(f"refused: pid {pid!r} is not a container's task")
        report = req.get("report") if isinstance(req.get("report"), dict) else None
        from shim.host.facts import host_pid_once  # as _host_pid: not at the guard's start

        with host_pid_once():  # four cgroups placed, one look for the host's process
            fz = freezer.lookup(pid)
            if fz is None:
                raise GuardError(f"the cgroup freezer of task {pid} cannot be placed on this host")
            root = self._current_root()
            fz = freezer.CgroupFreezer(_rebase(fz.directory, root), fz.v2)
            mine = (_cgroup_of(os.getpid()), _cgroup_of(peer_pid), _cgroup_of(1))
        protected = [_rebase(d, root) for d in mine if d]
        check_target(fz, protected=protected, root=root)
        path = os.path.join(self.state_dir, f"{uuid.uuid4().hex}.hold")
        with open(path, "w") as f:  # before the freeze: a guard killed right after it still thaws
            json.dump({"directory": fz.directory, "v2": fz.v2, "report": report, "pid": pid}, f)
        try:
            fz.freeze()  # thaws again and raises if the cgroup does not freeze in time
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        return _Hold(fz, report, path)

    def _hold(self, conn: socket.socket, reader: _Lines, hold: _Hold, deadline_s: float) -> None:
        end = time.monotonic() + deadline_s
        _send(conn, {"ok": True, "directory": hold.fz.directory, "deadline_s": deadline_s})
        expired = False
        while True:
            remaining = EXPIRED_WAIT_S if expired else end - time.monotonic()
            try:
                if remaining <= 0:
                    raise TimeoutError
                conn.settimeout(remaining)
                line = reader.readline(4096)
            except TimeoutError:
                if expired:
                    return
                hold.fz.thaw()
                expired = True
                reason = (
                    f"the pod stayed frozen past its deadline of {deadline_s:.0f} s (the agent hung or the dump "
                    "was too slow); the freeze guard thawed it"
                )
                log.warning("%s: %s", hold.fz.directory, reason)
                if hold.report:
                    self._report(hold.report, reason)
                with contextlib.suppress(OSError):
                    _send(conn, {"event": "expired"})
                continue
            except OSError:
                line = b""
            if not line:  # the holder went away without thawing
                hold.fz.thaw()
                if not expired:
                    reason = (
                        "the agent went away while the pod was frozen (its hold on the freeze guard closed); "
                        "the freeze guard thawed it"
                    )
                    log.warning("%s: %s", hold.fz.directory, reason)
                    if hold.report:
                        self._report(hold.report, reason)
                return
            try:
                op = json.loads(line).get("op")
            except (ValueError, AttributeError):
                op = None
            if op == "thaw":
                hold.fz.thaw()
                with contextlib.suppress(OSError):
                    _send(conn, {"ok": True, "expired": expired})
                return


def _deadline(value: Any) -> float:
    """The hold's deadline in seconds: a finite number, at least 0.1, at most MAX_DEADLINE_S."""
    if value is None:
        return MAX_DEADLINE_S
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise GuardError(f"refused: deadline {value!r} is not a number of seconds")
    return min(max(float(value), 0.1), MAX_DEADLINE_S)


class _Lines:
    """Lines from a socket, with whatever timeout the socket has (a makefile() is unusable after one)."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.buf = b""

    def readline(self, limit: int) -> bytes:
        while b"\n" not in self.buf and len(self.buf) < limit:
            data = self.conn.recv(4096)
            if not data:
                line, self.buf = self.buf, b""
                return line
            self.buf += data
        line, sep, rest = self.buf.partition(b"\n")
        self.buf = rest
        return line + sep


def _send(conn: socket.socket, msg: dict[str, Any]) -> None:
    conn.sendall(json.dumps(msg).encode() + b"\n")


def _host_pid() -> int | None:
    from shim.host.facts import host_pid

    return host_pid()


# --- the agent's side ------------------------------------------------------------------------------


class GuardedFreezer:
    """A container's freezer held through the guard (shim.engine.node_ports.Freezer)."""

    def __init__(self, client: GuardClient, pid: int, direct: freezer.CgroupFreezer) -> None:
        self.client, self.pid, self.direct = client, pid, direct
        self._conn: socket.socket | None = None
        self._reader: _Lines | None = None

    def frozen(self) -> bool:
        return self.direct.frozen()

    def ready(self) -> None:
        self.client.wait_ready()

    def freeze(self, *, deadline_s: float | None = None) -> None:
        self.client.wait_ready()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(FREEZE_REPLY_S)
        try:
            conn.connect(self.client.socket_path)
            req = {"op": "freeze", "pid": self.pid, "deadline_s": deadline_s or MAX_DEADLINE_S}
            if self.client.report:
                req["report"] = self.client.report
            _send(conn, req)
            reader = _Lines(conn)
            reply = json.loads(reader.readline(65536) or b"null")
        except (OSError, ValueError) as e:
            conn.close()
            raise GuardError(
                f"the freeze guard at {self.client.socket_path} did not answer: {e}",
                hint="check the guard container of the agent's pod (kubectl logs -c guard); nothing was frozen",
            ) from e
        if not isinstance(reply, dict) or not reply.get("ok"):
            conn.close()
            why = reply.get("error") if isinstance(reply, dict) else "no answer"
            raise GuardError(f"the freeze guard did not freeze task {self.pid}: {why}", hint="nothing was frozen")
        self._conn, self._reader = conn, reader

    def thaw(self) -> None:
        conn, self._conn = self._conn, None
        reader, self._reader = self._reader, None
        if conn is None or reader is None:  # not held (any more): thaw directly, which is idempotent
            self.direct.thaw()
            return
        with conn:
            try:
                _send(conn, {"op": "thaw"})
                while True:
                    reply = json.loads(reader.readline(65536) or b"null")
                    if not isinstance(reply, dict) or "event" not in reply:
                        break
            except (OSError, ValueError):
                reply = None
        if not isinstance(reply, dict) or not reply.get("ok"):
            self.direct.thaw()
            raise GuardError(
                "the freeze guard went away while the pod was frozen; the snapshot may be inconsistent",
                hint="the pod was thawed and keeps running; create a new PodSnapshot",
            )
        if reply.get("expired"):
            raise GuardError(
                "the pod stayed frozen past its deadline and the freeze guard thawed it before the dump ended",
                hint="the pod keeps running; a pod with much memory on a slow node may need more time than the "
                "deadline (see docs/troubleshooting.md)",
            )


class GuardClient:
    """Builds guarded freezers (`freezer_for`) against one guard socket."""

    def __init__(
        self, socket_path: str, report: dict[str, Any] | None = None, ready: Callable[[], None] | None = None
    ) -> None:
        self.socket_path = socket_path
        self.report = report
        self._ready = ready

    def wait_ready(self) -> None:
        """Wait for a guard that is still starting (private_guard); the agent's guard is up already."""
        if self._ready is not None:
            self._ready()
            self._ready = None

    def freezer_for(self, pid: int) -> GuardedFreezer | None:
        fz = freezer.lookup(pid)
        return GuardedFreezer(self, pid, fz) if fz is not None else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, under another uid
    return True


@contextlib.contextmanager
def private_guard(report: dict[str, Any] | None = None, *, persistent: bool = False) -> Iterator[GuardClient]:
    """A guard of this process's own, for one standalone checkpoint: a child in its own session (so a
    Ctrl-C or a kill of the CLI's process group does not reach it) that exits after its last hold.
    `persistent`: one guard for many checkpoints (`ks-agent serve`), stopped when the block ends."""
    import shim

    tmp = tempfile.mkdtemp(prefix="kubectl-snapshot-guard-")
    sock = os.path.join(tmp, "guard.sock")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(shim.__file__))), env.get("PYTHONPATH", "")]
    ).rstrip(os.pathsep)
    log_file = open(os.path.join(tmp, "guard.log"), "wb")  # noqa: SIM115
    # persistent: for as long as this process lives (a SIGKILL of it leaves no guard behind)
    lifetime = ("--owner-pid", str(os.getpid())) if persistent else ("--once", "--idle-exit", "60")
    proc = subprocess.Popen(
        [sys.executable, "-m", "shim.freeze_guard", "--socket", sock, "--state-dir", tmp, *lifetime],
        stdin=subprocess.DEVNULL,
        stdout=log_file,
        stderr=log_file,
        env=env,
        start_new_session=True,
    )
    log_file.close()

    waited: list[bool] = []

    def ready() -> None:
        waited.append(True)
        end = time.monotonic() + 10
        while not os.path.exists(sock):
            if proc.poll() is not None or time.monotonic() > end:
                with open(os.path.join(tmp, "guard.log"), errors="replace") as f:
                    tail = f.read()[-2000:]
                raise GuardError(f"the private freeze guard did not start: {tail.strip() or 'no output'}")
            time.sleep(0.005)

    try:
        # the guard starts (a Python process: ~0.1 s) while the caller prepares; the first freeze waits
        yield GuardClient(sock, report, ready)
    finally:
        if not waited:  # never asked to freeze anything: it holds nothing, stop it however far it got
            proc.kill()
            proc.wait()
        elif persistent:  # every hold has ended with the work of the block: it holds nothing now
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        else:
            # Every hold has ended by now; a --once guard exits after its last one, and after this
            # empty connection if it never held anything.
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                c.settimeout(2)
                c.connect(sock)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        if proc.poll() is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def parser() -> argparse.ArgumentParser:
    import argparse  # the agent imports this module for the client side only

    p = argparse.ArgumentParser(prog="kubectl-snapshot-guard", description=__doc__.split("\n\n")[0])
    p.add_argument("--socket", default=os.environ.get(ENV_SOCKET, "/run/kubectl-snapshot-guard/guard.sock"))
    p.add_argument("--state-dir", default="/run/kubectl-snapshot-guard/holds")
    p.add_argument("--once", action="store_true", help="Exit once every connection has ended (private guard).")
    p.add_argument("--idle-exit", type=float, default=0, help="Exit after this many idle seconds (0: never).")
    p.add_argument("--owner-pid", type=int, default=0, help="Exit, once idle, when this process is gone.")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s guard: %(message)s")
    guard = Guard(args.socket, args.state_dir, once=args.once, idle_exit_s=args.idle_exit, owner_pid=args.owner_pid)

    def on_term(signum: int, _frame: Any) -> None:
        guard.shutdown(f"the freeze guard was stopped (signal {signum}) while the pod was frozen; it thawed it")
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    thawed = guard.recover()
    if thawed:
        log.warning("thawed what an earlier guard held: %s", ", ".join(thawed))
    guard.serve()
    guard.wait_reports(15)  # failure reports still in flight (daemon threads)


if __name__ == "__main__":
    main()
