"""NICs the host uses, tainted so that the scheduler keeps claims away (docs/networking.md,
"Keeping the scheduler away").

Prepare refuses a NIC whose netdev the host uses (agent/prepare/hostuse.py: a global address, a
bond/bridge port or master, a VLAN or macvlan on it) unless the node and the claim allow it; the
scheduler cannot know that, so a claim allocated such a NIC would wait on a prepare that fails.
With ``taint_unhealthy`` (the cluster takes device taints) the NIC is published with the taint
``sysdra.io/host-in-use=<netdev>:NoSchedule``: claims keep away unless they tolerate it (the ones
meant to take it, with ``allowHostInUse``). The host's use is read in its network namespace, as
prepare reads it, after every scan and again on the kernel's address and link events there
(debounced): the taint follows DHCP, a network manager, a bond being built, a netdev back from a pod.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from typing import Callable

from agent import rtnetlink
from agent.rtnetlink import Listener, listen_on_host

log = logging.getLogger(__name__)

TAINT_KEY = "sysdra.io/host-in-use"
RTMGRP_LINK, RTMGRP_IPV4_IFADDR, RTMGRP_IPV6_IFADDR = 0x1, 0x10, 0x100
SETTLE = 0.5  # seconds from an event to the read of the host (a pod start is a burst: one read)
_LABEL_VALUE = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?)?$")


def host_used(root: str, inventory) -> dict[str, str] | None:
    """Device name -> the first of its netdevs the host uses, for the inventory's NICs; None when
    the host's network namespace is not the one under ``root`` or cannot be read (a fixture tree
    without its own ``proc/1``; the DaemonSet without CAP_SYS_PTRACE). Blocking: a worker thread."""
    from agent.prepare import hostuse, netmove  # (their models: not before the first publish, where nothing is tainted)

    netns = rtnetlink.init_netns(root)
    if not os.path.lexists(netns) or netmove.host_netns_problem(root) is not None:
        return None
    netdevs = {i.name: dev.pci.bdf for dev in inventory.devices if dev.kind == "nic" and dev.nic for i in dev.nic.interfaces}
    try:
        used = hostuse.host_uses(netns, netdevs)
    except OSError as err:
        log.warning("which NICs the host uses cannot be read (%s): none is tainted %s", err, TAINT_KEY)
        return None
    return {dev.name: name for dev in inventory.devices if dev.kind == "nic" and dev.nic
            for name in [next((i.name for i in dev.nic.interfaces if i.name in used), None)] if name}


def taint(netdev: str) -> dict:
    """The taint of a NIC whose netdev ``netdev`` the host uses (ResourceSlice encoding): the value
    names it where a label value can (an interface name may hold characters one cannot)."""
    return {"key": TAINT_KEY, "value": netdev if _LABEL_VALUE.match(netdev) else "", "effect": "NoSchedule"}


class HostNics:
    """The NICs the host uses now (``used``), read after each scan (``scanned``) and on the host's
    address and link events (``follow``), which call ``changed()`` when the set changes."""

    def __init__(self, settings: Callable[[], object], changed: Callable[[], None]):
        self.settings, self.changed = settings, changed
        self.used: dict[str, str] = {}
        self._inventory = None
        self._said = False  # that the host's namespace cannot be read here
        self._listener: Listener | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task | None = None
        self._arming: asyncio.Task | None = None  # follow_soon's
        self._reads = self._applied = 0  # reads of the host begun; the number of the one ``used`` is from

    def with_taints(self, taints: dict[str, list[dict]]) -> dict[str, list[dict]]:
        """``taints`` (the health monitor's) and those of the NICs the host uses."""
        return {**taints, **{name: [*taints.get(name, ()), taint(netdev)] for name, netdev in self.used.items()}}

    async def scanned(self, inventory) -> None:
        self._inventory = inventory
        self._apply(*await self._read())

    def _apply(self, ticket: int, inventory, used: dict[str, str]) -> bool:
        """Whether ``used``, read for ``inventory`` by the read numbered ``ticket``, is now
        ``self.used``: not when a read begun after it was applied (it read the host later) or
        ``inventory`` is no longer the scan's (a scan's read of the newer one is under way or done)."""
        if ticket <= self._applied or inventory is not self._inventory:
            return False
        self._applied, self.used = ticket, used
        return True

    async def _read(self) -> tuple[int, object, dict[str, str]]:
        """(the read's number, in the order reads begin; the inventory read for; what the host uses)."""
        self._reads += 1
        ticket, inventory, s = self._reads, self._inventory, self.settings()
        if not s.taint_unhealthy or inventory is None:
            return ticket, inventory, {}
        used = await asyncio.to_thread(host_used, s.root, inventory)
        if used is None and not self._said and any(d.kind == "nic" for d in inventory.devices):
            from agent.prepare import netmove

            self._said = True
            log.info("the host's network namespace is not readable here (%s): NICs the host uses are not tainted %s; "
                     "prepare still refuses them", netmove.host_netns_problem(s.root) or "no proc/1 under the root", TAINT_KEY)
        return ticket, inventory, used or {}

    async def follow(self, kernel: bool) -> bool:
        """Listen to the host's address and link events (``kernel``: the root's sys is the
        kernel's); False where they cannot be heard (then the scans alone keep the taints)."""
        if self._listener is not None:  # already listening
            return True
        listener = Listener(RTMGRP_LINK | RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR, self._batch, "address events")
        if not await listen_on_host(listener.start, self.settings().root, kernel, "address"):
            return False
        if self._listener is not None:  # another follow() armed one meanwhile
            listener.stop()
            return True
        self._listener = listener
        return True

    def follow_soon(self, kernel: bool) -> None:
        """``follow`` in a task of its own (a SIGHUP turned ``taint_unhealthy`` on: the events
        are followed from now on, as they are from the start with it on)."""
        if self._listener is None and (self._arming is None or self._arming.done()):
            self._arming = asyncio.get_running_loop().create_task(self.follow(kernel), name="host-nics-follow")

    def stop(self) -> None:
        for pending in (self._timer, self._task, self._arming):
            if pending is not None:
                pending.cancel()
        if self._listener is not None:
            self._listener.stop()

    def _batch(self, _datagrams) -> None:
        """The host read again SETTLE after the first message of a burst, not after its last: messages
        without a pause (a flapping port, pods starting back to back) put the read off for as long."""
        if self._timer is None:  # (else the read due covers this message too)
            self._timer = asyncio.get_running_loop().call_later(SETTLE, self._reread)

    def _reread(self) -> None:
        self._timer = None
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._again(), name="host-nics")
        else:  # a read is under way: one more after it
            self._timer = asyncio.get_running_loop().call_later(SETTLE, self._reread)

    async def _again(self) -> None:
        ticket, inventory, used = await self._read()
        before = self.used
        if self._apply(ticket, inventory, used) and used != before:
            for name in sorted(used.keys() - before.keys()):
                log.info("NIC %s: the host uses its netdev %s: tainted %s", name, used[name], TAINT_KEY)
            for name in sorted(before.keys() - used.keys()):
                log.info("NIC %s: the host no longer uses it: untainted", name)
            self.changed()
