"""Discovery against every fixture profile: golden expectations and lspci agreement."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from discovery.attributes import NUMA_NODE, PCI_BUS_ID, PCIE_ROOT
from discovery.inventory import scan
from tests.conftest import EXPECTED, profile_root, profiles, require_tool

PROFILES = profiles()


def _expected(profile: str) -> dict:
    path = os.path.join(EXPECTED, f"{profile}.json")
    if not os.path.exists(path):
        pytest.fail(f"profile {profile} has no golden expectation {path}")
    with open(path) as f:
        return json.load(f)


def _actual(inv) -> dict:
    devices = []
    for d in inv.devices:
        attrs = d.attributes
        devices.append(
            {
                "name": d.name,
                "kind": d.kind,
                "pciBusID": attrs[PCI_BUS_ID].string if PCI_BUS_ID in attrs else None,
                "pcieRoot": attrs[PCIE_ROOT].string if PCIE_ROOT in attrs else None,
                "numaNode": attrs[NUMA_NODE].int_ if NUMA_NODE in attrs else None,
                "deviceNodes": [{"path": n.path, "type": n.type, "major": n.major, "minor": n.minor} for n in d.device_nodes],
            }
        )
    return {"devices": devices, "skipped": sorted(s.bdf for s in inv.skipped)}


def _partitions(inv) -> dict:
    """Per partitioned GPU: its modes and the partitions the kernel exposes, with their nodes."""
    out = {}
    for d in inv.devices:
        pt = d.gpu and d.gpu.partitioning
        if not pt:
            continue
        e: dict = {"kind": pt.kind}
        if pt.kind == "amd":
            e.update(mode=f"{pt.compute_mode}/{pt.memory_mode}", computeModes=list(pt.compute_modes),
                     memoryModes=list(pt.memory_modes), xcds=pt.xcds)
        e["partitions"] = [
            {"index": x.index, **({"xcds": x.xcds} if x.xcds else {}), **({"gi": x.gi, "ci": x.ci} if x.gi is not None else {}),
             "deviceNodes": [f"{n.path} {n.major}:{n.minor}" for n in x.nodes]}
            for x in pt.partitions]  # fmt: skip
        out[d.name] = e
    return out


def test_at_least_nine_profiles():
    assert len(PROFILES) >= 9, PROFILES


@pytest.mark.parametrize("profile", PROFILES)
def test_golden(profile):
    want = _expected(profile)
    got = _actual(scan(profile_root(profile)))
    got_by_name = {d["name"]: d for d in got["devices"]}
    want_by_name = {d["name"]: d for d in want["devices"]}
    assert sorted(got_by_name) == sorted(want_by_name)
    for name, w in want_by_name.items():
        assert got_by_name[name] == w, name
    assert got["skipped"] == sorted(want["skipped"])
    # Alveo user PFs are part of their card's device, named after the management PF
    inv = scan(profile_root(profile))
    merged = {d.fpga.user_bdf: d.name for d in inv.devices if d.fpga and d.fpga.user_bdf and d.fpga.user_bdf != d.pci.bdf}
    assert merged == want.get("merged", {})
    # GPU partitions (AMD compute partitions, NVIDIA MIG instances) as the kernel exposes them
    assert _partitions(inv) == want.get("partitions", {})


@pytest.mark.parametrize("profile", PROFILES)
def test_no_problems_on_clean_fixtures(profile):
    """Fixture trees are complete: every value we try to read is there."""
    inv = scan(profile_root(profile))
    assert [p for p in inv.problems] == []
    for d in inv.devices:
        assert [p for p in d.problems if p.what != "drm"] == [], d.name


def _lspci(profile: str) -> dict[str, dict]:
    lspci = require_tool("lspci")
    bus = os.path.join(profile_root(profile), "sys", "bus", "pci")
    out = subprocess.run(
        [lspci, "-vmm", "-D", "-nn", "-A", "linux-sysfs", "-O", f"sysfs.path={bus}"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    records: dict[str, dict] = {}
    for block in out.strip().split("\n\n"):
        rec = {}
        for line in block.splitlines():
            key, _, value = line.partition(":\t")
            rec[key] = value
        records[rec["Slot"]] = rec
    return records


def _bracket_id(text: str) -> str:
    return text.rsplit("[", 1)[1].rstrip("]")


@pytest.mark.parametrize("profile", PROFILES)
def test_agrees_with_lspci(profile):
    inv = scan(profile_root(profile))
    records = _lspci(profile)
    for d in inv.devices:
        rec = records.get(d.pci.bdf)
        assert rec is not None, f"lspci does not list {d.pci.bdf}"
        assert _bracket_id(rec["Vendor"]) == d.pci.vendor_id
        assert _bracket_id(rec["Device"]) == d.pci.device_id
        assert _bracket_id(rec["Class"]) == f"{d.pci.class_code >> 8:04x}"
        lspci_numa = rec.get("NUMANode")
        assert (int(lspci_numa) if lspci_numa is not None else None) == d.pci.numa_node
    # every function lspci lists is either offered or skipped with a reason
    ours = {d.pci.bdf for d in inv.devices} | {s.bdf for s in inv.skipped}
    ours |= {d.fpga.user_bdf for d in inv.devices if d.fpga and d.fpga.user_bdf}
    assert set(records) <= ours


@pytest.mark.parametrize("profile", PROFILES)
def test_names_are_dns_labels_and_unique(profile):
    import re

    inv = scan(profile_root(profile))
    names = [d.name for d in inv.devices]
    assert len(names) == len(set(names))
    for n in names:
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", n), n


@pytest.mark.parametrize("profile", PROFILES)
def test_list_attributes_mode(profile):
    inv = scan(profile_root(profile), list_attributes=True)
    for d in inv.devices:
        if d.pci.numa_node is not None:
            numa = d.attributes[NUMA_NODE]
            assert numa.ints is not None and numa.ints[0] == d.pci.numa_node
        assert len(d.attributes) + len(d.capacity) <= 32
        assert sum(len(a.value) if isinstance(a.value, tuple) else 1 for a in d.attributes.values()) <= 48
