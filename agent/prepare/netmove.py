"""A claim's netdev into its pod's network namespace and back: the kernel's side of a
``NetdevMove`` record (prepare/records.py), for the NRI plugin (agent/nri/netdev.py) and the
netdev step's undo (prepare/steps/netdev.py). Blocking: worker threads only.

Both directions may be run again on a half-done state (the record is saved before the kernel is
touched, so a crash leaves a record that says "maybe"): each looks where the link is first.
"""

from __future__ import annotations

import errno
import glob
import logging
import os
import re

from agent import rtnetlink
from agent.prepare import rdma, rtnl
from agent.prepare.records import BDF_PATTERN, BUS_DEVICE_PATTERN, MAC_PATTERN, NetdevMove

log = logging.getLogger(__name__)


def identify(move: NetdevMove, host_netns: str, root: str = "/") -> NetdevMove:
    """``move`` with its host link's identity, read before it first moves: its name now, bus
    device, index, MAC and MTU. The link is the claim's NIC function's netdev whatever its name
    (``_of_function``): after a reboot the same function's netdev may come up under another name
    (ethN renumbering, a naming policy or driver change), or the operator renamed it, and the old
    name may be another NIC's now. Without the function's netdevs known (sysfs under ``root`` does
    not list them, the kernel says no bus device), by the recorded name. LinkError when there is
    none, or which of the function's netdevs it is cannot be told."""
    links = rtnl.links(host_netns)
    own = _of_function(links, move.bdf, root) if move.bdf else []
    if own:
        link = next((l for l in own if l.name == move.host), None) or (own[0] if len(own) == 1 else None)
        if link is None:
            raise rtnl.LinkError(errno.ENODEV, f"no link {move.host} in {host_netns}, and which netdev of {move.bdf} "
                                 f"({', '.join(l.name for l in own)}) is the claim's cannot be told")
    else:
        link = next((l for l in links if l.name == move.host), None)
        if link is None:
            raise rtnl.LinkError(errno.ENODEV, f"no link {move.host} in {host_netns}")
        if move.bdf and link.parent and _PCI.match(link.parent) and link.parent != move.bdf:
            raise rtnl.LinkError(errno.ENODEV, f"{move.host} is now a netdev of {link.parent}, not of the claim's {move.bdf}")
    if link.name != move.host:
        log.warning("netdev %s of %s is %s on the host now (renamed: a reboot, udev, the operator): moved as that, and "
                    "given back under it", move.host, move.bdf, link.name)
    return move.changed(host=link.name, index=link.index, mac=_fits(_MAC, link.mac), parent=_fits(_BUS, link.parent),
                        hostMtu=link.mtu if link.mtu is not None and 68 <= link.mtu <= 65535 else None)


def _of_function(links: list[rtnl.Link], bdf: str, root: str) -> list[rtnl.Link]:
    """The links of PCI function ``bdf``: those the kernel says are its (their bus device), and
    those sysfs under ``root`` lists in its ``net/`` (a kernel before 5.14 says none; sysfs shows
    the netdevs of the host's namespace) unless the kernel says they are another device's."""
    try:
        names = set(os.listdir(os.path.join(root, "sys/bus/pci/devices", bdf, "net")))
    except OSError:  # no netdev of it where sysfs sees, or no such function
        names = set()
    return [l for l in links if l.parent == bdf or (l.name in names and l.parent in (None, bdf))]


def find(netns: str, move: NetdevMove, name: str) -> rtnl.Link | None:
    """The record's netdev in ``netns`` under whatever name it has there; None when it is not
    there (``name``: where a record of an earlier agent, without an identity, expects it)."""
    return pick(rtnl.links(netns), move, name)


def pick(links: list[rtnl.Link], move: NetdevMove, name: str) -> rtnl.Link | None:
    """A NIC's netdev by its bus device (the pod cannot make one; several of one function, as
    ports or switchdev representors, are told apart by index, then MAC); a virtual one by its
    MAC, then index (an index is a small number per namespace: the kernel gives a link another
    when it moves into a namespace where its own is taken); never by a name alone, which any
    link may take, unless the record has nothing else."""
    if move.parent is not None:
        links = [link for link in links if link.parent == move.parent]
        if len(links) > 1:
            links = [link for link in links if link.index == move.index] or [link for link in links if link.mac == move.mac]
        return links[0] if len(links) == 1 else None
    if move.index is None and move.mac is None:
        return next((link for link in links if link.name == name), None)
    hits = [link for link in links if link.parent is None and (link.mac == move.mac if move.mac else link.index == move.index)]
    if len(hits) > 1:
        hits = [link for link in hits if link.index == move.index]
    return hits[0] if len(hits) == 1 else None


