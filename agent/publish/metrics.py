"""Process-wide counts of slice writes, as plain numbers: publishing does not load
prometheus_client (its import pulls in http.server, urllib and email: ~15 ms and ~2.5 MB),
and an agent without a metrics endpoint never loads it. ``agent.service.metrics`` exports
these on the agent's registry.

Publish attempts, failures and change-to-slice latency live in agent.service.metrics.Metrics."""

from __future__ import annotations

from agent.counts import Count

SLICE_WRITES = Count("sysdra_resourceslice_writes_total", "ResourceSlice writes", ("op",), known=("create", "update", "delete"))
INVALID_DEVICES = Count("sysdra_invalid_devices_total", "Devices left out of a slice because they would not validate")
LEFT_OUT = Count("sysdra_devices_left_out", "Devices left out of the published slices now, because they would not validate",
                 kind="gauge")
POOL_GENERATION = Count("sysdra_pool_generation", "Generation of the published pool", kind="gauge")
LIST_ATTRIBUTES_REFUSED = Count("sysdra_list_attributes_refused", "1 while the API server refuses list-typed attributes "
                                "(DRAListTypeAttributes off) and the pool is published without them", kind="gauge")
# why a sync failed: the reasons agent.publish.publisher counts, in sysdra_slice_publish_failures_total
FAILURE_REASONS = ("api", "conflict", "internal", "list_attributes")
ALL = (SLICE_WRITES, INVALID_DEVICES, LEFT_OUT, POOL_GENERATION, LIST_ATTRIBUTES_REFUSED)
