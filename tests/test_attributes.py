"""Device attributes as discovery publishes them (discovery/attributes.py): order, limits
and shared values."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from discovery import attributes
from discovery.attributes import MAX_ATTRIBUTES_AND_CAPACITIES, device_attributes
from discovery.inventory import scan
from tests.conftest import REPO, copy_profile, profile_root
from discovery.models import Device, GpuInfo, NetInterface, NicInfo, PciFunction, PciLink, RdmaDevice, Sriov


def _fn(bdf: str = "0000:3b:00.1", **kw) -> PciFunction:
    values = dict(bdf=bdf, sysfs_path=f"/sys/devices/pci0000:3a/0000:3a:00.0/{bdf}", pcie_root="pci0000:3a",
                  vendor_id="15b3", device_id="101e", class_code=0x020000, driver="mlx5_core", numa_node=1,
                  iommu_group=1, link=PciLink(max_speed="32.0 GT/s PCIe", max_width=16))  # fmt: skip
    values.update(kw)
    return PciFunction(**values)


def _nic(fn: PciFunction, rdma: bool = True, **iface) -> Device:
    net = NetInterface(**{"name": "ens1f1", "mac": "0c:42:a1:00:00:01", "mtu": 9000, **iface})
    rd = (RdmaDevice(name="mlx5_1"),) if rdma else ()
    return Device(name="nic-" + fn.bdf, kind="nic", pci=fn, nic=NicInfo(interfaces=(net,), rdma=rd))


def test_a_nic_vf_in_order_with_the_standard_ones_first():
    dev = _nic(_fn(physfn="0000:3b:00.0"))
    attrs, problems = device_attributes(dev, (), False)
    assert problems == []
    assert list(attrs) == [
        "resource.kubernetes.io/pciBusID", "resource.kubernetes.io/pcieRoot", "resource.kubernetes.io/numaNode",
        "type", "vendorID", "deviceID", "pciClass", "pciAddress", "driver", "iommuGroup", "pcieLinkSpeed",
        "pcieLinkWidth", "sriovRole", "pfPciAddress", "interfaceName", "macAddress", "mtu", "rdma", "rdmaDevice",
    ]  # fmt: skip
    api = {k: v.to_api() for k, v in attrs.items()}
    assert api["iommuGroup"] == {"int": 1} and api["rdma"] == {"bool": True}  # 1 and True stay apart
    assert api["pciClass"] == {"string": "020000"} and api["sriovRole"] == {"string": "vf"}
    assert api["resource.kubernetes.io/numaNode"] == {"int": 1}


def test_a_pf_publishes_its_vf_counts():
    attrs, _ = device_attributes(_nic(_fn(sriov=Sriov(total_vfs=8, num_vfs=0)), rdma=False), (), False)
    assert {k: attrs[k].to_api() for k in ("sriovRole", "sriovTotalVFs", "sriovNumVFs", "rdma")} == {
        "sriovRole": {"string": "pf"}, "sriovTotalVFs": {"int": 8}, "sriovNumVFs": {"int": 0}, "rdma": {"bool": False}}


@pytest.mark.parametrize("value", ["x" * 65, "é" * 33, ""])
def test_a_string_past_64_bytes_or_empty_is_left_out_with_a_problem(value):
    """65 ASCII characters, or 33 two-byte ones (66 bytes in 33 characters); an empty one."""
    gpu = Device(name="gpu-0000-3b-00-1", kind="gpu", pci=_fn(class_code=0x030200, driver=value),
                 gpu=GpuInfo(vendor="nvidia", model=value))
    attrs, problems = device_attributes(gpu, (), False)
    assert "driver" not in attrs and "model" not in attrs
    assert [(p.what, p.reason) for p in problems] == [("driver", "value longer than 64 bytes"),
                                                      ("model", "value longer than 64 bytes")]
    assert attrs["gpuVendor"].to_api() == {"string": "nvidia"}


def test_exactly_64_bytes_is_published():
    gpu = Device(name="gpu-0000-3b-00-1", kind="gpu", pci=_fn(class_code=0x030200),
                 gpu=GpuInfo(vendor="nvidia", model="é" * 32))
    attrs, problems = device_attributes(gpu, (), False)
    assert problems == [] and attrs["model"].to_api() == {"string": "é" * 32}


def test_values_are_shared_between_devices():
    a, _ = device_attributes(_nic(_fn("0000:3b:00.1")), (), False)
    b, _ = device_attributes(_nic(_fn("0000:3b:00.2"), mac="0c:42:a1:00:00:02"), (), False)
    assert a["vendorID"] is b["vendorID"] and a["driver"] is b["driver"] and a["mtu"] is b["mtu"]
    assert a["macAddress"] is not b["macAddress"]


def test_the_table_of_shared_values_is_bounded(monkeypatch):
    """Values come from untrusted files: the table of shared values is emptied when full (not
    grown for ever), and a value looked up after that is still right, then shared again."""
    monkeypatch.setattr(attributes, "_SHARED_MAX", 4)
    monkeypatch.setattr(attributes, "_SHARED", {})
    made = [attributes._value("string", f"v{i}") for i in range(10)]
    assert all(len(table) <= 4 for table in attributes._SHARED.values())
    assert [v.to_api() for v in made] == [{"string": f"v{i}"} for i in range(10)]
    assert attributes._value("string", "v9") is made[9] and attributes._value("string", "v0") == made[0]


def test_more_than_32_entries_keep_the_first_ones():
    dev = _nic(_fn()).replace(capacity={f"c{i}": "1" for i in range(20)})
    attrs, problems = device_attributes(dev, (), False)
    assert len(attrs) + len(dev.capacity) == MAX_ATTRIBUTES_AND_CAPACITIES
    assert list(attrs)[:3] == ["resource.kubernetes.io/pciBusID", "resource.kubernetes.io/pcieRoot",
                               "resource.kubernetes.io/numaNode"]  # fmt: skip
    assert [p.what for p in problems] == ["attributes"] and "dropped 5" in problems[0].reason


def test_a_string_and_an_integer_of_the_same_digits_stay_apart():
    """Shared values are looked up by value: 3 and "3" (and 1 and True) stay different."""
    attrs, problems = device_attributes(_nic(_fn(driver="3", iommu_group=3)), (), False)
    assert problems == []
    assert attrs["driver"].to_api() == {"string": "3"} and attrs["iommuGroup"].to_api() == {"int": 3}


def test_identity_values_past_the_limit_are_refused_for_every_device():
    """A refused identity value is reported by each device that has it, not by the first one alone."""
    for bdf in ("0000:3b:00.1", "0000:3b:00.2"):
        attrs, problems = device_attributes(_nic(_fn(bdf, vendor_id="v" * 65)), (), False)
        assert "vendorID" not in attrs and attrs["deviceID"].to_api() == {"string": "101e"}
        assert [p.what for p in problems] == ["vendorID"]


@pytest.mark.parametrize("domain", ["0000", "00ab", "ffff", "10000", "1000a", "abcdef"])
@pytest.mark.parametrize("function", range(8))
def test_pci_bus_id_exactly_for_the_addresses_in_upstream_form(domain, function):
    """pciBusID is published exactly for the addresses discovery lists (pci.BDF_RE) that are
    in upstream's form (a 4-digit domain)."""
    from discovery.pci import BDF_RE

    bdf = f"{domain}:3b:1f.{function}"
    assert BDF_RE.match(bdf)
    attrs, _ = device_attributes(_nic(_fn(bdf)), (), False)
    assert (attributes.PCI_BUS_ID in attrs) == bool(attributes.UPSTREAM_BDF.match(bdf)) == (len(domain) == 4)
    assert attrs["pciAddress"].string == bdf


