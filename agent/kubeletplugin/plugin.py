"""KubeletPlugin: the two gRPC servers and their sockets, started and stopped in order."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Awaitable, Callable

import grpc

from agent.kubeletplugin import sockets
from agent.kubeletplugin.claims import ClaimSource
from agent.kubeletplugin.registration import RegistrationServicer, RegistrationStatus
from agent.kubeletplugin.service import DRAPluginV1, DRAPluginV1beta1, Prepare, SerializeLock
from agent.kubeletplugin.statuswriter import StatusWriter
from agent.kubeletplugin.types import DriverProtocol
from agent.protos import dra_v1_pb2_grpc, dra_v1beta1_pb2_grpc, pluginregistration_pb2_grpc
from agent.settings import Settings

log = logging.getLogger(__name__)

DRA_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")  # kubelet picks the first it knows, in our order


class _Server:
    """One grpc.aio server on one unix socket."""

    def __init__(self, path: str):
        self.path = path
        self.server: grpc.aio.Server | None = None
        self._dir_fd: int | None = None
        self._ident: tuple[int, int] | None = None

    async def start(self, add_services: Callable[[grpc.aio.Server], None]) -> None:
        sockets.check_length(self.path)
        sockets.remove_stale(self.path)
        self._dir_fd = os.open(os.path.dirname(self.path), os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        add_services(self.server)
        try:
            self.server.add_insecure_port(sockets.bind_address(self.path, self._dir_fd))
        except RuntimeError as err:
            raise sockets.SocketError(f"cannot listen on {self.path}: {err}") from err
        await self.server.start()
        os.chmod(self.path, 0o660)  # the kubelet runs as root; nobody else needs it
        self._ident = sockets.file_id(self.path)

    async def stop(self, grace: float) -> None:
        if self.server is not None:
            await self.server.stop(grace)
            self.server = None
        try:
            sockets.remove_if_same(self.path, self._ident)
        except OSError as err:
            log.warning("cannot remove socket %s: %s", self.path, err)
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None


class KubeletPlugin:
    """See the package docstring for the contract."""

    def __init__(self, settings: Settings, driver: DriverProtocol, claims: ClaimSource,
                 status: StatusWriter | None = None, observe: Callable[[str, dict, float], None] | None = None):
        self.settings = settings
        self.observe = observe  # each call's results, for metrics (agent.kubeletplugin.service.Prepare)
        self.driver = driver
        self.claims = claims
        self.status = status  # writes results' status.devices entries; None: not reported
        if status is not None and status.recorded is None:  # what to write is the driver's record at write time
            status.recorded = getattr(driver, "recorded_status", None)
        self.dra_socket = sockets.dra_socket_path(settings)
        self.registration_socket = sockets.registration_socket_path(settings)
        self.registration = RegistrationStatus()
        self.supported_versions: list[str] = list(DRA_SERVICES)
        self._extra: list[Callable[[grpc.aio.Server], None]] = []
        self._lock = SerializeLock(os.path.join(settings.plugin_dir, "serialize.lock"))
        self._dra = _Server(self.dra_socket)
        self._core: Prepare | None = None  # made with the DRA server
        self._reg = _Server(self.registration_socket)
        self.started = False

    def add_service(self, advertised: str, add_to_server: Callable[[grpc.aio.Server], None]) -> None:
        """Serve another service on the DRA socket and advertise it after the existing ones
        (e.g. ``v1.DRAResourceHealth``). Only before ``start()``."""
        if self.started:
            raise RuntimeError("add_service must be called before start()")
        self.supported_versions.append(advertised)
        self._extra.append(add_to_server)

    def _add_dra(self, server: grpc.aio.Server) -> None:
        core = self._core = Prepare(self.driver, self.claims, self._lock, self.status, self.observe)
        dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(DRAPluginV1(core), server)
        dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(DRAPluginV1beta1(core), server)
        for add in self._extra:
            add(server)

    def _add_registration(self, server: grpc.aio.Server) -> None:
        servicer = RegistrationServicer(
            self.settings.driver_name, os.path.abspath(self.dra_socket), self.supported_versions, self.registration
        )
        pluginregistration_pb2_grpc.add_RegistrationServicer_to_server(servicer, server)

    async def start(self, after_recovery: Callable[[], Awaitable[None]] | None = None) -> None:
        """Recover the driver's state, run ``after_recovery`` (e.g. re-read hardware that recovery
        moved), serve DRA, then let the kubelet see the registration socket."""
        sockets.ensure_dir(self.settings.plugin_dir, owned=True)
        sockets.ensure_dir(self.settings.registry_dir, owned=False)
        recover = getattr(self.driver, "recover", None)
        self._lock.open()
        try:
            if callable(recover):  # under the lock: the old agent of a rolling update may be preparing
                await asyncio.to_thread(self._lock.run, lambda _: recover(), None)
            if after_recovery is not None:
                await after_recovery()
            await self._dra.start(self._add_dra)
            await self._reg.start(self._add_registration)
        except BaseException:
            await self.stop()
            raise
        self.started = True
        log.info("kubelet plugin serving %s, registration socket %s", self.dra_socket, self.registration_socket)

    async def stop(self, grace: float = 2.0) -> None:
        """Registration socket first (the kubelet deregisters on its removal), then DRA."""
        await self._reg.stop(0)
        await self._dra.stop(grace)
        await asyncio.to_thread(self._lock.close)  # after the calls still running in their threads
        if self._core is not None:
            self._core.close()
        if callable(close := getattr(self.driver, "close", None)):  # its own threads (MPS supervision)
            await asyncio.to_thread(close)
        if self.status is not None:  # pending status writes get a moment, then are dropped
            try:
                await self.status.idle(grace)
            except TimeoutError:
                log.warning("claim status writes still pending at stop")
            self.status.close()
        self.started = False
