"""Default-route changes from the kernel (rtnetlink, IPv4 and IPv6 route groups), so the host's
uplink (discovery/routes.py) is followed live: a new default route's NIC leaves the slices, and
the old one comes back, within the debounce instead of at the next full resync.

Only a route to the whole address space (destination length 0) matters; any other route message
is ignored. Lost messages (socket overrun) count as a change.

The chain below the default routes' interfaces changes without a route message: a NIC enslaved
to the uplink bond, added as a port of its bridge, or released. So link messages are heard too
and, SETTLE after the first of a burst, the uplink's PCI functions are read again (a few procfs and
sysfs reads, in a worker thread); a full rescan follows only when they differ from the last read
(a pod's veth joining another bridge costs that read, not a rescan). Without this such a NIC stayed
offered until the next full resync (incremental scans keep the uplink of the last full scan).
"""

from __future__ import annotations

import asyncio
import logging
import struct
from typing import Callable

from agent.rtnetlink import Listener, listen_on_host, messages

log = logging.getLogger(__name__)

RTMGRP_LINK, RTMGRP_IPV4_ROUTE, RTMGRP_IPV6_ROUTE = 0x1, 0x40, 0x400
RTM_NEWLINK, RTM_DELLINK, RTM_NEWROUTE, RTM_DELROUTE = 16, 17, 24, 25
SETTLE = 0.5  # seconds from a link message to the read of the uplink (a pod start is a burst: one read)
_RTMSG = struct.Struct("=BBBBBBBBI")  # rtmsg: family, dst_len, src_len, tos, table, protocol, scope, type, flags


def default_route_changed(data: bytes) -> bool:
    """Whether one datagram holds an RTM_NEWROUTE/RTM_DELROUTE of a default route. Malformed
    parts end the parse; they never raise."""
    return any(mtype in (RTM_NEWROUTE, RTM_DELROUTE) and len(body) >= _RTMSG.size and _RTMSG.unpack_from(body)[1] == 0
               for mtype, body in messages(data))


def link_changed(data: bytes) -> bool:
    return any(mtype in (RTM_NEWLINK, RTM_DELLINK) for mtype, _ in messages(data))


def uplink_functions(root: str) -> frozenset[str]:
    """The PCI functions of the host's uplink now. Blocking: a worker thread."""
    from discovery.routes import default_route_functions

    return frozenset(default_route_functions(root))


class RouteWatch:
    """Calls ``on_change()`` on the event loop when a default route appears or goes, and (with
    ``root``) when a link change makes other PCI functions the uplink's."""

    def __init__(self, on_change: Callable[[], None], root: str | None = None):
        self.on_change, self.root = on_change, root
        groups = RTMGRP_IPV4_ROUTE | RTMGRP_IPV6_ROUTE | (RTMGRP_LINK if root is not None else 0)
        self._listener = Listener(groups, self._batch, "route events")
        self.uplink: frozenset[str] | None = None  # the uplink's functions as last read (None: not yet)
        self.reads = 0  # reads of the uplink done
        self._timer: asyncio.TimerHandle | None = None
        self._timer_announce = False  # whether the pending read calls on_change on a difference
        self._task: asyncio.Task | None = None

    def start(self, sock=None) -> None:
        """``sock``: an unbound NETLINK_ROUTE socket of the namespace to hear (the host's), or this process's own."""
        self._listener.start(sock)

    def stop(self) -> None:
        for pending in (self._timer, self._task):
            if pending is not None:
                pending.cancel()
        self._listener.stop()

    def _batch(self, datagrams: list[bytes] | None) -> None:
        if datagrams is None or any(default_route_changed(d) for d in datagrams):
            self.on_change()  # (its full rescan reads the uplink; so does the read below, quietly)
            self._settled(announce=False)
        elif self.root is not None and any(link_changed(d) for d in datagrams):
            self._settled(announce=True)

    def _settled(self, announce: bool) -> None:
        """The uplink read again SETTLE after the first message of a burst (not after the last: a link
        that keeps changing would put it off for good); ``announce``: a difference calls on_change."""
        if self.root is None:
            return
        if self._timer is not None:  # a read is due: it covers this message too
            self._timer_announce = self._timer_announce or announce
            return
        self._timer_announce = announce
        self._timer = asyncio.get_running_loop().call_later(SETTLE, self._read_soon)

    def _read_soon(self) -> None:
        if self._task is not None and not self._task.done():  # one read at a time: another after it
            self._timer = asyncio.get_running_loop().call_later(SETTLE, self._read_soon)
            return
        self._timer = None
        self._task = asyncio.get_running_loop().create_task(self._read(self._timer_announce), name="uplink-read")

    async def _read(self, announce: bool) -> None:
        try:
            now = await asyncio.to_thread(uplink_functions, self.root)
        except Exception as err:  # noqa: BLE001 - sysfs/procfs are input: a full rescan reads them its own way
            log.warning("the host's uplink could not be read again (%s): a full rescan", err)
            now = None
        before, self.uplink = self.uplink, now
        self.reads += 1
        if announce and (now is None or now != before):
            if now is not None and before is not None:
                log.info("the host's uplink changed (now: %s; before: %s): a full rescan",
                         ", ".join(sorted(now)) or "none", ", ".join(sorted(before)) or "none")
            self.on_change()


async def follow_default_routes(settings, kernel: bool, on_change: Callable[[], None]) -> RouteWatch | None:
    """A started RouteWatch on the host's network namespace (``agent.rtnetlink.host_events_socket``:
    ``kernel``, whether the root's sys is the kernel's); None when the uplink is published anyway,
    the root is a fixture tree or the socket cannot be had (logged). The uplink it compares with is
    read before it listens (before the first scan: what changes after it is heard)."""
    if settings.publish_uplink:
        return None
    routes = RouteWatch(on_change, settings.root)
    try:
        routes.uplink = await asyncio.to_thread(uplink_functions, settings.root)
    except Exception as err:  # noqa: BLE001 - then the first link change's read counts as a change
        log.warning("the host's uplink could not be read (%s)", err)
    return routes if await listen_on_host(routes.start, settings.root, kernel, "route") else None
