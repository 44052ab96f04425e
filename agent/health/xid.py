"""NVIDIA XID and ECC events from NVML -> device faults (docs/health.md, "NVIDIA events").

The driver reports a GPU fault as an XID (a numbered error; 79: the GPU fell off the bus, 48: a
double-bit ECC error, ...) or an ECC event. NVML delivers them to an event set that one thread of
our own waits on (a blocking call by design, so never the event loop or NVML's query thread).
Application errors (``nvidia_ignored_xids``, XIDs 13, 31, 43, 45, 68, 109 by default: a program's
own fault, not the GPU's) are ignored, as NVIDIA's driver ignores them; a double-bit ECC error is
a fault; a single-bit one is corrected and only logged. An XID NVML places in one MIG instance
(the event's GPU and compute instance IDs set) is reported with them: it is that MIG device's
fault, not its GPU's (agent/health/gpuevents.py), as in NVIDIA's device plugin. A fault holds
until the node reboots (kept across agent restarts: agent/health/faults.py) or the operator
clears it: a GPU that raised one needs a reset (and so a restart of what uses it) to be trusted again.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)

WAIT_MS = 5000  # each wait returns at least this often, so stop() is noticed
NO_INSTANCE = 0xFFFFFFFF  # an event's GPU/compute instance ID when it is not a MIG instance's
RETRY_FIRST, RETRY_MOST = 1.0, 60.0  # seconds before registering again after a failed wait
NOTE_EVERY = 600.0  # seconds between log lines of one kind of event that is no fault
_HEX = re.compile(r"[0-9a-f]{1,8}")


def bus_id(text) -> str | None:
    """NVML's ``00000000:00:06.0`` as the kernel names the function: ``0000:00:06.0``; a domain
    above ffff (Intel VMD) keeps all its digits, ``00010000:01:00.0`` -> ``10000:01:00.0``."""
    if isinstance(text, bytes):
        text = text.decode("ascii", "replace")
    if not isinstance(text, str):
        return None
    parts = text.strip().lower().split(":")
    if len(parts) != 3 or not all(parts):
        return None
    if not _HEX.fullmatch(parts[0]):  # int() would also take "-1", "0x1", "1_0"
        return None
    return f"{int(parts[0], 16):04x}:{parts[1]}:{parts[2]}"


def _text(value) -> str:
    return value.decode("ascii", "replace") if isinstance(value, bytes) else str(value)


def mig_instance(data) -> tuple[int, int] | None:
    """(GPU instance, compute instance) of an event NVML places in a MIG instance, else None."""
    gi, ci = getattr(data, "gpuInstanceId", NO_INSTANCE), getattr(data, "computeInstanceId", NO_INSTANCE)
    if not isinstance(gi, int) or not isinstance(ci, int) or not 0 <= gi < NO_INSTANCE or not 0 <= ci < NO_INSTANCE:
        return None
    return gi, ci


class XidWatch:
    """Calls ``on_fault(bdf, code, message, instance)`` (from its own thread) for every fault
    event; ``instance``: ``mig_instance``'s answer for an XID, None for an ECC event."""

    def __init__(self, nvml, on_fault: Callable[[str, str, str, tuple[int, int] | None], None], ignored,
                 wait_ms: int = WAIT_MS):
        self.nvml = nvml  # discovery.nvml.Nvml
        self.nv = nvml.pynvml
        self.on_fault = on_fault
        self.ignored = frozenset(ignored)
        self.wait_ms = wait_ms
        self.registered: list[str] = []  # bus IDs of the GPUs whose events are watched
        self.uuids: dict[str, str] = {}  # bus ID -> the GPU's UUID (NVML's), for faults kept across restarts
        self.events = 0
        self.outages = 0  # waits NVML failed (each followed by registering again)
        self.clock = time.monotonic
        self._noted: dict[str, tuple[float, int]] = {}  # what -> (when last logged, how many since)
        self._stop = threading.Event()
        self._set = None
        self._lock = threading.Lock()  # the watched set and its lists: a new set (failed wait) or GPUs added
        self.wanted: set[str] = set()  # bus IDs ``add`` registered: every new set registers them too
        self._delay = RETRY_FIRST  # before the next registering after a failed wait

    def _mask(self) -> int:
        nv = self.nv
        return nv.nvmlEventTypeXidCriticalError | nv.nvmlEventTypeDoubleBitEccError | nv.nvmlEventTypeSingleBitEccError

    def _register(self):
        """A new event set with every GPU's fault events (on NVML's thread) -> (set, bus IDs, UUIDs),
        or None when NVML did not answer. The GPUs NVML counts, and those ``add`` asked for (NVML
        may count only the GPUs of its start)."""
        nv, mask, wanted = self.nv, self._mask(), list(self.wanted)

        def register():
            event_set = nv.nvmlEventSetCreate()
            done, uuids = [], {}
            for i in range(nv.nvmlDeviceGetCount()):
                h = nv.nvmlDeviceGetHandleByIndex(i)
                try:
                    nv.nvmlDeviceRegisterEvents(h, mask, event_set)
                except nv.NVMLError as err:  # e.g. not supported on this GPU, or it is lost
                    log.warning("NVML events of GPU %d not watched: %s", i, err)
                    continue
                done.append(bus_id(nv.nvmlDeviceGetPciInfo(h).busId))
                with contextlib.suppress(nv.NVMLError):  # discovery's UUID (procfs) is used first anyway
                    uuids[done[-1]] = _text(nv.nvmlDeviceGetUUID(h))
            more, more_uuids = self._register_by_address([b for b in wanted if b not in done], event_set)
            return event_set, done + more, {**uuids, **more_uuids}

        return self.nvml.call("registering for XID/ECC events", register)

    def _register_by_address(self, bdfs: list[str], event_set) -> tuple[list[str], dict[str, str]]:
        """On NVML's thread: ``bdfs``' events into ``event_set``, each GPU found by its PCI address (as
        NVML finds a GPU at its handle lookup since nvmlInit_v2) -> (bus IDs registered, their UUIDs)."""
        nv, done, uuids = self.nv, [], {}
        for bdf in bdfs:
            try:
                h = nv.nvmlDeviceGetHandleByPciBusId(bdf)
                nv.nvmlDeviceRegisterEvents(h, self._mask(), event_set)
            except nv.NVMLError as err:
                log.warning("NVML events of GPU %s not watched: %s", bdf, err)
                continue
            done.append(bdf)
            with contextlib.suppress(nv.NVMLError):
                uuids[bdf] = _text(nv.nvmlDeviceGetUUID(h))
        return done, uuids

    def add(self, bdfs: list[str]) -> list[str]:
        """GPUs bound to nvidia since the watch registered its GPUs (hot-added; given back from
        vfio-pci, which NVML does not manage; bound again, so an earlier registration may be the
        function's of before): registered in the watched set -> those NVML took (logged)."""
        self.wanted.update(bdfs)
        with self._lock:  # not while a failed wait makes a new set (that one takes ``wanted`` too)
            got = self.nvml.call("registering new GPUs for XID/ECC events", lambda s=self._set: self._register_by_address(bdfs, s))
            if not got:
                return []
            done, uuids = got
            self.registered = [*[b for b in self.registered if b not in done], *done]
            self.uuids = {**self.uuids, **uuids}
        if done:
            log.info("NVML XID/ECC events watched on %s too", ", ".join(done))
        return done

    def start(self) -> bool:
        """Register every GPU's fault events; False (logged) when NVML refuses all of them."""
        got = self._register()
        if not got or not got[1]:
            log.warning("NVML XID/ECC events not watched: GPU faults are seen by the sysfs checks only")
            return False
        self._set, self.registered, self.uuids = got
        threading.Thread(target=self._run, name="nvml-events", daemon=True).start()
        log.info("NVML XID/ECC events watched on %s (XIDs ignored: %s)", ", ".join(self.registered),
                 ", ".join(map(str, sorted(self.ignored))) or "none")
        return True

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        nv = self.nv
        while not self._stop.is_set():
            try:
                data = nv.nvmlEventSetWait_v2(self._set, self.wait_ms)
            except nv.NVMLError as err:
                if getattr(err, "value", None) != nv.NVML_ERROR_TIMEOUT:
                    self._watch_again(err)
                    continue
                data = None
            self._delay = RETRY_FIRST  # NVML answered: a later failure starts the backoff afresh
            if data is None:
                continue
            self.events += 1
            try:
                self._handle(data)
            except Exception:  # noqa: BLE001 - one odd event must not end the watch
                log.exception("NVML event not understood")

    def _watch_again(self, err) -> None:
        """A wait NVML failed (a GPU lost, the driver reloaded): a new event set, registered again
        after ``RETRY_FIRST`` seconds, doubling up to ``RETRY_MOST`` (also across failures that
        follow each other), until it takes (or ``stop``). Meanwhile GPU faults are seen by the sysfs
        checks only; a GPU NVML no longer registers is left out."""
        log.error("NVML event wait failed (%s): XID/ECC events not watched until NVML takes them again", err)
        self.outages += 1
        while not self._stop.wait(self._delay):
            self._delay = min(self._delay * 2, RETRY_MOST)
            with self._lock:
                got = self._register()
                if got and got[1]:
                    self.nvml.call("freeing the old event set", lambda old=self._set: self.nv.nvmlEventSetFree(old))
                    self._set, self.registered, self.uuids = got
            if got and got[1]:
                log.warning("NVML XID/ECC events watched again on %s", ", ".join(self.registered))
                return
            if got:  # a set without a GPU in it
                self.nvml.call("freeing an empty event set", lambda empty=got[0]: self.nv.nvmlEventSetFree(empty))

    def _handle(self, data) -> None:
        nv = self.nv
        bdf = bus_id(nv.nvmlDeviceGetPciInfo(data.device).busId)
        kind, detail = data.eventType, data.eventData
        if bdf is None:
            return
        if kind == nv.nvmlEventTypeXidCriticalError:
            if detail in self.ignored:
                self._note(f"GPU {bdf}: XID {detail} (an application's error, ignored)")
                return
            instance = mig_instance(data)
            where = f" in MIG GPU instance {instance[0]}, compute instance {instance[1]}" if instance else ""
            self.on_fault(bdf, f"xid-{detail}", f"NVML: critical XID {detail}{where}", instance)
        elif kind == nv.nvmlEventTypeDoubleBitEccError:  # the GPU's memory, whichever instance met it
            self.on_fault(bdf, "ecc-double-bit", "NVML: uncorrectable (double-bit) ECC error", None)
        elif kind == nv.nvmlEventTypeSingleBitEccError:
            self._note(f"GPU {bdf}: a single-bit ECC error (corrected)")

    def _note(self, what: str) -> None:
        """An event that is no fault, logged the first time and then once per ``NOTE_EVERY``
        with how many came between: an application looping on its errors, or a GPU whose ECC
        corrects all day, must not flood the log."""
        now = self.clock()
        last, since = self._noted.get(what, (None, 0))
        if last is not None and now - last < NOTE_EVERY:
            self._noted[what] = (last, since + 1)
            return
        self._noted[what] = (now, 0)
        log.info("%s%s", what, f" ({since} more in the last {now - last:.0f} s)" if since else "")
