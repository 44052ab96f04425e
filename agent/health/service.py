"""The DRAResourceHealth servicers (v1 and v1alpha1: same messages, different packages).

``NodeWatchResources`` sends the full list when the stream opens and again after every
monitor round (health changes, timer); a stream that heard nothing for ``RESEND_MAX``
seconds (a stuck round) resends the last known list anyway, so the kubelet's 30 s
lease never runs out while we are alive.
"""

from __future__ import annotations

import asyncio
from types import ModuleType

from agent.health.monitor import HealthMonitor
from agent.protos import dra_health_v1_pb2, dra_health_v1_pb2_grpc, dra_health_v1alpha1_pb2, dra_health_v1alpha1_pb2_grpc

RESEND_MAX = 10.0


def build_response(monitor: HealthMonitor, pb: ModuleType):
    resp = pb.NodeWatchResourcesResponse()
    for name, state in monitor.device_states():
        resp.devices.add(
            device=pb.DeviceIdentifier(pool_name=monitor.pool, device_name=name),
            health=pb.HealthStatus.Value(state.verdict.health),
            last_updated_time=int(state.checked_at),
            message=state.verdict.message,  # already <= 1024 bytes (checks.truncate)
        )
    return resp


async def watch(monitor: HealthMonitor, pb: ModuleType):
    sub = monitor.subscribe()
    try:
        yield build_response(monitor, pb)
        while True:
            try:  # asyncio.timeout: 3.11's wait_for can swallow the stream's cancellation
                async with asyncio.timeout(min(RESEND_MAX, 2 * monitor.interval)):
                    await sub.event.wait()
            except TimeoutError:
                pass
            sub.event.clear()
            if sub.closed:
                return
            yield build_response(monitor, pb)
    finally:
        monitor.unsubscribe(sub)


class HealthV1(dra_health_v1_pb2_grpc.DRAResourceHealthServicer):
    def __init__(self, monitor: HealthMonitor):
        self.monitor = monitor

    async def NodeWatchResources(self, request, context):  # grpc.aio wants an async generator method
        async for resp in watch(self.monitor, dra_health_v1_pb2):
            yield resp


class HealthV1alpha1(dra_health_v1alpha1_pb2_grpc.DRAResourceHealthServicer):
    def __init__(self, monitor: HealthMonitor):
        self.monitor = monitor

    async def NodeWatchResources(self, request, context):  # grpc.aio wants an async generator method
        async for resp in watch(self.monitor, dra_health_v1alpha1_pb2):
            yield resp
