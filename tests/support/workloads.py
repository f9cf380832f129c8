"""The real workloads of the conformance suite (tests/e2e/test_conformance.py), as users run them.

Each is an image built from Debian packages (debootstrap bookworm minbase, cached by the packages'
versions: tests/support/images.py) or, for the static binary, an image of that binary alone, plus the
command that starts it and a way to read its state from outside: every one answers `GET /` on
port 8080 (or its own status) with a token only its memory holds, a counter, and its pids, which a
restore must carry on (same token and pids, a counter no lower).

The Debian images carry busybox at /opt/busybox/busybox for the test's reads (`wget`); the static
image has no shell at all, so its binary reads its own state (`/server get`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.support.images import BUSYBOX, CACHE_DIR, debian_tarball, scratch_tarball

PORT = 8080
BUSYBOX_AT = "/opt/busybox/busybox"
WGET = [BUSYBOX_AT, "wget", "-qO-", f"http://127.0.0.1:{PORT}/"]


@dataclass(frozen=True)
class Workload:
    """One application: its image (a cached OCI layout tarball), how it starts, how its state is read."""

    name: str
    what: str  # for the coverage table
    image: str  # the name it is pushed under, in the cluster's registry
    tarball: Callable[[], Path]
    command: list[str]
    read: list[str]  # argv run in the container (kubectl exec) that prints its state
    # the words of the state that a restore keeps (token, pids) and the one that only grows (a counter)
    same: tuple[int, ...] = (0, 2)
    grows: int = 1
    # root-owned settings the workload cannot run under (nginx's master switches workers' groups)
    needs_caps: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    writes: tuple[str, ...] = ("/tmp",)  # what it writes: emptyDirs there under a read-only root


def _busybox_file() -> dict[str, tuple[bytes, int]]:
    if not BUSYBOX.exists():
        pytest.skip(f"{BUSYBOX} is missing (apt-get install busybox-static)")
    return {BUSYBOX_AT: (BUSYBOX.read_bytes(), 0o755)}


# --- the JVM: Debian's OpenJDK 17, an HTTP server of the JDK's own (com.sun.net.httpserver) -------------

JAVA_SERVER = """
import com.sun.net.httpserver.HttpServer;
import java.net.InetSocketAddress;
import java.util.concurrent.atomic.AtomicLong;

public class Server {
    public static void main(String[] args) throws Exception {
        String tok = Long.toHexString(new java.security.SecureRandom().nextLong());
        AtomicLong n = new AtomicLong();
        Thread t = new Thread(() -> {
            while (true) {
                n.incrementAndGet();
                try { Thread.sleep(100); } catch (InterruptedException e) { return; }
            }
        });
        t.setDaemon(true);
        t.start();
        HttpServer s = HttpServer.create(new InetSocketAddress(8080), 16);
        s.createContext("/", ex -> {
            byte[] b = (tok + " " + n.get() + " " + ProcessHandle.current().pid() + "\\n").getBytes();
            ex.sendResponseHeaders(200, b.length);
            ex.getResponseBody().write(b);
            ex.close();
        });
        s.start();
    }
}
"""


def _javac(source: str) -> bytes:
    """Server.class compiled by the host's javac for Java 17 (the image carries only the JRE)."""
    javac = shutil.which("javac")
    if javac is None:
        pytest.skip("javac is missing (apt-get install openjdk-17-jdk-headless)")
    key = hashlib.sha256(source.encode()).hexdigest()[:16]
    out = CACHE_DIR / f"java-server-{key}.class"
    if out.exists():
        return out.read_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "Server.java").write_text(source)
        subprocess.run([javac, "--release", "17", "-d", tmp, str(Path(tmp) / "Server.java")], check=True, timeout=300)
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(tmp) / "Server.class", out)
    return out.read_bytes()


def _jvm_tarball() -> Path:
    files = {"/app/Server.class": (_javac(JAVA_SERVER), 0o644), **_busybox_file()}
    return debian_tarball("jvm", "localhost/ks-conformance/jvm:1", ["openjdk-17-jre-headless"], files=files)


JVM = Workload(
    name="jvm",
    what="JVM service (Debian's OpenJDK 17, com.sun.net.httpserver)",
    image="ks-conformance/jvm:1",
    tarball=_jvm_tarball,
    # no perf data file in /tmp, a small serial heap: what container-sized JVMs run with
    command=["java", "-Xmx64m", "-XX:+UseSerialGC", "-XX:-UsePerfData", "-cp", "/app", "Server"],
    read=WGET,
)

# --- Node.js: Debian's nodejs, its http module ----------------------------------------------------------

