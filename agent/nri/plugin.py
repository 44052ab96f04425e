"""sysdra's NRI plugin: connects to the runtime's NRI socket, registers, and hands pod
sandbox events to a :class:`PodEvents` (agent/nri/netdev.py moves NICs with them).

The runtime dials nothing: the plugin connects, calls ``Runtime/RegisterPlugin``, and the
runtime then calls ``Configure`` (the plugin answers with the events it wants and a failure
policy), ``Synchronize`` (the pods and containers that exist, maybe in several batches) and
the subscribed events. When the runtime restarts the socket closes; the plugin connects
again, with a growing pause, until it is stopped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from agent.nri.ttrpc import PLUGIN_CONN, RUNTIME_CONN, Endpoint, ProtocolError
from agent.protos import nri_v1alpha1_pb2 as api

log = logging.getLogger(__name__)

PKG = "nri.pkg.api.v1alpha1"
# Sandbox events only: the runtime waits for the plugin's answer to each subscribed event, and a
# container's creation has nothing for us to do (its sandbox's namespace already has the netdevs).
EVENTS = (api.RUN_POD_SANDBOX, api.STOP_POD_SANDBOX, api.REMOVE_POD_SANDBOX)
RETRY_FIRST, RETRY_MAX = 0.5, 10.0


def event_mask(events) -> int:
    """NRI's subscription bits: bit ``event - 1`` for each event."""
    mask = 0
    for event in events:
        mask |= 1 << (event - 1)
    return mask


@dataclass(frozen=True)
class Pod:
    """A pod sandbox as the runtime reports it; ``netns`` is the path of its network
    namespace, None for a host-network pod."""
    id: str
    name: str
    namespace: str
    uid: str
    netns: str | None
    ips: tuple[str, ...] = ()

    @classmethod
    def of(cls, pod: api.PodSandbox) -> Pod:
        netns = next((ns.path for ns in pod.linux.namespaces if ns.type == "network" and ns.path), None)
        return cls(pod.id, pod.name, pod.namespace, pod.uid, netns, tuple(pod.ips))


class PodEvents(Protocol):
    """What the plugin reports. An exception fails the runtime's request (the pod sandbox
    or container is not created): the failure policy asks for that."""

    async def synchronized(self, pods: list[Pod]) -> None: ...
    async def pod_started(self, pod: Pod) -> None: ...
    async def pod_stopped(self, pod: Pod) -> None: ...
    async def pod_removed(self, pod: Pod) -> None: ...
    async def container_created(self, pod: Pod, container: str) -> None: ...


@dataclass
class State:
    """What the plugin knows of its runtime, for logs, status and tests."""
    connected: bool = False
    runtime: str = ""
    synchronized: bool = False
    connections: int = 0
    events: dict[str, int] = field(default_factory=dict)


