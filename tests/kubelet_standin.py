"""Test helpers for the kubelet plugin: inventories with device nodes, ResourceClaims in a
``dir:`` store, a plugin serving a small inventory with the stand-in registered (``Env``); the
kubelet stand-in itself is agent.kubeletplugin.kubelet_client (re-exported)."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from contextlib import asynccontextmanager

from agent.kubeletplugin.kubelet_client import KNOWN, find_registration_sockets  # noqa: F401 - re-exported for tests
from agent.kubeletplugin.kubelet_client import KubeletClient as KubeletStandIn  # noqa: F401
from agent.kubeletplugin.kubelet_client import claim_ref as _ref  # noqa: F401
from agent.settings import Settings
from discovery.models import Device, DeviceNode, Inventory, NetInterface, NicInfo, PciFunction

DRIVER = "sysdra.io"
NODE = "node-1"


def gpu(n: int, root: str = "/", major: int = 226, minor: int | None = None) -> Device:
    bdf = f"0000:{0x1b + n:02x}:00.0"
    minor = 128 + n if minor is None else minor
    path = f"/dev/dri/renderD{128 + n}"
    node = DeviceNode(path=path, host_path=os.path.join(root, path.lstrip("/")), type="c", major=major,
                      minor=minor, source="dev node")
    pci = PciFunction(bdf=bdf, sysfs_path=f"/sys/devices/pci0000:00/{bdf}", pcie_root="pci0000:00",
                      vendor_id="1002", device_id="740f", class_code=0x038000)
    return Device(name=f"gpu-{bdf.replace(':', '-').replace('.', '-')}", kind="gpu", pci=pci, device_nodes=(node,))


def nic(n: int, ifname: str | None = None) -> Device:
    bdf = f"0000:{0x40 + n:02x}:00.0"
    pci = PciFunction(bdf=bdf, sysfs_path=f"/sys/devices/pci0000:40/{bdf}", pcie_root="pci0000:40",
                      vendor_id="15b3", device_id="101d", class_code=0x020000)
    return Device(name=f"nic-{bdf.replace(':', '-').replace('.', '-')}", kind="nic", pci=pci,
                  nic=NicInfo(interfaces=(NetInterface(name=ifname or f"ens{n}f0"),)))


def inventory(*devices: Device, root: str = "/") -> Inventory:
    return Inventory(root=root, devices=tuple(devices))


def settings_for(tmp: str, **kw) -> Settings:
    base = dict(root="/", node_name=NODE, driver_name=DRIVER, kubelet_dir=os.path.join(tmp, "kubelet"),
                cdi_dir=os.path.join(tmp, "cdi"), cluster="dir:" + os.path.join(tmp, "cluster"))
    base.update(kw)
    return Settings(**base)


def claim(name: str, results: list[tuple[str, str]], namespace: str = "default", uid: str | None = None,
          driver: str = DRIVER, pool: str = NODE, share_ids: dict[str, str] | None = None) -> dict:
    """A ResourceClaim dict; ``results`` = [(request, device)]."""
    uid = uid or str(uuid.uuid4())
    res = []
    for request, device in results:
        r = {"request": request, "driver": driver, "pool": pool, "device": device}
        if share_ids and device in share_ids:
            r["shareID"] = share_ids[device]
        res.append(r)
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": uid},
        "spec": {}, "status": {"allocation": {"devices": {"results": res}}},
    }


def store_claim(settings: Settings, obj: dict) -> dict:
    d = os.path.join(settings.cluster_dir, "resourceclaims", obj["metadata"]["namespace"])
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, obj["metadata"]["name"] + ".json"), "w") as f:
        json.dump(obj, f)
    return obj


@asynccontextmanager
async def registered_plugin(settings: Settings, inv: Inventory, source, writer):
    """A real kubelet plugin serving ``inv`` (claims from ``source``, status by ``writer``), and
    a kubelet stand-in registered with it; the plugin is stopped on the way out."""
    from agent.kubeletplugin import KubeletPlugin
    from agent.prepare.driver import Driver

    plugin = KubeletPlugin(settings, Driver(settings, lambda: inv), source, writer)
    await plugin.start()
    try:
        kubelet = KubeletStandIn(settings.registry_dir)
        await kubelet.register()
        yield kubelet
    finally:
        await plugin.stop()


@asynccontextmanager
async def running_agent(settings: Settings):
    """The whole agent (``agent.service.daemon.Agent``) on this loop, and a kubelet stand-in
    registered with it once its sockets are served; the agent is stopped on the way out."""
    import asyncio
    import time

    from agent.service.daemon import Agent

    stop = asyncio.Event()
    agent_task = asyncio.create_task(Agent(settings).run(stop))
    try:
        deadline = time.monotonic() + 60
        while not (find_registration_sockets(settings.registry_dir) or agent_task.done()):
            assert time.monotonic() < deadline, "the agent served no registration socket"
            await asyncio.sleep(0.05)
        kubelet = KubeletStandIn(settings.registry_dir)
        await kubelet.register()
        yield kubelet
    finally:
        stop.set()
        try:
            await asyncio.wait_for(agent_task, 30)
        except asyncio.TimeoutError:
            pass
        assert agent_task.done()


def run(coro):
    return asyncio.run(coro)


class Env:
    """A real kubelet plugin and driver over GPUs 0 and 1 and NIC 0, claims from a ``dir:`` store;
    entered, the plugin serves and the kubelet stand-in (``kubelet``) is registered with it."""

    def __init__(self, tmp, **kw):
        from agent.kubeletplugin import KubeletPlugin
        from agent.kubeletplugin.claims import DirClaimSource
        from agent.prepare.driver import Driver

        self.settings = settings_for(str(tmp), **kw)
        self.inv = inventory(gpu(0), gpu(1), nic(0))
        self.driver = Driver(self.settings, lambda: self.inv)
        self.plugin = KubeletPlugin(self.settings, self.driver, DirClaimSource(self.settings.cluster_dir))

    async def __aenter__(self):
        await self.plugin.start()
        self.kubelet = KubeletStandIn(self.settings.registry_dir)
        await self.kubelet.register()
        return self

    async def __aexit__(self, *exc):
        await self.plugin.stop()


def _waiting_for_flock(path: str) -> bool:
    """Someone waits for a flock of ``path`` (a blocked request in /proc/locks)."""
    ino = os.stat(path).st_ino
    with open("/proc/locks") as f:
        return any(p[1] == "->" and p[2] == "FLOCK" and int(p[6].rsplit(":", 1)[1]) == ino
                   for p in (line.split() for line in f) if len(p) > 6)
