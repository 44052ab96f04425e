"""NVML, NVIDIA's own management library, through nvidia-ml-py (``pynvml``): read-only facts.

``libnvidia-ml.so.1`` is loaded from the configured driver root under the host root (a node's
driver may live in ``/usr/local/nvidia`` or ``/run/nvidia/driver``, not in the ld cache), before
pynvml asks the loader for it by soname. Every call runs on one daemon thread, in order, and is
waited for with a timeout: a hung driver must not hang a scan. A call's timeout counts from when
it begins, not while it waits behind others: a MIG change (prepare/mig.py) may take a minute, and
a query queued behind it is no sign of a hung driver. A caller gives up before its call began only
when the call running ahead outlasts its own timeout; its call is then never run.

Once a query times out, queries are not asked again; the GPU's facts then come from the table
(``discovery/nvidia.py``), never flapping between the two. An NVML that failed to open is not
hung: the kernel driver may load after the agent (the GPU operator, boot order), so ``shared`` opens
it again on a later call, backing off (``RETRY``), and its callers ask only while a GPU is bound to
the nvidia driver; one whose initialisation hung is never opened again. A GPU query that failed
is asked again when a scan next reads the GPU (a reset, a GPU given back from vfio-pci). Changes (``run``)
are refused only while a call runs past its timeout (nothing piles up behind a hung driver), and
accepted again once the thread answers: a query that gave up does not take MIG prepare down.

Answers are input: strings are checked where they are published, numbers by type here.
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import threading
import time
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


RETRY = (10.0, 300.0)  # seconds from a failed open to the next try: the first, the most (doubling)


class NvmlSource(Protocol):
    """What discovery asks NVML (a simulated one in tests)."""

    def system(self) -> tuple[str | None, int | None]:
        """(driver version, CUDA driver version), each None when not answered."""

    def device(self, bdf: str, uuid: str | None = None) -> NvmlDevice | None:
        """The GPU at PCI address ``bdf`` (``uuid``: the one the driver says is there), None when
        NVML does not know it."""

    def mig_profiles(self, bdf: str) -> tuple[MigProfile, ...]:
        """The GPU's MIG GPU-instance profiles (empty: no MIG, or NVML does not say)."""

    def mig_instances(self, bdf: str) -> list[mig.GpuInstanceNow] | None:
        """The GPU instances that exist now (None: NVML did not answer)."""


def find_library(root: str, driver_root: str) -> str | None:
    """``libnvidia-ml.so.1`` of the driver root, as a path the agent can open, or None."""
    for d in LIB_DIRS:
        real = resolve(root, os.path.join(driver_root, d, LIBRARY))
        if real is not None and os.path.isfile(path := os.path.join(root, real.lstrip("/"))):
            return path
    return None


class _Call:
    __slots__ = ("fn", "budget", "what", "fut", "began")

    def __init__(self, fn: Callable, budget: float, what: str):
        self.fn, self.budget, self.what = fn, budget, what
        self.fut: Future = Future()
        self.began: float | None = None  # monotonic


