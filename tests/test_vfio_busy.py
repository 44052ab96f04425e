"""A function already on vfio-pci whose IOMMU group a process on the host has open (a VM libvirt runs
outside Kubernetes, a leftover qemu): a ``VfioConfig`` claim of it is refused, naming the process, as
for a function whose driver's device files are open (docs/vfio.md, "In use on the host"): the pod's VM
could not open the group (it opens once) and its start would fail with no word of why. Real processes,
simulated PCI kernel (tests/test_vfio_inuse.py)."""

from __future__ import annotations

from tests.test_vfio import vfio_claim
from tests.test_vfio_inuse import NIC, NIC_BDF, UID, hold, node  # noqa: F401 - node is a fixture


def test_a_function_on_vfio_pci_whose_group_a_host_process_has_open_is_refused(node):
    s, sim, driver, children = node
    sim.stop()
    sim.unbind("mlx5_core", NIC_BDF)
    sim.bind("vfio-pci", NIC_BDF)  # the host's own choice
    sim.start()
    group = sim.group(NIC_BDF)
    child = hold(s.root, children, f"/dev/vfio/{group}", (1, 3), "qemu-system-x86")
    d = driver()
    err = d.prepare_claims([vfio_claim("vm", [NIC], UID)])[UID].error
    assert err and f"{s.root}/dev/vfio/{group} is open by pid {child.pid} (qemu-system-x86)" in err, err
    assert UID not in d.checkpoint.claims and sim.override(NIC_BDF) is None  # nothing written
    child.kill()
    child.wait()
    assert d.prepare_claims([vfio_claim("vm", [NIC], UID)])[UID].error is None
