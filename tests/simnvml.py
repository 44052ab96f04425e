"""A simulated NVML (the ``pynvml`` module's functions discovery calls), built from what NVML
answered on a real H200 host (the team's H200 facts sheet in the shared reference material). No
NVIDIA driver can run here, so this stands in for ``libnvidia-ml``; the real-GPU check
(tests/hardware) runs the real one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


_STRINGS = {2: "Invalid Argument", 3: "Not Supported", 4: "Insufficient Permissions", 6: "Not Found", 10: "Timeout", 13: "Function Not Found",
            16: "GPU requires restart", 19: "In use by another client", 23: "Insufficient Resources"}  # nvmlErrorString's wording


class NVMLError(Exception):
    def __init__(self, value: int = 3):  # NVML_ERROR_NOT_SUPPORTED
        super().__init__(_STRINGS.get(value, f"NVML error {value}"))
        self.value = value


@dataclass
class SimGpu:
    bus_id: str = "0000:00:06.0"
    name: str = "NVIDIA H200"
    uuid: str = "GPU-7e3a1c52-0d4b-4f6e-9a81-2b3c4d5e6f70"
    memory_total: int = 150_754_820_096
    architecture: int = 9  # Hopper
    compute_capability: tuple[int, int] = (9, 0)
    brand: int = 14  # NVML_BRAND_NVIDIA
    addressing_mode: int = 0  # NVML_DEVICE_ADDRESSING_MODE_NONE, as the real H200 answers
    remapped_rows: tuple = (0, 0, 0, 0)  # (correctable, uncorrectable, pending, failure): a healthy GPU
    unsupported: set[str] = field(default_factory=set)  # queries answered NOT_SUPPORTED
    minor: int = 0  # /dev/nvidia<minor>
    mig_capable: bool = False  # MIG: tests/simnvml_mig.py (the H200 is; off here, so no MIG profiles)
    mig: list[int] = field(default_factory=lambda: [0, 0])  # MIG mode (current, pending)
    # nvmlDeviceSetMigMode's activation status (tests/simnvml_mig.py): 0 the mode switches at once;
    # 16 (RESET_REQUIRED) or 19 (IN_USE) it stays pending until a GPU reset
    mig_activation: int = 0
    gis: dict = field(default_factory=dict)  # GPU instances (tests/simnvml_mig.py)
    compute_mode: int = 0  # NVML_COMPUTEMODE_DEFAULT, as the real H200 answers; "set_compute_mode" in unsupported:
    # a set is refused with NO_PERMISSION, as NVML answers a caller without root


@dataclass
class _Memory:
    total: int
    free: int
    used: int = 0


class SimNvml:
    """``pynvml`` as far as discovery uses it. ``hang``: an Event every handle lookup waits on
    (a driver that stops answering)."""

    NVMLError = NVMLError

    def __init__(self, gpus: list[SimGpu] | None = None, driver: str = "580.159.04", cuda: int = 13000):
        self.gpus = {g.bus_id: g for g in (gpus if gpus is not None else [SimGpu()])}
        self.driver, self.cuda = driver, cuda
        self.initialised = False
        self.hang: threading.Event | None = None
        self.calls: list[str] = []

    def nvmlInit(self):
        self.initialised = True

    def nvmlShutdown(self):
        self.initialised = False

    def nvmlSystemGetDriverVersion(self):
        return self.driver

    def nvmlSystemGetCudaDriverVersion_v2(self):
        return self.cuda

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str):
        self.calls.append(bus_id)
        if self.hang is not None:
            self.hang.wait()
        gpu = self.gpus.get(bus_id.lower().replace("00000000:", "0000:"))
        if gpu is None:
            raise NVMLError(6)  # NVML_ERROR_NOT_FOUND
        return gpu

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int):
        return list(self.gpus.values())[i]  # a device's handle is its SimGpu, however it was found

    def nvmlDeviceGetPciInfo(self, h):
        return _PciInfo("0000" + h.bus_id.upper())  # NVML's 8-digit domain

    def _answer(self, gpu: SimGpu, what: str, value):
        if what in gpu.unsupported:
            raise NVMLError()
        return value

    def nvmlDeviceGetName(self, h):
        return self._answer(h, "name", h.name)

    def nvmlDeviceGetUUID(self, h):
        return self._answer(h, "uuid", h.uuid)

    def nvmlDeviceGetMemoryInfo(self, h):
        return self._answer(h, "memory", _Memory(h.memory_total, h.memory_total))

    def nvmlDeviceGetArchitecture(self, h):
        return self._answer(h, "architecture", h.architecture)

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return self._answer(h, "cc", h.compute_capability)

    def nvmlDeviceGetBrand(self, h):
        return self._answer(h, "brand", h.brand)

    def nvmlDeviceGetAddressingMode(self, h):
        return self._answer(h, "addressing", h.addressing_mode)

    def nvmlDeviceGetRemappedRows(self, h):
        return self._answer(h, "remapped_rows", h.remapped_rows)

    def nvmlDeviceGetMigMode(self, h):
        raise NVMLError()  # NOT_SUPPORTED: a GPU without MIG (tests/simnvml_mig.py has MIG)

    def nvmlDeviceGetHandleByUUID(self, uuid):
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        if self.hang is not None:
            self.hang.wait()
        gpu = next((g for g in self.gpus.values() if g.uuid == uuid), None)
        if gpu is None:
            raise NVMLError(6)  # NVML_ERROR_NOT_FOUND
        return gpu

    def nvmlDeviceGetComputeMode(self, h):
        return self._answer(h, "compute_mode", h.compute_mode)

    def nvmlDeviceSetComputeMode(self, h, mode: int):
        self.calls.append(f"set-compute-mode {h.uuid} {mode}")
        if "set_compute_mode" in h.unsupported:
            raise NVMLError(4)  # NVML_ERROR_NO_PERMISSION
        if mode not in (0, 2, 3):
            raise NVMLError(2)  # INVALID_ARGUMENT (1, EXCLUSIVE_THREAD, is no longer supported)
        h.compute_mode = mode


def open_sim(root: str, sim: SimNvml, driver_root: str = "/usr/local/nvidia", timeout: float = 5.0):
    """discovery.nvml.Nvml over ``sim``, found and 'loaded' from the fixture's driver root."""
    from discovery.nvml import Nvml

    return Nvml.open(root, driver_root, timeout=timeout, pynvml=sim, load=lambda path: None)