def test_a_value_that_is_not_utf8_is_left_out_with_a_problem():
    """A name read via surrogateescape (bytes that are not UTF-8) cannot be encoded: refused."""
    gpu = Device(name="gpu-0000-3b-00-1", kind="gpu", pci=_fn(class_code=0x030200, driver="mlx\udcff"),
                 gpu=GpuInfo(vendor="nvidia", model="A\udcff"))
    attrs, problems = device_attributes(gpu, (), False)
    assert "driver" not in attrs and "model" not in attrs and attrs["gpuVendor"].to_api() == {"string": "nvidia"}
    assert [(p.what, p.reason) for p in problems] == [("driver", "value not UTF-8"), ("model", "value not UTF-8")]


SWITCHDEV_PF = "0000:bd:00.0"


def _switchdev_pf(tmp_path, port_names: list[str | None]) -> str:
    """server-2s-gpu-nic with netdevs added under the PF's own net/ (a switchdev PF lists its
    representors there), each with the given phys_port_name (None: none)."""
    root = str(tmp_path / "root")
    shutil.copytree(profile_root("server-2s-gpu-nic"), root, symlinks=True)
    net = os.path.join(os.path.realpath(os.path.join(root, "sys/bus/pci/devices", SWITCHDEV_PF)), "net")
    for i, port in enumerate(port_names):
        d = os.path.join(net, f"eth{i}")
        shutil.copytree(os.path.join(net, "enp189s0np0"), d, symlinks=True)
        os.unlink(os.path.join(d, "phys_port_name"))
        if port is not None:
            with open(os.path.join(d, "phys_port_name"), "w") as f:
                f.write(port + "\n")
    return root