NODE_SERVER = """
const http = require('http');
const tok = require('crypto').randomBytes(8).toString('hex');
let n = 0;
setInterval(() => { n += 1; }, 100);
http.createServer((req, res) => { res.end(`${tok} ${n} ${process.pid}\\n`); }).listen(8080);
"""


def _node_tarball() -> Path:
    files = {"/app/server.js": (NODE_SERVER.encode(), 0o644), **_busybox_file()}
    return debian_tarball("node", "localhost/ks-conformance/node:1", ["nodejs"], files=files)


NODE = Workload(
    name="node",
    what="Node.js server (Debian's nodejs, http module)",
    image="ks-conformance/node:1",
    tarball=_node_tarball,
    command=["node", "/app/server.js"],
    read=WGET,
)

# --- Python web app: Flask on Werkzeug's threaded server ----------------------------------------------

FLASK_APP = """
import os, threading, time
from flask import Flask
app = Flask(__name__)
tok, n = os.urandom(8).hex(), [0]
def tick():
    while True:
        n[0] += 1
        time.sleep(0.1)
threading.Thread(target=tick, daemon=True).start()
@app.get("/")
def state():
    return f"{tok} {n[0]} {os.getpid()}\\n"
if __name__ == "__main__":
    app.run(host="0.0.0.0", port=8080, threaded=True)
"""


def _flask_tarball() -> Path:
    files = {"/app/app.py": (FLASK_APP.encode(), 0o644), **_busybox_file()}
    return debian_tarball("flask", "localhost/ks-conformance/flask:1", ["python3-flask"], files=files)


FLASK = Workload(
    name="flask",
    what="Python web app (Flask 2.2 on Werkzeug, threaded)",
    image="ks-conformance/flask:1",
    tarball=_flask_tarball,
    command=["python3", "/app/app.py"],
    read=WGET,
    env={"PYTHONDONTWRITEBYTECODE": "1"},
)

# --- a multi-process server with SysV and POSIX shared memory: gunicorn, 2 workers ---------------------
# PostgreSQL refuses to run as root, and these machines cannot dump a process of another uid
# (../shared/docs/PLATFORM.md), so the multi-process server is gunicorn (a master and its workers, as
# root): the app, preloaded by the master, keeps its counters in a SysV segment (shmget) and in a POSIX
# one (/dev/shm) that every worker maps.

SHM_APP = """
import ctypes, mmap, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
shmid = libc.shmget(0, 4096, 0o1000 | 0o600)  # IPC_PRIVATE, IPC_CREAT
assert shmid >= 0, ctypes.get_errno()
sysv = ctypes.c_long.from_address(libc.shmat(shmid, None, 0))
fd = os.open("/dev/shm/app-counter", os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 4096)
posix = ctypes.c_long.from_buffer(mmap.mmap(fd, 4096))
tok = os.urandom(8).hex()
def app(environ, start):
    sysv.value += 1
    posix.value += 1
    body = f"{tok} {sysv.value} {os.getppid()} {posix.value}\\n".encode()
    start("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
    return [body]
"""


def _shm_tarball() -> Path:
    files = {"/app/shmapp.py": (SHM_APP.encode(), 0o644), **_busybox_file()}
    return debian_tarball("shm", "localhost/ks-conformance/gunicorn:1", ["gunicorn"], files=files)


SHM = Workload(
    name="gunicorn-shm",
    what="multi-process server with SysV and POSIX shared memory (gunicorn master + 2 workers)",
    image="ks-conformance/gunicorn:1",
    tarball=_shm_tarball,
    command=["gunicorn", "--preload", "--workers", "2", "--bind", "0.0.0.0:8080", "--chdir", "/app", "shmapp:app"],
    read=WGET,
    same=(0, 2),  # the token and the master's pid (a request lands on either worker)
    grows=1,
    env={"PYTHONDONTWRITEBYTECODE": "1"},
)

# --- nginx: a master and two workers ------------------------------------------------------------------

NGINX_CONF = """
user root;
worker_processes 2;
daemon off;
pid /tmp/nginx.pid;
error_log stderr;
events { worker_connections 64; }
http {
    access_log off;
    client_body_temp_path /tmp/body; proxy_temp_path /tmp/proxy; fastcgi_temp_path /tmp/fcgi;
    uwsgi_temp_path /tmp/uwsgi; scgi_temp_path /tmp/scgi;
    server {
        listen 8080;
        location / { return 200 "$hostname $connection $pid\\n"; }
    }
}
"""
# its state: the master's pid and the workers' (its own /proc), which a restore keeps
NGINX_READ = [
    BUSYBOX_AT,
    "sh",
    "-c",
    "echo $(cat /tmp/nginx.pid) $(cat /proc/*/stat | wc -l) $(pidof nginx | tr ' ' ,)",
]