@dataclass
class _PciInfo:
    busId: str


@dataclass
class SimEvent:
    device: object
    eventType: int
    eventData: int
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


class _EventSet:
    def __init__(self):
        self.devices: set[str] = set()  # bus IDs registered in it
        self.freed = False


class SimNvmlEvents(SimNvml):
    """With NVML's event API: ``emit(bus_id, type, data)`` delivers an event to the waiting set
    if the GPU is registered in a set not freed (NVML delivers a set only the events of the devices
    registered in it; the others are counted in ``dropped``); a wait with nothing to deliver ends
    in NVML_ERROR_TIMEOUT, as the real one does."""

    NVML_ERROR_TIMEOUT = 10
    nvmlEventTypeSingleBitEccError, nvmlEventTypeDoubleBitEccError, nvmlEventTypeXidCriticalError = 0x1, 0x2, 0x8

    def __init__(self, *args, refuse: set[str] = frozenset(), **kw):
        super().__init__(*args, **kw)
        import queue

        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.refuse = refuse  # bus IDs whose registration NVML refuses
        self.registered: list[tuple[str, int]] = []
        self.freed: list = []  # event sets freed
        self.sets: list[_EventSet] = []
        self.dropped = 0  # events of GPUs no live set has registered

    def nvmlEventSetCreate(self):
        self.sets.append(_EventSet())
        return self.sets[-1]

    def nvmlEventSetFree(self, event_set):
        self.freed.append(event_set)
        event_set.freed = True

    def nvmlDeviceRegisterEvents(self, h, mask: int, event_set):
        if h.bus_id in self.refuse:
            raise NVMLError()
        self.registered.append((h.bus_id, mask))
        event_set.devices.add(h.bus_id)

    def nvmlEventSetWait_v2(self, event_set, timeout_ms: int):
        import queue

        try:
            return self.queue.get(timeout=timeout_ms / 1000)
        except queue.Empty:
            raise NVMLError(self.NVML_ERROR_TIMEOUT) from None

    def emit(self, bus_id: str, event_type: int, data: int = 0, gi: int = 0xFFFFFFFF, ci: int = 0xFFFFFFFF) -> None:
        """``gi``, ``ci``: the MIG instance NVML places the event in (none by default)."""
        if not any(bus_id in s.devices for s in self.sets if not s.freed):
            self.dropped += 1
            return
        self.queue.put(SimEvent(self.gpus[bus_id], event_type, data, gi, ci))
