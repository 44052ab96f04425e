"""The MPS control daemons' records (``<plugin dir>/mps/daemons.json``) and their directories.

A record is written before its daemon starts and says which process is that daemon: PID, start
time, command line and the boot it runs in. All four must match a live process before the
agent adopts, signals or supervises it, so a PID the kernel gave to another process (after the
daemon died, or after a reboot) is never taken for the daemon. The file is input when read back:
validated, and moved aside when invalid. Paths and pod names are never recorded: a daemon's directories
and pod are derived from its GPU's UUID, so a record cannot point the agent elsewhere.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import shutil
import time
from typing import Annotated

import psutil
from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from agent.fsutil import atomic_write_json, make_dirs, read_bounded

log = logging.getLogger("agent.prepare.mps")

GPU_UUID = r"^(GPU|MIG)-[0-9A-Za-z-]{1,64}$"
MNT_DETACH = 2
MS_NOSUID, MS_NODEV = 2, 4
Arg = Annotated[str, StringConstraints(max_length=4096)]
_ESCAPED = re.compile(r"\\([0-7]{3})")  # mountinfo writes space, tab, newline, backslash as \ooo


class MpsRecord(BaseModel):
    """One daemon: a process of the agent's (``pid``) or a pod of its own (``pod_uid``: the
    agent's pod may end while the daemon serves, prepare/mps_pods.py). ``boot_id``/``cmdline``
    None: written by an agent that did not record them (that check is then skipped: PID and
    start time still are made)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    uuid: str = Field(pattern=GPU_UUID)
    pid: int | None = Field(default=None, ge=1, le=4194304)  # None: recorded, not (yet) started; at most PID_MAX_LIMIT
    # the process's start time (wall clock), for people and older records (a NaN would match any process's)
    started: float | None = Field(default=None, allow_inf_nan=False)
    ticks: int | None = Field(default=None, ge=0)  # its start in clock ticks since boot: tells a reused PID apart
    boot_id: str | None = Field(default=None, max_length=128)
    cmdline: list[Arg] | None = Field(default=None, max_length=16)
    pod_uid: str | None = Field(default=None, pattern=r"^[0-9a-fA-F-]{1,64}$")  # the pod's name is derived, never recorded
    # the GPU's compute mode (NVML's number) before the agent made it EXCLUSIVE_PROCESS for this daemon
    # (prepare/computemode.py), saved before the change and set back when the daemon stops; None: unchanged
    mode_before: int | None = Field(default=None, ge=0, le=3)


class MpsState(BaseModel):
    model_config = ConfigDict(extra="forbid")
    daemons: dict[str, MpsRecord] = {}


MAX_BYTES = 4 << 20  # a record is ~1 KiB, one per GPU


def load(path: str) -> MpsState:
    """The records at ``path``, each checked alone: a damaged one is left out (logged, the file
    copied aside; the next save drops it), the others kept, so another GPU's daemon is still
    adopted, never taken for a stray. A file that holds no records at all is moved aside."""
    try:
        doc = json.loads(read_bounded(path, MAX_BYTES))
        if not isinstance(doc, dict) or set(doc) - {"daemons"} or not isinstance(doc.get("daemons", {}), dict):
            raise ValueError("not an object of daemon records by GPU")
    except FileNotFoundError:
        return MpsState()
    except (OSError, ValueError, RecursionError) as err:  # RecursionError: JSON nested too deep
        _aside(path, str(err) if not isinstance(err, RecursionError) else "nested too deep", os.replace)
        return MpsState()
    state, bad = MpsState(), []
    for key, raw in doc.get("daemons", {}).items():
        try:
            rec = MpsRecord.model_validate(raw)
            if rec.uuid != key:
                raise ValueError("a record under another GPU's key")
        except ValueError as err:  # (pydantic's ValidationError too)
            bad.append(f"record {key[:80]!r}: {' '.join(str(err).split())[:300]}")
            continue
        state.daemons[key] = rec
    if bad:
        _aside(path, "; ".join(bad), shutil.copyfile)
    return state


def _aside(path: str, why: str, how) -> None:
    aside = f"{path}.invalid.{int(time.time())}"
    log.error("MPS daemon records %s are invalid (%s): %s to %s; their daemons found again", path, why,
              "moved" if how is os.replace else "copied", aside)
    try:
        how(path, aside)
    except OSError:
        pass


