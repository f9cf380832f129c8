"""The agent's Prometheus metrics: what was saved and restored, how long each step took, what it cost.

One registry per agent process (not prometheus_client's global one, so that tests and the standalone
commands do not share state). The controller records through :class:`AgentMetrics`; the metrics
server (shim/service/metrics_server.py) serves :attr:`AgentMetrics.registry` to authorised scrapers only.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# Seconds: a freeze is milliseconds to seconds, an upload seconds to many minutes.
_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 1800)
NS = "kubectl_snapshot"
MAX_TRACKED_PODS = 10_000  # last-save ages kept (oldest dropped first): bounded memory


class _LastSaves(Collector):
    """``kubectl_snapshot_last_save_age_seconds{namespace,pod}``, computed at scrape time."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str], float] = {}

    def saved(self, namespace: str, pod: str) -> None:
        with self._lock:
            self._last.pop((namespace, pod), None)
            self._last[(namespace, pod)] = self._clock()
            while len(self._last) > MAX_TRACKED_PODS:
                self._last.pop(next(iter(self._last)))

    def forget(self, namespace: str, pod: str) -> None:
        with self._lock:
            self._last.pop((namespace, pod), None)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily(
            f"{NS}_last_save_age_seconds",
            "Seconds since the last successful save of each pod this agent saved.",
            labels=["namespace", "pod"],
        )
        now = self._clock()
        with self._lock:
            for (ns, pod), t in self._last.items():
                g.add_metric([ns, pod], now - t)
        yield g


class _DiskReserved(Collector):
    """``kubectl_snapshot_disk_reserved_bytes{kind,namespace}``: what the node's disk ledger holds for the
    dumps and restores in flight (shim/host/diskspace.py), read at scrape time."""

    def __init__(self, held: Callable[[], Mapping[tuple[str, str], int]]) -> None:
        self._held = held

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily(
            f"{NS}_disk_reserved_bytes",
            "Disk bytes reserved for dumps and restore staging in flight, by kind and namespace.",
            labels=["kind", "namespace"],
        )
        for (kind, namespace), n in sorted(self._held().items()):
            g.add_metric([kind, namespace], n)
        yield g


class AgentMetrics:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.saves = Counter(f"{NS}_saves", "Snapshots taken, by result.", ["result"], registry=r)
        self.restores = Counter(f"{NS}_restores", "Restores staged, by result.", ["result"], registry=r)
        self.freeze = Histogram(f"{NS}_freeze_seconds", "How long the pod was frozen.", buckets=_BUCKETS, registry=r)
        self.dump = Histogram(f"{NS}_dump_seconds", "CRIU dump time of a pod.", buckets=_BUCKETS, registry=r)
        self.upload = Histogram(
            f"{NS}_upload_seconds", "Packaging and upload time of a snapshot.", buckets=_BUCKETS, registry=r
        )
        self.restore = Histogram(
            f"{NS}_restore_seconds", "Time to pull, verify and stage a restore.", buckets=_BUCKETS, registry=r
        )
        self.uploaded_bytes = Counter(f"{NS}_uploaded_bytes", "Bytes sent to registries.", registry=r)
        self.skipped_bytes = Counter(
            f"{NS}_skipped_bytes", "Bytes not sent because the registry already had them.", registry=r
        )
        self.in_progress = Gauge(
            f"{NS}_operations_in_progress", "Snapshots and restores being worked on.", ["kind"], registry=r
        )
        self.queue = Gauge(
            f"{NS}_queue_length", "PodSnapshots for this node's pods seen but not started yet.", registry=r
        )
        self.last_saves = _LastSaves(clock)
        r.register(self.last_saves)

    def track_disk(self, held: Callable[[], Mapping[tuple[str, str], int]]) -> None:
        """Serve what `held` reports (the node's disk ledger) as kubectl_snapshot_disk_reserved_bytes."""
        self.registry.register(_DiskReserved(held))

    def saved(self, namespace: str, pod: str, *, timings_ms: Mapping[str, float], size: int, uploaded: int) -> None:
        self.saves.labels("succeeded").inc()
        for hist, key in ((self.freeze, "freeze_ms"), (self.dump, "dump_ms"), (self.upload, "upload_ms")):
            if key in timings_ms:
                hist.observe(timings_ms[key] / 1000)
        self.uploaded_bytes.inc(uploaded)
        self.skipped_bytes.inc(max(0, size - uploaded))
        self.last_saves.saved(namespace, pod)

    def save_failed(self) -> None:
        self.saves.labels("failed").inc()

    def restored(self, seconds: float) -> None:
        self.restores.labels("succeeded").inc()
        self.restore.observe(seconds)

    def restore_failed(self) -> None:
        self.restores.labels("failed").inc()
