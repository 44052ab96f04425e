"""Hardware change -> ResourceSlice published latency, offline mode, on the large node.

A VF's bus link is removed from a copy of the generated 2,000+-function tree while
``sysdra run``'s Agent watches it (watchdog file events, debounce D); the figure is the
time until the slice file no longer lists the VF. Floor: D + one full scan of the same
tree measured in the same run (what a rescan-based design cannot beat)."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import statistics
import tempfile
import time

from bench.bench_scan import build_large_node
from bench.report import Figure, progress

DEBOUNCE = 0.25


def _names(cluster: str) -> set[str]:
    out = set()
    for path in glob.glob(os.path.join(cluster, "resourceslices", "*.json")):
        try:
            with open(path) as f:
                out.update(d["name"] for d in json.load(f)["spec"].get("devices", []))
        except (OSError, ValueError):
            pass
    return out


async def _measure(root: str, cluster: str, repeat: int) -> list[float]:
    from agent.daemon import Agent
    from agent.settings import Settings

    settings = Settings(root=root, node_name="bench-node", cluster=f"dir:{cluster}", debounce=DEBOUNCE, resync_interval=0,
                        kubelet_dir=os.path.join(cluster, "kubelet"), cdi_dir=os.path.join(cluster, "cdi"))
    agent = Agent(settings)

    async def no_plugin():
        return None

    agent.start_kubelet_plugin = no_plugin
    stop = asyncio.Event()
    task = asyncio.get_running_loop().create_task(agent.run(stop))
    while not _names(cluster):
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)
    vfs = [d for d in agent.inventory.devices if d.pci.physfn][:repeat]
    bus = os.path.join(root, "sys/bus/pci/devices")
    out = []
    for dev in vfs:
        t0 = time.monotonic()
        os.unlink(os.path.join(bus, dev.pci.bdf))
        while dev.name in _names(cluster):
            await asyncio.sleep(0.005)
        out.append(time.monotonic() - t0)
        await asyncio.sleep(DEBOUNCE + 0.2)
    stop.set()
    await task
    return out


def run(repeat: int = 3) -> list[Figure]:
    from discovery.inventory import scan

    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "node")
        build_large_node(root)
        scans = []
        for _ in range(repeat):
            t0 = time.monotonic()
            scan(root)
            scans.append(time.monotonic() - t0)
        progress("publish latency: watching the large node")
        latencies = asyncio.run(_measure(root, os.path.join(tmp, "cluster"), repeat))
    value = statistics.median(latencies) * 1000
    floor = (DEBOUNCE + statistics.median(scans)) * 1000
    goal_ms = (DEBOUNCE + 0.1) * 1000
    return [Figure("publish_latency", value, "ms", floor, f"value <= debounce + 100 ms = {goal_ms:.0f} ms", value <= goal_ms)]