class _Worker:
    """One daemon thread running calls in order; a caller waits at most ``timeout`` seconds
    from when its call begins (the module docstring)."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.running: _Call | None = None
        self.changed = threading.Condition()  # a call began or ended
        threading.Thread(target=self._run, name="nvml", daemon=True).start()

    def close(self) -> None:
        """Let the thread end once the calls queued before this one ran (an NVML that did not open)."""
        self.calls.put(None)

    def _run(self) -> None:
        while True:
            call = self.calls.get()
            if call is None:
                return
            if not call.fut.set_running_or_notify_cancel():
                continue  # its caller gave up before it began
            with self.changed:
                call.began, self.running = time.monotonic(), call
                self.changed.notify_all()
            try:
                result, error = call.fn(), None
            except BaseException as err:  # noqa: BLE001 - handed to the waiting caller
                result, error = None, err
            with self.changed:  # before the caller wakes: it may ask ``stuck`` next
                self.running = None
                self.changed.notify_all()
            if error is None:
                call.fut.set_result(result)
            else:
                call.fut.set_exception(error)

    def stuck(self) -> str | None:
        """The call running past its timeout (a hung driver), or None."""
        r = self.running
        return f"{r.what or 'a call'} has run {time.monotonic() - r.began:.0f} s" if (
            r is not None and time.monotonic() > r.began + r.budget) else None

    def submit(self, fn: Callable, timeout: float | None = None, what: str = "") -> _Call:
        call = _Call(fn, timeout or self.timeout, what)
        self.calls.put(call)
        return call

    def call(self, fn: Callable, timeout: float | None = None, what: str = ""):
        call = self.submit(fn, timeout, what)
        with self.changed:
            while call.began is None:
                r = self.running
                if r is not None and (left := r.began + r.budget - time.monotonic()) <= 0 and call.fut.cancel():
                    raise TimeoutError(f"NVML is not answering ({r.what or 'a call'} has run {r.budget - left:.0f} s)")
                self.changed.wait(max(left, 0.0) if r is not None else None)  # between calls: the next begins
        return call.fut.result(timeout=max(0.0, call.began + call.budget - time.monotonic()))


def _import_pynvml():
    """nvidia-ml-py, imported once a library has loaded: its 8,000 lines are ~2.7 MB of the process."""
    import pynvml

    return pynvml


class Nvml:
    """NVML of the running driver. Construct with :meth:`open`; ``None`` there means no NVML."""

    def __init__(self, pynvml, worker: _Worker, where: str):
        self.pynvml = pynvml
        self.worker = worker
        self.where = where
        self.failed: str | None = None
        self._devices: dict[str, NvmlDevice] = {}
        self._unanswered: set[str] = set()  # GPUs whose last query failed (logged once)

    @classmethod
    def open(cls, root: str, driver_root: str = "/", timeout: float = 5.0, pynvml=None,
             load: Callable[[str], object] | None = None) -> Nvml | None:
        """NVML loaded from the driver root, initialised; None (and one log line) when the node
        has no NVML or it fails. ``pynvml`` and ``load`` (the library loader) are for a simulated
        NVML in tests."""
        nvml, why, _ = cls._probe(root, driver_root, timeout, pynvml, load)
        _log_open(nvml, why)
        return nvml

    @classmethod
    def probe(cls, root: str, driver_root: str = "/", timeout: float = 5.0, pynvml=None,
              load: Callable[[str], object] | None = None) -> tuple[Nvml | None, str]:
        """``open`` without its log line: (NVML, "") or (None, why not)."""
        return cls._probe(root, driver_root, timeout, pynvml, load)[:2]

    @classmethod
    def _probe(cls, root, driver_root, timeout, pynvml, load) -> tuple[Nvml | None, str, bool]:
        """-> (NVML, "", False) or (None, why not, whether a later try may do better)."""
        path = find_library(root, driver_root)
        if path is None:  # the GPU operator's driver container may not have put it there yet
            return None, f"no {LIBRARY} under {root} (driver root {driver_root})", True
        load = load or (lambda p: ctypes.CDLL(p, mode=os.RTLD_GLOBAL | os.RTLD_NOW))
        worker = _Worker(timeout)
        loaded = []

        def init():
            load(path)  # pynvml then finds it by its soname, already loaded
            loaded.append(path)
            nv = pynvml or _import_pynvml()  # only now: a library that does not load costs no pynvml
            nv.nvmlInit()
            return nv

        try:
            nv = worker.call(init)
        except ImportError as err:
            worker.close()
            return None, f"nvidia-ml-py is not installed ({err})", False
        except Exception as err:  # noqa: BLE001 - a timeout, a load error or an NVML error
            hung = isinstance(err, TimeoutError)  # its thread is stuck in the driver: no second init beside it
            if not hung:
                worker.close()
            return None, f"{path} failed to initialise ({_why(err)})" + (
                "" if not loaded or os.path.exists(CONTROL_NODE) else
                f"; this process has no {CONTROL_NODE}: NVML needs the GPUs' device nodes (in a container: "
                "privileged, as the chart's nvidia.enabled with config.nvml makes it; docs/nvidia.md)"), not hung
        return cls(nv, worker, path), "", False

    @classmethod
    def shared(cls, root: str, driver_root: str = "/", retry: bool = True) -> Nvml | None:
        """One NVML per host root and driver root for the whole process (the scans and the health
        events use the same); opened on first use, and again on a later call with ``retry`` (a GPU
        is bound to the nvidia driver) while it is not (the module docstring). Blocks: call it in
        a thread."""
        return SHARED.get(root, driver_root, retry)

    def call(self, what: str, fn: Callable):
        """``fn()`` on the NVML thread: its result, or None (logged) when it fails or times out."""
        return self._ask(what, fn)

    def run(self, what: str, fn: Callable, timeout: float | None = None):
        """``fn(pynvml)`` on the NVML thread -> its result; its NVMLError (or a timeout, which
        does not stop NVML asking later) raised to the caller: for changes (prepare/mig.py),
        which may take longer than a query (``timeout``). Refused while a call runs past its
        timeout, whatever ``failed`` says (the module docstring)."""
        if stuck := self.worker.stuck():
            raise TimeoutError(f"NVML is not answering ({stuck})")
        return self.worker.call(lambda: fn(self.pynvml), timeout, what)

    def after(self, what: str, fn: Callable, timeout: float | None = None) -> Future:
        """``fn(pynvml)`` queued behind every call before it, however long those take, and not
        waited for: the undo of a change that failed or timed out, which must run after it."""
        return self.worker.submit(lambda: fn(self.pynvml), timeout, what).fut

    def handle(self, bdf: str):
        """The GPU's NVML handle; call on the NVML thread (inside ``run``)."""
        return self.pynvml.nvmlDeviceGetHandleByPciBusId(bdf)

    def mig_profiles(self, bdf: str) -> tuple[MigProfile, ...]:
        """Static, so asked with the GPU's other facts, once; empty for a GPU without MIG. A GPU
        whose last query failed is not asked again here: its facts, read first, just asked."""
        return ((None if bdf in self._unanswered else self.device(bdf)) or NvmlDevice()).mig_profiles

    def mig_instances(self, bdf: str) -> list[mig.GpuInstanceNow] | None:
        """The GPU instances that exist now, of the GPU's profiles (static MIG: the operator's), asked
        at every scan as they come and go; None when NVML did not answer."""
        ids = [p.id for p in self.mig_profiles(bdf)]
        if not ids:
            return None
        return self._ask(f"MIG instances of {bdf}", lambda: mig.gpu_instances(self.pynvml, self.handle(bdf), ids))

    def _ask(self, what: str, fn: Callable, quiet: bool = False):
        if self.failed:
            return None
        try:
            return self.worker.call(fn, what=what)
        except TimeoutError:
            self.failed = f"{what} timed out after {self.worker.timeout} s"
            log.error("NVML: %s; not asked again, GPU facts from the PCI ID table", self.failed)
        except Exception as err:  # noqa: BLE001 - NVML_ERROR_* for this query only
            log.log(logging.DEBUG if quiet else logging.WARNING, "NVML: %s: %s", what, _why(err))
        return None

    def system(self) -> tuple[str | None, int | None]:
        nv = self.pynvml
        version = self._ask("driver version", nv.nvmlSystemGetDriverVersion)
        cuda = self._ask("CUDA driver version", nv.nvmlSystemGetCudaDriverVersion_v2)
        return (_text(version), cuda if _is_int(cuda) else None)

    def device(self, bdf: str, uuid: str | None = None) -> NvmlDevice | None:
        """Static facts, so kept once answered, while ``uuid`` (the driver's, when known) is the one
        answered: another GPU put at that address is a new GPU, asked anew. A query that failed is
        asked again next time (the module docstring), its warning given once."""
        kept = self._devices.get(bdf)
        if kept is not None and uuid is not None and kept.uuid not in (None, uuid):
            del self._devices[bdf]
        if bdf not in self._devices:
            answer = self._ask(f"GPU {bdf}", lambda: self._query(bdf), quiet=bdf in self._unanswered)
            if answer is None:
                self._unanswered.add(bdf)
                return None
            self._devices[bdf] = answer
            self._unanswered.discard(bdf)
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
        # (older bindings lack the call; an older driver answers FunctionNotFound, an NVMLError)
        addressing = optional(nv.nvmlDeviceGetAddressingMode) if hasattr(nv, "nvmlDeviceGetAddressingMode") else None
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
            addressing_mode=addressing if _is_int(addressing) else None,
            compute_capability=tuple(cc) if isinstance(cc, tuple) and len(cc) == 2 and all(map(_is_int, cc)) else None,
        )


