"""When pods reached their phases, from one watch (not a poll): `kubectl get pods -w` in the background.

A poll reads a phase up to one poll interval plus one `kubectl get` late, and each bench that compares two
of its own times (a restore against a fresh start) would carry that error twice; the watch's line is read
when the API server sends the change. Used by bench/lazy_cluster.py for both sides of its comparison.
"""

from __future__ import annotations

import subprocess
import threading
import time
from types import TracebackType

from tests.support.cluster import Cluster

TEMPLATE = '{.metadata.name}{" "}{.status.phase}{" "}{.metadata.creationTimestamp}{"\\n"}'


class PhaseWatch:
    """`with PhaseWatch(cluster, ns) as w: ...; w.first("pod", "Running", timeout=...)` -> the monotonic
    time the watch first showed pod `pod` in that phase ("" for created: the first line naming it)."""

    def __init__(self, cluster: Cluster, namespace: str) -> None:
        self._cmd = [str(cluster.kubectl_bin), "--kubeconfig", str(cluster.kubeconfig), "get", "pods", "-n", namespace,
                     "-w", "-o", f"jsonpath={TEMPLATE}"]  # fmt: skip
        self._seen: dict[tuple[str, str], float] = {}
        self._cond = threading.Condition()
        self._proc: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PhaseWatch:
        self._proc = subprocess.Popen(self._cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            now = time.monotonic()
            name, _, rest = line.strip().partition(" ")
            phase = rest.split(" ")[0] if rest else ""
            with self._cond:
                self._seen.setdefault((name, ""), now)
                if phase:
                    self._seen.setdefault((name, phase), now)
                self._cond.notify_all()

    def first(self, pod: str, phase: str, *, timeout: float) -> float:
        deadline = time.monotonic() + timeout
        with self._cond:
            while (pod, phase) not in self._seen:
                left = deadline - time.monotonic()
                if left <= 0 or (self._proc is not None and self._proc.poll() is not None):
                    raise AssertionError(f"{pod}: not {phase or 'created'} within {timeout:.0f} s (watch)")
                self._cond.wait(min(left, 1.0))
            return self._seen[(pod, phase)]
