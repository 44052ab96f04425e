"""A GPU's compute mode while its MPS control daemon runs (``nvidia_mps_exclusive``; docs/sharing.md,
"Exclusive compute mode").

In EXCLUSIVE_PROCESS mode one process at a time holds a context on the GPU: with an MPS daemon
that is its server, so a share's container that does not go through the daemon (its
``CUDA_MPS_PIPE_DIRECTORY`` changed or unset) gets no GPU instead of all of it, and the shares'
limits hold against a workload that would escape them. NVIDIA's DRA driver sets it with every MPS
daemon; here the operator chooses (compute mode is not changed unless configured), since any other
CUDA process on the GPU (a host tool, an admin pod) is refused it meanwhile.

Through NVML (``nvmlDeviceGetComputeMode``/``nvmlDeviceSetComputeMode``) on its thread, within its
timeout. The caller (prepare/mps.py) records the mode before with the daemon, before it changes,
and sets it back when the daemon stops; a reboot resets it (the driver does not keep it).
"""

from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger(__name__)

# nvmlComputeMode_t (nvml.h); 1 (EXCLUSIVE_THREAD) is no longer supported
EXCLUSIVE_PROCESS = 3
NAMES = {0: "Default", 1: "Exclusive_Thread", 2: "Prohibited", 3: "Exclusive_Process"}  # as nvidia-smi says them


class ComputeModeError(Exception):
    """The mode cannot be read or set; the claim's error (prepare/mps.py)."""


class ComputeModes:
    def __init__(self, nvml: Callable[[], object]):
        self.nvml = nvml  # -> discovery.nvml.Nvml, or None (no NVML on the node); blocking: worker threads

    def _run(self, uuid: str, what: str, fn: Callable):
        nvml = self.nvml()
        if nvml is None:
            raise ComputeModeError(f"GPU {uuid}: {what}: NVML is not available on this node")
        try:
            return nvml.run(f"{what} of GPU {uuid}", lambda nv: fn(nv, nv.nvmlDeviceGetHandleByUUID(uuid)))
        except Exception as err:  # noqa: BLE001 - NVMLError, a timeout: the claim's error, said
            raise ComputeModeError(f"GPU {uuid}: {what}: {str(err) or type(err).__name__}") from err

    def get(self, uuid: str) -> int:
        mode = self._run(uuid, "reading the compute mode", lambda nv, h: nv.nvmlDeviceGetComputeMode(h))
        if mode not in NAMES:
            raise ComputeModeError(f"GPU {uuid}: NVML answered compute mode {mode!r}")
        return mode

    def set(self, uuid: str, mode: int) -> None:
        """``mode``, read back: a GPU that does not take it is an error."""
        def change(nv, h):
            nv.nvmlDeviceSetComputeMode(h, mode)
            return nv.nvmlDeviceGetComputeMode(h)

        if (now := self._run(uuid, f"setting compute mode {NAMES[mode]}", change)) != mode:
            raise ComputeModeError(f"GPU {uuid}: compute mode {NAMES.get(now, now)} after setting {NAMES[mode]}")
        log.info("GPU %s: compute mode %s", uuid, NAMES[mode])


class DaemonModes:
    """The compute modes of MPS daemons' GPUs (prepare/mps.py): with ``exclusive``, EXCLUSIVE_PROCESS
    before a daemon starts, the mode before recorded first and set back when the daemon stops. A
    mode a record says the agent changed is set back whatever ``exclusive`` says now."""

    def __init__(self, modes: ComputeModes | None, exclusive: bool):
        self.modes, self.exclusive = modes, exclusive  # modes None: the node's NVML is off

    @classmethod
    def of(cls, settings) -> DaemonModes:
        """As the agent's settings say: through the process's NVML unless ``nvml`` is off."""
        from agent.prepare.mig import shared_nvml

        nvml = shared_nvml(settings.root, settings.nvidia_driver_root) if settings.nvml else None
        return cls(ComputeModes(nvml) if nvml else None, settings.nvidia_mps_exclusive)

    def lost_before(self, uuid: str) -> str:
        """What becomes of the mode of a GPU whose daemon was adopted without its record (prepare/mps.py): with
        ``exclusive`` and the GPU in EXCLUSIVE_PROCESS, the mode before went with the record: it stays, said."""
        try:
            if not self.exclusive or self._modes(uuid).get(uuid) != EXCLUSIVE_PROCESS:
                return ""
        except ComputeModeError:
            return ""
        return (f"; its GPU's compute mode before Exclusive_Process went with the record: it stays so after the last "
                f"share (nvidia-smi -i {uuid} -c DEFAULT, or a reboot, sets it back)")

    def _modes(self, uuid: str) -> ComputeModes:
        if self.modes is None:
            raise ComputeModeError(f"GPU {uuid}: its compute mode needs NVML (the setting nvml is off)")
        return self.modes

    def before(self, uuid: str, recorded: int | None) -> int | None:
        """The mode to record before ``make_exclusive``: ``recorded`` (a start that did not finish,
        a dead daemon's), with ``exclusive`` the GPU's mode now, else None. A GPU in EXCLUSIVE_PROCESS
        already gives None: not the agent's to set back."""
        if recorded is not None or not self.exclusive:
            return recorded
        mode = self._modes(uuid).get(uuid)
        return None if mode == EXCLUSIVE_PROCESS else mode

    def make_exclusive(self, uuid: str, before: int | None) -> None:
        if before is not None:
            self._modes(uuid).set(uuid, EXCLUSIVE_PROCESS)

    def set_back(self, uuid: str, before: int | None) -> None:
        """``before`` again (None: nothing to do); a failure is said with what sets it back (a reboot does too)."""
        if before is None:
            return
        try:
            self._modes(uuid).set(uuid, before)
        except ComputeModeError as err:
            log.error("%s: it stays Exclusive_Process until set back (nvidia-smi -i %s -c %s) or a reboot",
                      err, uuid, NAMES[before].upper())
