"""A dynamic-MIG node for tests: a copy of the h200-vm fixture (the lent H200's tree) with the
driver's ``/proc/driver/nvidia-caps/mig-minors``, the simulated NVML with MIG
(tests/simnvml_mig.py) over a state file beside it, its slices as the agent publishes them
(``--partitions`` unless told otherwise), and claims allocated from them by the scheduler's allocator."""

from __future__ import annotations

import os
import shutil

from agent.publish.sharing import share_plan
from agent.publish.slices import build_pool, render
from discovery.inventory import scan
from tests.conftest import profile_root
from tests.controlplane import allocate, claim_from, with_allocation
from tests.kubelet_standin import DRIVER, NODE, settings_for
from tests.simnvml import SimGpu, open_sim
from tests.simnvml_mig import SimMigNvml, write_mig_minors
from tests.test_allocator import CLASSES, claim, exactly
from tests.test_partitions_allocator import Partitions

GPU, BDF = "gpu-0000-00-06-0", "0000:00:06.0"


def sel(expr: str) -> list[dict]:
    return [{"cel": {"expression": expr}}]


def profile(name: str) -> list[dict]:
    return Partitions(sel(f'device.attributes["sysdra.io"].?migProfile.orValue("") == "{name}"'))


def whole() -> list[dict]:
    return sel(f'device.attributes["sysdra.io"].pciAddress == "{BDF}" && !has(device.attributes["sysdra.io"].partitionOf)')


def req(name: str, selectors: list[dict], count: int = 1) -> dict:
    return exactly(name, getattr(selectors, "device_class", "gpu.sysdra.io"), selectors=selectors, count=count)


def shared_request(request: dict) -> dict:
    if request["exactly"]["deviceClassName"] != "gpu.sysdra.io":
        return request
    return {**request, "exactly": {**request["exactly"], "deviceClassName": "gpu-share.sysdra.io"}}


class MigNode:
    """``root`` (a copy of h200-vm) and ``sim`` (NVML, its state in ``nvml.json`` beside it)."""

    def __init__(self, tmp: str, mig: int = 1, **settings):
        self.root = os.path.join(tmp, "host")
        shutil.copytree(profile_root("h200-vm"), self.root, symlinks=True)
        write_mig_minors(self.root)
        self.state = os.path.join(tmp, "nvml.json")
        self.sim = SimMigNvml([SimGpu(mig_capable=True, mig=[mig, mig])], state=self.state, root=self.root)
        self.nvml = open_sim(self.root, self.sim)
        settings.setdefault("partitions", True)
        self.settings = settings_for(tmp, root=self.root, nvidia_driver_root="/usr/local/nvidia", **settings)
        self.inv = self.scan()

    def scan(self):
        """The node as the agent's settings scan it (``nvidia_mig``: dynamic or static MIG)."""
        return scan(self.root, list_attributes=True, nvml=self.nvml, static_mig=self.settings.nvidia_mig == "static")

    def inventory(self):
        return self.inv

    def slices(self, taints: dict[str, list[dict]] | None = None) -> list[dict]:
        """As the agent publishes them with its settings (``partitions``, ``share``)."""
        s = self.settings
        pool = build_pool(self.scan(), node_name=NODE, driver_name=DRIVER,
                          list_attributes=True, partitions=s.partitions, taints=taints, share=share_plan(s.share, None))
        return render(pool, driver_name=DRIVER, node_name=NODE, generation=1, full_name=True)

    def allocated(self, name: str, *requests: dict, prepared: list[dict] = ()) -> dict:
        """``requests`` allocated; on a node that shares its GPUs (``share``), a request for a whole
        GPU asks for a share of it, as a claim there must (gpu.sysdra.io holds unshared GPUs only)."""
        if "gpu" in self.settings.share:
            requests = tuple(shared_request(r) for r in requests)
        c = claim_from(claim(name, *requests))
        (alloc,) = allocate(self.slices(), CLASSES, c, node=NODE, allocated=list(prepared))
        return with_allocation(c, alloc)
