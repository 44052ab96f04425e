"""SIGHUP: which changed settings a running agent applies, and which need a restart."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from agent.service import startup
from agent.settings import FIELDS, ConfigError, Settings

log = logging.getLogger("sysdra.daemon")

# Settings a SIGHUP applies without a restart; the others need one (sockets, paths, identity, and
# share/share_policies: prepare's ownership and MPS steps are built from them once, at start).
LIVE_SETTINGS = frozenset({"log_level", "log_format", "resync_interval", "debounce", "health_interval",
                           "list_attributes", "pf_vf_exclusive", "taint_unhealthy", "taint_hold", "taint_effect",
                           "taint_effects", "skip_node_operations", "device_attributes", "partition_type_attribute"})
# Of those, the ones that change the slices' content: a SIGHUP that changes one republishes.
REPUBLISH_SETTINGS = frozenset({"list_attributes", "pf_vf_exclusive", "taint_unhealthy", "taint_effect", "taint_effects",
                                "skip_node_operations", "device_attributes", "partition_type_attribute"})
# Of those, the ones a scan reads (list attributes and the operator's device_attributes are made at
# scan time; with taints, which NICs the host uses is read after it): a full rescan.
RESCAN_SETTINGS = frozenset({"list_attributes", "taint_unhealthy", "device_attributes"})


def changes(old: Settings, new: Settings) -> tuple[dict[str, Any], list[str]]:
    """(live, restart): the changed settings a running agent applies (name -> new value), and
    the names of the changed ones that need a restart."""
    changed = {k for k in FIELDS if getattr(old, k) != getattr(new, k)}
    return {k: getattr(new, k) for k in changed & LIVE_SETTINGS}, sorted(changed - LIVE_SETTINGS)


def apply(agent, new: Settings, node_operations: dict | None = None) -> None:
    """Apply to ``agent`` (service.daemon.Agent) the settings that can change live; say which
    ones need a restart. ``node_operations``: the skip_node_operations ``agent._node_operations``
    settled for ``new`` in a worker thread (None: settled here, which blocks: fsync)."""
    old = agent.settings
    live, restart = changes(old, new)
    if agent.lists.retry(new) and "list_attributes" not in live:
        agent._rescan_soon()  # refused before (agent/service/listfallback.py): the cluster may take them now
    if not live and not restart:
        log.info("SIGHUP: configuration unchanged")
        return
    if restart:
        log.warning("SIGHUP: %s changed but need a restart; keeping the running values", ", ".join(restart))
    if "skip_node_operations" in live:
        if node_operations is None:
            node_operations = agent._node_operations(new.skip_node_operations)
        if node_operations != new.skip_node_operations:
            del live["skip_node_operations"]  # refused (logged): prepared claims hold such devices
    if not live:
        return
    s = agent.settings = old.replace(**live)
    agent.publisher.resync_interval, agent.publisher.debounce = s.resync_interval, s.debounce
    if agent.debouncer is not None:
        agent.debouncer.delay = s.debounce
    if agent.health is not None:
        agent.health.interval, agent.health.taint_hold = s.health_interval, s.taint_hold
        agent.health.taint_effect, agent.health.taint_effects = s.taint_effect, s.taint_effects
    if "log_level" in live or "log_format" in live:
        from agent.service.logs import setup_logging

        setup_logging(s)
    log.info("SIGHUP: applied %s", ", ".join(f"{k}={v}" for k, v in sorted(live.items())))
    if "resync_interval" in live:  # both timers wait on the old interval: they recompute theirs now
        agent.resync_changed.set()
        agent.publisher.request_sync()
    if live.get("taint_unhealthy") and agent.watcher is not None:  # its host-in-use taints follow the host's events
        agent.host_nics.follow_soon(agent.watcher.uevents)
    if RESCAN_SETTINGS & set(live):  # the inventory was scanned with the old value: read everything again
        agent._rescan_soon()
    elif REPUBLISH_SETTINGS & set(live):
        agent._republish()


def sighup_handler(agent, reload_settings: Callable[[], Settings]) -> Callable[[], None]:
    """SIGHUP's handler: the configuration read again in a worker thread (its file, the paths
    resolved as at start, so unchanged ones compare equal), a changed skip_node_operations settled
    there too (its record is an fsync), then applied on the loop; one SIGHUP after another, so an
    older read never lands after a newer one."""
    lock, running = asyncio.Lock(), set()

    async def again() -> None:
        async with lock:
            try:
                new = await asyncio.to_thread(lambda: startup.resolve(reload_settings()))
            except (ConfigError, startup.StartupError) as err:
                log.error("SIGHUP: new configuration rejected, keeping the running one: %s", err)
                return
            ops = None
            if new.skip_node_operations != agent.settings.skip_node_operations:  # (only a SIGHUP changes it)
                ops = await asyncio.to_thread(agent._node_operations, new.skip_node_operations)
            agent.reload(new, ops)

    def on_hup() -> None:
        task = asyncio.get_running_loop().create_task(again(), name="sighup")
        running.add(task)  # (a task nothing refers to may be collected before it ends)
        task.add_done_callback(running.discard)

    return on_hup
