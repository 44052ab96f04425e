"""Prometheus metrics of the agent on their own registry, and the /metrics endpoint.

A private :class:`CollectorRegistry` (not prometheus_client's global one) keeps tests
independent and the endpoint limited to what we define. The publisher's process-wide counts
(``agent/publish/metrics.py``, plain numbers so publishing never loads this library) are
exported by a bridge collector, so one endpoint shows everything once. Without an endpoint
the daemon keeps no metrics at all (``agent.service.observers.NullMetrics``).

The daemon calls the ``observe_*``/``set_*`` methods; see docs/operations.md "Metrics".
"""

from __future__ import annotations

import logging
import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Enum,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from agent.publish import metrics as publish_metrics
from agent.service import procstats
from agent.service.devicemetrics import DeviceRows
from agent.settings_net import parse_address

log = logging.getLogger("sysdra.metrics")

KINDS = ("gpu", "nic", "fpga", "accelerator")
HEALTH_STATES = ("healthy", "unhealthy", "unknown")
REGISTRATION_STATES = ("not_started", "waiting", "registered", "failed")
NRI_STATES = ("disabled", "connecting", "registered", "failed")  # agent.nri.plugin.State.phase, or no plugin
# agent.kubeletplugin.statuswriter.RESULTS, written out: importing the writer here would load the
# kubelet side before the first publish (tests/test_claim_status_reporting.py keeps the two equal)
CLAIM_STATUS_RESULTS = ("written", "unchanged", "refused", "invalid", "failed")
PREPARE_RESULTS = ("ok", "error")
_FAST = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_SLOW = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)


class _PublishBridge:
    """Exports the process-wide counts of the wings (``agent.counts.Count``): the publisher's,
    the checkpoint's repairs, rejected entries and a newer sysdra's entries, the MPS daemons' restarts."""

    def collect(self):
        from agent.prepare.checkpoint import CORRUPT, REJECTED_ENTRIES
        from agent.prepare.checkpoint_entries import FOREIGN_ENTRIES
        from agent.prepare.mps_watch import RESTARTS

        for count in (*publish_metrics.ALL, CORRUPT, REJECTED_ENTRIES, FOREIGN_ENTRIES, RESTARTS):
            family_of = CounterMetricFamily if count.kind == "counter" else GaugeMetricFamily
            family = family_of(count.name, count.documentation, labels=list(count.labelnames))
            for labels, value in sorted(count.values.items()):
                family.add_metric(list(labels), value)
            yield family


