"""GPU faults kept across agent restarts (docs/health.md, "Kept faults").

An NVML XID or double-bit ECC event (agent/health/xid.py) says the GPU cannot be trusted until
it is reset; the event is not sent again. So the faults that make a GPU unhealthy are written to
``<plugin dir>/gpu-faults.json``, one per GPU UUID with the boot ID they were seen in, and read
back when the agent starts: an upgrade or a crash does not give a broken GPU back to the pool.
An XID NVML places in one MIG instance is that MIG device's fault (``partition``: its device's
name), kept beside its GPU's.

A reboot resets every GPU (and applies the row remapping or page retirement a double-bit ECC
error asks for), so a fault of another boot is dropped when the file is read. A GPU reset without
a reboot (``nvidia-smi -r``) leaves the boot ID: the operator clears the fault
(``sysdra health clear``). The file is input like any other: a damaged file is logged and
counts as empty, a bad entry is skipped with its reason, nothing here raises to the caller.
Writes are atomic and hold ``gpu-faults.lock``, which the CLI holds too; all of this blocks
(the monitor calls it in worker threads).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import stat
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from agent.bootid import read_boot_id
from agent.fsutil import atomic_write_json
from discovery.inventory import device_name

log = logging.getLogger(__name__)

FILE, LOCK = "gpu-faults.json", "gpu-faults.lock"
MAX_BYTES = 1 << 20
MAX_FAULTS = 1024
LOCK_TIMEOUT = 10.0  # seconds: a write holds it for milliseconds
MAX_SINCE = 253402300799.0  # 9999-12-31: later is no time (time.localtime, the next write's JSON)

Uuid = Annotated[str, StringConstraints(pattern=r"^GPU-[0-9A-Za-z-]{1,60}$")]
Bdf = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")]
Reason = Annotated[str, StringConstraints(pattern=r"^(xid-[0-9]{1,5}|ecc-double-bit)$")]
BootId = Annotated[str, StringConstraints(pattern=r"^([A-Za-z0-9][-A-Za-z0-9_.]{0,63})?$")]
DeviceName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")]


class GpuFault(BaseModel):
    """One GPU's fault as the file holds it (keys as written: camelCase)."""

    model_config = ConfigDict(frozen=True, extra="ignore")  # a newer sysdra's fields: the fault still holds
    uuid: Uuid
    bdf: Bdf  # where the GPU was (its device's name); the UUID is what is matched
    reason: Reason
    message: str = Field(max_length=1024)
    since: float = Field(ge=0, le=MAX_SINCE, allow_inf_nan=False)  # Unix seconds (a time: written back, shown)
    bootId: BootId
    partition: DeviceName | None = None  # a MIG device's own fault (an XID in its instance); None: the GPU's

    @property
    def gpu(self) -> str:
        return device_name("gpu", self.bdf)

    @property
    def device(self) -> str:
        """The device the fault makes unhealthy: the GPU, or one of its MIG devices."""
        return self.partition or self.gpu

    @property
    def key(self) -> tuple[str, str | None]:
        return self.uuid, self.partition


class _FaultFile(BaseModel):
    model_config = ConfigDict(extra="ignore")
    version: Literal[1]
    faults: list[Any] = Field(max_length=MAX_FAULTS)  # each entry checked alone: a bad one is its own problem


