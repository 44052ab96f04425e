"""A partitionable node for prepare tests: a copy of the mi300x-partitions fixture with the
kernel simulator (fixtures/simkernel/amdgpu.py) running on it, its slices as the agent
publishes them, and claims allocated from them by the scheduler's allocator."""

from __future__ import annotations

import os
import shutil

from agent.publish.slices import build_pool, render
from discovery.inventory import scan
from fixtures.simkernel.amdgpu import AmdgpuSim
from tests.conftest import profile_root
from tests.controlplane import allocate, claim_from, with_allocation
from tests.kubelet_standin import DRIVER, NODE, settings_for
from tests.test_allocator import CLASSES, claim
from tests.test_partitions_allocator import part_of, req, whole

CPX_GPU, SPX_GPU = "gpu-0000-05-00-0", "gpu-0000-27-00-0"


def copy_node(dest: str, profile: str = "mi300x-partitions") -> str:
    shutil.copytree(profile_root(profile), dest, symlinks=True)
    return dest


def mode_of(root: str, bdf: str) -> str:
    d = os.path.join(root, "sys/bus/pci/devices", bdf)
    with open(f"{d}/current_compute_partition") as c, open(f"{d}/current_memory_partition") as m:
        return f"{c.read().strip()}/{m.read().strip()}"


class Node:
    """``root`` with a running simulator; ``inventory()`` is what the daemon would hold (rescanned
    on ``hardware_changed``, as the daemon does after a switch)."""

    def __init__(self, tmp: str, delay: float = 0.02, mknod: bool = False, **settings):
        self.root = copy_node(os.path.join(tmp, "host"))
        self.sim = AmdgpuSim(self.root, delay=delay, mknod=mknod)
        settings.setdefault("partitions", True)
        settings.setdefault("compatibility_groups", True)
        settings.setdefault("partition_switch_timeout", 3.0)
        self.settings = settings_for(tmp, root=self.root, **settings)
        self.inv = scan(self.root)
        self.rescans = 0

    def inventory(self):
        return self.inv

    def rescan(self) -> None:
        self.rescans += 1
        self.inv = scan(self.root)

    def slices(self) -> list[dict]:
        s = self.settings
        pool = build_pool(scan(self.root, list_attributes=True), node_name=NODE, driver_name=DRIVER, list_attributes=True,
                          partitions=s.partitions, compatibility_groups=s.compatibility_groups)
        return render(pool, driver_name=DRIVER, node_name=NODE, generation=1, full_name=True)

    def allocated(self, name: str, selectors: list[dict], count: int = 1, prepared: list[dict] = ()) -> dict:
        """A claim for ``count`` devices matching ``selectors``, allocated by the allocator."""
        c = claim_from(claim(name, req("gpu", selectors, count=count)))
        (alloc,) = allocate(self.slices(), CLASSES, c, node=NODE, allocated=list(prepared))
        return with_allocation(c, alloc)


def devices_of(c: dict) -> list[str]:
    return [r["device"] for r in c["status"]["allocation"]["devices"]["results"] if r["pool"] == NODE]


__all__ = ["CPX_GPU", "SPX_GPU", "Node", "copy_node", "devices_of", "mode_of", "part_of", "whole"]
