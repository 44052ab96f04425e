"""The daemon's scans of the host: NVML opened once per process for the NVIDIA facts, the host's
uplink left out unless ``publish_uplink``, and rescans that re-read only what an event names."""

from __future__ import annotations

import os

from agent.settings import Settings


def open_nvml(settings: Settings):
    """NVML for GPU facts, or None (``nvml: false``, or the node has none): blocks, call in a thread."""
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