def _nginx_tarball() -> Path:
    files = {"/etc/nginx/nginx.conf": (NGINX_CONF.encode(), 0o644), **_busybox_file()}
    return debian_tarball("nginx", "localhost/ks-conformance/nginx:1", ["nginx-light"], files=files)


NGINX = Workload(
    name="nginx",
    what="nginx (master + 2 workers)",
    image="ks-conformance/nginx:1",
    tarball=_nginx_tarball,
    command=["nginx", "-c", "/etc/nginx/nginx.conf"],
    read=NGINX_READ,
    same=(0, 2),  # the master's pid and every nginx pid
    grows=-1,
    needs_caps=("SETUID", "SETGID", "CHOWN"),
)

# --- a static binary in an image with no shell (distroless-like): a Go HTTP server ---------------------

GO_SERVER = """
package main

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"os"
	"sync/atomic"
	"time"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "get" { // the image has no shell: the binary reads its own state
		r, err := http.Get("http://127.0.0.1:8080/")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		io.Copy(os.Stdout, r.Body)
		return
	}
	b := make([]byte, 8)
	rand.Read(b)
	tok := hex.EncodeToString(b)
	var n atomic.Int64
	go func() {
		for {
			n.Add(1)
			time.Sleep(100 * time.Millisecond)
		}
	}()
	http.HandleFunc("/", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintf(w, "%s %d %d\\n", tok, n.Load(), os.Getpid())
	})
	http.ListenAndServe(":8080", nil)
}
"""


def _go_build(source: str) -> bytes:
    go = shutil.which("go") or ("/usr/local/go/bin/go" if os.path.exists("/usr/local/go/bin/go") else None)
    if go is None:
        pytest.skip("go is missing (the Go toolchain builds the static test binary)")
    key = hashlib.sha256(source.encode()).hexdigest()[:16]
    out = CACHE_DIR / f"go-server-{key}"
    if out.exists():
        return out.read_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "main.go").write_text(source)
        (Path(tmp) / "go.mod").write_text("module server\n\ngo 1.21\n")
        env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-trimpath", "GOPROXY": "off"}
        subprocess.run([go, "build", "-o", str(Path(tmp) / "server"), "."], cwd=tmp, env=env, check=True, timeout=600)
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(Path(tmp) / "server", out)
    return out.read_bytes()


def _static_tarball() -> Path:
    files = {"/server": (_go_build(GO_SERVER), 0o755)}
    return scratch_tarball("static", "localhost/ks-conformance/static:1", files, {"Entrypoint": ["/server"]})


STATIC = Workload(
    name="static",
    what="static Go binary in an image with no shell, libc or /etc",
    image="ks-conformance/static:1",
    tarball=_static_tarball,
    command=["/server"],
    read=["/server", "get"],
    writes=(),
)

# --- busybox: the project's own counter --------------------------------------------------------------

BUSYBOX_COUNTER = (
    "tok=$(cat /proc/sys/kernel/random/uuid); i=0; "
    'while true; do i=$((i+1)); echo "$tok $i $$" > /tmp/count.t; mv /tmp/count.t /tmp/count; sleep 0.2; done'
)

BUSYBOX_WL = Workload(
    name="busybox",
    what="busybox shell loop",
    image="",  # the cluster's own busybox image
    tarball=lambda: Path(),
    command=["sh", "-c", BUSYBOX_COUNTER],
    read=["cat", "/tmp/count"],
)

ALL: tuple[Workload, ...] = (JVM, NODE, FLASK, SHM, NGINX, STATIC, BUSYBOX_WL)


def parse_state(workload: Workload, text: str) -> list[str]:
    words = text.split()
    if len(words) < max((*workload.same, workload.grows)) + 1:
        raise ValueError(f"{workload.name}: unexpected state {text!r}")
    return words


def carried_on(workload: Workload, before: str, after: str) -> str | None:
    """None when `after` is `before` carried on (same token and pids, counter no lower); else why not."""
    b, a = parse_state(workload, before), parse_state(workload, after)
    for i in workload.same:
        if b[i] != a[i]:
            return f"{workload.name}: word {i} changed from {b[i]!r} to {a[i]!r} (a fresh start, not a restore)"
    if workload.grows >= 0 and int(a[workload.grows]) < int(b[workload.grows]):
        return f"{workload.name}: the counter went back from {b[workload.grows]} to {a[workload.grows]}"
    return None


def manifest_container(workload: Workload, image: str, name: str = "app") -> dict[str, Any]:
    c: dict[str, Any] = {"name": name, "image": image, "command": list(workload.command)}
    if workload.env:
        c["env"] = [{"name": k, "value": v} for k, v in sorted(workload.env.items())]
    return c
