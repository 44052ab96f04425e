"""The daemon's scans of the host: NVML opened once per process for the NVIDIA facts (and again
after a scan that finds a GPU bound to nvidia while it is not: the driver loaded after the agent),
the host's uplink left out unless ``publish_uplink``, and rescans that re-read only what an event
names."""

from __future__ import annotations

import os

from agent.settings import Settings


def open_nvml(settings: Settings):
    """NVML for GPU facts, or None (``nvml: false``, or the node has none, or not yet: ``Nvml.shared``
    backs off): blocks, call in a thread."""
    if not settings.nvml:
        return None
    from discovery.nvml import Nvml

    return Nvml.shared(settings.root, settings.nvidia_driver_root)


def default_scan(settings: Settings):
    from discovery.inventory import scan

    return scan(settings.root, list_attributes=settings.list_attributes, nvml=open_nvml(settings),
                publish_uplink=settings.publish_uplink)


def scanner_for(current, settings: Settings):
    """``current`` (a discovery.inventory.IncrementalScanner) while the settings it scans with are
    unchanged, else a new one (whose first update is a full scan)."""
    from discovery.inventory import IncrementalScanner

    s = settings
    if (current is not None and current.root == os.path.abspath(s.root) and current.list_attributes == s.list_attributes
            and current.publish_uplink == s.publish_uplink):
        return current
    return IncrementalScanner(s.root, list_attributes=s.list_attributes, nvml=open_nvml(s), publish_uplink=s.publish_uplink)


def update(current, settings: Settings, changed: set[str] | None):
    """-> (scanner, inventory): ``changed`` re-read by ``scanner_for``'s scanner (everything by a
    new one). A scanner without NVML whose scan finds a GPU bound to nvidia asks for it again; once
    it is up, a new scanner reads everything with it (its unchanged GPUs were read without)."""
    from discovery.nvml import nvidia_bound

    sc = scanner_for(current, settings)
    inv = sc.update(changed if sc is current else None)
    if sc.nvml is None and nvidia_bound(inv) and (nvml := open_nvml(settings)) is not None:
        from discovery.inventory import IncrementalScanner

        sc = IncrementalScanner(sc.root, list_attributes=sc.list_attributes, nvml=nvml,
                                publish_uplink=sc.publish_uplink)
        inv = sc.full()
    return sc, inv
