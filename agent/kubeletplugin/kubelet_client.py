"""Talk to a running plugin the way the kubelet does: find the registration socket,
GetInfo, pick the first known DRA service in the plugin's order, notify, then call
NodePrepareResources / NodeUnprepareResources on the advertised endpoint.

Used by ``make demo`` and the tests (tests/kubelet_standin.py)."""

from __future__ import annotations

import os
import stat
from contextlib import asynccontextmanager

import grpc

from agent.kubeletplugin.sockets import UNIX_PATH_MAX
from agent.protos import (
    dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc,
    pluginregistration_pb2, pluginregistration_pb2_grpc,
)

KNOWN = {
    "v1.DRAPlugin": (dra_v1_pb2, dra_v1_pb2_grpc),
    "v1beta1.DRAPlugin": (dra_v1beta1_pb2, dra_v1beta1_pb2_grpc),
}
CALL_TIMEOUT = 45  # the kubelet's defaultClientCallTimeout


def find_registration_sockets(registry_dir: str) -> list[str]:
    """Like the kubelet's plugin watcher: any non-dot unix socket, recursively."""
    found = []
    for dirpath, _dirs, files in os.walk(registry_dir):
        for name in files:
            path = os.path.join(dirpath, name)
            if not name.startswith(".") and stat.S_ISSOCK(os.lstat(path).st_mode):
                found.append(path)
    return sorted(found)


def claim_ref(c: dict | tuple[str, str, str]) -> tuple[str, str, str]:
    """(namespace, name, uid) of a ResourceClaim dict, or the tuple itself."""
    if isinstance(c, tuple):
        return c
    m = c["metadata"]
    return m["namespace"], m["name"], m["uid"]


@asynccontextmanager
async def channel(path: str):
    """A channel to the unix socket ``path``, of up to 108 bytes as the kubelet (Go) takes; gRPC
    takes 107, so a longer one is reached through ``/proc/self/fd/<its directory>/<name>``."""
    if len(path.encode()) < UNIX_PATH_MAX:
        async with grpc.aio.insecure_channel("unix:" + path) as ch:
            yield ch
        return
    fd = os.open(os.path.dirname(path), os.O_PATH | os.O_CLOEXEC)
    try:
        async with grpc.aio.insecure_channel(f"unix:/proc/self/fd/{fd}/{os.path.basename(path)}") as ch:
            yield ch
    finally:
        os.close(fd)


class KubeletClient:
    def __init__(self, registry_dir: str, prefer: str | None = None):
        self.registry_dir = registry_dir
        self.prefer = prefer  # force a DRA service version (tests exercise both)
        self.info = None
        self.service: str | None = None
        self.timeout: float = CALL_TIMEOUT  # a call's deadline (tests shorten it to play a kubelet that gave up)

    async def register(self, socket_path: str | None = None) -> None:
        if socket_path is None:
            (socket_path,) = find_registration_sockets(self.registry_dir)
        async with channel(socket_path) as ch:
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
        async with channel(self.info.endpoint) as ch:
            return await getattr(pb_grpc.DRAPluginStub(ch), method)(req, timeout=self.timeout)

    async def prepare(self, *claims: dict | tuple[str, str, str]):
        return await self._call("NodePrepareResources", [claim_ref(c) for c in claims])

    async def unprepare(self, *claims: dict | tuple[str, str, str]):
        return await self._call("NodeUnprepareResources", [claim_ref(c) for c in claims])
