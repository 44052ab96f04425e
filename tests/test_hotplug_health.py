"""``--taint-unhealthy`` and devices that come while the agent runs: a device new to the node is
published with its first health verdict, as the first publish publishes every device (no
unhealthy device offered untainted, one write per change). The whole agent in-process, its
kubelet side (and so its health monitor) running, on a copied fixture tree whose file events
stand in for uevents; every slice write it sends is recorded."""

from __future__ import annotations

import asyncio
import glob
import os
import shutil

from agent.publish.dirstore import DirStore
from agent.service import startup
from agent.service.daemon import Agent
from agent.settings import Settings
from tests.conftest import profile_root
from tests.test_agent_loops import _until

NIC, BDF = "nic-0000-1a-00-0", "0000:1a:00.0"


class Recorded:
    """The store; each write's taints of ``NIC`` (None: the write does not list it)."""

    def __init__(self, store: DirStore):
        self.store, self.full_names, self.directory = store, store.full_names, store.directory
        self.nic: list[list | None] = []

    def _note(self, obj: dict) -> None:
        listed = [d for d in obj["spec"].get("devices") or () if d["name"] == NIC]
        self.nic.append(listed[0].get("taints") or [] if listed else None)

    async def list_slices(self):
        return await self.store.list_slices()

    async def create(self, obj):
        self._note(obj)
        return await self.store.create(obj)

    async def update(self, obj):
        self._note(obj)
        return await self.store.update(obj)

    async def delete(self, name, uid, rv):
        return await self.store.delete(name, uid, rv)


def test_a_nic_plugged_in_with_its_link_down_is_published_tainted(tmp_path):
    """A NIC hot-added without carrier (no cable, the switch port down) was first published as
    healthy, and tainted by a second write once the health round the new inventory started had
    run: the scheduler could give it to a claim in between."""
    root = str(tmp_path / "root")
    shutil.copytree(profile_root("server-2s-gpu-nic"), root, symlinks=True)
    bus = os.path.join(root, "sys/bus/pci/devices", BDF)
    target, real = os.readlink(bus), os.path.realpath(bus)
    os.unlink(bus)  # not on the node when the agent starts
    cluster = str(tmp_path / "cluster")
    settings = startup.resolve(Settings(
        root=root, node_name="node-a", cluster=f"dir:{cluster}", debounce=0.1, resync_interval=0, taint_unhealthy=True,
        health_interval=10, kubelet_dir=str(tmp_path / "kubelet"), cdi_dir=str(tmp_path / "cdi"), metrics_address=""))
    store = Recorded(DirStore(cluster, node_name="node-a", driver_name="sysdra.io"))

    async def scenario():
        agent = Agent(settings, store=store)
        stop = asyncio.Event()
        task = asyncio.get_running_loop().create_task(agent.run(stop))
        try:
            await _until(lambda: agent.publisher.syncs and agent.health is not None and agent.health.rounds, "starting")
            await _until(lambda: agent.watcher.reports()[0], "arming the file watch")
            before = len(store.nic)
            with open(glob.glob(os.path.join(real, "net", "*", "carrier"))[0], "w") as f:
                f.write("0\n")
            os.symlink(target, bus)  # plugged in
            await _until(lambda: any(store.nic[before:]), "waiting for the NIC's slice")
            await asyncio.sleep(0.5)  # (a second write would have come by now)
            return store.nic[before:]
        finally:
            stop.set()
            await task

    writes = asyncio.run(asyncio.wait_for(scenario(), 90))
    assert len(writes) == 1, writes
    (taint,) = writes[0]
    assert (taint["key"], taint["value"], taint["effect"]) == ("sysdra.io/unhealthy", "no-carrier", "NoSchedule")
