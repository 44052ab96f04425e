"""sysdra's NRI plugin: connects to the runtime's NRI socket, registers, and hands pod
sandbox events to a :class:`PodEvents` (agent/nri/netdev.py moves NICs with them).

The runtime dials nothing: the plugin connects, calls ``Runtime/RegisterPlugin``, and the
runtime then calls ``Configure`` (the plugin answers with the events it wants and a failure
policy), ``Synchronize`` (the pods and containers that exist, maybe in several batches) and
the subscribed events. When the runtime restarts the socket closes; the plugin connects
again, with a growing pause, until it is stopped.

Whether it works is never silent (docs/networking.md, "Is NRI working?"): ``state.phase`` is
``connecting``, ``registered`` or ``failed`` with the reason, handed to ``on_state`` (the daemon:
``sysdra status``, ``sysdra_nri_connected``, doctor) at every change; a failure is logged at
WARNING the first time, when its reason changes, and then once per ``WARN_EVERY`` with how many
attempts failed since; the registration that ends a run of failures at INFO.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from agent.nri.ttrpc import PLUGIN_CONN, RUNTIME_CONN, Endpoint, ProtocolError
from agent.protos import nri_v1alpha1_pb2 as api

log = logging.getLogger(__name__)

PKG = "nri.pkg.api.v1alpha1"
# The runtime waits for the plugin's answer to each subscribed event. A container's creation is
# answered at once unless its pod's netdevs are not in its sandbox (one that started while the
# plugin was not registered): they go in first (agent/nri/netdev.py).
EVENTS = (api.RUN_POD_SANDBOX, api.STOP_POD_SANDBOX, api.REMOVE_POD_SANDBOX, api.CREATE_CONTAINER)
RETRY_FIRST, RETRY_MAX = 0.5, 10.0
WARN_EVERY = 600.0  # seconds between WARNING lines of one unchanged failure


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

    def configured(self, request_timeout: float | None) -> None:
        """The runtime's deadline for each request, in seconds (None: it did not say)."""
    async def synchronized(self, pods: list[Pod]) -> None: ...
    async def pod_started(self, pod: Pod) -> None: ...
    async def pod_stopped(self, pod: Pod) -> None: ...
    async def pod_removed(self, pod: Pod) -> None: ...
    async def container_created(self, pod: Pod, container: str) -> None: ...


@dataclass
class State:
    """What the plugin knows of its runtime, for logs, status and tests. ``phase``: connecting
    (no answer yet), registered, failed (``reason`` says why; tried again meanwhile)."""
    connected: bool = False
    runtime: str = ""
    synchronized: bool = False
    connections: int = 0
    events: dict[str, int] = field(default_factory=dict)
    phase: str = "connecting"
    reason: str | None = None
    since: float = field(default_factory=time.time)  # Unix seconds of the phase's (or reason's) start
    failures: int = 0  # attempts failed since the last registration
    # the last failure found no socket at the path: the runtime has no NRI (or serves another path), which
    # readiness cannot tell apart; any other failure is a runtime serving NRI that this instance does not reach
    no_socket: bool = False

    def report(self, socket: str) -> dict:
        """For ``sysdra status`` (JSON ``nri``)."""
        return {"state": self.phase, "reason": self.reason, "since": self.since, "socket": socket,
                "runtime": self.runtime or None, "synchronized": self.synchronized, "connections": self.connections,
                "failedAttempts": self.failures, "noSocket": self.no_socket}


def why_not(err: OSError, path: str) -> str:
    """A failed connection to the NRI socket, as the operator needs to read it."""
    if isinstance(err, FileNotFoundError):
        return (f"no NRI socket at {path}: NRI is off in the container runtime, or it serves another path "
                "(containerd 1.7: [plugins.\"io.containerd.nri.v1.nri\"] disable = false; sysdra doctor checks the config)")
    if isinstance(err, ConnectionRefusedError):
        return f"connection to {path} refused: nobody serves it (the runtime is down, or NRI is off)"
    if err.errno in (errno.EACCES, errno.EPERM):
        return f"{path}: permission denied (the agent runs as root, or the DaemonSet mounts /var/run/nri)"
    return f"{path}: {err.strerror or err}"


