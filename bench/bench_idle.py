"""CPU and memory of an idle, running ``sysdra run`` on the large node.

The agent serves the generated large node in offline mode with its defaults (full resync
every 300 s, health checks every 10 s, file watches on what discovery reads of the tree's sys/,
kubelet plugin, status socket) and nothing happens for ``DURATION`` seconds. At the same time a floor
process runs: a bare interpreter that imports the same modules and then idles in an
asyncio loop. Both are sampled with psutil over the same window.

``idle_cpu``: CPU time (user + system) / wall time, in % of one core. Goal < 0.5 %.
``idle_rss``: the highest RSS seen during the window (MB). Goal <= 80 MB."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time

from bench.agentproc import AgentProcess, installed, installed_env, large_node, tmpfs_dir
from bench.report import Figure, progress

DURATION = 60.0

# what this ``sysdra run`` imports once it serves (daemon, kubelet plugin, health, publishing,
# discovery, watchers, NRI); the floor imports the same and does nothing. Not prometheus_client
# (no metrics endpoint) nor pyudev (a fixture root has file events, not uevents): the agent
# measured loads neither
FLOOR_IMPORTS = ("agent.cli.main", "agent.cli.run", "agent.service.daemon", "agent.prepare.driver", "agent.kubeletplugin.claims",
                 "agent.kubeletplugin.plugin", "agent.health", "agent.publish.dirstore", "agent.publish.drift",
                 "agent.service.status", "agent.service.logs", "agent.service.nodeops", "agent.nri.netdev", "watchdog.observers",
                 "discovery.inventory", "discovery.nvml", "grpc")
FLOOR_CODE = ("import asyncio, importlib\n"
              "for m in {mods!r}:\n"
              "    try:\n        importlib.import_module(m)\n    except ImportError:\n        pass\n"
              "asyncio.run(asyncio.sleep({secs}))\n")


def _sample(procs: dict, duration: float) -> dict:
    import psutil

    ps = {k: psutil.Process(p.pid) for k, p in procs.items()}
    cpu0 = {k: p.cpu_times() for k, p in ps.items()}
    rss = {k: p.memory_info().rss for k, p in ps.items()}
    t0 = time.monotonic()
    next_report = 10.0
    while (elapsed := time.monotonic() - t0) < duration:
        time.sleep(min(1.0, duration - elapsed))
        for k, p in ps.items():
            rss[k] = max(rss[k], p.memory_info().rss)
        if elapsed >= next_report:
            progress(f"idle: {elapsed:.0f}/{duration:.0f} s")
            next_report += 10
    wall = time.monotonic() - t0
    out = {}
    for k, p in ps.items():
        c = p.cpu_times()
        used = (c.user - cpu0[k].user) + (c.system - cpu0[k].system)
        out[k] = (100.0 * used / wall, rss[k] / 2**20)
    return out


def _settle(proc, quiet_ms: float = 20.0, longest: float = 30.0) -> None:
    """Wait (at least 5 s, at most ``longest``) until the agent's start-up is done: two seconds in
    a row under ``quiet_ms`` of CPU each. On a busy machine the start (a fixture tree's file watch
    walks ~10,500 directories, then a full rescan) can outlast a fixed wait and land in the window."""
    import psutil

    p, t0 = psutil.Process(proc.pid), time.monotonic()
    time.sleep(5.0)
    quiet, last = 0, sum(p.cpu_times()[:2])
    while quiet < 2 and time.monotonic() - t0 < longest:
        time.sleep(1.0)
        now = sum(p.cpu_times()[:2])
        quiet = quiet + 1 if (now - last) * 1000 < quiet_ms else 0
        last = now


def run(duration: float = DURATION) -> list[Figure]:
    root = large_node()
    work = tempfile.mkdtemp(prefix="sysdra-bench-idle-")
    cdi = tmpfs_dir("sysdra-bench-cdi-")
    floor = None
    try:
        progress("idle: starting sysdra run on the large node and the floor process")
        with AgentProcess(root, work, cdi) as agent:
            floor = subprocess.Popen([installed().python, "-c", FLOOR_CODE.format(mods=FLOOR_IMPORTS, secs=duration + 30)],
                                     cwd=installed().cwd, env=installed_env())
            _settle(agent.proc)  # start-up work (the file watch's rescan, first health round) is not idle time
            if agent.proc.poll() is not None or floor.poll() is not None:
                raise RuntimeError("agent or floor process exited early")
            got = _sample({"agent": agent.proc, "floor": floor}, duration)
    finally:
        if floor is not None and floor.poll() is None:
            floor.kill()
            floor.wait()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(cdi, ignore_errors=True)
    (cpu, rss), (fcpu, frss) = got["agent"], got["floor"]
    return [
        Figure("idle_cpu", cpu, "% of a core", fcpu, "value < 0.5 %", cpu < 0.5),
        Figure("idle_rss", rss, "MB", frss, "value <= 80 MB", rss <= 80.0),
    ]
