"""Link changes from the kernel (rtnetlink, group RTMGRP_LINK), so a NIC's health is checked
the moment its link goes down or up instead of at the next round (``health_interval``).

Link state changes are not uevents: the kernel announces them as RTM_NEWLINK/RTM_DELLINK
on the route netlink socket (what ``ip monitor link`` shows). Any process may listen. We
only need the interface names; the health rules re-read operstate and carrier from sysfs.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
import struct
from typing import Callable

log = logging.getLogger(__name__)

RTMGRP_LINK = 0x1
RTM_NEWLINK, RTM_DELLINK = 16, 17
IFLA_IFNAME = 3
_NLMSG = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_IFINFO = struct.Struct("=BxHiII")  # ifinfomsg: family, type, index, flags, change
_RTA = struct.Struct("=HH")  # rtattr: len, type


def _align(n: int) -> int:
    return (n + 3) & ~3


def interface_names(data: bytes) -> set[str]:
    """Names of the interfaces in the RTM_NEWLINK/RTM_DELLINK messages of one datagram.
    Malformed parts end the parse; they never raise."""
    names: set[str] = set()
    off = 0
    while off + _NLMSG.size <= len(data):
        length, mtype, _, _, _ = _NLMSG.unpack_from(data, off)
        if length < _NLMSG.size or off + length > len(data):
            break
        if mtype in (RTM_NEWLINK, RTM_DELLINK) and length >= _NLMSG.size + _IFINFO.size:
            a, end = off + _NLMSG.size + _IFINFO.size, off + length
            while a + _RTA.size <= end:
                alen, atype = _RTA.unpack_from(data, a)
                if alen < _RTA.size or a + alen > end:
                    break
                if atype == IFLA_IFNAME:
                    name = data[a + _RTA.size:a + alen].split(b"\0", 1)[0]
                    if name:
                        names.add(name.decode("ascii", "replace"))
                a += _align(alen)
        off += _align(length)
    return names


class LinkWatch:
    """Calls ``on_change(names)`` on the event loop for every batch of link messages;
    ``names`` is None when the kernel dropped messages (socket overrun): check everything."""

    def __init__(self, on_change: Callable[[set[str] | None], None]):
        self.on_change = on_change
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC,
                             socket.NETLINK_ROUTE)
        try:
            sock.bind((0, RTMGRP_LINK))
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
        names: set[str] | None = set()
        while self._sock is not None:
            try:
                data = self._sock.recv(65536)
            except BlockingIOError:
                break
            except OSError as err:
                if err.errno != errno.ENOBUFS:
                    log.warning("link events: %s", err)
                    break
                names = None  # overrun: some link changes were lost
                continue
            if names is not None:
                names |= interface_names(data)
        if names is None or names:
            self.on_change(names)