class NriPlugin:
    """The plugin for one runtime socket; :meth:`run` until cancelled."""

    def __init__(self, socket_path: str, events: PodEvents, *, name: str = "sysdra", index: str = "50",
                 fail_request: bool = True, on_state: Callable[[dict], None] | None = None):
        self.socket_path, self.name, self.index = socket_path, name, index
        self._events, self._fail_request = events, fail_request
        self.state = State()
        self.on_state = on_state  # called on the loop with state.report() after every change
        self.clock = time.monotonic
        self._warned: tuple[str, float] | None = None  # (reason, when) of the last WARNING
        self._sync_pods: list[Pod] = []
        self.changed = asyncio.Condition()

    async def run(self) -> None:
        delay = RETRY_FIRST
        await self._note()  # the first report: connecting
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(self.socket_path)
            except OSError as err:
                await self._failed(why_not(err, self.socket_path), no_socket=isinstance(err, FileNotFoundError))
            else:
                delay = RETRY_FIRST
                await self._session(reader, writer)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX)

    async def _failed(self, reason: str, no_socket: bool = False) -> None:
        """One failed attempt: WARNING the first time, on a new reason and once per WARN_EVERY."""
        st, now = self.state, self.clock()
        changes = {"failures": st.failures + 1, "connected": False, "synchronized": False, "no_socket": no_socket}
        if st.phase != "failed" or st.reason != reason:
            changes.update(phase="failed", reason=reason, since=time.time())
        if self._warned is None or self._warned[0] != reason or now - self._warned[1] >= WARN_EVERY:
            since = f" ({st.failures} attempts failed before)" if st.failures and self._warned else ""
            log.warning("NRI: %s%s; claimed NICs' netdevs stay on the host until the agent registers "
                        "(tried again every %g s)", reason, since, RETRY_MAX)
            self._warned = (reason, now)
        else:
            log.debug("NRI: %s", reason)
        await self._note(**changes)

    async def _session(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        endpoint = Endpoint(reader, writer, self._services())
        self._sync_pods = []
        serving = asyncio.get_running_loop().create_task(endpoint.serve())
        try:
            await endpoint.call(RUNTIME_CONN, f"{PKG}.Runtime", "RegisterPlugin",
                                api.RegisterPluginRequest(plugin_name=self.name, plugin_idx=self.index),
                                api.Empty)
            after = f" (after {self.state.failures} failed attempts)" if self.state.failures else ""
            await self._note(connected=True, connections=self.state.connections + 1, phase="registered", reason=None,
                             since=time.time(), failures=0)
            self._warned = None
            log.info("NRI: registered as %s-%s on %s%s", self.index, self.name, self.socket_path, after)
            await serving
            failure = f"the runtime closed the connection on {self.socket_path}"
        except (ConnectionError, ProtocolError, OSError, TimeoutError) as err:
            failure = f"connection to {self.socket_path} lost: {err}"
        except Exception as err:  # a refused registration: the runtime said why
            failure = f"registration on {self.socket_path} refused: {err}"
        finally:
            endpoint.close()
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
        await self._failed(failure)

    async def _note(self, **changes) -> None:
        for key, value in changes.items():
            setattr(self.state, key, value)
        if self.on_state is not None:
            try:
                self.on_state(self.state.report(self.socket_path))
            except Exception:  # noqa: BLE001 - a report's failure must not end the session
                log.exception("NRI state not reported")
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
        timeout = req.request_timeout / 1000 if req.request_timeout > 0 else None  # milliseconds on the wire
        log.info("NRI: configured by %s (NRI %s, request timeout %s)", self.state.runtime, req.NRI_version or "unknown",
                 f"{timeout:g} s" if timeout else "not said")
        self._events.configured(timeout)  # the events' waits end before the runtime's deadline
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
        # NRI before v0.12 (containerd 1.7 to 2.2) has no dedicated pod sandbox RPCs: it sends the
        # subscribed RUN/STOP/REMOVE_POD_SANDBOX events here (NRI 0.12 too, after an UNIMPLEMENTED)
        handler = {api.RUN_POD_SANDBOX: (self._run_pod, api.RunPodSandboxRequest),
                   api.STOP_POD_SANDBOX: (self._stop_pod, api.StopPodSandboxRequest),
                   api.REMOVE_POD_SANDBOX: (self._remove_pod, api.RemovePodSandboxRequest)}.get(req.event)
        if handler is not None:
            method, kind = handler
            await method(kind(pod=req.pod))
        return api.Empty()  # post-events are not subscribed; an older runtime may still send them
