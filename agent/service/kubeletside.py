"""The daemon's kubelet side, started by ``Agent.start_kubelet_plugin``: the prepare driver,
the kubelet plugin over it, the health monitor, then the sockets. Imported only when that side
starts: gRPC, the driver and health load after the first publish to a directory
(docs/architecture.md, "Start-up order")."""

from __future__ import annotations

import asyncio
import os

from agent import health
from agent.kubeletplugin.claimapi import ClaimApi
from agent.kubeletplugin.claims import claim_source
from agent.kubeletplugin.plugin import KubeletPlugin
from agent.kubeletplugin.sockets import SocketError
from agent.kubeletplugin.statuswriter import status_writer
from agent.nri.start import crash_at
from agent.prepare.checkpoint import CheckpointError
from agent.prepare.driver import Driver
from agent.prepare.steps.partition import gpus_in_use
from agent.service.observers import ClaimStatusObserver, ObservedDriver, call_observer
from agent.service.startup import EX_CANTCREAT, EX_DATAERR, StartupError


async def start(agent) -> None:
    """Serve the kubelet (issue 4) next to publishing; ``agent`` is the daemon's ``Agent``."""
    core = Driver(agent.settings, lambda: agent.inventory)
    _crash_points(core)
    loop = asyncio.get_running_loop()
    # a GPU mode switch at prepare (any thread): rescan and republish
    core.hardware_changed = lambda: loop.call_soon_threadsafe(agent._rescan_soon)
    driver = ObservedDriver(core, agent.board, loop=loop, on_claims=lambda claims: held_gpus(agent, claims))  # the loop's
    _make_plugin(agent, driver)
    await _start_health(agent)
    await _serve_sockets(agent, driver)
    _after_serving(agent, core, driver)


def _crash_points(core: Driver) -> None:
    """The real-node tests' fault hook (``SYSDRA_TEST_CRASH_AT``, as the NRI mover's): SIGKILL at
    a driver point (``prepare:specs-written``) or an MPS daemon's (``mps:launched``)."""
    point = os.environ.get("SYSDRA_TEST_CRASH_AT", "")
    if point:
        core.fault = crash_at(point)
        if core.nvidia.mps is not None:
            core.nvidia.mps.fault = lambda at: crash_at(point)("mps:" + at)


def _make_plugin(agent, driver: ObservedDriver) -> None:
    """``agent.kubelet_plugin``: claims from the API (or the offline dir), their status written if asked."""
    api = None if agent.settings.cluster_dir is not None else ClaimApi(field_manager=agent.settings.driver_name)  # reads + writes
    status = (status_writer(agent.settings, api, observer=ClaimStatusObserver(agent.metrics, agent.board))
              if agent.settings.claim_status else None)
    agent.board.claim_status_enabled = agent.settings.claim_status
    agent.kubelet_plugin = KubeletPlugin(agent.settings, driver, claim_source(agent.settings, api), status,
                                         observe=call_observer(agent.metrics))
    agent.kubelet_plugin.registration.listeners.append(agent._on_registration)


async def _start_health(agent) -> None:
    """``agent.health`` on the plugin, followed before its first round, with its event sources."""
    agent.health = health.attach(agent.kubelet_plugin, lambda: agent.inventory, agent.settings)
    agent._follow_health()
    await agent.health.start()
    await agent.health.watch_links(agent.watcher is not None and agent.watcher.uevents)
    # NVML under any root is the host's driver (the DaemonSet's root is /host): its events are the GPUs'
    agent.health.nvml_up = agent._nvml_up
    await agent.health.watch_gpu_events()
    if agent.watcher is not None:  # timer rounds need not poll what its events report
        agent.health.events_report(agent.watcher.reports)


async def _serve_sockets(agent, driver: ObservedDriver) -> None:
    """Recovery, then the DRA and registration sockets; what keeps them from serving is a ``StartupError``."""
    async def rescan_if_moved() -> None:  # recovery moved functions between drivers: re-read them
        recovery = getattr(driver.driver, "recovery", None)
        if recovery is not None and recovery.kernel_changed:
            await agent.rescan()

    try:  # the kubelet may call as soon as the sockets exist: the inventory must be current by then
        await agent.kubelet_plugin.start(after_recovery=rescan_if_moved)
    except SocketError as err:
        raise StartupError(str(err), EX_CANTCREAT) from None
    except CheckpointError as err:
        raise StartupError(str(err), EX_DATAERR) from None


def _after_serving(agent, core: Driver, driver: ObservedDriver) -> None:
    """The MPS daemons supervised; the board told registration is awaited and which claims are prepared."""
    loop = asyncio.get_running_loop()  # a dead MPS daemon: its GPU unhealthy until back; the daemons in status
    core.supervise_mps(agent.health.gpu_daemon_fault, lambda rows: loop.call_soon_threadsafe(agent.board.set_mps_daemons, rows))
    agent.board.set_registration("waiting")
    if driver.checkpoint is not None:
        agent.board.set_prepared_claims(driver.checkpoint.claims)
        held_gpus(agent, driver.checkpoint.claims)


def held_gpus(agent, claims: dict[str, dict]) -> None:
    """With ``partitions`` off, the GPUs whose partitions prepared claims hold (claims prepared before it
    was turned off) are not offered whole: republished as that changes. On the loop."""
    held = frozenset() if agent.settings.partitions else gpus_in_use(claims)
    if held != agent.held_gpus:
        agent.held_gpus = held
        agent._republish()
