"""Changes during `sysdra run`'s start-up are not lost: hardware events and a wipe of our slices
that happen while the agent is held between its first scan and its watchers (a seam in the
real daemon), and the health monitor's first round, reach the published slices and the status
board without waiting for a periodic resync or the next health round."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import shutil
import time

import pytest

from agent.health.monitor import HealthMonitor
from agent.service.daemon import Agent
from agent.settings import Settings
from tests.conftest import copy_profile, profile_root, write_file
from tests.kubelet_standin import settings_for

GONE = ("0000:18:00.0", "gpu-0000-18-00-0")  # published at start, removed during the hold
NEW = ("0000:19:00.0", "gpu-0000-19-00-0")  # absent at start, added during the hold
PATIENCE = 30.0  # seconds: generous for a loaded machine; the resyncs that would also repair are off


def _slices(cluster: str) -> dict[str, list[str]]:
    out = {}
    for path in glob.glob(os.path.join(cluster, "resourceslices", "*.json")):
        try:
            with open(path) as f:
                out[path] = [d["name"] for d in json.load(f)["spec"].get("devices", [])]
        except (OSError, ValueError):
            pass  # being replaced
    return out


def _devices(cluster: str) -> set[str]:
    return {name for names in _slices(cluster).values() for name in names}


async def _until(predicate, what: str, timeout: float = PATIENCE) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached: {what}")
        await asyncio.sleep(0.02)


async def _no_plugin():
    return None


class Hold:
    """The seam: patches one start-up step of Agent to wait, once it has run, until released."""

    def __init__(self, monkeypatch, step: str):
        self.reached, self.released = asyncio.Event(), asyncio.Event()
        original = getattr(Agent, step)

        async def held(agent, *args, **kwargs):
            result = await original(agent, *args, **kwargs)
            if not self.reached.is_set():
                self.reached.set()
                await self.released.wait()
            return result

        monkeypatch.setattr(Agent, step, held)


@pytest.mark.parametrize("step, change", [("rescan", "hardware"), ("_first_publish", "hardware"),
                                          ("_first_publish", "wipe")])
def test_changes_while_held_after_the_first_scan_are_published(tmp_path, monkeypatch, step, change):
    """Held right after the first scan (``rescan``: before anything is published) or after the
    first slices went out (``_first_publish``): a device removed and another added meanwhile
    are both in the slices soon after the hold ends; slices wiped meanwhile (and nothing else)
    are written again."""
    root = str(tmp_path / "root")
    shutil.copytree(profile_root("server-2s-gpu-nic"), root, symlinks=True)
    bus = os.path.join(root, "sys/bus/pci/devices")
    new_target = os.readlink(os.path.join(bus, NEW[0]))
    os.unlink(os.path.join(bus, NEW[0]))
    cluster = str(tmp_path / "cluster")
    settings = Settings(root=root, node_name="node-a", cluster=f"dir:{cluster}", debounce=0.1, resync_interval=0,
                        kubelet_dir=str(tmp_path / "kubelet"), cdi_dir=str(tmp_path / "cdi"), metrics_address="")

    async def scenario():
        hold = Hold(monkeypatch, step)
        agent = Agent(settings)
        agent.start_kubelet_plugin = _no_plugin  # this test is about publishing
        stop = asyncio.Event()
        task = asyncio.get_running_loop().create_task(agent.run(stop))
        try:
            await asyncio.wait_for(hold.reached.wait(), PATIENCE)
            first = {d.name for d in agent.inventory.devices}
            if change == "hardware":
                os.unlink(os.path.join(bus, GONE[0]))
                os.symlink(new_target, os.path.join(bus, NEW[0]))
            else:
                assert _devices(cluster) >= {GONE[1]}, "the first slices were not written before the hold"
                for path in _slices(cluster):
                    os.unlink(path)  # the kubelet's wipe
            hold.released.set()
            if change == "hardware":
                await _until(lambda: NEW[1] in _devices(cluster) and GONE[1] not in _devices(cluster),
                             f"{NEW[1]} published and {GONE[1]} gone")
            else:
                await _until(lambda: len(_slices(cluster)) == len(agent.pool.slices) and GONE[1] in _devices(cluster),
                             "the wiped slices written again")
            return first
        finally:
            stop.set()
            await asyncio.wait_for(task, PATIENCE)

    first = asyncio.run(scenario())
    assert GONE[1] in first and NEW[1] not in first  # the first scan saw the node as it was before the hold


def test_a_slice_file_deleted_while_running_is_written_again(tmp_path):
    """The offline dir's file watch (armed in a worker thread after the first publish) hears
    someone delete our slice files and the next sync writes them again; no resync runs here."""
    cluster = str(tmp_path / "cluster")
    settings = Settings(root=profile_root("server-2s-gpu-nic"), node_name="node-a", cluster=f"dir:{cluster}", debounce=0.05,
                        resync_interval=0, kubelet_dir=str(tmp_path / "kubelet"), cdi_dir=str(tmp_path / "cdi"), metrics_address="")

    async def scenario():
        async with publishing(settings) as agent:
            await _until(lambda: agent.pool is not None and len(_slices(cluster)) == len(agent.pool.slices), "the first slices")
            await asyncio.sleep(0.5)  # the file watch armed (after the first publish)
            for path in _slices(cluster):
                os.unlink(path)
            await _until(lambda: len(_slices(cluster)) == len(agent.pool.slices), "the deleted slices written again")

    asyncio.run(scenario())


@contextlib.asynccontextmanager
async def publishing(settings: Settings):
    """The whole agent without its kubelet side (these tests are about publishing), stopped on the way out."""
    agent = Agent(settings)
    agent.start_kubelet_plugin = _no_plugin
    stop = asyncio.Event()
    task = asyncio.get_running_loop().create_task(agent.run(stop))
    try:
        yield agent
    finally:
        stop.set()
        await asyncio.wait_for(task, PATIENCE)


VM_NIC, VM_NIC_NET = "nic-0000-05-00-0", "sys/devices/pci0000:00/0000:00:01.4/0000:05:00.0/virtio12/net/eth0"


def test_the_first_health_round_reaches_status_and_taints(tmp_path, monkeypatch):
    """With --taint-unhealthy, a NIC whose link is down at start is tainted in the published slice
    and reported unhealthy by the status board from the health monitor's first round on: no
    later round runs here (its timer is stopped), so nothing else could bring them."""
    async def first_round_only(self):
        await asyncio.Event().wait()

    monkeypatch.setattr(HealthMonitor, "_run", first_round_only)
    root = copy_profile(tmp_path, "vm-numa-none")
    write_file(root, VM_NIC_NET + "/carrier", "0\n")
    settings = settings_for(str(tmp_path), root=root, taint_unhealthy=True, metrics_address="")
    cluster = settings.cluster_dir

    def nic_taints() -> list[dict]:
        for path in glob.glob(os.path.join(cluster, "resourceslices", "*.json")):
            try:
                with open(path) as f:
                    devices = json.load(f)["spec"].get("devices", [])
            except (OSError, ValueError):
                continue
            for d in devices:
                if d["name"] == VM_NIC:
                    return d.get("taints", [])
        return []

    async def scenario():
        agent = Agent(settings)
        stop = asyncio.Event()
        task = asyncio.get_running_loop().create_task(agent.run(stop))
        try:
            await _until(lambda: agent.health is not None and agent.health.rounds >= 1, "the first health round")
            await _until(lambda: any(t.get("key") == "sysdra.io/unhealthy" for t in nic_taints()), "the NIC tainted")
            await _until(lambda: agent.board.snapshot()["devices"]["byHealth"].get("unhealthy") == 1,
                         "the status board's health")
            by_health = agent.board.snapshot()["devices"]["byHealth"]
            assert agent.health.rounds == 1
            return by_health
        finally:
            stop.set()
            await asyncio.wait_for(task, PATIENCE)

    by_health = asyncio.run(scenario())
    assert not by_health.get("unknown"), by_health


def test_a_wipe_through_the_api_while_held_is_republished(apiserver, tmp_path, monkeypatch):
    """API mode, held after the first publish: the kubelet's wipe of our slices (as it does on
    registration) is seen by the slice watch, armed before the first scan, and repaired."""
    from tests.inventory_factory import inventory
    from tests.test_apiserver_publish import Node

    node = Node(apiserver, tmp_path)
    monkeypatch.setenv("KUBECONFIG", node.kubeconfig)
    settings = Settings(root=str(tmp_path), node_name=node.name, cluster="kube", debounce=0.05, resync_interval=0,
                        kubelet_dir=str(tmp_path / "kubelet"), cdi_dir=str(tmp_path / "cdi"), metrics_address="")

    async def scenario():
        hold = Hold(monkeypatch, "_first_publish")
        agent = Agent(settings, scan=lambda s: inventory(130))
        agent.start_kubelet_plugin = _no_plugin
        stop = asyncio.Event()
        task = asyncio.get_running_loop().create_task(agent.run(stop))
        try:
            await asyncio.wait_for(hold.reached.wait(), PATIENCE)
            assert await asyncio.to_thread(node.wipe_as_kubelet) == 2
            hold.released.set()
            deadline = time.monotonic() + PATIENCE
            while len(await asyncio.to_thread(node.slices)) != 2:  # (the API is read off the agent's loop)
                assert time.monotonic() < deadline, "the wiped slices were not created again"
                await asyncio.sleep(0.05)
        finally:
            stop.set()
            await asyncio.wait_for(task, PATIENCE)

    asyncio.run(scenario())
    assert {o["spec"]["pool"]["generation"] for o in node.slices()} == {2}
