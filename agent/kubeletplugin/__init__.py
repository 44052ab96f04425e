"""Kubelet plugin protocol plumbing (like Go's kubeletplugin helper); device logic is elsewhere.

Public API::

    from agent.kubeletplugin import KubeletPlugin
    from agent.prepare.driver import Driver
    from agent.kubeletplugin.claims import claim_source

    driver = Driver(settings, inventory=lambda: current_inventory)   # agent/prepare/driver.py
    plugin = KubeletPlugin(settings, driver, claim_source(settings))
    plugin.add_service("v1.DRAResourceHealth", add_fn)   # optional, before start()
    await plugin.start()   # driver.recover() (if defined), DRA socket, then registration socket
    plugin.registration    # RegistrationStatus: registered, error, updated, failures;
                           # .listeners.append(fn) -> fn(status) after each kubelet notification
    plugin.supported_versions, plugin.dra_socket, plugin.registration_socket
    await plugin.stop()    # on SIGTERM: removes the registration socket, then the DRA socket

``DriverProtocol`` (types.py): ``prepare_claims(list[dict]) -> {uid: PrepareResult}``,
``unprepare_claims(list[ClaimRef]) -> {uid: error | None}``; plain methods run in a
worker thread, serialized by a flock on ``<plugin dir>/serialize.lock``.
"""

import importlib

# name -> module; imported on first use, so ``agent.kubeletplugin.sockets`` (the daemon's
# instance lock, taken before anything else) does not load gRPC before the first publish
_EXPORTS = {
    "DRA_SERVICES": "plugin", "KubeletPlugin": "plugin", "RegistrationStatus": "registration",
    "SocketError": "sockets", "ClaimRef": "types", "DriverProtocol": "types", "PreparedDevice": "types",
    "PrepareResult": "types",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
