"""Link changes from the kernel (rtnetlink, group RTMGRP_LINK), so a NIC's health is checked
the moment its link goes down or up instead of at the next round (``health_interval``).

Link state changes are not uevents: the kernel announces them as RTM_NEWLINK/RTM_DELLINK
on the route netlink socket (what ``ip monitor link`` shows). Any process may listen. We
only need the interface names; the health rules re-read operstate and carrier from sysfs.
"""

from __future__ import annotations

import struct
from typing import Callable

from agent.rtnetlink import Listener, align, messages

RTMGRP_LINK = 0x1
RTM_NEWLINK, RTM_DELLINK = 16, 17
IFLA_IFNAME = 3
_IFINFO = struct.Struct("=BxHiII")  # ifinfomsg: family, type, index, flags, change
_RTA = struct.Struct("=HH")  # rtattr: len, type


def interface_names(data: bytes) -> set[str]:
    """Names of the interfaces in the RTM_NEWLINK/RTM_DELLINK messages of one datagram.
    Malformed parts end the parse; they never raise."""
    names: set[str] = set()
    for mtype, body in messages(data):
        if mtype not in (RTM_NEWLINK, RTM_DELLINK) or len(body) < _IFINFO.size:
            continue
        a = _IFINFO.size
        while a + _RTA.size <= len(body):
            alen, atype = _RTA.unpack_from(body, a)
            if alen < _RTA.size or a + alen > len(body):
                break
            if atype == IFLA_IFNAME:
                name = bytes(body[a + _RTA.size:a + alen]).split(b"\0", 1)[0]
                if name:
                    names.add(name.decode("ascii", "replace"))
            a += align(alen)
    return names


class LinkWatch:
    """Calls ``on_change(names)`` on the event loop for every batch of link messages;
    ``names`` is None when the kernel dropped messages (socket overrun): check everything."""

    def __init__(self, on_change: Callable[[set[str] | None], None]):
        self.on_change = on_change
        self._listener = Listener(RTMGRP_LINK, self._batch, "link events")

    def start(self, sock=None) -> None:
        """``sock``: an unbound NETLINK_ROUTE socket of the namespace to hear (the host's), or this process's own."""
        self._listener.start(sock)

    def stop(self) -> None:
        self._listener.stop()

    def _batch(self, datagrams: list[bytes] | None) -> None:
        if datagrams is None:
            self.on_change(None)
            return
        names: set[str] = set()
        for data in datagrams:
            names |= interface_names(data)
        if names:
            self.on_change(names)