def _published(root: str) -> dict[str, dict]:
    out = subprocess.run([sys.executable, "-m", "agent", "scan", "--root", root, "--list-attributes", "-o", "slices",
                          "--node-name", "node-a"], cwd=REPO, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "SYSDRA_CONFIG": os.devnull})  # fmt: skip
    assert out.returncode == 0, out.stderr
    return {d["name"]: d for s in json.loads(out.stdout)["items"] for d in s["spec"]["devices"]}


def test_representors_are_not_the_pfs_interface_names(tmp_path):
    """devlink's port names of VF, SF and PF representors, an external controller's too."""
    ports = [f"pf0vf{i}" for i in range(56)] + ["pf0sf3", "c1pf0vf2", "pf1", "c2pf0", "p1"]
    root = _switchdev_pf(tmp_path, ports)
    dev = scan(root, list_attributes=True).by_name()["nic-0000-bd-00-0"]
    assert len(dev.nic.interfaces) == 62 and [p.what for p in dev.problems] == []
    assert dev.attributes["interfaceNames"].to_api() == {"strings": ["enp189s0np0", "eth60"]}
    assert _published(root)["nic-0000-bd-00-0"]["attributes"]["interfaceNames"] == {"strings": ["enp189s0np0", "eth60"]}


def test_interface_names_past_the_values_budget_are_left_out_not_the_device(tmp_path):
    root = _switchdev_pf(tmp_path, [None] * 60)
    dev = scan(root, list_attributes=True).by_name()["nic-0000-bd-00-0"]
    assert "interfaceNames" not in dev.attributes and dev.attributes["interfaceName"].to_api() == {"string": "enp189s0np0"}
    assert [(p.what, p.reason) for p in dev.problems] == [("interfaceNames", "61 values, past the device's 48")]
    published = _published(root)["nic-0000-bd-00-0"]["attributes"]
    assert "interfaceNames" not in published and published["interfaceName"] == {"string": "enp189s0np0"}


def test_the_values_budget_counts_single_values_too(tmp_path):
    """48 values in all, a single value counting one: the most interface names that fit beside
    the PF's other attributes are published, one more are left out."""
    def pf(ports: int):
        root = _switchdev_pf(tmp_path / str(ports), [None] * ports)
        return scan(root, list_attributes=True).by_name()["nic-0000-bd-00-0"]

    small = pf(1).attributes
    others = sum(len(v.value) if isinstance(v.value, tuple) else 1 for k, v in small.items() if k != "interfaceNames")
    room = 48 - others  # interface names that fit: the PF's own and room - 1 others
    fits, over = pf(room - 1), pf(room)
    assert len(fits.attributes["interfaceNames"].value) == room and list(fits.problems) == []
    assert "interfaceNames" not in over.attributes
    assert [(p.what, p.reason) for p in over.problems] == [("interfaceNames", f"{room + 1} values, past the device's 48")]


DFL_FPGA = "fpga-0000-b1-00-0"  # dfl-fpga: an N6001's FME and port
DFL_FME = "sys/devices/pci0000:b0/0000:b0:02.0/0000:b1:00.0/fpga_region/region0/dfl-fme.0"
FIM_ID = "ce3139c959cf528ca27751c50829797a"


def test_a_dfl_cards_bitstream_id_is_its_fmes(tmp_path):
    """``bitstreamID`` names the FPGA Interface Manager build the card runs (the FME's
    ``bitstream_id``): a class or claim selects cards that run a given FIM. Only a well-formed id
    (``0x`` and up to 16 hex digits) is published, in lower case."""
    root = copy_profile(tmp_path, "dfl-fpga")
    assert _published(root)[DFL_FPGA]["attributes"]["bitstreamID"] == {"string": "0x5010202aecbd6e5"}
    path = os.path.join(root, DFL_FME, "bitstream_id")
    with open(path, "w") as f:
        f.write("0x5010202AECBD6E6\n")
    assert _published(root)[DFL_FPGA]["attributes"]["bitstreamID"] == {"string": "0x5010202aecbd6e6"}
    with open(path, "w") as f:
        f.write("garbage\n")
    assert "bitstreamID" not in _published(root)[DFL_FPGA]["attributes"]


