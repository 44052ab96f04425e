"""DRM class views below a PCI function: ``drm/cardN`` and ``drm/renderDN``.

Names come from the function's own ``drm/`` directory, never from probe order, so a
BMC's ``card0`` cannot shift anybody else's card numbers.
"""

from __future__ import annotations

import re

from discovery.devnodes import NodeResolver
from discovery.models import DeviceNode, Problem
from discovery.sysfs import AttrError, Dir, HostFS

_CARD = re.compile(r"^card(\d+)$")
_RENDER = re.compile(r"^renderD(\d+)$")


def drm_minors(fs: HostFS, d: Dir) -> tuple[str | None, str | None]:
    """-> (cardN, renderDN) of the function, lowest index each (connectors ignored)."""
    if not d.has("drm"):
        return None, None
    try:
        names = fs.listdir(f"{d.path}/drm")
    except AttrError:
        return None, None
    cards = sorted((int(m.group(1)), n) for n in names if (m := _CARD.match(n)))
    renders = sorted((int(m.group(1)), n) for n in names if (m := _RENDER.match(n)))
    return (cards[0][1] if cards else None), (renders[0][1] if renders else None)


def drm_nodes(
    fs: HostFS, resolver: NodeResolver, pci_dir: str, card: str | None, render: str | None, problems: list[Problem]
) -> list[DeviceNode]:
    nodes = []
    for name in (card, render):
        if name is None:
            continue
        node = resolver.resolve(f"/dev/dri/{name}", problems, sysfs_dev=f"{pci_dir}/drm/{name}/dev")
        if node is not None:
            nodes.append(node)
    return nodes
