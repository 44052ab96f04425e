"""The agent's long-running loops. A round that raises is logged and the next one runs: a loop
that died would end the resync safety net, or taints following health, for good and in silence."""

from __future__ import annotations

import asyncio
import contextlib
import logging

log = logging.getLogger("sysdra.daemon")


async def periodic_rescan(agent) -> None:
    """A rescan ``resync_interval`` after the last one; runs idle while it is 0. A SIGHUP that
    changes the interval sets ``agent.resync_changed``: the wait is recomputed at once."""
    loop = asyncio.get_running_loop()
    last = loop.time()
    while True:
        agent.resync_changed.clear()
        interval = agent.settings.resync_interval
        if not interval or loop.time() < last + interval:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(last + interval if interval else None):
                    await agent.resync_changed.wait()
            continue
        try:
            await agent.rescan()
        except Exception:  # noqa: BLE001 - the next round may well succeed
            log.exception("periodic rescan failed; next one in %ss", agent.settings.resync_interval)
        agent.publisher.request_sync()  # also repair drift nobody told us about
        last = loop.time()


async def follow_health(agent, sub) -> None:
    """Each health round's verdicts to status, metrics and (``--taint-unhealthy``) taints."""
    try:
        while not sub.closed:
            await sub.event.wait()
            sub.event.clear()
            try:
                if agent.inventory is not None:
                    agent.board.set_inventory(agent.inventory, *agent.health_states())
                if agent.settings.taint_unhealthy:
                    agent._republish()
            except Exception:  # noqa: BLE001 - the next round's verdicts must still get through
                log.exception("health verdicts not applied; retried after the next round")
    finally:
        agent.health.unsubscribe(sub)


async def new_devices_checked(health, inventory) -> None:
    """``--taint-unhealthy``: a health round before a device new to the node is published, as the first
    publish has every device's first verdict; else an unhealthy one (a NIC plugged in without carrier) was
    offered untainted until the round its rescan starts, and written twice. A round that raises is
    logged: the devices are published, and the next round taints them."""
    if all(d.name in health.states for d in inventory.devices):
        return
    try:
        await health.check_now()
    except Exception:  # noqa: BLE001 - publishing the new devices must not wait on a broken rule
        log.exception("health round for new devices failed; the next one checks them")
