"""NVML, NVIDIA's own management library, through nvidia-ml-py (``pynvml``): read-only facts.

``libnvidia-ml.so.1`` is loaded from the configured driver root under the host root (a node's
driver may live in ``/usr/local/nvidia`` or ``/run/nvidia/driver``, not in the ld cache), before
pynvml asks the loader for it by soname. Every call runs on one daemon thread and is waited for
with a timeout: a hung driver must not hang a scan. Once NVML fails to load or times out it is
not asked again; the GPU's facts then come from the table (``discovery/nvidia.py``).

Answers are input: strings are checked where they are published, numbers by type here.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import threading
from concurrent.futures import Future
from typing import Callable, Protocol

from discovery import mig
from discovery.models import MigProfile
from discovery.nvidia import NvmlDevice
from discovery.nvidia_driver import LIB_DIRS, resolve

log = logging.getLogger(__name__)

LIBRARY = "libnvidia-ml.so.1"
# NVML opens the driver's control node in this process's own /dev, whatever the host root: a
# container without it (not privileged) cannot initialise NVML
CONTROL_NODE = "/dev/nvidiactl"


_SHARED: dict[tuple[str, str], "Nvml | None"] = {}
_SHARED_LOCK = threading.Lock()


class NvmlSource(Protocol):
    """What discovery asks NVML (a simulated one in tests)."""

    def system(self) -> tuple[str | None, int | None]:
        """(driver version, CUDA driver version), each None when not answered."""

    def device(self, bdf: str) -> NvmlDevice | None:
        """The GPU at PCI address ``bdf``, None when NVML does not know it."""

    def mig_profiles(self, bdf: str) -> tuple[MigProfile, ...]:
        """The GPU's MIG GPU-instance profiles (empty: no MIG, or NVML does not say)."""


def find_library(root: str, driver_root: str) -> str | None:
    """``libnvidia-ml.so.1`` of the driver root, as a path the agent can open, or None."""
    for d in LIB_DIRS:
        real = resolve(root, os.path.join(driver_root, d, LIBRARY))
        if real is not None and os.path.isfile(path := os.path.join(root, real.lstrip("/"))):
            return path
    return None