def test_a_dfl_cards_interface_id_is_its_pr_regions_compat_id(tmp_path):
    """``interfaceID`` is the FPGA interface manager's id an AFU (green bitstream) is built
    against: a claim selects on it to get a card its AFU loads into. The kernel shows it as the
    ``compat_id`` of the partial-reconfiguration region below the FME; of several regions the
    first (sorted) with a well-formed id (32 hex digits, ``0x`` and case as the kernel may print
    them) says it; a card without one publishes none."""
    root = copy_profile(tmp_path, "dfl-fpga")
    assert _published(root)[DFL_FPGA]["attributes"]["interfaceID"] == {"string": FIM_ID}
    fme = os.path.join(root, DFL_FME)
    first = os.path.join(fme, "dfl-fme-region.0/fpga_region/region0")  # sorted before dfl-fme-region.1
    os.makedirs(first)
    with open(os.path.join(first, "compat_id"), "w") as f:
        f.write("not-an-id\n")
    assert scan(root).by_name()[DFL_FPGA].attributes["interfaceID"].to_api() == {"string": FIM_ID}
    with open(os.path.join(first, "compat_id"), "w") as f:
        f.write("0x" + FIM_ID[::-1].upper() + "\n")
    assert _published(root)[DFL_FPGA]["attributes"]["interfaceID"] == {"string": FIM_ID[::-1]}
    shutil.rmtree(os.path.join(fme, "dfl-fme-region.0"))
    os.unlink(os.path.join(fme, "dfl-fme-region.1/fpga_region/region1/compat_id"))
    assert "interfaceID" not in _published(root)[DFL_FPGA]["attributes"]


@pytest.mark.parametrize("bdf, bridges, switch", [
    ("0000:18:00.0", ("0000:15:01.0", "0000:16:00.0", "0000:17:00.0"), "0000:16:00.0"),  # root port, switch
    ("0000:0d:00.0", ("0000:00:03.1", "0000:0b:00.0", "0000:0c:00.0", "0000:0d:00.0", "0000:0e:01.0"),
     "0000:0b:00.0"),  # a switch below a switch: the topmost one
    ("0000:0a:00.0", ("0000:00:03.2",), None),  # on its root port
    ("0000:05:00.0", ("0000:00:1c.0", "0000:04:00.0"), None),  # behind a PCI bridge, no switch
    ("10000:03:00.0", ("0000:17:05.5", "10000:00:03.0", "10000:01:00.0", "10000:02:00.0"), "10000:01:00.0"),  # VMD
    ("10000:02:00.0", ("0000:17:05.5", "10000:00:03.0"), None),  # VMD's controller is no switch port
])
def test_pcie_switch_is_the_topmost_switch_below_the_root_port(bdf, bridges, switch):
    attrs, _ = device_attributes(_nic(_fn(bdf, bridges=bridges)), (), False)
    assert (attrs["pcieSwitch"].string if "pcieSwitch" in attrs else None) == switch


def test_pcie_switch_tells_apart_what_one_pcie_root_holds():
    """The workstation's GPU and NICs share their pcieRoot (one root complex) but no switch: the
    pairing a claim asks for with ``matchAttribute: sysdra.io/pcieSwitch``."""
    inv = scan(profile_root("workstation-deep-bridges"))
    switch = {d.name: d.attributes["pcieSwitch"].string if "pcieSwitch" in d.attributes else None for d in inv.devices}
    roots = {d.attributes["resource.kubernetes.io/pcieRoot"].string for d in inv.devices}
    assert roots == {"pci0000:00"}
    assert switch == {"gpu-0000-0a-00-0": None, "gpu-0000-0d-00-0": "0000:0b:00.0", "nic-0000-03-00-0": "0000:01:00.2",
                      "nic-0000-06-00-0": "0000:01:00.2", "nic-0000-06-00-1": "0000:01:00.2", "nic-0000-08-00-0": "0000:01:00.2"}


@pytest.mark.parametrize("width", [2**63, -(2**63) - 1])
def test_an_integer_past_64_bits_is_left_out_with_a_problem_not_the_device(tmp_path, width):
    """An int attribute is 64 bits in the API: a ``max_link_width`` past it is that attribute's
    problem; published, the API (and the publisher's check) refuses the whole device."""
    from agent.publish.slices import build_pool

    root = copy_profile(tmp_path, "sriov-nic")
    victim = scan(root).devices[0]
    with open(os.path.join(root, victim.pci.sysfs_path.lstrip("/"), "max_link_width"), "w") as f:
        f.write(f"{width}\n")
    dev = scan(root).by_name()[victim.name]
    assert "pcieLinkWidth" not in dev.attributes
    assert any(p.what == "pcieLinkWidth" for p in dev.problems)
    pool = build_pool(scan(root), node_name="node-a", driver_name="sysdra.io")
    assert pool.rejected == ()
    assert victim.name in {d["name"] for s in pool.slices for d in s.get("devices", [])}
