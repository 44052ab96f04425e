"""Prepare and unprepare of functions on a variant driver of vfio-pci (``mlx5_vfio_pci``, ...; docs/vfio.md,
"Which class"): they are VFIO functions already, as one on vfio-pci is. A ``VfioConfig`` claim leaves
such a function on its variant driver (moving it to plain vfio-pci loses what the variant gives the VM:
Grace Hopper's GPU memory, mlx5's live migration) and unprepare leaves it there; vfio-pci itself need
not be loaded for it; a group member on a variant driver is no host user; a plain claim holds the rest
of its group. Simulated PCI kernel (tests/simkernel.py)."""

from __future__ import annotations

import os

import pytest

from agent.kubeletplugin.types import ClaimRef
from discovery.inventory import scan
from tests.kubelet_standin import claim
from tests.simkernel import SimPciKernel
from tests.test_ownership_driver import _into_group, _prepare
from tests.test_vfio import UID, UID2, VF, VF2, VF_BDF, node_root, rebooted, served, spec_nodes, vfio_claim

VARIANT = "mlx5_vfio_pci"
VF2_BDF = "0000:06:00.3"


@pytest.fixture
def variant_node(tmp_path):
    """sriov-nic with the VF (IOMMU group 42) on mlx5_vfio_pci, as the host's VM set-up binds it."""
    root = node_root(tmp_path, "sriov-nic")
    os.makedirs(os.path.join(root, "sys/bus/pci/drivers", VARIANT))
    sim = SimPciKernel(root)
    sim.unbind("mlx5_core", VF_BDF)
    sim.bind(VARIANT, VF_BDF)
    yield from served(tmp_path, root, sim.start())


def test_a_vm_claim_of_a_function_on_a_variant_driver_leaves_it_there(variant_node):
    s, sim, state, driver = variant_node
    d, before = driver(), len(sim.log)
    assert _prepare(d, vfio_claim("vm", [VF], UID)) == {UID: None}
    assert sim.driver(VF_BDF) == VARIANT and spec_nodes(s, UID) == ["/dev/vfio/42", "/dev/vfio/vfio"]
    assert d.unprepare_claims([ClaimRef("default", "vm", UID)]) == {UID: None}
    assert sim.driver(VF_BDF) == VARIANT and sim.override(VF_BDF) is None
    assert sim.log[before:] == []  # never moved off it, nor back


def test_after_a_reboot_the_vm_claims_function_goes_back_to_its_variant_driver(variant_node):
    """The kernel forgot the binding (the function came up on mlx5_core): the re-bind puts it on the driver
    it was prepared on, mlx5_vfio_pci, not plain vfio-pci; unprepare then leaves it there."""
    s, sim, state, driver = variant_node
    assert _prepare(driver(), vfio_claim("vm", [VF], UID)) == {UID: None}
    rebooted(s.root, sim, VF_BDF, "mlx5_core")
    report = driver().recover()
    assert report.boot_changed and UID in report.rebuilt and sim.driver(VF_BDF) == VARIANT
    assert spec_nodes(s, UID) == ["/dev/vfio/42", "/dev/vfio/vfio"]
    assert driver().unprepare_claims([ClaimRef("default", "vm", UID)]) == {UID: None}
    assert sim.driver(VF_BDF) == VARIANT and sim.override(VF_BDF) is None


def test_a_group_member_on_a_variant_driver_is_no_host_user_and_the_vm_claim_holds_it(variant_node):
    """VF2 (mlx5_core) shares IOMMU group 42 with the VF on mlx5_vfio_pci: a VM may have VF2, as beside a
    member on vfio-pci, and holds the VF with it (its container would get /dev/vfio/42)."""
    s, sim, state, driver = variant_node
    sim.stop()
    _into_group(s.root, VF2_BDF, 42)
    sim.start()
    state["inv"] = scan(s.root)
    d = driver()
    assert _prepare(d, vfio_claim("vm", [VF2], UID)) == {UID: None}
    assert sim.driver(VF2_BDF) == "vfio-pci" and sim.driver(VF_BDF) == VARIANT
    err = _prepare(d, claim("plain", [("dev", VF)], uid=UID2))[UID2]
    assert err and f"{VF2_BDF}'s IOMMU group 42" in err, err


def test_plain_claims_of_two_functions_on_variant_drivers_in_one_group_do_not_both_get_it(variant_node):
    s, sim, state, driver = variant_node
    sim.stop()
    _into_group(s.root, VF2_BDF, 42)
    sim.unbind("mlx5_core", VF2_BDF)
    sim.bind(VARIANT, VF2_BDF)
    sim.start()
    state["inv"] = scan(s.root)
    d = driver()
    assert _prepare(d, claim("a", [("dev", VF)], uid=UID)) == {UID: None}
    assert spec_nodes(s, UID) == ["/dev/vfio/42", "/dev/vfio/vfio"]
    err = _prepare(d, claim("b", [("dev", VF2)], uid=UID2))[UID2]
    assert err and "IOMMU group 42" in err, err