class _Worker:
    """One daemon thread running calls in order; a caller waits at most ``timeout`` seconds."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="nvml", daemon=True).start()

    def _run(self) -> None:
        while True:
            fn, fut = self.calls.get()
            try:
                fut.set_result(fn())
            except BaseException as err:  # noqa: BLE001 - handed to the waiting caller
                fut.set_exception(err)

    def call(self, fn: Callable, timeout: float | None = None):
        fut: Future = Future()
        self.calls.put((fn, fut))
        return fut.result(timeout=timeout or self.timeout)


class Nvml:
    """NVML of the running driver. Construct with :meth:`open`; ``None`` there means no NVML."""

    def __init__(self, pynvml, worker: _Worker, where: str):
        self.pynvml = pynvml
        self.worker = worker
        self.where = where
        self.failed: str | None = None
        self._devices: dict[str, NvmlDevice | None] = {}

    @classmethod
    def open(cls, root: str, driver_root: str = "/", timeout: float = 5.0, pynvml=None,
             load: Callable[[str], object] | None = None) -> Nvml | None:
        """NVML loaded from the driver root, initialised; None (and one log line) when the node
        has no NVML or it fails. ``pynvml`` and ``load`` (the library loader) are for a simulated
        NVML in tests."""
        nvml, why = cls.probe(root, driver_root, timeout, pynvml=pynvml, load=load)
        if nvml is not None:
            log.info("NVML: loaded %s", nvml.where)
        elif why.startswith(f"no {LIBRARY} "):  # a node without the NVIDIA driver: nothing is wrong
            log.info("NVML: %s: GPU facts from the PCI ID table", why)
        else:
            log.warning("NVML: %s: GPU facts from the PCI ID table", why)
        return nvml

    @classmethod
    def probe(cls, root: str, driver_root: str = "/", timeout: float = 5.0, pynvml=None,
              load: Callable[[str], object] | None = None) -> tuple[Nvml | None, str]:
        """``open`` without its log line: (NVML, "") or (None, why not)."""
        path = find_library(root, driver_root)
        if path is None:
            return None, f"no {LIBRARY} under {root} (driver root {driver_root})"
        if pynvml is None:
            try:
                import pynvml
            except ImportError as err:
                return None, f"nvidia-ml-py is not installed ({err})"
        load = load or (lambda p: ctypes.CDLL(p, mode=os.RTLD_GLOBAL | os.RTLD_NOW))
        worker = _Worker(timeout)
        loaded = []

        def init():
            load(path)  # pynvml then finds it by its soname, already loaded
            loaded.append(path)
            pynvml.nvmlInit()

        try:
            worker.call(init)
        except Exception as err:  # noqa: BLE001 - a timeout, a load error or an NVML error
            return None, f"{path} failed to initialise ({_why(err)})" + (
                "" if not loaded or os.path.exists(CONTROL_NODE) else
                f"; this process has no {CONTROL_NODE}: NVML needs the GPUs' device nodes (in a container: "
                "privileged, as the chart's nvidia.enabled with config.nvml makes it; docs/nvidia.md)")
        return cls(pynvml, worker, path), ""

    @classmethod
    def shared(cls, root: str, driver_root: str = "/") -> Nvml | None:
        """One NVML per host root and driver root for the whole process (the scans and the health
        events use the same); opened on first use. Blocks: call it in a thread."""
        key = (os.path.abspath(root), driver_root)
        with _SHARED_LOCK:
            if key not in _SHARED:
                _SHARED[key] = cls.open(root, driver_root)
            return _SHARED[key]

    def call(self, what: str, fn: Callable):
        """``fn()`` on the NVML thread: its result, or None (logged) when it fails or times out."""
        return self._ask(what, fn)

    def run(self, what: str, fn: Callable, timeout: float | None = None):
        """``fn(pynvml)`` on the NVML thread -> its result; its NVMLError (or a timeout, which
        does not stop NVML asking later) raised to the caller: for changes (prepare/mig.py),
        which may take longer than a query (``timeout``)."""
        if self.failed:
            raise TimeoutError(f"NVML is not answering ({self.failed})")
        return self.worker.call(lambda: fn(self.pynvml), timeout)

    def handle(self, bdf: str):
        """The GPU's NVML handle; call on the NVML thread (inside ``run``)."""
        return self.pynvml.nvmlDeviceGetHandleByPciBusId(bdf)

    def mig_profiles(self, bdf: str) -> tuple[MigProfile, ...]:
        """Static, so asked with the GPU's other facts, once; empty for a GPU without MIG."""
        return (self.device(bdf) or NvmlDevice()).mig_profiles

    def _ask(self, what: str, fn: Callable):
        if self.failed:
            return None
        try:
            return self.worker.call(fn)
        except TimeoutError:
            self.failed = f"{what} timed out after {self.worker.timeout} s"
            log.error("NVML: %s; not asked again, GPU facts from the PCI ID table", self.failed)
        except Exception as err:  # noqa: BLE001 - NVML_ERROR_* for this query only
            log.warning("NVML: %s: %s", what, _why(err))
        return None

    def system(self) -> tuple[str | None, int | None]:
        nv = self.pynvml
        version = self._ask("driver version", nv.nvmlSystemGetDriverVersion)
        cuda = self._ask("CUDA driver version", nv.nvmlSystemGetCudaDriverVersion_v2)
        return (_text(version), cuda if _is_int(cuda) else None)

    def device(self, bdf: str) -> NvmlDevice | None:
        """Static facts, so asked once per GPU (a new UUID at the same address is a new GPU)."""
        if bdf not in self._devices:
            self._devices[bdf] = self._ask(f"GPU {bdf}", lambda: self._query(bdf))
        return self._devices[bdf]

    def _query(self, bdf: str) -> NvmlDevice:
        nv = self.pynvml
        h = nv.nvmlDeviceGetHandleByPciBusId(bdf)  # the bindings call NVML's _v2 entry point

        def optional(fn, *args):  # a query the GPU does not support leaves its fact out
            try:
                return fn(h, *args)
            except nv.NVMLError:
                return None

        mem = optional(nv.nvmlDeviceGetMemoryInfo)
        cc = optional(nv.nvmlDeviceGetCudaComputeCapability)
        arch, brand = optional(nv.nvmlDeviceGetArchitecture), optional(nv.nvmlDeviceGetBrand)
        total = getattr(mem, "total", None)
        try:
            profiles = mig.profiles(nv, h)
        except Exception as err:  # noqa: BLE001 - MIG is optional: the GPU's other facts stand
            log.warning("NVML: MIG profiles of %s: %s", bdf, _why(err))
            profiles = ()
        return NvmlDevice(mig_profiles=profiles,
            name=_text(optional(nv.nvmlDeviceGetName)), uuid=_text(optional(nv.nvmlDeviceGetUUID)),
            memory_bytes=total if _is_int(total) and total > 0 else None,
            architecture=arch if _is_int(arch) else None, brand=brand if _is_int(brand) else None,
            compute_capability=tuple(cc) if isinstance(cc, tuple) and len(cc) == 2 and all(map(_is_int, cc)) else None,
        )


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63


def _text(v) -> str | None:
    if isinstance(v, bytes):
        v = v.decode("utf-8", "replace")
    return v if isinstance(v, str) else None


def _why(err: BaseException) -> str:
    return "timed out" if isinstance(err, TimeoutError) else f"{type(err).__name__}: {err}"
