"""Per-device metrics (docs/operations.md, "Metrics"), read at each scrape from what the status
board last handed over, so a scrape never sees half an update; the prepared rows are built at the
scrape from the claims and inventory handed over, not at each prepare (a node's thousands of
devices would be indexed again for every claim):

- ``sysdra_device_unhealthy{device, reason}``: 1 for each unhealthy device (a MIG device with a
  fault of its own too), with its fault's reason code (``xid-79``, ``link-down``): an alert names
  the device and what is wrong with it, and a healthy device has no series;
- ``sysdra_device_prepared{device, namespace, claim, pci_bus_id, uuid}``: 1 for each device of a
  prepared claim, with the PCI address and (NVIDIA) GPU UUID of the hardware under it (a MIG
  device's or a share's GPU), so a GPU's own metrics (DCGM's ``UUID``) join with the claim using it.
"""

from __future__ import annotations

from agent.prepare.checkpoint_format import COMPLETED


class DeviceRows:
    """A collector of the rows below; each set of rows is replaced whole (by the loop's thread)."""

    def __init__(self):
        self.unhealthy: tuple[tuple[str, str], ...] = ()
        self.prepared_from: tuple[dict[str, dict], object] = ({}, None)  # (claims, inventory)

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily  # (the status board imports this module without metrics)

        family = GaugeMetricFamily("sysdra_device_unhealthy", "1 for each unhealthy device, by its fault's reason",
                                   labels=["device", "reason"])
        for row in self.unhealthy:
            family.add_metric(list(row), 1)
        yield family
        family = GaugeMetricFamily("sysdra_device_prepared", "1 for each device of a prepared claim, with the "
                                   "hardware under it", labels=["device", "namespace", "claim", "pci_bus_id", "uuid"])
        for row in prepared_rows(*self.prepared_from):
            family.add_metric(list(row), 1)
        yield family


def unhealthy_rows(faults: dict[str, tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """``faults``: device -> (reason, message) of the unhealthy devices."""
    return tuple(sorted((device, reason or "unknown") for device, (reason, _message) in faults.items()))


def prepared_rows(claims: dict[str, dict], inventory) -> tuple[tuple[str, str, str, str, str], ...]:
    """``claims``: checkpoint-shaped entries (the status board's); only completed ones count."""
    by_name = {d.name: d for d in inventory.devices} if inventory is not None else {}
    rows = set()
    for c in claims.values():
        if c.get("state") != COMPLETED:
            continue
        for entry in c.get("devices") or ():
            name = entry.get("device") if isinstance(entry, dict) else None
            if not isinstance(name, str):
                continue
            hw = _hardware(by_name, name)
            uuid = hw.gpu.nvidia_uuid if hw is not None and hw.gpu is not None else None
            rows.add((name, str(c.get("namespace") or ""), str(c.get("name") or ""), hw.pci.bdf if hw else "", uuid or ""))
    return tuple(sorted(rows))


def _hardware(by_name: dict, name: str):
    """The discovered device ``name`` is, or is a partition of (``<gpu>-mig-...``: its name begins
    with its GPU's); None when it is gone from the node."""
    if name in by_name:
        return by_name[name]
    parents = [d for n, d in by_name.items() if name.startswith(n + "-")]
    return max(parents, key=lambda d: len(d.name)) if parents else None
