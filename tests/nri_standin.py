"""The runtime's side of NRI, as containerd's NRI adaptation plays it: it serves the runtime
socket, takes the plugin's RegisterPlugin (runtime connection), then configures and synchronizes
it (in batches) and calls it with pod events (plugin connection). agent/nri/ttrpc.Endpoint with
the runtime's roles swapped. A stand-in: tests/test_nri_protocol.py checks the plugin against it,
tests/test_realnode.py runs the plugin against containerd's NRI itself; tests/test_systemd_real.py
uses it as a program where no runtime can run (a systemd container):

    python -m tests.nri_standin SOCKET POD_UID NETNS

serves SOCKET and says ``{"registered": ""}`` once the plugin registered; then a line ``run`` on
stdin starts one pod (``app``, uid POD_UID) in network namespace NETNS, ``stop`` stops it. Each
call's outcome is a JSON line on stdout: ``{"RunPodSandbox": ""}``, or the plugin's error."""

from __future__ import annotations

import asyncio
import json
import sys

from agent.nri.plugin import PKG
from agent.nri.ttrpc import PLUGIN_CONN, RUNTIME_CONN, CallError, Endpoint
from agent.protos import nri_v1alpha1_pb2 as api


def sandbox(name: str, netns: str | None = "/run/netns/cni-1", uid: str | None = None) -> api.PodSandbox:
    pod = api.PodSandbox(id="id-" + name, name=name, namespace="ns", uid=uid or "uid-" + name)
    if netns:
        pod.linux.namespaces.add(type="network", path=netns)
    pod.linux.namespaces.add(type="ipc", path="/proc/1/ns/ipc")
    return pod


class Runtime:
    """Serves RegisterPlugin on the runtime connection, then configures and synchronizes the
    plugin with ``batches`` of pods (all but the last with ``more``) on the plugin connection.
    ``request_timeout`` (seconds): said in Configure, and :meth:`event`'s deadline, as containerd's
    ``plugin_request_timeout`` (None: not said, 10 s)."""

    def __init__(self, path: str, batches: tuple[tuple[api.PodSandbox, ...], ...] = ((), ),
                 request_timeout: float | None = None):
        self.path = path
        self.batches = batches
        self.request_timeout = request_timeout
        self.registered: asyncio.Queue = asyncio.Queue()
        self.endpoints: list[Endpoint] = []

    async def start(self):
        self.server = await asyncio.start_unix_server(self._accept, self.path)

    async def stop(self):
        self.server.close()
        for ep in self.endpoints:
            ep.close()
        await self.server.wait_closed()

    async def _accept(self, reader, writer):
        holder: list[Endpoint] = []

        async def register(payload: bytes):
            req = api.RegisterPluginRequest.FromString(payload)
            asyncio.get_running_loop().create_task(self._after_register(holder[0], req))
            return api.Empty()

        ep = Endpoint(reader, writer, {(RUNTIME_CONN, f"{PKG}.Runtime/RegisterPlugin"): register})
        holder.append(ep)
        self.endpoints.append(ep)
        await ep.serve()

    async def _after_register(self, ep: Endpoint, req):
        said = int(self.request_timeout * 1000) if self.request_timeout else 0
        cfg = await self.call(ep, "Configure", api.ConfigureRequest(runtime_name="test", runtime_version="1",
                                                                    request_timeout=said), api.ConfigureResponse)
        answers = []
        for i, pods in enumerate(self.batches):
            more = i < len(self.batches) - 1
            answers.append(await self.call(ep, "Synchronize", api.SynchronizeRequest(pods=list(pods), more=more),
                                           api.SynchronizeResponse))
        await self.registered.put((ep, req, cfg, answers[0]))

    @staticmethod
    async def call(ep: Endpoint, method: str, request, answer):
        return await ep.call(PLUGIN_CONN, f"{PKG}.Plugin", method, request, answer)

    async def event(self, ep: Endpoint, method: str, request, answer):
        """``call`` within the request timeout (TimeoutError past it: the runtime gave up)."""
        return await ep.call(PLUGIN_CONN, f"{PKG}.Plugin", method, request, answer, timeout=self.request_timeout or 10.0)


async def _one_pod(path: str, uid: str, netns: str) -> None:
    runtime = Runtime(path)
    await runtime.start()
    try:
        ep, *_ = await runtime.registered.get()
        print(json.dumps({"registered": ""}), flush=True)
        pod = sandbox("app", netns, uid=uid)
        calls = {"run": ("RunPodSandbox", api.RunPodSandboxRequest, api.RunPodSandboxResponse),
                 "stop": ("StopPodSandbox", api.StopPodSandboxRequest, api.StopPodSandboxResponse)}
        while line := (await asyncio.to_thread(sys.stdin.readline)).strip():
            method, request, answer = calls[line]
            try:
                await runtime.call(ep, method, request(pod=pod), answer)
                error = ""
            except CallError as err:
                error = str(err) or repr(err)
            print(json.dumps({method: error}), flush=True)
    finally:
        await runtime.stop()


if __name__ == "__main__":
    asyncio.run(_one_pod(*sys.argv[1:4]))