class FaultStore:
    """The file: ``load`` (this boot's faults by ``GpuFault.key``), ``record`` one, ``clear`` some."""

    def __init__(self, plugin_dir: str, root: str = "/", boot_id: str | None = None):
        self.path, self.lock_path = os.path.join(plugin_dir, FILE), os.path.join(plugin_dir, LOCK)
        self.root, self._boot_id = root, boot_id
        self.problems: list[str] = []  # what the last read found wrong (logged too), for sysdra doctor

    @property
    def boot_id(self) -> str:
        if self._boot_id is None:
            self._boot_id = read_boot_id(self.root)
        return self._boot_id

    def signature(self) -> tuple | None:
        """What tells a changed file (another process's write): None while there is none."""
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def read(self) -> list[GpuFault]:
        """Every valid entry, of any boot; problems logged (and in ``problems``), never raised."""
        self.problems = []
        try:
            raw = _read_bounded(self.path)
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as err:
            return self._problem(f"GPU fault file {self.path} unreadable ({err}): treated as empty, so GPUs it held "
                                 "unhealthy are not; fix or remove it")
        try:
            doc = _FaultFile.model_validate(json.loads(raw))
        except (ValueError, ValidationError, RecursionError) as err:  # RecursionError: JSON nested too deep
            why = ("not JSON" if isinstance(err, json.JSONDecodeError) else
                   "JSON nested too deep" if isinstance(err, RecursionError) else _first_error(err))
            return self._problem(f"GPU fault file {self.path} is damaged ({why}): treated as empty, so GPUs it "
                                 "held unhealthy are not; fix or remove it")
        faults: dict[tuple, GpuFault] = {}
        for i, entry in enumerate(doc.faults):
            try:
                fault = GpuFault.model_validate(entry)
            except ValidationError as err:
                self._problem(f"GPU fault file {self.path}: entry {i} skipped: {_first_error(err)}")
                continue
            faults[fault.key] = fault  # the last of a GPU's (or MIG device's) wins, as the last write does
        return list(faults.values())

    def _problem(self, text: str) -> list:
        log.warning("%s", text)
        self.problems.append(text)
        return []

    def load(self) -> dict[tuple[str, str | None], GpuFault]:
        """This boot's faults by ``GpuFault.key`` (UUID, MIG device); those of another boot are
        ignored (logged) and left out of the next write. Never writes (``sysdra scan`` reads it too)."""
        faults = self.read()
        for f in faults:
            if f.bootId != self.boot_id:
                log.info("GPU %s (%s): fault %s of boot %s ignored: the node rebooted since, which resets the GPU",
                         f.uuid, f.bdf, f.reason, f.bootId or "unknown")
        return {f.key: f for f in faults if f.bootId == self.boot_id}

    def record(self, uuid: str, bdf: str, reason: str, message: str, partition: str | None = None) -> GpuFault:
        """Keep this boot's fault of GPU ``uuid``, or of its MIG device ``partition``, replacing
        its earlier one. OSError when it cannot be written (logged by the caller)."""
        fault = GpuFault(uuid=uuid, bdf=bdf, reason=reason, message=message[:1024], since=time.time(),
                         bootId=self.boot_id, partition=partition)
        self._update(lambda current: [f for f in current if f.key != fault.key] + [fault])
        return fault

    def clear(self, selector: str | None) -> list[GpuFault]:
        """Remove the faults ``selector`` names (None: all of them); the removed ones. A GPU's
        UUID, PCI address or device name names its faults and its MIG devices' (a reset of the
        GPU resets its instances); a MIG device's name names its own."""
        removed: list[GpuFault] = []

        def keep(current: list[GpuFault]) -> list[GpuFault]:
            removed.extend(f for f in current if selector is None or selector in (f.uuid, f.bdf, f.gpu, f.device))
            return [f for f in current if f not in removed]

        self._update(keep)
        return removed

    def _update(self, change) -> None:
        """``change(this boot's faults)`` -> the faults to write; other boots' are dropped."""
        with _flock(self.lock_path):
            read = self.read()
            current = [f for f in read if f.bootId == self.boot_id]
            new = change(current)
            if self.problems:  # what could not be read is kept for the operator, not overwritten
                aside = f"{self.path}.damaged-{time.strftime('%Y%m%dT%H%M%S')}"
                os.replace(self.path, aside)
                log.warning("GPU fault file %s moved aside to %s before it is written again", self.path, aside)
            if new != read or self.problems:
                atomic_write_json(self.path, {"version": 1, "faults": [f.model_dump(exclude_none=True) for f in new]},
                                  mode=0o600)


