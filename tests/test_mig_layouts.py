"""MIG layouts changed on a running node (agent/service/miglayouts.py; docs/partitions.md, "Static
MIG"): instances made or destroyed by the operator (nvidia-smi, mig-parted) reach the slices within
a health interval, without a resync, on the running agent over a copy of the h100-mig fixture (the
driver's procfs as nvidia-smi leaves it: gi/ci directories with access files). NVML (dynamic MIG
placements) is looked at by the agent's scans, not here: a dynamic GPU is never listed."""

from __future__ import annotations

import asyncio
import os
import shutil

from agent.service import miglayouts
from agent.service.daemon import Agent
from discovery.inventory import scan
from discovery.models import MigProfile
from discovery.partitions import mig_layout
from discovery.sysfs import HostFS
from tests.conftest import profile_root
from tests.kubelet_standin import settings_for
from tests.test_mig_procfs import MIG, _access

GPU = "gpu-0000-18-00-0"


def _root(tmp_path) -> str:
    root = str(tmp_path / "root")
    shutil.copytree(profile_root("h100-mig"), root, symlinks=True)
    return root


def _published(agent: Agent) -> set[str]:
    return {d["name"] for s in agent.pool.slices for d in s.get("devices", ()) if d["name"].startswith(GPU)}


async def _until(predicate, timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.02)


def test_the_operators_changes_are_published_without_a_resync(tmp_path):
    root = _root(tmp_path)
    agent = Agent(settings_for(str(tmp_path), root=root, nvml=False, partitions=True, health_interval=0.05,
                               resync_interval=0, metrics_address=""))

    async def main():
        await agent.rescan()
        assert _published(agent) == {f"{GPU}-mig-gi1-ci0", f"{GPU}-mig-gi2-ci0", f"{GPU}-mig-gi2-ci1", f"{GPU}-mig-gi9-ci0"}
        follow = asyncio.create_task(miglayouts.follow(agent))
        try:
            await asyncio.sleep(0.3)  # a few looks at an unchanged layout: no scan
            assert agent.rescans == 1
            _access(root, "gi10", 93)  # nvidia-smi mig -cgi ... -C: mig-minors gives gi10 93, its ci0 94
            _access(root, "gi10/ci0", 94)
            await _until(lambda: f"{GPU}-mig-gi10-ci0" in _published(agent))
            shutil.rmtree(os.path.join(root, MIG))  # every instance destroyed, MIG mode off
            await _until(lambda: _published(agent) == {GPU})  # the whole GPU is a device CUDA sees again
        finally:
            follow.cancel()

    asyncio.run(main())


def test_a_layout_is_compared_with_the_last_look_and_dynamic_gpus_are_left_out(tmp_path):
    root = _root(tmp_path)
    inv = scan(root)
    layouts = miglayouts.MigLayouts(root)
    assert layouts.changed(inv) == set()  # the scan's instances are the listing's
    assert mig_layout(HostFS(root), 0) == {(1, 0), (2, 0), (2, 1), (9, 0)} and mig_layout(HostFS(root), 1) is None
    os.makedirs(os.path.join(root, MIG, "gi3"))  # a GPU instance without a compute instance yet: no MIG device
    assert layouts.changed(inv) == set()
    os.makedirs(os.path.join(root, MIG, "gi3/ci0"))
    assert layouts.changed(inv) == {"0000:18:00.0"} and layouts.changed(inv) == set()  # once
    gpu = inv.by_name()[GPU]
    profile = MigProfile(id=19, name="1g.10gb", slices=1, memory_mb=9856, multiprocessors=16, copy_engines=1,
                         decoders=1, encoders=0, jpeg=1, ofa=0, placements=((0, 1),))
    dynamic = gpu.replace(gpu=gpu.gpu.replace(partitioning=gpu.gpu.partitioning.replace(profiles=(profile,))))
    assert miglayouts.MigLayouts(root).changed(inv.replace(devices=(gpu,))) == {"0000:18:00.0"}  # gi3/ci0 is new
    assert miglayouts.MigLayouts(root).changed(inv.replace(devices=(dynamic,))) == set()  # NVML's placements
