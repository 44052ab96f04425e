"""The daemon's scans of the host: NVML opened once per process for the NVIDIA facts (and again
after a scan that finds a GPU bound to nvidia while it is not: the driver loaded after the agent),
the host's uplink left out unless ``publish_uplink``, the operator's ``exclude_devices`` left out,
the netdev facts of NICs whose netdevs are in pods kept (``away``: agent/service/inpod.py), and
rescans that re-read only what an event names."""

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


def _options(settings: Settings, away=None) -> dict:
    from discovery.exclude import Exclusions
    from discovery.extra_attributes import ExtraAttributes

    return dict(list_attributes=settings.list_attributes, publish_uplink=settings.publish_uplink,
                exclude=Exclusions.parse(settings.exclude_devices), away=away, static_mig=settings.nvidia_mig == "static",
                extra_attributes=ExtraAttributes.parse(settings.device_attributes, settings.driver_name))


def default_scan(settings: Settings):
    from discovery.inventory import scan

    return scan(settings.root, nvml=open_nvml(settings), **_options(settings))


def scanner_for(current, settings: Settings, away=None):
    """``current`` (a discovery.inventory.IncrementalScanner) while the settings it scans with are
    unchanged, else a new one (whose first update is a full scan)."""
    from discovery.inventory import IncrementalScanner

    options = _options(settings, away)
    if current is not None and current.root == os.path.abspath(settings.root) and all(
            getattr(current, name) == value for name, value in options.items()):
        return current
    return IncrementalScanner(settings.root, nvml=open_nvml(settings), **options)


def update(current, settings: Settings, changed: set[str] | None, away=None):
    """-> (scanner, inventory): ``changed`` re-read by ``scanner_for``'s scanner (everything by a
    new one). A scanner without NVML whose scan finds a GPU bound to nvidia asks for it again; once
    it is up, a new scanner reads everything with it (its unchanged GPUs were read without)."""
    from discovery.nvml import nvidia_bound

    sc = scanner_for(current, settings, away)
    inv = sc.update(changed if sc is current else None)
    if sc.nvml is None and nvidia_bound(inv) and (nvml := open_nvml(settings)) is not None:
        from discovery.inventory import IncrementalScanner

        sc = IncrementalScanner(sc.root, nvml=nvml, **_options(settings, away))
        inv = sc.full()
    return sc, inv
