"""Functions on a variant driver of vfio-pci (drivers/vfio/pci/*: ``nvgrace-gpu-vfio-pci`` for Grace
Hopper, ``mlx5_vfio_pci``, ``hisi_acc_vfio_pci``, ...): the kernel binds VM-bound functions to them
instead of vfio-pci, and they are VFIO devices as vfio-pci's are (``/dev/vfio/<group>``). Discovery
publishes them as such, the container classes never give them, vfio.sysdra.io does, and prepare treats
them as functions already bound for VMs (docs/vfio.md, "Variant drivers"). Simulated PCI kernel."""

from __future__ import annotations

import os

from agent.publish.sharing import share_plan
from agent.publish.slices import build_pool, render as render_slices
from discovery.inventory import scan
from tests.conftest import copy_profile
from tests.simkernel import SimPciKernel
from tests.test_allocator import DRIVER, NODE, devices
from tests.test_deviceclasses import extended, got

GH_GPU, GH_BDF, GH_DRIVER = "gpu-0000-01-00-0", "0000:01:00.0", "nvgrace-gpu-vfio-pci"


def on_variant(root: str, bdf: str, host_driver: str, variant: str) -> SimPciKernel:
    """``bdf`` moved from ``host_driver`` to ``variant`` (loaded), as the host's VM set-up does."""
    os.makedirs(os.path.join(root, "sys/bus/pci/drivers", variant), exist_ok=True)
    sim = SimPciKernel(root)
    sim.unbind(host_driver, bdf)
    sim.bind(variant, bdf)
    return sim


def test_a_gpu_on_a_variant_driver_is_published_as_vfio_and_only_the_vfio_class_gives_it(tmp_path):
    root = copy_profile(tmp_path / "n", "nvidia-minor-order")
    on_variant(root, GH_BDF, "nvidia", GH_DRIVER)
    dev = scan(root).by_name()[GH_GPU]
    group = dev.pci.iommu_group
    assert dev.pci.driver == GH_DRIVER
    assert {n.path for n in dev.device_nodes} == {f"/dev/vfio/{group}", "/dev/vfio/vfio"}, dev.device_nodes
    slices = render_slices(build_pool(scan(root), node_name=NODE, driver_name=DRIVER), driver_name=DRIVER,
                           node_name=NODE, generation=1, full_name=True)
    assert devices(slices)[GH_GPU]["attributes"]["driver"]["string"] == GH_DRIVER
    assert GH_GPU not in got(slices, extended(mode="All"))  # sysdra.io/gpu: a container would get /dev/vfio
    assert got(slices, extended("vfio.sysdra.io", mode="All")) == [GH_GPU]
    shared = render_slices(build_pool(scan(root), node_name=NODE, driver_name=DRIVER, share=share_plan(("gpu",), None)),
                           driver_name=DRIVER, node_name=NODE, generation=1, full_name=True)
    assert not devices(shared)[GH_GPU].get("allowMultipleAllocations")  # one VM's, whole (docs/sharing.md)


def test_the_chart_matches_the_driver_names_discovery_takes_for_vfio():
    from discovery.vfio import VFIO_DRIVER_ENDINGS, is_vfio_driver
    from tests.test_deviceclasses import classes

    exprs = {c["metadata"]["name"]: c["spec"]["selectors"][0]["cel"]["expression"] for c in classes()}
    drv = 'device.attributes["sysdra.io"].?driver.orValue("")'
    ends = " || ".join(f'{drv}.endsWith("{e}")' for e in VFIO_DRIVER_ENDINGS)
    assert all(f"({ends})" in e for e in exprs.values()), exprs
    assert all(is_vfio_driver(d) for d in ("vfio-pci", "mlx5_vfio_pci", GH_DRIVER, "hisi_acc_vfio_pci", "xe-vfio-pci"))
    assert not any(is_vfio_driver(d) for d in (None, "nvidia", "mlx5_core", "vfio_pci_core", "vfio-pci-x", "nouveau"))