def _read_bounded(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        data = os.read(fd, MAX_BYTES + 1)
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:
        raise ValueError(f"larger than {MAX_BYTES} bytes")
    return data


def _first_error(err: Exception) -> str:
    if isinstance(err, ValidationError):
        e = err.errors()[0]
        return f"{'.'.join(map(str, e['loc'])) or 'top level'}: {e['msg']}"
    return str(err)


@contextlib.contextmanager
def _flock(path: str, timeout: float = LOCK_TIMEOUT):
    """The writers' lock (the agent's and ``sysdra health``'s); OSError after ``timeout``."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{path} held for over {timeout:.0f} s") from None
                time.sleep(0.02)
        yield
    finally:
        os.close(fd)  # closing drops the lock


class KeptFaults:
    """The monitor's view of the file: ``refresh`` when it changed, ``apply`` to the devices'
    memory, ``record`` a new fault. Called from the monitor's rounds and fault tasks, which hold
    its round lock: one at a time."""

    def __init__(self, store: FaultStore):
        self.store = store
        self.kept: dict[tuple, GpuFault] = {}
        self._sig: tuple | None | bool = False  # False: never read
        self._gone: dict[tuple, GpuFault] = {}  # the faults that left the file (cleared), not yet applied
        self._recorded = False  # a fault written since the last apply (a round may have cleared its GPU meanwhile)

    @property
    def pending(self) -> bool:
        return bool(self._gone) or self._recorded

    def _adopt(self, faults: dict[tuple, GpuFault]) -> None:
        self._gone.update((k, f) for k, f in self.kept.items() if k not in faults)
        self.kept = faults
        self._sig = self.store.signature()

    def refresh(self) -> bool:
        """Read the file again if another process changed it (or on the first call)."""
        if self._sig is not False and self.store.signature() == self._sig:
            return False
        self._adopt(self.store.load())
        return True

    def record(self, uuid: str, bdf: str, reason: str, message: str, partition: str | None = None) -> None:
        """Keep a new fault (a repeat of the kept one costs no write: a GPU may raise it often)."""
        self.refresh()  # the file as it is now: a fault the operator cleared since is no repeat
        kept = self.kept.get((uuid, partition))
        if kept is not None and kept.reason == reason and kept.bdf == bdf:
            return
        try:
            self.store.record(uuid, bdf, reason, message, partition)
        except (OSError, ValueError) as err:  # a UUID or address the file's model refuses: in memory only
            log.error("GPU %s (%s): fault %s of %s not kept across restarts: %s", uuid, bdf, reason, partition or "the GPU", err)
            return
        self._adopt(self.store.load())
        self._recorded = True

    def apply(self, known: dict, memory: dict, partition_faults: dict[str, tuple[str, str]]) -> None:
        """Kept faults onto their GPUs' memory and into ``partition_faults`` (MIG device -> fault),
        cleared ones off both: matched by UUID, or by PCI address for a GPU whose UUID discovery
        could not read (the fault was kept under NVML's)."""
        gone, self._gone, self._recorded = self._gone, {}, False
        gpu_faults = {u: f for (u, p), f in self.kept.items() if p is None}
        by_device = {f.gpu: u for u, f in gpu_faults.items()}
        gone_devices = {f.gpu: u for (u, p), f in gone.items() if p is None}
        uuids: dict[str, str | None] = {}  # GPU device -> the UUID its faults are kept under
        for name, dev in known.items():
            mem = memory.get(name)
            if dev.gpu is None or mem is None:
                continue
            uuid = uuids[name] = dev.gpu.nvidia_uuid or by_device.get(name) or gone_devices.get(name)
            if mem.event_fault is not None and None not in (mem.event_uuid, dev.gpu.nvidia_uuid) \
                    and mem.event_uuid != dev.gpu.nvidia_uuid:  # another GPU put in the slot: not its fault
                log.info("device %s: fault %s was GPU %s's; %s is there now", name, mem.event_fault[0], mem.event_uuid,
                         dev.gpu.nvidia_uuid)
                mem.event_fault = mem.event_uuid = None
            if (uuid, None) in gone and mem.event_fault is not None:
                log.info("device %s (%s): fault %s cleared (no longer in %s)", name, uuid, mem.event_fault[0],
                         self.store.path)
                mem.event_fault = None
            fault = gpu_faults.get(uuid)
            if fault is not None and mem.event_fault is None:
                mem.event_fault, mem.event_uuid = (fault.reason, fault.message), uuid
        for (uuid, part), f in gone.items():
            if part is not None and partition_faults.pop(part, None) is not None:
                log.info("device %s (%s): fault %s cleared (no longer in %s)", part, uuid, f.reason, self.store.path)
        for (uuid, part), f in self.kept.items():
            if part is None:
                continue
            if uuids.get(f.gpu) in (None, uuid):  # not another GPU's put in that slot
                partition_faults.setdefault(part, (f.reason, f.message))
            elif partition_faults.get(part) == (f.reason, f.message):  # held since before another GPU came
                del partition_faults[part]