def save(path: str, state: MpsState) -> None:
    make_dirs(os.path.dirname(path), 0o700)
    # a record of an unchanged mode is written as an agent without ``mode_before`` wrote it, which
    # that agent (a rollback) reads; one with it is refused there (moved aside): docs/sharing.md
    doc = state.model_dump(mode="json")
    for rec in doc["daemons"].values():
        if rec["mode_before"] is None:
            del rec["mode_before"]
    atomic_write_json(path, doc, mode=0o600)


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat``): unlike a
    wall-clock start time (psutil's, boot time plus this), no clock step moves it. None: gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold anything
        return int(fields[19])  # field 22 of proc(5); the state is field 3
    except (OSError, IndexError, ValueError):
        return None


def is_process(rec: MpsRecord | None, boot_id: str) -> bool:
    """The recorded process runs now: same boot, PID, start and command line, not a zombie."""
    if rec is None or rec.pid is None or (rec.ticks is None and rec.started is None):
        return False
    if rec.boot_id is not None and rec.boot_id != boot_id:
        return False  # its PID and start time mean nothing in this boot
    try:
        p = psutil.Process(rec.pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return False
        if rec.ticks is not None:
            if start_ticks(rec.pid) != rec.ticks:
                return False
        elif abs(p.create_time() - rec.started) >= 0.5:  # a record of an agent that kept no ticks
            return False
        return rec.cmdline is None or p.cmdline() == rec.cmdline
    except psutil.Error:
        return False


def runtime_namespace_pid(environ: dict[str, str] | None = None) -> int | None:
    """Whose mount namespace the shm tmpfs must reach: PID 1's when the agent is a systemd
    service (``$INVOCATION_ID``, PID 1 is systemd), because the container runtime, another service,
    resolves the shares' CDI mounts there. None elsewhere: in a pod the chart's mount propagation
    decides, and a namespace of the agent's own is then the point (tests)."""
    if not (os.environ if environ is None else environ).get("INVOCATION_ID"):
        return None
    try:
        with open("/proc/1/comm") as f:
            return 1 if f.read().strip() == "systemd" else None
    except OSError:
        return None


def _mountinfo(pid: int | str = "self") -> list[tuple[str, str, str]]:
    """(mount point, file system type, super options) of the mount namespace of process ``pid``
    (this one's by default), in mount order (a later one at the same point is on top)."""
    out = []
    try:
        with open(f"/proc/{pid}/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()  # optional fields, then "-", type, source, super options
                sep = fields.index("-", 6) if "-" in fields[6:] else len(fields)
                if len(fields) > sep + 3:  # the point is octal-escaped (\040 for a space)
                    point = _ESCAPED.sub(lambda m: chr(int(m.group(1), 8)), fields[4])
                    out.append((point, fields[sep + 1], fields[sep + 3]))
    except OSError:
        return []
    return out


def mounts_below(path: str) -> list[str]:
    """Mount points at or below ``path`` (this process's mount namespace), deepest first."""
    found = {p for p, _, _ in _mountinfo() if p == path or p.startswith(path + "/")}
    return sorted(found, key=len, reverse=True)


def mounted_at(path: str, pid: int | str = "self") -> tuple[str, str] | None:
    """(file system type, super options) of the topmost mount at ``path`` (in the mount namespace
    of process ``pid``, this one's by default); None: nothing is."""
    found = [(fs, opts) for p, fs, opts in _mountinfo(pid) if p == path]
    return found[-1] if found else None


def mount_tmpfs(path: str, size: int) -> None:
    """A tmpfs of ``size`` bytes at ``path``, writable by every user (as ``/dev/shm`` is); OSError."""
    libc = ctypes.CDLL(None, use_errno=True)
    data = f"size={size},mode=1777".encode()
    if libc.mount(b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mounting a tmpfs at {path}: {os.strerror(err)}")


def remove_dirs(path: str) -> list[str]:
    """A daemon's directory gone: a tmpfs (or any mount) below it unmounted first, so removing
    never reaches into a mount. -> problems (a mount that would not go: the tree is kept)."""
    problems = []
    libc = ctypes.CDLL(None, use_errno=True)
    for point in mounts_below(path):
        if libc.umount2(point.encode(), MNT_DETACH) != 0:
            problems.append(f"unmounting {point}: {os.strerror(ctypes.get_errno())}")
        else:
            log.info("unmounted %s", point)
    if not problems:
        shutil.rmtree(path, ignore_errors=True)
    return problems
