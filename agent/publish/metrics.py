"""Prometheus metrics of slice publishing (exposed by the daemon's metrics endpoint)."""

from prometheus_client import Counter, Gauge, Histogram

SLICE_WRITES = Counter("sysdra_resourceslice_writes_total", "ResourceSlice writes", ["op"])
SYNC_ERRORS = Counter("sysdra_resourceslice_sync_errors_total", "Failed pool syncs", ["reason"])
INVALID_DEVICES = Counter("sysdra_invalid_devices_total", "Devices left out of a slice because they would not validate")
POOL_GENERATION = Gauge("sysdra_pool_generation", "Generation of the published pool")
PUBLISH_LATENCY = Histogram(
    "sysdra_hardware_change_publish_seconds",
    "Hardware change (first event) to slices published",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
)
