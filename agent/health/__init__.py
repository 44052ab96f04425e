"""KEP-4680 device health: rules (``checks``), the monitor, and the two gRPC services
served on the DRA socket (docs/health.md).

Wiring (the daemon)::

    monitor = agent.health.attach(plugin, inventory_fn, settings)  # before plugin.start()
    sub = monitor.subscribe()     # before start(), or its first round's wake-up is missed
    await monitor.start()         # first check round, then every settings.health_interval
    monitor.events_report(fn)     # fn() -> (functions, links) the watchers report: not polled by timer rounds
    await plugin.start()
    watcher: monitor.on_inventory(inv) after every rescan (any thread)
    monitor.snapshot()            # {device: (HEALTHY|UNHEALTHY|UNKNOWN, message, reason)}
    monitor.taints()              # {device: [{"key": "sysdra.io/unhealthy", "value": reason, "effect": taint_effect}]}
    await monitor.stop()          # ends open streams; then plugin.stop()
"""

from __future__ import annotations

from typing import Callable

from agent.health.checks import HEALTHY, UNHEALTHY, UNKNOWN
from agent.health.monitor import HealthMonitor
from agent.health.service import HealthV1, HealthV1alpha1
from agent.health.taints import TAINT_KEY
from agent.protos import dra_health_v1_pb2_grpc, dra_health_v1alpha1_pb2_grpc
from agent.settings import Settings
from discovery.models import Inventory

HEALTH_SERVICES = ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")  # kubelet prefers v1


def attach(plugin, inventory_fn: Callable[[], Inventory | None], settings: Settings) -> HealthMonitor:
    """Serve both health services on ``plugin``'s DRA socket, advertised after the DRA
    services in this order. Call before ``plugin.start()``."""
    monitor = HealthMonitor(settings, inventory_fn)
    plugin.add_service(HEALTH_SERVICES[0], lambda server: dra_health_v1_pb2_grpc.add_DRAResourceHealthServicer_to_server(
        HealthV1(monitor), server))
    plugin.add_service(HEALTH_SERVICES[1], lambda server: dra_health_v1alpha1_pb2_grpc.add_DRAResourceHealthServicer_to_server(
        HealthV1alpha1(monitor), server))
    return monitor


__all__ = ["HEALTH_SERVICES", "HEALTHY", "UNHEALTHY", "UNKNOWN", "TAINT_KEY", "HealthMonitor", "attach"]
