"""Build Inventory objects directly (no sysfs) for slice and publisher tests."""

from __future__ import annotations

from discovery.models import AttributeValue, Device, Inventory, PciFunction, Sriov


def bdf(n: int, fn: int = 0) -> str:
    return f"0000:{n // 32:02x}:{n % 32:02x}.{fn}"


def device(n: int, kind: str = "gpu", *, fn: int = 0, physfn: str | None = None, sriov: Sriov | None = None,
           attributes: dict | None = None, capacity: dict | None = None, name: str | None = None) -> Device:
    address = bdf(n, fn)
    attrs = {
        "resource.kubernetes.io/pciBusID": AttributeValue(string=address),
        "type": AttributeValue(string=kind),
        "vendorID": AttributeValue(string="10de"),
    }
    if physfn:
        attrs["pfPciAddress"] = AttributeValue(string=physfn)
    attrs.update(attributes or {})
    pci = PciFunction(bdf=address, sysfs_path=f"/sys/devices/pci0000:00/{address}", pcie_root="pci0000:00",
                      vendor_id="10de", device_id="2330", class_code=0x030200, physfn=physfn, sriov=sriov)
    return Device(name=name or f"{kind}-{address.replace(':', '-').replace('.', '-')}", kind=kind, pci=pci,
                  attributes=attrs, capacity=capacity or {})


def inventory(n: int, kind: str = "gpu", **kw) -> Inventory:
    return Inventory(root="/", devices=tuple(device(i, kind, **kw) for i in range(n)))


def sriov_inventory(pfs: int = 2, vfs: int = 4) -> Inventory:
    devices = []
    for p in range(pfs):
        pf = bdf(p)
        devices.append(device(p, "nic", sriov=Sriov(total_vfs=8, num_vfs=vfs)))
        devices.extend(device(p, "nic", fn=f, physfn=pf) for f in range(1, vfs + 1))
    return Inventory(root="/", devices=tuple(devices))
