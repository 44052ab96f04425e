"""Default-route changes from the kernel (rtnetlink, IPv4 and IPv6 route groups), so the host's
uplink (discovery/routes.py) is followed live: a new default route's NIC leaves the slices, and
the old one comes back, within the debounce instead of at the next full resync.

Only a route to the whole address space (destination length 0) matters; any other route message
is ignored. Lost messages (socket overrun) count as a change.
"""

from __future__ import annotations

import logging
import struct
from typing import Callable

from agent.rtnetlink import Listener, listen_on_host, messages

log = logging.getLogger(__name__)

RTMGRP_IPV4_ROUTE, RTMGRP_IPV6_ROUTE = 0x40, 0x400
RTM_NEWROUTE, RTM_DELROUTE = 24, 25
_RTMSG = struct.Struct("=BBBBBBBBI")  # rtmsg: family, dst_len, src_len, tos, table, protocol, scope, type, flags


def default_route_changed(data: bytes) -> bool:
    """Whether one datagram holds an RTM_NEWROUTE/RTM_DELROUTE of a default route. Malformed
    parts end the parse; they never raise."""
    return any(mtype in (RTM_NEWROUTE, RTM_DELROUTE) and len(body) >= _RTMSG.size and _RTMSG.unpack_from(body)[1] == 0
               for mtype, body in messages(data))


class RouteWatch:
    """Calls ``on_change()`` on the event loop when a default route appears or goes."""

    def __init__(self, on_change: Callable[[], None]):
        self.on_change = on_change
        self._listener = Listener(RTMGRP_IPV4_ROUTE | RTMGRP_IPV6_ROUTE, self._batch, "route events")

    def start(self, sock=None) -> None:
        """``sock``: an unbound NETLINK_ROUTE socket of the namespace to hear (the host's), or this process's own."""
        self._listener.start(sock)

    def stop(self) -> None:
        self._listener.stop()

    def _batch(self, datagrams: list[bytes] | None) -> None:
        if datagrams is None or any(default_route_changed(d) for d in datagrams):
            self.on_change()


async def follow_default_routes(settings, kernel: bool, on_change: Callable[[], None]) -> RouteWatch | None:
    """A started RouteWatch on the host's network namespace (``agent.rtnetlink.host_events_socket``:
    ``kernel``, whether the root's sys is the kernel's); None when the uplink is published anyway,
    the root is a fixture tree or the socket cannot be had (logged)."""
    if settings.publish_uplink:
        return None
    routes = RouteWatch(on_change)
    return routes if await listen_on_host(routes.start, settings.root, kernel, "route") else None
