"""A claim's netdev into its pod's network namespace and back: the kernel's side of a
``NetdevMove`` record (prepare/records.py), for the NRI plugin (agent/nri/netdev.py) and the
netdev step's undo (prepare/steps/netdev.py). Blocking: worker threads only.

Both directions may be run again on a half-done state (the record is saved before the kernel is
touched, so a crash leaves a record that says "maybe"): each looks where the link is first.
"""

from __future__ import annotations

import errno
import logging
import os

from agent import rtnetlink
from agent.prepare import rdma, rtnl
from agent.prepare.records import NetdevMove

log = logging.getLogger(__name__)


def move_in(move: NetdevMove, host_netns: str) -> str | None:
    """``move`` into its ``netns`` as its pod name, configured (MTU, up, addresses, routes) and
    its RDMA device with it; -> its MAC. LinkError/OSError on a refusal: nothing is undone
    here (``move_out`` does that, from the record)."""
    assert move.netns is not None
    if not rtnl.has_link(move.netns, move.pod):
        rtnl.move(host_netns, move.host, move.netns, move.pod)
    if move.mtu is not None:
        rtnl.set_mtu(move.netns, move.pod, move.mtu)
    rtnl.set_up(move.netns, move.pod)  # before routes: a gateway is reached over an up link
    for address in move.addresses:
        rtnl.add_address(move.netns, move.pod, address)
    for route in move.routes:
        rtnl.add_route(move.netns, move.pod, route.destination, route.gateway)
    if move.rdma:
        rdma.move(host_netns, move.rdma, move.netns)
    return rtnl.hardware_address(move.netns, move.pod)


def move_out(move: NetdevMove, host_netns: str) -> None:
    """``move`` back on the host under its host name, wherever it is now: in the pod, already
    back, back under its pod name (its namespace died: the kernel returns physical netdevs), or
    gone (a virtual link dies with its namespace: logged)."""
    alive = move.netns is not None and os.path.exists(move.netns)
    if move.rdma and alive:
        try:
            rdma.move(move.netns, move.rdma, host_netns)
        except rtnl.LinkError as err:
            if err.errno != errno.ENODEV:  # not in the pod: never moved, or back
                raise
    if rtnl.has_link(host_netns, move.host):
        return  # never moved, or already back
    if alive and _has(move.netns, move.pod):
        rtnl.move(move.netns, move.pod, host_netns, move.host)
    elif rtnl.has_link(host_netns, move.pod) and move.mac and rtnl.hardware_address(host_netns, move.pod) == move.mac:
        rtnl.rename(host_netns, move.pod, move.host)
    else:
        log.warning("netdev %s (%s in sandbox %s) is nowhere: a virtual link dies with its namespace",
                    move.host, move.pod, move.sandbox)


def in_pod(move: NetdevMove) -> bool:
    """The netdev is in its pod's namespace now (the namespace may be gone)."""
    return move.netns is not None and os.path.exists(move.netns) and _has(move.netns, move.pod)


def _has(netns: str, name: str) -> bool:
    try:
        return rtnl.has_link(netns, name)
    except OSError as err:  # the namespace's file is gone or is no namespace any more
        if err.errno in (errno.ENOENT, errno.EINVAL):
            return False
        raise


# what a move needs, and where a deployment grants it
MOVE_RIGHTS = ("CAP_NET_ADMIN and CAP_SYS_ADMIN, and namespaces it may enter (systemd: the drop-in "
               "sysdra-nri.conf; the chart: nri.enabled; docs/networking.md)")
_MOVE_CAPABILITIES = (("CAP_NET_ADMIN", 12), ("CAP_SYS_ADMIN", 21))


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