class _ProcessStats:
    """The standard ``process_*`` metrics, from psutil (``agent.service.procstats``)."""

    def collect(self):
        u = procstats.usage()
        if u is None:
            return
        yield CounterMetricFamily("process_cpu_seconds", "Total user and system CPU time spent in seconds.",
                                  value=u["cpuSeconds"])
        for name, doc, value in (
            ("process_resident_memory_bytes", "Resident memory size in bytes.", u["rssBytes"]),
            ("process_virtual_memory_bytes", "Virtual memory size in bytes.", u["virtualBytes"]),
            ("process_open_fds", "Number of open file descriptors.", u["openFds"]),
            ("process_max_fds", "Maximum number of open file descriptors.", u["maxFds"]),
            ("process_start_time_seconds", "Start time of the process since unix epoch in seconds.", u["startTime"]),
            ("process_threads", "Number of OS threads in the process.", u["threads"]),
        ):
            yield GaugeMetricFamily(name, doc, value=value)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None, process: bool = True, bridge_global: bool = True):
        r = self.registry = registry if registry is not None else CollectorRegistry()
        self.prepare_total = Counter("sysdra_prepare_total", "NodePrepareResources claims by result", ["result"], registry=r)
        self.prepare_seconds = Histogram("sysdra_prepare_seconds", "Time to prepare one claim", ["result"], buckets=_FAST, registry=r)
        self.unprepare_total = Counter("sysdra_unprepare_total", "NodeUnprepareResources claims by result", ["result"], registry=r)
        self.unprepare_seconds = Histogram("sysdra_unprepare_seconds", "Time to unprepare one claim", ["result"], buckets=_FAST, registry=r)
        self.published_devices = Gauge("sysdra_published_devices", "Devices in the published ResourceSlices", ["kind"], registry=r)
        self.publish_attempts = Counter("sysdra_slice_publish_attempts_total", "Pool syncs attempted", registry=r)
        self.publish_failures = Counter("sysdra_slice_publish_failures_total", "Pool syncs that failed", ["reason"], registry=r)
        self.publish_seconds = Histogram("sysdra_slice_publish_seconds", "Duration of one pool sync", buckets=_FAST, registry=r)
        self.change_to_slice_seconds = Histogram(
            "sysdra_hardware_change_to_slice_seconds", "First hardware event to the slices that reflect it", buckets=_SLOW, registry=r
        )
        self.watcher_events = Counter("sysdra_watcher_events_total", "Events that triggered work, by source", ["source"], registry=r)
        self.device_health = Gauge("sysdra_device_health", "Devices by health state", ["state"], registry=r)
        self.registration = Enum("sysdra_registration", "Kubelet plugin registration state", states=list(REGISTRATION_STATES), registry=r)
        self.claim_status_writes = Counter("sysdra_claim_status_writes_total", "ResourceClaim status.devices writes by result",
                                           ["result"], registry=r)
        self.nri_connected = Gauge("sysdra_nri_connected", "1 while the NRI plugin is registered with the container "
                                   "runtime (claimed NICs' netdevs move into their pods), else 0", registry=r)
        self.nri = Enum("sysdra_nri", "NRI plugin state", states=list(NRI_STATES), registry=r)
        self.nri_claims_waiting = Gauge("sysdra_nri_claims_waiting", "Prepared claims with netdevs to move into their "
                                        "pods while the NRI plugin is not registered (they stay on the host)", registry=r)
        self.last_publish = Gauge("sysdra_last_successful_publish_timestamp_seconds", "Unix time of the last successful sync", registry=r)
        for kind in KINDS:
            self.published_devices.labels(kind).set(0)
        for state in HEALTH_STATES:
            self.device_health.labels(state).set(0)
        # every series an alert watches is present at 0: increase() cannot see the first count of a
        # series that appears with it (deploy/helm/sysdra/files/alerts.yaml)
        for result in CLAIM_STATUS_RESULTS:
            self.claim_status_writes.labels(result)
        for result in PREPARE_RESULTS:
            self.prepare_total.labels(result)
            self.unprepare_total.labels(result)
        for reason in publish_metrics.FAILURE_REASONS:
            self.publish_failures.labels(reason)
        if process:
            r.register(_ProcessStats())
            PlatformCollector(registry=r)
            GCCollector(registry=r)
        if bridge_global:
            r.register(_PublishBridge())
        self.device_rows = DeviceRows()  # per device: the unhealthy ones, the prepared ones
        r.register(self.device_rows)

    # --- kubelet plugin -----------------------------------------------------------------
    def observe_prepare(self, ok: bool, seconds: float) -> None:
        result = "ok" if ok else "error"
        self.prepare_total.labels(result).inc()
        self.prepare_seconds.labels(result).observe(seconds)

    def observe_unprepare(self, ok: bool, seconds: float) -> None:
        result = "ok" if ok else "error"
        self.unprepare_total.labels(result).inc()
        self.unprepare_seconds.labels(result).observe(seconds)

    def observe_claim_status(self, result: str) -> None:
        """One finished status.devices write; ``result`` one of CLAIM_STATUS_RESULTS."""
        self.claim_status_writes.labels(result).inc()

    def set_registration(self, state: str) -> None:
        self.registration.state(state if state in REGISTRATION_STATES else "failed")

    def set_nri(self, state: str) -> None:
        self.nri.state(state if state in NRI_STATES else "failed")
        self.nri_connected.set(1 if state == "registered" else 0)

    def set_nri_claims_waiting(self, count: int) -> None:
        self.nri_claims_waiting.set(count)

    # --- publishing -----------------------------------------------------------------------
    def set_published_devices(self, counts: dict[str, int]) -> None:
        for kind in set(KINDS) | set(counts):
            self.published_devices.labels(kind).set(counts.get(kind, 0))

    def observe_publish(self, ok: bool, seconds: float, reason: str = "error") -> None:
        self.publish_attempts.inc()
        self.publish_seconds.observe(seconds)
        if ok:
            self.last_publish.set(time.time())
        else:
            self.publish_failures.labels(reason).inc()

    def observe_change_to_slice(self, seconds: float) -> None:
        self.change_to_slice_seconds.observe(seconds)

    def count_watcher_event(self, source: str) -> None:
        """``source``: the hardware watcher's (agent/service/watch.py): udev or kernel (uevents), file."""
        self.watcher_events.labels(source).inc()

    def set_unhealthy_devices(self, rows: tuple) -> None:
        self.device_rows.unhealthy = rows

    def set_prepared_devices(self, claims: dict[str, dict], inventory) -> None:
        """``claims``: a copy the caller no longer changes (the status board's)."""
        self.device_rows.prepared_from = (claims, inventory)

    def set_health(self, counts: dict[str, int]) -> None:
        for state in set(HEALTH_STATES) | set(counts):
            self.device_health.labels(state).set(counts.get(state, 0))


class MetricsServer:
    """The HTTP endpoint; ``port`` is the bound port (useful with port 0)."""

    def __init__(self, httpd, thread):
        self._httpd, self._thread = httpd, thread
        self.host, self.port = httpd.server_address[:2]

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)


def start_server(address: str, metrics: Metrics) -> MetricsServer | None:
    """Serve ``/metrics`` on ``address`` in a daemon thread; None when ``address`` is "".

    Binds exactly the given host (never a wildcard unless written). Raises OSError /
    ValueError on a bad or busy address; the daemon logs it and runs on without metrics.
    Quick enough to call from the event loop (it only binds)."""
    if not address:
        return None
    host, port = parse_address(address)
    httpd, thread = start_http_server(port, addr=host, registry=metrics.registry)
    server = MetricsServer(httpd, thread)
    log.info("metrics on http://%s:%d/metrics", server.host, server.port)
    return server
