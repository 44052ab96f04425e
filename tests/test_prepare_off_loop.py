"""A prepare whose host change blocks for seconds (a GPU mode switch on the simulated amdgpu,
which takes seconds to bring the new partitions up) never stalls the agent: meanwhile the
health stream keeps sending, GetInfo and the status socket answer, and a second claim's
unprepare waits on the serialize lock. The invariant is the event loop's own: no callback
is delayed by more than MAX_LAG while the driver works (issue 36)."""

from __future__ import annotations

import asyncio
import json
import os
import time

import grpc

from agent.protos import dra_health_v1_pb2, dra_health_v1_pb2_grpc, pluginregistration_pb2, pluginregistration_pb2_grpc
from agent.service.status import status_socket_path
from tests.kubelet_standin import claim, find_registration_sockets, running_agent, store_claim
from tests.partition_node import CPX_GPU, SPX_GPU, Node, mode_of
from tests.test_partitions_allocator import gpu_bdf

SWITCH_SECONDS = 3.0  # how long the simulated kernel takes to bring up a new mode's partitions
# The loop must run every ready callback within this. A driver on the loop blocks it for the
# whole switch (SWITCH_SECONDS); the agent's own loop work meanwhile (the rescan and pool build
# that the switch's sysfs changes cause) takes tens of milliseconds on an idle machine, and a
# shared test machine (load 6x its cores) delays a runnable thread by up to ~0.3 s.
MAX_LAG = 0.5
TICK = 0.01


class LagProbe:
    """Schedules a callback every TICK and records how late each one ran."""

    def __init__(self):
        self.worst = 0.0
        self._due = 0.0
        self._handle = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._due = loop.time() + TICK
        self._handle = loop.call_at(self._due, self._tick)

    def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        self.worst = max(self.worst, loop.time() - self._due)
        self._due = loop.time() + TICK
        self._handle = loop.call_at(self._due, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()


async def _status(path: str) -> dict:
    reader, writer = await asyncio.open_unix_connection(path)
    try:
        return json.loads(await reader.read())
    finally:
        writer.close()


async def _get_info(registry_dir: str) -> str:
    (path,) = find_registration_sockets(registry_dir)
    async with grpc.aio.insecure_channel("unix:" + path) as ch:
        info = await pluginregistration_pb2_grpc.RegistrationStub(ch).GetInfo(pluginregistration_pb2.InfoRequest(), timeout=5)
    return info.name


async def _wait_for(predicate, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


def test_a_blocking_prepare_stalls_nothing_else(tmp_path):
    node = Node(str(tmp_path), delay=SWITCH_SECONDS, partition_switch_timeout=30.0, health_interval=0.2,
                metrics_address="", claim_status=False)
    settings = node.settings
    # b: a partition in the GPU's current mode (no switch); a: needs the other GPU switched to DPX
    b = store_claim(settings, claim("b", [("gpu", f"{CPX_GPU}-cpx-nps1-0")]))
    a = store_claim(settings, claim("a", [("gpu", f"{SPX_GPU}-dpx-nps1-0")]))

    async def main() -> None:
        async with running_agent(settings) as kubelet:
            assert not (await kubelet.prepare(b)).claims[b["metadata"]["uid"]].error

            async with grpc.aio.insecure_channel("unix:" + kubelet.info.endpoint) as ch:
                stream = dra_health_v1_pb2_grpc.DRAResourceHealthStub(ch).NodeWatchResources(
                    dra_health_v1_pb2.NodeWatchResourcesRequest())
                await stream.read()  # the first snapshot
                probe = LagProbe()
                probe.start()
                prepare_a = asyncio.create_task(kubelet.prepare(a))
                await _wait_for(lambda: mode_of(node.root, gpu_bdf(SPX_GPU)) != "SPX/NPS1" or prepare_a.done())
                assert not prepare_a.done(), "the switch did not block: the test shows nothing"
                unprepare_b = asyncio.create_task(kubelet.unprepare(b))
                # while the driver waits for the kernel: the rest of the agent answers
                health_sent = 0
                while not prepare_a.done():
                    async with asyncio.timeout(5):
                        await stream.read()
                    health_sent += 1
                    assert await _get_info(settings.registry_dir) == settings.driver_name
                    assert (await _status(status_socket_path(settings)))["nodeName"] == settings.node_name
                    if not prepare_a.done():
                        assert not unprepare_b.done(), "unprepare ran beside a prepare: the lock was not held"
                resp_a = await prepare_a
                resp_b = await unprepare_b
                probe.stop()
                stream.cancel()
            assert probe.worst < MAX_LAG, f"a callback on the event loop waited {probe.worst:.3f} s"
            assert not resp_a.claims[a["metadata"]["uid"]].error, resp_a.claims[a["metadata"]["uid"]].error
            assert resp_b.claims[b["metadata"]["uid"]].error == ""
            assert mode_of(node.root, gpu_bdf(SPX_GPU)) == "DPX/NPS1"
            assert health_sent >= 2, "the health stream stalled while the driver worked"

    with node.sim:
        asyncio.run(main())
    assert os.path.exists(settings.plugin_dir)
