"""Names from listings and links (netdevs, RDMA devices, a driver link's target) are bytes on
Linux: one that is not printable UTF-8 is that device's problem, never the scan's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from discovery import inventory
from discovery.inventory import scan
from tests.conftest import REPO, profile_root

NETDEV_NIC, RDMA_NIC, DRIVER_NIC = "0000:bd:00.0", "0000:9f:00.0", "0000:3c:00.0"


def _fn_dir(root: str, bdf: str) -> bytes:
    return os.fsencode(os.path.realpath(os.path.join(root, "sys/bus/pci/devices", bdf)))


def _rename_only_entry(d: bytes, new: bytes) -> None:
    (old,) = os.listdir(d)
    os.rename(os.path.join(d, old), os.path.join(d, new))


def test_names_that_are_not_utf8_cost_one_value_each(tmp_path):
    root = str(tmp_path / "root")
    shutil.copytree(profile_root("server-2s-gpu-nic"), root, symlinks=True)
    before = scan(root)
    _rename_only_entry(_fn_dir(root, NETDEV_NIC) + b"/net", b"en\xffx")
    _rename_only_entry(_fn_dir(root, RDMA_NIC) + b"/infiniband", b"mlx5_\xff")
    fn = _fn_dir(root, DRIVER_NIC)
    os.unlink(fn + b"/uevent")  # without it, the driver is the link's target
    os.unlink(fn + b"/driver")
    os.symlink(b"../../../../../../bus/pci/drivers/mlx5\x01core", fn + b"/driver")

    inv = scan(root, list_attributes=True)
    by_bdf = {d.pci.bdf: d for d in inv.devices}
    assert set(by_bdf) == {d.pci.bdf for d in before.devices} - {DRIVER_NIC}
    netdev, rdma = by_bdf[NETDEV_NIC], by_bdf[RDMA_NIC]
    assert netdev.nic.interfaces == () and "interfaceName" not in netdev.attributes
    assert [(p.what, p.reason) for p in netdev.problems] == [("netdev", r"name b'en\xffx' is not printable UTF-8")]
    assert rdma.nic.rdma == () and rdma.attributes["rdma"].to_api() == {"bool": False}
    assert [(p.what, p.reason) for p in rdma.problems] == [("RDMA device", r"name b'mlx5_\xff' is not printable UTF-8")]
    assert {s.bdf: s.reason for s in inv.skipped}[DRIVER_NIC].startswith("no driver bound")
    json.dumps(inv.to_json(), ensure_ascii=False).encode()  # all of it encodes: no stray surrogate

    out = subprocess.run([sys.executable, "-m", "agent", "scan", "--root", root, "--list-attributes", "-o", "slices",
                          "--node-name", "node-a"], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "SYSDRA_CONFIG": os.devnull})  # fmt: skip
    assert out.returncode == 0, out.stderr
    published = {d["name"] for s in json.loads(out.stdout)["items"] for d in s["spec"]["devices"]}
    assert {"nic-0000-bd-00-0", "nic-0000-9f-00-0"} <= published


def test_a_failure_building_attributes_costs_that_device_only(tmp_path, monkeypatch):
    """Fault injection (no tree makes attribute building fail once names are checked): a
    failure with a device's details keeps its PCI attributes; one with those too skips it."""
    real = inventory.device_attributes
    broken = [None]

    def failing(dev, numa, list_attributes):
        if dev.pci.bdf == NETDEV_NIC and (dev.nic is not None or dev.pci.bdf == broken[0]):
            raise UnicodeEncodeError("utf-8", "\udcff", 0, 1, "surrogates not allowed")
        return real(dev, numa, list_attributes)

    monkeypatch.setattr(inventory, "device_attributes", failing)
    inv = scan(profile_root("server-2s-gpu-nic"))
    dev = inv.by_name()["nic-0000-bd-00-0"]
    assert dev.nic is None and dev.attributes["pciAddress"].to_api() == {"string": NETDEV_NIC}
    assert [p.what for p in dev.problems] == ["details"] and "UnicodeEncodeError" in dev.problems[0].reason
    assert len(inv.devices) == len(scan(profile_root("server-2s-gpu-nic")).devices)

    broken[0] = NETDEV_NIC
    inv = scan(profile_root("server-2s-gpu-nic"))
    assert "nic-0000-bd-00-0" not in inv.by_name() and len(inv.devices) > 1
    assert {s.bdf: s.reason for s in inv.skipped}[NETDEV_NIC].startswith("unexpected error: UnicodeEncodeError")
