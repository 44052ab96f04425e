"""Process-wide counters of slice writes (bridged onto the agent's registry by agent.service.metrics).

Publish attempts, failures and change-to-slice latency live in agent.service.metrics.Metrics."""

from prometheus_client import Counter, Gauge

SLICE_WRITES = Counter("sysdra_resourceslice_writes_total", "ResourceSlice writes", ["op"])
INVALID_DEVICES = Counter("sysdra_invalid_devices_total", "Devices left out of a slice because they would not validate")
POOL_GENERATION = Gauge("sysdra_pool_generation", "Generation of the published pool")
