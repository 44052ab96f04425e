"""Whether the host uses a NIC's netdev (docs/networking.md, "NICs the host uses"): a netdev that
in the host's network namespace holds a global-scope address (the node's InternalIP, a storage
network), is a port of a bond, bridge, team or OVS datapath, is itself a master with ports, or
carries a VLAN/macvlan/ipvlan link. Moving such a netdev into a pod, or unbinding its function for
vfio-pci, cuts the node (or its storage) off that network: the netdev step and the VFIO step refuse
it at prepare, nothing changed, unless the node allows it (``allow_host_in_use_nics``) and the
claim's config asks for it (``allowHostInUse: true``).

Read over rtnetlink in the host's namespace (one link dump, one address dump): the namespace the
move itself uses. Blocking (netlink, setns): worker threads only, as prepare runs.
"""

from __future__ import annotations

import errno
import logging
import re
from collections.abc import Callable, Mapping

from agent import rtnetlink
from agent.prepare import netaddrs, netmove, rtnl
from agent.prepare.records import BDF_PATTERN

log = logging.getLogger(__name__)

UPPER_KINDS = frozenset({"vlan", "macvlan", "macvtap", "ipvlan", "ipvtap"})  # links that carry a netdev's traffic
SHOWN = 4  # addresses or links named in one reason
SETTING, FIELD = "allow_host_in_use_nics", "allowHostInUse"
_PCI = re.compile(BDF_PATTERN)


def _names(items: list[str]) -> str:
    more = f" (+{len(items) - SHOWN})" if len(items) > SHOWN else ""
    return ", ".join(items[:SHOWN]) + more


def _ours(links: list[rtnl.Link], name: str, bdf: str | None) -> rtnl.Link | None:
    """The link ``name`` if it may be the function's netdev: not one whose bus device is another
    PCI function (what ``netmove.identify`` refuses anyway)."""
    return next((link for link in links if link.name == name and not (
        bdf and link.parent and _PCI.fullmatch(link.parent) and link.parent != bdf)), None)


def _why(link: rtnl.Link, links: list[rtnl.Link], addresses: list[str]) -> list[str]:
    by_index = {other.index: other for other in links}
    why = []
    if addresses:
        why.append(f"it holds the host's address{'es' if len(addresses) > 1 else ''} {_names(addresses)}")
    if link.master is not None and (master := by_index.get(link.master)) is not None:
        why.append(f"it is a port of {master.kind or 'master'} {master.name}")
    if ports := [other.name for other in links if other.master == link.index]:
        why.append(f"it is the master of {_names(ports)}")
    if uppers := [f"{other.kind} {other.name}" for other in links if other.lower == link.index and other.kind in UPPER_KINDS]:
        why.append(f"{_names(uppers)} sits on it")
    return why


def host_uses(netns: str, netdevs: Mapping[str, str | None]) -> dict[str, str]:
    """``{name: why}`` of the ``netdevs`` (name -> the PCI function it belongs to) the host's
    namespace ``netns`` uses; a name not there (in a pod, gone) is not used by the host. OSError
    (rtnl.LinkError among them) when the namespace cannot be read."""
    if not netdevs:
        return {}
    links = rtnl.links(netns)
    addresses = netaddrs.netlink_addresses(rtnetlink.socket_in(netns))
    out = {}
    for name, bdf in netdevs.items():
        if (link := _ours(links, name, bdf)) is not None and (why := _why(link, links, addresses.get(name, []))):
            out[name] = "; ".join(why)
    return out


def namespace(root: str, host_netns: Callable[[], str]) -> str:
    """``host_netns()``, the host's network namespace; OSError when that is the init's under
    ``root`` and this process may not open it (``host_netns`` then gives the agent's own, which
    in a pod of its own is not the host's: nothing of the host's would be found there)."""
    if (problem := netmove.host_netns_problem(root)) is not None:
        raise OSError(errno.EACCES, problem)
    return host_netns()


def refusal(netns: Callable[[], str], netdevs: Mapping[str, str | None], node_allows: bool, claim_allows: bool,
            doing: str, config_kind: str) -> str | None:
    """Why ``doing`` (a move into a pod, a bind to vfio-pci) must not be done to ``netdevs`` (read
    in ``netns()``, ``namespace``), or None. A host-used netdev is refused unless the node allows it
    and the claim asks for it (then logged); one whose use cannot be read is refused (a check that
    cannot be made does not pass) unless both allow it whatever it is."""
    try:
        used = host_uses(netns(), netdevs) if netdevs else {}
    except OSError as err:
        names = ", ".join(netdevs)
        if node_allows and claim_allows:
            log.warning("whether the host uses netdev %s cannot be read (%s): %s as the node's %s and the claim's "
                        "%s allow it", names, err, doing, SETTING, FIELD)
            return None
        return f"whether the host uses netdev {names} cannot be read ({err}): not {doing} (docs/networking.md)"
    if not used:
        return None
    said = "; ".join(f"netdev {name} ({netdevs[name]}): {why}" for name, why in used.items())
    if node_allows and claim_allows:
        log.warning("%s, which the host uses (%s): the node's %s and the claim's %s allow it", doing, said, SETTING, FIELD)
        return None
    gate = (f"the claim's {config_kind} does not say {FIELD}: true" if node_allows
            else f"the node's setting {SETTING} is off")
    return f"the host uses it: {said}; not {doing}, which would cut the node off that network ({gate}; docs/networking.md)"