class Sharing:
    """The process's NVML per (host root, driver root), for ``Nvml.shared``. ``opener(root,
    driver_root)`` -> ``Nvml._probe``'s triple and ``clock`` are for a simulated NVML in tests."""

    def __init__(self, opener: Callable | None = None, clock: Callable[[], float] = time.monotonic):
        self.opener = opener or (lambda root, driver_root: Nvml._probe(root, driver_root, 5.0, None, None))
        self.clock = clock
        self.lock = threading.Lock()
        self.opened: dict[tuple[str, str], Nvml] = {}
        self.failing: dict[tuple[str, str], tuple[int, float | None, str]] = {}  # tries, next try (None: never), why

    def get(self, root: str, driver_root: str = "/", retry: bool = True) -> Nvml | None:
        key = (os.path.abspath(root), driver_root)
        with self.lock:  # one open at a time: callers behind it get its answer
            if key in self.opened:
                return self.opened[key]
            tries, next_try, last = self.failing.get(key, (0, 0.0, ""))
            if tries and (not retry or next_try is None or self.clock() < next_try):
                return None
            nvml, why, again = self.opener(root, driver_root)
            if nvml is None:
                wait = min(RETRY[0] * 2**tries, RETRY[1])
                self.failing[key] = (tries + 1, self.clock() + wait if again else None, why)
                if why != last:  # the same reason again is no news
                    _log_open(None, why)
                log.debug("NVML: %s", f"tried again in {wait:.0f} s" if again else "not tried again")
                return None
            self.opened[key] = nvml
            self.failing.pop(key, None)
            if tries:  # the driver came up after the agent
                log.info("NVML: loaded %s after %d failed tries", nvml.where, tries)
            else:
                _log_open(nvml, "")
            return nvml


SHARED = Sharing()


def _log_open(nvml: Nvml | None, why: str) -> None:
    if nvml is not None:
        log.info("NVML: loaded %s", nvml.where)
    elif why.startswith(f"no {LIBRARY} "):  # a node without the NVIDIA driver: nothing is wrong
        log.info("NVML: %s: GPU facts from the PCI ID table", why)
    else:
        log.warning("NVML: %s: GPU facts from the PCI ID table", why)


def nvidia_bound(inventory) -> bool:
    """Whether a GPU of the inventory is bound to the nvidia driver: only then can a failed NVML
    open do better next time (a node without NVIDIA GPUs, or before the driver loads, never)."""
    return inventory is not None and any(d.pci.driver == "nvidia" for d in inventory.devices)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63


def _text(v) -> str | None:
    if isinstance(v, bytes):
        v = v.decode("utf-8", "replace")
    return v if isinstance(v, str) else None


def _why(err: BaseException) -> str:
    return "timed out" if isinstance(err, TimeoutError) else f"{type(err).__name__}: {err}"
