"""Default-route changes from the kernel (rtnetlink, IPv4 and IPv6 route groups), so the host's
uplink (discovery/routes.py) is followed live: a new default route's NIC leaves the slices, and
the old one comes back, within the debounce instead of at the next full resync.

Only a route to the whole address space (destination length 0) matters; any other route message
is ignored. Lost messages (socket overrun) count as a change.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import struct
from typing import Callable

log = logging.getLogger(__name__)

RTMGRP_IPV4_ROUTE, RTMGRP_IPV6_ROUTE = 0x40, 0x400
RTM_NEWROUTE, RTM_DELROUTE = 24, 25
_NLMSG = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_RTMSG = struct.Struct("=BBBBBBBBI")  # rtmsg: family, dst_len, src_len, tos, table, protocol, scope, type, flags


def _align(n: int) -> int:
    return (n + 3) & ~3


def default_route_changed(data: bytes) -> bool:
    """Whether one datagram holds an RTM_NEWROUTE/RTM_DELROUTE of a default route. Malformed
    parts end the parse; they never raise."""
    off = 0
    while off + _NLMSG.size <= len(data):
        length, mtype, _, _, _ = _NLMSG.unpack_from(data, off)
        if length < _NLMSG.size or off + length > len(data):
            break
        if mtype in (RTM_NEWROUTE, RTM_DELROUTE) and length >= _NLMSG.size + _RTMSG.size:
            if _RTMSG.unpack_from(data, off + _NLMSG.size)[1] == 0:
                return True
        off += _align(length)
    return False


class RouteWatch:
    """Calls ``on_change()`` on the event loop when a default route appears or goes."""

    def __init__(self, on_change: Callable[[], None]):
        self.on_change = on_change
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC,
                             socket.NETLINK_ROUTE)
        try:
            sock.bind((0, RTMGRP_IPV4_ROUTE | RTMGRP_IPV6_ROUTE))
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._loop.add_reader(sock.fileno(), self._readable)

    def stop(self) -> None:
        if self._sock is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None

    def _readable(self) -> None:
        changed = False
        while self._sock is not None:
            try:
                data = self._sock.recv(65536)
            except BlockingIOError:
                break
            except OSError as err:
                if err.errno != errno.ENOBUFS:
                    log.warning("route events: %s", err)
                    break
                changed = True  # overrun: a default route may have changed
                continue
            changed = changed or default_route_changed(data)
        if changed:
            self.on_change()


def follow_default_routes(settings, on_change: Callable[[], None]) -> RouteWatch | None:
    """A started RouteWatch on the host's own root (a fixture tree has no kernel routes of its
    own); None when the uplink is published anyway or the socket is refused (logged)."""
    if settings.publish_uplink or os.path.abspath(settings.root) != "/":
        return None
    routes = RouteWatch(on_change)
    try:
        routes.start()
    except OSError as err:
        log.warning("default routes not followed (%s): a new uplink is seen at the next resync", err)
        return None
    return routes
