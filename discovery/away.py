"""NIC functions whose netdevs are in a pod's network namespace keep their netdev facts.

sysfs shows a netdev only in the network namespace it was mounted in (the host's): once the agent's
NRI plugin moves a claimed NIC's netdev into its pod, the function reads without it, and its
``interfaceName``, ``macAddress`` and ``mtu`` would leave the slice at every pod start and come
back at its stop, each a slice write (dranet#99). The scan is told which functions' netdevs are
away (``Away``, asked once per scan: ``{bdf: {host name: the facts the move's record knows}}``; the
agent reads it from the checkpoint's netdev records, agent/service/inpod.py: discovery imports
nothing of prepare) and keeps each missing one as it last read it from sysfs, else as the record
knows it (name, MAC, the host's MTU: after an agent restart while it was away). Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from discovery.models import NetInterface, NicInfo

Away = Callable[[], Mapping[str, Mapping[str, NetInterface]]]


def kept(now: NicInfo, before: tuple[NetInterface, ...], away: Mapping[str, NetInterface]) -> NicInfo:
    """``now`` (as sysfs reads) with the ``away`` netdevs it lacks as ``before`` (the function's
    last read) had them, else as the record knows them; in ``before``'s order."""
    names = {i.name for i in now.interfaces}
    last = {i.name: i for i in before}
    missing = [last.get(name, fact) for name, fact in away.items() if name not in names]
    if not missing:
        return now
    order = {i.name: n for n, i in enumerate(before)}
    interfaces = sorted((*now.interfaces, *missing), key=lambda i: (order.get(i.name, len(order)), i.name))
    return now.replace(interfaces=tuple(interfaces))
