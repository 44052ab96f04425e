"""CUDA MPS control daemons: one per shared NVIDIA GPU, so a share's limits are enforced.

A share's environment carries MPS client limits (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``,
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, prepare/shares.py); they bind only for a client that talks
to an MPS control daemon. Measured on an H200: with the daemon's pipe directory mounted at
``/tmp/nvidia-mps`` and ``CUDA_MPS_PIPE_DIRECTORY`` pointing there, a 10 GiB allocation under a
20 GiB limit succeeds and a 30 GiB one fails (docs/sharing.md, "MPS").

Each daemon runs ``nvidia-cuda-mps-control -f`` (in the foreground, so its PID is ours to know)
in a session of its own, with ``CUDA_VISIBLE_DEVICES`` = the GPU's UUID, and its pipe and log
directories under ``<plugin dir>/mps/<uuid>/``. Its record (a typed, validated model) is written
before the process starts; ``reconcile`` makes the running daemons equal to the GPUs that shares
hold: it adopts a live daemon of a record (same PID and start time: not a reused PID), starts
missing ones, restarts dead ones, and stops those no share needs (after a reboot every record is
stale and only the needed ones start again). Runs in the prepare worker thread: it blocks.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
from typing import Callable

import psutil
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agent.fsutil import atomic_write_json, make_dirs

log = logging.getLogger(__name__)

BINARY = "nvidia-cuda-mps-control"
PIPE_IN_CONTAINER = "/tmp/nvidia-mps"
START_TIMEOUT = 10.0  # seconds for the daemon's pipe to appear
STOP_TIMEOUT = 10.0
_UUID = r"^(GPU|MIG)-[0-9A-Za-z-]{1,64}$"


class MpsError(Exception):
    """The daemon a claim needs cannot be had; the claim's error."""


