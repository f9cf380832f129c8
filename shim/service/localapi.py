"""The agent's node-local socket: `ks-agent checkpoint|restore` run by the node's warm agent.

`ks-agent` is a node tool like `ctr`, and like `ctr` it can be a thin client of the daemon already
running on the node: the DaemonSet's `ks-agent run` (and `ks-agent serve`, the same without Kubernetes)
listen on a Unix socket in the agent's state dir. A `checkpoint` or `restore` then skips what a fresh
process pays before its first useful call (the interpreter, ~600 imported modules, a gRPC channel, a
private freeze guard) and uses the agent's own freeze guard, containerd connection and page index.

Trust: the socket is root's alone (created with umask 077 in the agent's state dir), and the server accepts only peers
whose credentials (SO_PEERCRED, given by the kernel) are root's, who could run the same command
standalone. The server acts only on requests it would give the same answer to as a standalone run:
the same containerd address and namespace, the same working directory and the same values of the
environment variables the commands read; otherwise it declines and the client runs the command itself.

Protocol: one JSON object per line. The client sends one request
``{"v": 1, "command": ..., "argv": [...], "cwd": ..., "env": {...}}``; the server answers with any number
of ``{"phase": NAME}`` and ``{"bytes": [N, TOTAL]}`` lines (progress), then exactly one of
``{"result": DATA, "output": FORMAT, "rendered": TEXT}`` (TEXT: what the command prints on stdout; where the
format could not be applied, ``"render_error"`` instead of it), ``{"error": TEXT, "exit": CODE}`` or
``{"declined": WHY}``.

Two clients speak it: this module's (the Python `ks-agent`, shim/agent_entry.py) and the node's static
launcher in front of it (launcher/agentclient.go, configured by `client_launch`), which serves a
command without starting an interpreter where no terminal waits for a progress bar.

Standard library only: the client side runs before anything heavy is imported, and imports nothing of
the server's (logging, shim.host.safefs, threads): `ks-agent`'s start-up is part of every served command's time.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import threading
from collections.abc import Callable, Mapping

TYPE_CHECKING = False  # typing is not imported at run time: the client's start-up (ks-agent)
if TYPE_CHECKING:
    import logging
    import queue
    from typing import Any

SOCKET_ENV = "KUBECTL_SNAPSHOT_AGENT_SOCKET"  # a path, or "none": always run standalone
SOCKET_NAME = "agent.sock"
VERSION = 1
MAX_REQUEST = 1 << 20
REQUEST_WAIT_S = 30.0
PROGRESS_BACKLOG = 64
ANSWER_WAIT_S = 30.0
COMMANDS = ("checkpoint", "restore")
# what the commands (and the libraries they use) read from the environment: a request is served only
# where these are equal. Registry credentials (docker config, its credential helpers on PATH), TLS trust
# and proxies (requests), temporary files, the code itself.
_ENV_PREFIXES = ("KUBECTL_SNAPSHOT_", "CONTAINERD_")
_ENV_NAMES = (
    "DOCKER_CONFIG", "HOME", "PATH", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE", "SSL_CERT_DIR",
    "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "no_proxy", "all_proxy",
    "TMPDIR", "PYTHONPATH",
)  # fmt: skip

Send = Callable[[dict[str, "Any"]], None]
Handler = Callable[[dict[str, "Any"], Send], None]


def _log() -> logging.Logger:
    import logging  # the server's only: the client never logs

    return logging.getLogger(__name__)


def relevant_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if (k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES) and k != SOCKET_ENV}


def env_differences(client: Mapping[str, str], server: Mapping[str, str]) -> list[str]:
    """The names of the variables the commands read whose values differ between client and server."""
    mine, theirs = relevant_env(server), relevant_env(client)
    return sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))


def peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def _write(conn: socket.socket, msg: dict[str, Any]) -> None:
    conn.sendall(json.dumps(msg, separators=(",", ":")).encode() + b"\n")


class LocalServer:
    """Serves requests on `path` with `handler`, one thread per connection, until `stop`."""

    def __init__(self, path: str, handler: Handler) -> None:
        self.path = path
        self._handler = handler
        self._stop = threading.Event()
        self._sock: socket.socket | None = None

    def start(self) -> LocalServer:
        os.makedirs(os.path.dirname(self.path) or ".", mode=0o700, exist_ok=True)
        from shim.host import safefs

        srv = safefs.listen_unix(self.path, 16)  # replaces a dead agent's socket
        srv.settimeout(0.5)
        self._sock = srv
        threading.Thread(target=self._accept, name="local-api", daemon=True).start()
        _log().info("node-local API on %s", self.path)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def _accept(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed by stop()
            threading.Thread(target=self._serve, args=(conn,), name="local-api-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                uid = peer_uid(conn)
                if uid != os.geteuid():
                    _write(conn, {"error": f"error: the agent serves only uid {os.geteuid()}, not {uid}", "exit": 1})
                    return
                conn.settimeout(REQUEST_WAIT_S)  # a client that connects and sends nothing holds no thread
                request = _read_request(conn)
                conn.settimeout(None)
                if request is None:
                    return
                if request.get("v") != VERSION or request.get("command") not in COMMANDS:
                    _write(conn, {"declined": f"unsupported request (version {request.get('v')!r})"})
                    return
                sender = _Sender(conn)
                try:
                    self._handler(request, sender)
                finally:
                    sender.close()
            except (OSError, ValueError) as e:  # the client went away, or sent garbage
                _log().info("node-local API: connection ended: %s", e)


class _Sender:
    """Answer lines from any thread (progress comes from the packaging's workers), written by a thread of
    its own: the work never waits for the client. Progress a client does not read fast enough is
    dropped (at most PROGRESS_BACKLOG lines wait); the final answer is always queued, and `close` waits
    up to ANSWER_WAIT_S for it to be written. A client that went away stops nothing: the work goes on
    to its end, as a standalone command's would after its terminal closed; the agent's log says what it
    did."""

    def __init__(self, conn: socket.socket) -> None:
        import queue

        self._conn = conn
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._waiting = 0
        self._lock = threading.Lock()
        self._writer = threading.Thread(target=self._write_all, name="local-api-send", daemon=True)
        self._writer.start()

    def __call__(self, msg: dict[str, Any]) -> None:
        progress = "phase" in msg or "bytes" in msg
        with self._lock:
            if progress and self._waiting >= PROGRESS_BACKLOG:
                return
            self._waiting += 1
        self._queue.put(msg)

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join(ANSWER_WAIT_S)

    def _write_all(self) -> None:
        gone = False
        while (msg := self._queue.get()) is not None:
            with self._lock:
                self._waiting -= 1
            if gone:
                continue
            try:
                _write(self._conn, msg)
            except OSError:
                gone = True
                _log().info("node-local API: the client left; the work goes on")


def _read_request(conn: socket.socket) -> dict[str, Any] | None:
    buf = b""
    while b"\n" not in buf:
        piece = conn.recv(65536)
        if not piece:
            return None
        buf += piece
        if len(buf) > MAX_REQUEST:
            raise ValueError("request too large")
    request = json.loads(buf.split(b"\n", 1)[0])
    return request if isinstance(request, dict) else None


# --- the client ------------------------------------------------------------------------------------


def client_launch(argv: list[str]) -> str:
    """The launch configuration (JSON, beside the launcher as ``<its path>.launch``) of a launcher that is
    `ks-agent` (launcher/agentclient.go): `argv` runs the Python program; "agentClient" holds the
    names this module's client reads, so that the launcher's client asks the agent exactly where this
    one would."""
    from kubectl_snapshot.core import constants as C

    client = {
        "version": VERSION,
        "commands": list(COMMANDS),
        "socketEnv": SOCKET_ENV,
        "socketName": SOCKET_NAME,
        "stateDirEnv": C.ENV_STATE_DIR,
        "defaultStateDir": C.DEFAULT_STATE_DIR,
        "envPrefixes": list(_ENV_PREFIXES),
        "envNames": list(_ENV_NAMES),
    }
    return json.dumps({"argv": argv, "agentClient": client}, sort_keys=True)


def socket_path(env: Mapping[str, str], state_dir: str) -> str | None:
    """Where the node's agent listens (None: configured off)."""
    value = env.get(SOCKET_ENV)
    if value is not None and value.strip().lower() in ("", "none", "off"):
        return None
    return value or os.path.join(state_dir, SOCKET_NAME)


def forward(
    path: str,
    command: str,
    argv: list[str],
    on_message: Callable[[dict[str, Any]], None],
    *,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any] | None:
    """Send the request and pass every progress line to `on_message`; returns the final answer, or None
    when no agent listens: then the caller runs the command itself. Once the request is sent, a broken
    connection is an error answer, not None: the agent may have acted on it."""
    request = {
        "v": VERSION,
        "command": command,
        "argv": argv,
        "cwd": os.getcwd(),
        "env": relevant_env(os.environ if env is None else env),
    }
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with conn:
        try:
            conn.connect(path)
        except OSError:
            return None  # no agent (ENOENT), a dead one's socket (ECONNREFUSED), not ours (EACCES)
        try:
            _write(conn, request)
            with conn.makefile("rb") as lines:
                for line in lines:
                    msg = json.loads(line)
                    if not isinstance(msg, dict):
                        raise ValueError("an answer that is not a JSON object")
                    if "phase" in msg or "bytes" in msg:
                        on_message(msg)
                        continue
                    return msg
            why = "it closed the connection without an answer"
        except (OSError, ValueError) as e:
            why = str(e)
    # The request may have been acted on: never run it a second time behind the user's back.
    return {
        "error": f"error: the node's agent ({path}) did not finish the {command}: {why}\n"
        f"hint: check the agent's log and the containers' state; {SOCKET_ENV}=none runs the command "
        "without the agent",
        "exit": 1,
    }