class NriPlugin:
    """The plugin for one runtime socket; :meth:`run` until cancelled."""

    def __init__(self, socket_path: str, events: PodEvents, *, name: str = "sysdra", index: str = "50",
                 fail_request: bool = True):
        self.socket_path, self.name, self.index = socket_path, name, index
        self._events, self._fail_request = events, fail_request
        self.state = State()
        self._sync_pods: list[Pod] = []
        self.changed = asyncio.Condition()

    async def run(self) -> None:
        delay = RETRY_FIRST
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(self.socket_path)
            except OSError as err:
                log.debug("NRI socket %s: %s", self.socket_path, err)
            else:
                delay = RETRY_FIRST
                await self._session(reader, writer)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX)

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        endpoint = Endpoint(reader, writer, self._services())
        self._sync_pods = []
        serving = asyncio.get_running_loop().create_task(endpoint.serve())
        try:
            await endpoint.call(RUNTIME_CONN, f"{PKG}.Runtime", "RegisterPlugin",
                                api.RegisterPluginRequest(plugin_name=self.name, plugin_idx=self.index),
                                api.Empty)
            await self._note(connected=True, connections=self.state.connections + 1)
            log.info("NRI: registered as %s-%s on %s", self.index, self.name, self.socket_path)
            await serving
        except (ConnectionError, ProtocolError, OSError, TimeoutError) as err:
            log.warning("NRI: connection to %s lost: %s", self.socket_path, err)
        except Exception as err:  # a refused registration: the runtime said why
            log.warning("NRI: registration on %s failed: %s", self.socket_path, err)
        finally:
            endpoint.close()
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
            await self._note(connected=False, synchronized=False)

    async def _note(self, **changes) -> None:
        for key, value in changes.items():
            setattr(self.state, key, value)
        async with self.changed:
            self.changed.notify_all()

    async def wait_for(self, predicate: Callable[[State], bool]) -> None:
        """Until ``predicate(state)`` holds (tests, startup)."""
        async with self.changed:
            await self.changed.wait_for(lambda: predicate(self.state))

    # --- the Plugin service ------------------------------------------------------
    def _services(self) -> dict:
        def handler(kind, method: Callable[..., Awaitable]):
            async def call(payload: bytes):
                request = kind()
                request.ParseFromString(payload)
                return await method(request)
            return call

        table = {"Configure": (api.ConfigureRequest, self._configure),
                 "Synchronize": (api.SynchronizeRequest, self._synchronize),
                 "Shutdown": (api.Empty, self._shutdown),
                 "RunPodSandbox": (api.RunPodSandboxRequest, self._run_pod),
                 "StopPodSandbox": (api.StopPodSandboxRequest, self._stop_pod),
                 "RemovePodSandbox": (api.RemovePodSandboxRequest, self._remove_pod),
                 "CreateContainer": (api.CreateContainerRequest, self._create_container),
                 "StateChange": (api.StateChangeEvent, self._state_change)}
        return {(PLUGIN_CONN, f"{PKG}.Plugin/{name}"): handler(kind, method) for name, (kind, method) in table.items()}

    async def _configure(self, req: api.ConfigureRequest) -> api.ConfigureResponse:
        await self._note(runtime=f"{req.runtime_name} {req.runtime_version}".strip())
        log.info("NRI: configured by %s (NRI %s)", self.state.runtime, req.NRI_version or "unknown")
        policy = api.FailurePolicy(fail_request=self._fail_request)
        return api.ConfigureResponse(events=event_mask(EVENTS), failure_policy=policy)

    async def _synchronize(self, req: api.SynchronizeRequest) -> api.SynchronizeResponse:
        self._sync_pods += [Pod.of(p) for p in req.pods]
        if not req.more:
            pods, self._sync_pods = self._sync_pods, []
            await self._events.synchronized(pods)
            await self._note(synchronized=True)
            log.info("NRI: synchronized with %d pod sandbox(es)", len(pods))
        return api.SynchronizeResponse(more=req.more)

    async def _shutdown(self, _req) -> api.Empty:
        log.info("NRI: the runtime is shutting down")
        return api.Empty()

    async def _count(self, event: str) -> None:
        events = dict(self.state.events)
        events[event] = events.get(event, 0) + 1
        await self._note(events=events)

    async def _run_pod(self, req: api.RunPodSandboxRequest) -> api.RunPodSandboxResponse:
        await self._events.pod_started(Pod.of(req.pod))
        await self._count("RunPodSandbox")
        return api.RunPodSandboxResponse()

    async def _stop_pod(self, req: api.StopPodSandboxRequest) -> api.StopPodSandboxResponse:
        await self._events.pod_stopped(Pod.of(req.pod))
        await self._count("StopPodSandbox")
        return api.StopPodSandboxResponse()

    async def _remove_pod(self, req: api.RemovePodSandboxRequest) -> api.RemovePodSandboxResponse:
        await self._events.pod_removed(Pod.of(req.pod))
        await self._count("RemovePodSandbox")
        return api.RemovePodSandboxResponse()

    async def _create_container(self, req: api.CreateContainerRequest) -> api.CreateContainerResponse:
        await self._events.container_created(Pod.of(req.pod), req.container.name)
        await self._count("CreateContainer")
        return api.CreateContainerResponse()

    async def _state_change(self, req: api.StateChangeEvent) -> api.Empty:
        return api.Empty()  # post-events are not subscribed; an older runtime may still send them