class MpsRecord(BaseModel):
    """One daemon, as recorded before it starts (read back from disk: input, checked)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    uuid: str = Field(pattern=_UUID)
    pid: int | None = Field(default=None, ge=1)  # None: recorded, not (yet) started
    started: float | None = None  # the process's start time, to tell a reused PID apart


class MpsState(BaseModel):
    model_config = ConfigDict(extra="forbid")
    daemons: dict[str, MpsRecord] = {}


class MpsDaemons:
    def __init__(self, plugin_dir: str, binary: str | None | Callable[[], str | None],
                 env: dict[str, str] | Callable[[], dict[str, str]] | None = None):
        self.base = os.path.join(plugin_dir, "mps")
        self.path = os.path.join(self.base, "daemons.json")
        # as the agent runs it (under --root), or how to find it when needed; None: the node has none
        self._binary = binary
        self._env = env or {}  # e.g. LD_LIBRARY_PATH to the driver root's libraries
        self.state = self._load()

    @property
    def binary(self) -> str | None:
        return self._binary() if callable(self._binary) else self._binary

    @property
    def env(self) -> dict[str, str]:
        return self._env() if callable(self._env) else self._env

    # --- records ---------------------------------------------------------------------------
    def _load(self) -> MpsState:
        try:
            with open(self.path, "rb") as f:
                return MpsState.model_validate_json(f.read())
        except FileNotFoundError:
            return MpsState()
        except (OSError, ValueError, ValidationError) as err:
            aside = f"{self.path}.invalid.{int(time.time())}"
            log.error("MPS daemon records %s are invalid (%s): moved to %s; daemons found again", self.path, err, aside)
            try:
                os.replace(self.path, aside)
            except OSError:
                pass
            return MpsState()

    def _save(self) -> None:
        make_dirs(self.base, 0o700)
        atomic_write_json(self.path, self.state.model_dump(mode="json"), mode=0o600)

    def dirs(self, uuid: str) -> dict[str, str]:
        d = os.path.join(self.base, uuid)
        return {"pipe": os.path.join(d, "pipe"), "log": os.path.join(d, "log")}

    # --- processes --------------------------------------------------------------------------
    def alive(self, rec: MpsRecord | None) -> bool:
        if rec is None or rec.pid is None:
            return False
        try:
            p = psutil.Process(rec.pid)
            return p.status() != psutil.STATUS_ZOMBIE and abs(p.create_time() - (rec.started or 0)) < 0.5
        except psutil.Error:
            return False

    def _daemon_env(self, uuid: str) -> dict[str, str]:
        dirs = self.dirs(uuid)
        return {**os.environ, **self.env, "CUDA_VISIBLE_DEVICES": uuid,
                "CUDA_MPS_PIPE_DIRECTORY": dirs["pipe"], "CUDA_MPS_LOG_DIRECTORY": dirs["log"]}

    def _start(self, uuid: str) -> MpsRecord:
        if self.binary is None:
            raise MpsError(f"GPU {uuid}: no {BINARY} on this node (the NVIDIA driver's tools): MPS limits cannot be enforced")
        dirs = self.dirs(uuid)
        for d in dirs.values():
            make_dirs(d, 0o755)
        self.state.daemons[uuid] = MpsRecord(uuid=uuid)  # the intent, before the process exists
        self._save()
        log_file = open(os.path.join(dirs["log"], "agent-started.log"), "ab")
        try:
            proc = subprocess.Popen([self.binary, "-f"], env=self._daemon_env(uuid), stdin=subprocess.DEVNULL,
                                    stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as err:
            raise MpsError(f"GPU {uuid}: starting {BINARY}: {err}") from err
        finally:
            log_file.close()
        rec = MpsRecord(uuid=uuid, pid=proc.pid, started=psutil.Process(proc.pid).create_time())
        self.state.daemons[uuid] = rec
        self._save()
        deadline = time.monotonic() + START_TIMEOUT
        while not os.path.exists(os.path.join(dirs["pipe"], "control")):
            if proc.poll() is not None or time.monotonic() > deadline:
                self._stop(rec)
                raise MpsError(f"GPU {uuid}: {BINARY} did not start (see {dirs['log']})")
            time.sleep(0.02)
        log.info("MPS control daemon for GPU %s started (pid %d)", uuid, proc.pid)
        return rec

    def _stop(self, rec: MpsRecord) -> None:
        """``quit`` through its pipe (it stops its servers cleanly), then signals."""
        if self.alive(rec) and self.binary is not None:
            try:
                subprocess.run([self.binary], input=b"quit\n", env=self._daemon_env(rec.uuid), timeout=STOP_TIMEOUT,
                               capture_output=True)
            except (OSError, subprocess.TimeoutExpired) as err:
                log.warning("MPS control daemon for GPU %s: quit failed: %s", rec.uuid, err)
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            if not self.alive(rec):
                break
            if sig is not None:
                os.kill(rec.pid, sig)
            try:
                psutil.Process(rec.pid).wait(timeout=STOP_TIMEOUT / 2)
            except psutil.Error:
                pass
        self.state.daemons.pop(rec.uuid, None)
        self._save()
        shutil.rmtree(os.path.join(self.base, rec.uuid), ignore_errors=True)
        log.info("MPS control daemon for GPU %s stopped", rec.uuid)

    # --- what prepare calls -------------------------------------------------------------------
    def reconcile(self, wanted: set[str]) -> dict[str, str]:
        """Daemons for exactly the GPUs in ``wanted`` (UUIDs); -> {uuid: error} for those that
        could not be started (their claims' errors). Others are stopped."""
        errors = {}
        for uuid, rec in list(self.state.daemons.items()):
            if uuid not in wanted:
                self._stop(rec)
        for uuid in sorted(wanted):
            rec = self.state.daemons.get(uuid)
            if self.alive(rec):
                continue
            if rec is not None and rec.pid is not None:
                log.warning("MPS control daemon for GPU %s (pid %d) is gone: starting it again", uuid, rec.pid)
            try:
                self._start(uuid)
            except MpsError as err:
                errors[uuid] = str(err)
        return errors

    def container_edits(self, uuid: str) -> dict:
        """What a share's container needs to be a client of the GPU's daemon."""
        return {"env": [f"CUDA_MPS_PIPE_DIRECTORY={PIPE_IN_CONTAINER}"],
                "mounts": [{"hostPath": self.dirs(uuid)["pipe"], "containerPath": PIPE_IN_CONTAINER,
                            "options": ["rw", "nosuid", "nodev", "bind"]}]}