def move_in(move: NetdevMove, host_netns: str) -> NetdevMove:
    """``move`` (identified) into its ``netns`` as its pod name, configured (MTU, up, addresses,
    routes) and its RDMA device with it; -> the record with its index and MAC in the pod.
    LinkError/OSError on a refusal: nothing is undone here (``move_out`` does that, from the record)."""
    assert move.netns is not None
    here = find(move.netns, move, move.pod)
    if here is None:
        there = find(host_netns, move, move.host)
        if there is None:
            raise rtnl.LinkError(errno.ENODEV, f"netdev {move.host} is not on the host{_as(move)}")
        _free(move.netns, move.pod, f"{move.pod} is taken in the pod's network namespace by another interface (the "
              "runtime's, another claim's): give the netdev another name (NicConfig interfaceName, or the request's name)")
        rtnl.move(host_netns, there.name, move.netns, move.pod, index=there.index)
    elif here.name != move.pod:
        rtnl.rename(move.netns, here.name, move.pod, index=here.index)
    if move.mtu is not None:
        rtnl.set_mtu(move.netns, move.pod, move.mtu)
    rtnl.set_up(move.netns, move.pod)  # before routes: a gateway is reached over an up link
    for address in [*move.addresses, *move.leased]:
        rtnl.add_address(move.netns, move.pod, address)
    for route in [*move.routes, *move.leasedRoutes]:
        rtnl.add_route(move.netns, move.pod, route.destination, route.gateway)
    if move.rdma:
        rdma.move(host_netns, move.rdma, move.netns)
    now = rtnl.link(move.netns, move.pod)
    if now is None:
        raise rtnl.LinkError(errno.ENODEV, f"{move.pod} left the pod's network namespace while it was configured")
    return move.changed(index=now.index, mac=_fits(_MAC, now.mac))


def move_out(move: NetdevMove, host_netns: str, root: str = "/") -> str | None:
    """``move`` back on the host under its host name (its MTU as it was), wherever it is now:
    in the pod under any name, or back on the host under any name (its namespace died: the
    kernel returns a NIC's netdev as it was named, or ``dev<index>``), or already back. A
    virtual link dies with its namespace (logged). A NIC's netdev that is in neither place
    while its function is on the bus (a namespace still being torn down) is LinkError (EAGAIN):
    the record stays, to be looked at again. LinkError (EEXIST) when it is in the pod and its host
    name is another link's now; one already on the host then keeps the name it has (a reboot's).
    -> its name on the host (None: nowhere)."""
    alive = move.netns is not None and os.path.exists(move.netns)
    if move.rdma and alive:
        try:
            rdma.move(move.netns, move.rdma, host_netns)
        except rtnl.LinkError as err:
            if err.errno != errno.ENODEV:  # not in the pod: never moved, or back
                raise
    here, there = _locate(move, host_netns, alive)
    name = move.host
    if there is not None and there.name != move.host:
        if rtnl.link(host_netns, move.host) is None:
            rtnl.rename(host_netns, there.name, move.host, index=there.index)
        else:  # nothing left to move: a record that waited for the name would block unprepare for good
            name = there.name
            log.warning("netdev %s%s is on the host as %s, and another link has its name now (a reboot's names): left "
                        "under %s", move.host, _as(move), there.name, there.name)
    elif here is not None:
        _free(host_netns, move.host, f"netdev {move.host} cannot come back under its name: another link has it now{_as(move)}")
        rtnl.move(move.netns, here.name, host_netns, move.host, index=here.index)
    if here is None and there is None:
        if move.parent is not None and glob.glob(os.path.join(root, "sys/bus/*/devices", move.parent)):
            raise rtnl.LinkError(errno.EAGAIN, f"netdev {move.host}{_as(move)} is neither in pod sandbox {move.sandbox} "
                                 "nor back on the host yet (a network namespace being torn down returns it)")
        log.warning("netdev %s (%s in sandbox %s) is nowhere: a virtual link dies with its namespace, a NIC function "
                    "may have left the bus", move.host, move.pod, move.sandbox)
        return None
    if move.hostMtu is not None and (now := rtnl.link(host_netns, name)) is not None and now.mtu != move.hostMtu:
        rtnl.set_mtu(host_netns, name, move.hostMtu)  # the config's MTU, or one the pod set
    return name


