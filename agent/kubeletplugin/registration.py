"""``pluginregistration.Registration``: how the kubelet learns our DRA endpoint."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc

from agent.protos import pluginregistration_pb2 as pb
from agent.protos import pluginregistration_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"


@dataclass
class RegistrationStatus:
    """Last word from the kubelet; read by status output and metrics."""

    registered: bool = False
    error: str = ""
    updated: float | None = None  # unix time of the last NotifyRegistrationStatus
    notifications: int = 0
    failures: int = 0
    # called with this object after every notification (status output, metrics)
    listeners: list[Callable[["RegistrationStatus"], None]] = field(default_factory=list, repr=False)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "listeners"}


class RegistrationServicer(pb_grpc.RegistrationServicer):
    def __init__(self, driver_name: str, endpoint: str, versions: list[str], status: RegistrationStatus):
        self.driver_name = driver_name
        self.endpoint = endpoint
        self.versions = versions  # shared list: services added before start appear here
        self.status = status

    async def GetInfo(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.PluginInfo:
        log.debug("kubelet: GetInfo")
        return pb.PluginInfo(
            type=PLUGIN_TYPE, name=self.driver_name, endpoint=self.endpoint, supported_versions=self.versions
        )

    async def NotifyRegistrationStatus(
        self, request: pb.RegistrationStatus, context: grpc.aio.ServicerContext
    ) -> pb.RegistrationStatusResponse:
        st = self.status
        st.registered, st.error, st.updated = request.plugin_registered, request.error, time.time()
        st.notifications += 1
        if request.plugin_registered and not request.error:
            log.info("registered with the kubelet as DRA driver %s (endpoint %s)", self.driver_name, self.endpoint)
        else:
            st.failures += 1
            log.error(
                "KUBELET REJECTED REGISTRATION of DRA driver %s: %s (advertised %s at %s)",
                self.driver_name, request.error or "no reason given", ", ".join(self.versions), self.endpoint,
            )
        for listener in st.listeners:
            try:
                listener(st)
            except Exception:  # a broken listener must not fail the kubelet's call
                log.exception("registration status listener failed")
        return pb.RegistrationStatusResponse()
