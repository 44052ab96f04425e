"""Test helpers for the kubelet plugin: inventories with device nodes, ResourceClaims in a
``dir:`` store, and an in-process kubelet stand-in speaking gRPC over the real sockets."""

from __future__ import annotations

import json
import os
import stat
import uuid

import grpc

from agent.protos import (
    dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc,
    pluginregistration_pb2, pluginregistration_pb2_grpc,
)
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


KNOWN = {
    "v1.DRAPlugin": (dra_v1_pb2, dra_v1_pb2_grpc),
    "v1beta1.DRAPlugin": (dra_v1beta1_pb2, dra_v1beta1_pb2_grpc),
}


def find_registration_sockets(registry_dir: str) -> list[str]:
    """Like the kubelet's plugin watcher: any non-dot unix socket, recursively."""
    found = []
    for dirpath, _dirs, files in os.walk(registry_dir):
        for name in files:
            path = os.path.join(dirpath, name)
            if not name.startswith(".") and stat.S_ISSOCK(os.lstat(path).st_mode):
                found.append(path)
    return sorted(found)


class KubeletStandIn:
    """Registers like the kubelet (GetInfo, pick the first known service in the plugin's
    order, NotifyRegistrationStatus), then calls prepare/unprepare on the endpoint."""

    def __init__(self, registry_dir: str, prefer: str | None = None):
        self.registry_dir = registry_dir
        self.prefer = prefer  # force a service version (test both)
        self.info = None
        self.service: str | None = None

    async def register(self) -> None:
        (sock,) = find_registration_sockets(self.registry_dir)
        async with grpc.aio.insecure_channel("unix:" + sock) as ch:
            stub = pluginregistration_pb2_grpc.RegistrationStub(ch)
            self.info = await stub.GetInfo(pluginregistration_pb2.InfoRequest(), timeout=5)
            known = [v for v in self.info.supported_versions if v in KNOWN]
            self.service = self.prefer or (known[0] if known else None)
            ok = self.info.type == "DRAPlugin" and self.service in self.info.supported_versions
            await stub.NotifyRegistrationStatus(
                pluginregistration_pb2.RegistrationStatus(plugin_registered=ok, error="" if ok else "no known service"),
                timeout=5,
            )

    async def _call(self, method: str, claims: list[tuple[str, str, str]]):
        pb, pb_grpc = KNOWN[self.service]
        req_cls = pb.NodePrepareResourcesRequest if method == "NodePrepareResources" else pb.NodeUnprepareResourcesRequest
        req = req_cls(claims=[pb.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in claims])
        async with grpc.aio.insecure_channel("unix:" + self.info.endpoint) as ch:
            return await getattr(pb_grpc.DRAPluginStub(ch), method)(req, timeout=45)

    async def prepare(self, *claims: dict | tuple[str, str, str]):
        return await self._call("NodePrepareResources", [_ref(c) for c in claims])

    async def unprepare(self, *claims: dict | tuple[str, str, str]):
        return await self._call("NodeUnprepareResources", [_ref(c) for c in claims])


def _ref(c: dict | tuple[str, str, str]) -> tuple[str, str, str]:
    if isinstance(c, tuple):
        return c
    m = c["metadata"]
    return m["namespace"], m["name"], m["uid"]
