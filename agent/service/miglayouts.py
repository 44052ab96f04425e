"""MIG layouts changed on a running node (``nvidia-smi mig``, mig-parted, the GPU operator's MIG
manager; docs/partitions.md, "Static MIG"). Neither NVML nor the kernel reports them, yet where the
operator's instances are what is published (static MIG, or no NVML) a change adds or removes MIG
devices, and the first instance made (or the last destroyed) takes the whole GPU out of the slices
(or puts it back). So every ``health_interval`` the instances each such GPU's procfs lists are
listed by name (a few directory reads, in a worker thread), and a GPU whose list changed is scanned
again at once instead of at the next resync. Dynamic MIG GPUs (NVML's profiles) are left out: their
placements are published whatever exists, and their instances are the agent's own."""

from __future__ import annotations

import asyncio
import logging

from discovery.models import Inventory
from discovery.partitions import mig_layout
from discovery.sysfs import HostFS

log = logging.getLogger("sysdra.daemon")


class MigLayouts:
    def __init__(self, root: str):
        self.fs = HostFS(root)
        self.seen: dict[str, frozenset | None] = {}  # GPU address -> its instances at the last look

    def changed(self, inventory: Inventory) -> set[str]:
        """The addresses of the GPUs whose instances differ from the last look (at a GPU's first
        look: from those the inventory has). Blocks: a worker thread's."""
        out: set[str] = set()
        for dev in inventory.devices:
            gpu = dev.gpu
            if gpu is None or gpu.nvidia_minor is None or (gpu.partitioning is not None and gpu.partitioning.profiles):
                continue
            bdf, now = dev.pci.bdf, mig_layout(self.fs, gpu.nvidia_minor)
            before = self.seen[bdf] if bdf in self.seen else _scanned(dev)
            if now != before:
                out.add(bdf)
            self.seen[bdf] = now
        return out


def _scanned(dev) -> frozenset | None:
    pt = dev.gpu.partitioning
    return frozenset((p.gi, p.ci) for p in pt.partitions) if pt is not None and pt.kind == "mig" else None


async def follow(agent) -> None:
    """Each ``health_interval``: the GPUs whose MIG layout changed, scanned again."""
    layouts = MigLayouts(agent.settings.root)
    while True:
        await asyncio.sleep(agent.settings.health_interval)
        inventory = agent.inventory
        if inventory is None or not any(d.gpu is not None and d.gpu.nvidia_minor is not None for d in inventory.devices):
            continue
        try:
            changed = await asyncio.to_thread(layouts.changed, inventory)
            if changed:
                log.info("MIG instances changed on %s: scanned again", ", ".join(sorted(changed)))
                await agent.rescan(changed=changed)
        except Exception:  # noqa: BLE001 - the next look may well succeed; the resync stays the safety net
            log.exception("looking for MIG layout changes failed")