def _locate(move: NetdevMove, host_netns: str, alive: bool) -> tuple[rtnl.Link | None, rtnl.Link | None]:
    """Where ``move``'s netdev is now: (in the pod, on the host), at most one of them. On the host
    first, where one that never left (or came back as it was: its index and MAC) needs no look into
    the pod. Else a NIC's is looked for in the pod before the host's other candidates: the pod
    cannot make a link of its bus device, while the host may hold that device's other netdevs (a
    switchdev PF's representors, other ports), then the only one of it there. A virtual link that
    is not on the host is looked for in the pod (which may make one with its MAC, so never first)."""
    there = find(host_netns, move, move.host)
    if there is not None and (move.parent is None or (there.index, there.mac) == (move.index, move.mac)):
        return None, there
    here = _find_in(move.netns, move) if alive else None
    return here, there if here is None else None


def in_pod(move: NetdevMove) -> bool:
    """The netdev is in its pod's namespace now (the namespace may be gone)."""
    return move.netns is not None and os.path.exists(move.netns) and _find_in(move.netns, move) is not None


def _find_in(netns: str, move: NetdevMove) -> rtnl.Link | None:
    try:
        return find(netns, move, move.pod)
    except OSError as err:  # the namespace's file is gone or is no namespace any more
        if err.errno in (errno.ENOENT, errno.EINVAL):
            return None
        raise


def _free(netns: str, name: str, taken: str) -> None:
    """LinkError (EEXIST, ``taken``) when ``name`` is a link's in ``netns``: checked before a
    move, which the kernel makes under the link's own name when that one is free there and
    renames after, so a taken name would leave it moved under the wrong one."""
    if rtnl.link(netns, name) is not None:
        raise rtnl.LinkError(errno.EEXIST, taken)


def _as(move: NetdevMove) -> str:
    what = [f"device {move.parent}" if move.parent else "", f"index {move.index}" if move.index else "",
            f"MAC {move.mac}" if move.mac else ""]
    return f" ({', '.join(w for w in what if w)})" if any(what) else ""


def _fits(pattern: re.Pattern, value: str | None) -> str | None:
    return value if value is not None and pattern.match(value) else None


_MAC, _BUS, _PCI = re.compile(MAC_PATTERN), re.compile(BUS_DEVICE_PATTERN), re.compile(BDF_PATTERN)  # the records' own


# what a move needs, and where a deployment grants it
MOVE_RIGHTS = ("CAP_NET_ADMIN and CAP_SYS_ADMIN, and namespaces it may enter (systemd: the drop-in "
               "sysdra-nri.conf; the chart: nri.enabled; docs/networking.md)")
_MOVE_CAPABILITIES = (("CAP_NET_ADMIN", 12), ("CAP_SYS_ADMIN", 21))


def rights_hint(err: Exception) -> str:
    """What a move needs, said after a refusal of the kernel's (EPERM, EACCES)."""
    return f" (a move needs {MOVE_RIGHTS})" if getattr(err, "errno", None) in (errno.EPERM, errno.EACCES) else ""


def missing_move_capabilities(status: str = "/proc/self/status") -> list[str]:
    """The capabilities a move needs that this process's effective set lacks ([] if unknown)."""
    try:
        with open(status, encoding="ascii", errors="replace") as f:
            effective = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return []
    return [name for name, bit in _MOVE_CAPABILITIES if not effective >> bit & 1]


def host_netns(root: str) -> str:
    """The host's network namespace: its init's under ``root`` (a DaemonSet's ``/host/proc``),
    else the agent's own (a fixture root; or an init whose link this process may not open, see
    ``host_netns_problem``: under systemd the agent's own is the host's)."""
    init = rtnetlink.init_netns(root)
    return init if os.path.exists(init) else "/proc/self/ns/net"


def host_netns_problem(root: str) -> str | None:
    """Why the init's network namespace under ``root`` is there but cannot be opened, or None.
    The kernel lets only a process with all of the init's capabilities, or CAP_SYS_PTRACE, open
    it; without, netdevs move from and to the agent's own namespace, the host's only under
    systemd or with the host's network."""
    init = rtnetlink.init_netns(root)
    if not os.path.lexists(init):
        return None
    try:
        os.close(os.open(init, os.O_RDONLY | os.O_CLOEXEC))
    except OSError as err:
        return (f"{init}: {err.strerror}: claimed netdevs move from and to the agent's own network namespace, "
                "the host's only under systemd or with hostNetwork (grant CAP_SYS_PTRACE; docs/networking.md)")
    return None
