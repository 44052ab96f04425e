"""CUDA MPS control daemons: one per shared NVIDIA GPU, so a share's limits are enforced.

A share's environment carries MPS client limits (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``,
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, prepare/shares.py); they bind only for a client that talks
to an MPS control daemon. Measured on an H200: with the daemon's pipe directory mounted at
``/tmp/nvidia-mps`` and ``CUDA_MPS_PIPE_DIRECTORY`` pointing there, a 10 GiB allocation under a
20 GiB limit succeeds and a 30 GiB one fails (docs/sharing.md, "MPS").

Each daemon runs ``nvidia-cuda-mps-control -f`` (in the foreground, so its PID is ours to know)
in a session of its own, with ``CUDA_VISIBLE_DEVICES`` = the GPU's UUID, and its pipe, log and
shm directories under ``<plugin dir>/mps/<uuid>/``. The shm directory is a sized tmpfs, mounted
before the daemon starts (unless mountinfo shows it is: a restart never stacks a second one),
and the daemon's ``/dev/shm`` (a mount namespace of its own, see ``_command``): its MPS servers
and the clients, which get it at ``/dev/shm`` too, share memory there as NVIDIA's driver has
them. Under systemd the tmpfs must also be in PID 1's mount namespace, where the container
runtime binds it (``runtime_namespace_pid``): a unit setting that gives the agent a namespace of
its own fails the claim instead of handing the shares an empty /dev/shm. Its record
(prepare/mps_records.py: PID, start time, command line, boot ID) is written before the process
starts; ``reconcile`` makes the running daemons equal to the GPUs that shares hold: it adopts a
live daemon of a record (all four match: never a reused PID), starts missing ones, restarts dead
ones, stops those no share needs and removes the directories of records from another boot (a
tmpfs below unmounted) and of daemons nobody recorded. ``restart`` is the supervisor's (prepare/mps_watch.py): the same
GPU, directories and environment again. Both run in worker threads and block, one at a time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from typing import Callable

import psutil
from pydantic import ValidationError

from agent.fsutil import make_dirs
from agent.prepare import mps_records
from agent.prepare.mps_records import MpsRecord

log = logging.getLogger(__name__)

BINARY = "nvidia-cuda-mps-control"
PIPE_IN_CONTAINER = "/tmp/nvidia-mps"
START_TIMEOUT = 10.0  # seconds for the daemon's pipe to appear
STOP_TIMEOUT = 10.0
ANSWER_TIMEOUT = 5.0  # seconds for ``get_server_list`` to be answered
SHM_SIZE = 1 << 30  # the shm tmpfs's size unless configured (nvidia_mps_shm_size): NVIDIA's default
# the daemon's own mount namespace, private (so nothing of it reaches the agent's), with the shm
# tmpfs bound on /dev/shm; then exec: the PID stays the daemon's, its command line ends as the binary's
_BIND_SHM = 'mount --bind "$0" /dev/shm && exec "$@"'
_UUID = re.compile(mps_records.GPU_UUID)


class MpsError(Exception):
    """The daemon a claim needs cannot be had; the claim's error."""


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


class MpsDaemons:
    def __init__(self, plugin_dir: str, binary: str | None | Callable[[], str | None],
                 env: dict[str, str] | Callable[[], dict[str, str]] | None = None, boot_id: str = "",
                 shm_size: int = SHM_SIZE):
        self.base = os.path.join(plugin_dir, "mps")
        self.path = os.path.join(self.base, "daemons.json")
        # as the agent runs it (under --root), or how to find it when needed; None: the node has none
        self._binary = binary
        self._env = env if env is not None else {}  # e.g. LD_LIBRARY_PATH to the driver root's libraries
        self.boot_id = boot_id  # this boot's (prepare/bootid.py): records of another are stale
        self.shm_size = shm_size  # bytes
        self.runtime_pid = runtime_namespace_pid()  # where the shm tmpfs must be seen too; None: not checked
        self.lock = threading.RLock()  # prepare's reconcile and the supervisor's restart, one at a time
        self._procs: dict[str, subprocess.Popen] = {}  # daemons this process started: reaped when they end
        self.wanted: set[str] = set()  # the GPUs shares need, as the last reconcile was told
        self.on_change: Callable[[], None] = lambda: None  # the supervisor looks again
        self.state = mps_records.load(self.path)

    @property
    def binary(self) -> str | None:
        return self._binary() if callable(self._binary) else self._binary

    @property
    def env(self) -> dict[str, str]:
        return self._env() if callable(self._env) else self._env

    def _save(self) -> None:
        mps_records.save(self.path, self.state)

    def dirs(self, uuid: str) -> dict[str, str]:
        d = os.path.join(self.base, uuid)
        return {"pipe": os.path.join(d, "pipe"), "log": os.path.join(d, "log"), "shm": os.path.join(d, "shm")}

    def watched(self) -> dict[str, MpsRecord | None]:
        """The GPUs that need a daemon and its record now (None: none started) for the supervisor."""
        with self.lock:
            return {u: self.state.daemons.get(u) for u in sorted(self.wanted)}

    def dead(self, uuid: str, rec: MpsRecord | None) -> bool:
        """Still needed, still recorded as ``rec``, and not running: prepare, which may have just
        stopped or started it, is done (the supervisor's snapshot may be older)."""
        with self.lock:
            return uuid in self.wanted and self.state.daemons.get(uuid) == rec and not self.alive(rec)

    # --- processes --------------------------------------------------------------------------
    def alive(self, rec: MpsRecord | None) -> bool:
        if rec is not None and (proc := self._procs.get(rec.uuid)) is not None and proc.pid == rec.pid:
            proc.poll()  # our child: reaped once it ended, so it is no zombie of ours
        return mps_records.is_process(rec, self.boot_id)

    def _daemon_env(self, uuid: str) -> dict[str, str]:
        dirs = self.dirs(uuid)
        return {**os.environ, **self.env, "CUDA_VISIBLE_DEVICES": uuid,
                "CUDA_MPS_PIPE_DIRECTORY": dirs["pipe"], "CUDA_MPS_LOG_DIRECTORY": dirs["log"]}

    def _end_strays(self, uuid: str) -> None:
        """Daemons of this GPU's pipe dir that no record names: an agent killed between starting
        one and recording its PID. Found by command line, then environment; ended before another
        starts (only processes this agent can see: in a pod, those of its PID namespace)."""
        pipe, known = self.dirs(uuid)["pipe"], self.state.daemons.get(uuid)
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info["cmdline"] or []
            if cmd[-1:] != ["-f"] or not any(os.path.basename(a) == BINARY for a in cmd[:-1]):
                continue
            try:
                if p.environ().get("CUDA_MPS_PIPE_DIRECTORY") != pipe or (known is not None and p.pid == known.pid):
                    continue
                log.warning("MPS control daemon for GPU %s with no record (pid %d): ended", uuid, p.pid)
                p.kill()
                p.wait(STOP_TIMEOUT / 2)
            except psutil.Error:
                continue

    def _mount_shm(self, uuid: str) -> None:
        """The shm tmpfs, unless one is there already (a daemon started again, an agent that
        restarted): mounted state is read back, never assumed. Raises ``MpsError``."""
        shm = self.dirs(uuid)["shm"]
        found = mps_records.mounted_at(shm)
        if found is not None and found[0] != "tmpfs":
            raise MpsError(f"GPU {uuid}: {shm} is a mount of {found[0]}, not the daemon's tmpfs")
        if found is None:
            try:
                mps_records.mount_tmpfs(shm, self.shm_size)
            except OSError as err:
                raise MpsError(f"GPU {uuid}: {err} (MPS needs CAP_SYS_ADMIN: docs/sharing.md)") from err
            log.info("MPS shm of GPU %s: a tmpfs of %d bytes at %s", uuid, self.shm_size, shm)
        if self.runtime_pid is not None and (mps_records.mounted_at(shm, self.runtime_pid) or ("",))[0] != "tmpfs":
            # the runtime would bind the empty directory beneath as the shares' /dev/shm
            raise MpsError(f"GPU {uuid}: the tmpfs at {shm} is not in the mount namespace of PID {self.runtime_pid}, where "
                           "the container runtime binds it: the agent runs in a mount namespace of its own (a unit "
                           "setting such as ReadWritePaths= or ProtectSystem= read after the MPS drop-in; "
                           "docs/operations.md)")

    def _command(self, uuid: str) -> list[str]:
        """The daemon behind ``unshare``: the agent has threads, so no preexec_fn can unshare."""
        unshare, sh = shutil.which("unshare"), shutil.which("sh")
        if unshare is None or sh is None:
            raise MpsError(f"GPU {uuid}: no unshare or sh on the agent's PATH (util-linux): the daemon's /dev/shm cannot be set")
        return [unshare, "--mount", "--propagation", "private", sh, "-c", _BIND_SHM,
                self.dirs(uuid)["shm"], str(self.binary), "-f"]

    def _start(self, uuid: str) -> MpsRecord:
        if self.binary is None:
            raise MpsError(f"GPU {uuid}: no {BINARY} on this node (the NVIDIA driver's tools): MPS limits cannot be enforced")
        dirs = self.dirs(uuid)
        for d in dirs.values():
            make_dirs(d, 0o755)
        control = os.path.join(dirs["pipe"], "control")
        with contextlib.suppress(FileNotFoundError):  # a killed daemon's: its readiness is this appearing
            os.unlink(control)
        intent = self.state.daemons[uuid] = MpsRecord(uuid=uuid, boot_id=self.boot_id)  # before the process
        self._save()
        self._end_strays(uuid)
        try:
            self._mount_shm(uuid)
            command = self._command(uuid)
        except MpsError:
            self._stop(intent)  # nothing runs: the intent goes, its directories too (a tmpfs unmounted)
            raise
        log_file = open(os.path.join(dirs["log"], "agent-started.log"), "ab")
        try:
            proc = subprocess.Popen(command, env=self._daemon_env(uuid), stdin=subprocess.DEVNULL,
                                    stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as err:
            raise MpsError(f"GPU {uuid}: starting {BINARY}: {err}") from err
        finally:
            log_file.close()
        self._procs[uuid] = proc
        try:
            started = psutil.Process(proc.pid).create_time()
        except psutil.Error:  # it ended at once
            started = 0.0
        rec = MpsRecord(uuid=uuid, pid=proc.pid, started=started, boot_id=self.boot_id)
        self.state.daemons[uuid] = rec
        self._save()
        deadline = time.monotonic() + START_TIMEOUT
        while not os.path.exists(control):
            if proc.poll() is not None or time.monotonic() > deadline:
                self._stop(rec)
                raise MpsError(f"GPU {uuid}: {BINARY} did not start (see {dirs['log']})")
            time.sleep(0.02)
        try:  # serving: any exec of a wrapper (env, a script's interpreter) is done, the command line final
            rec = MpsRecord.model_validate({**rec.model_dump(), "cmdline": psutil.Process(proc.pid).cmdline()})
        except (psutil.Error, ValidationError):  # gone (the supervisor sees it) or an odd command line: not checked
            pass
        self.state.daemons[uuid] = rec
        self._save()
        log.info("MPS control daemon for GPU %s started (pid %d)", uuid, proc.pid)
        return rec

    def _signal_until_gone(self, rec: MpsRecord, quitting: bool = False) -> None:
        """SIGTERM, then SIGKILL (after a moment to quit, if asked to), each only while the
        recorded process (checked each time) runs."""
        for sig in ((None,) if quitting else ()) + (signal.SIGTERM, signal.SIGKILL):
            if not self.alive(rec):
                return
            if sig is not None:
                try:
                    os.kill(rec.pid, sig)
                except ProcessLookupError:
                    return
            try:
                psutil.Process(rec.pid).wait(timeout=STOP_TIMEOUT / 2)
            except psutil.Error:
                pass

    def _stop(self, rec: MpsRecord) -> None:
        """``quit`` through its pipe (it stops its servers cleanly), then signals; its directories go."""
        quitting = False
        if self.alive(rec) and self.binary is not None:
            try:
                quitting = subprocess.run([self.binary], input=b"quit\n", env=self._daemon_env(rec.uuid),
                                          timeout=STOP_TIMEOUT, capture_output=True).returncode == 0
            except (OSError, subprocess.TimeoutExpired) as err:
                log.warning("MPS control daemon for GPU %s: quit failed: %s", rec.uuid, err)
        self._signal_until_gone(rec, quitting)
        self._procs.pop(rec.uuid, None)
        self.state.daemons.pop(rec.uuid, None)
        self._save()
        self._remove_dirs(rec.uuid)
        log.info("MPS control daemon for GPU %s stopped", rec.uuid)

    def _remove_dirs(self, uuid: str) -> None:
        for problem in mps_records.remove_dirs(os.path.join(self.base, uuid)):
            log.error("MPS directories of GPU %s: %s", uuid, problem)

    def answers(self, uuid: str) -> bool:
        """The daemon answers a client (``get_server_list``) within ``ANSWER_TIMEOUT``."""
        if self.binary is None:
            return False
        try:
            done = subprocess.run([self.binary], input=b"get_server_list\n", env=self._daemon_env(uuid),
                                  timeout=ANSWER_TIMEOUT, capture_output=True)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return done.returncode == 0

    # --- what prepare and the supervisor call ---------------------------------------------------
    def _forget_stale(self) -> None:
        """Records of another boot: nothing of theirs runs any more (their PIDs are someone
        else's now, never signalled); their directories go, a tmpfs below them unmounted."""
        for uuid, rec in list(self.state.daemons.items()):
            if rec.boot_id is not None and rec.boot_id != self.boot_id:
                log.info("MPS control daemon for GPU %s was recorded before a reboot: its directories removed", uuid)
                del self.state.daemons[uuid]
                self._save()
                self._remove_dirs(uuid)

    def _remove_unrecorded(self, wanted: set[str]) -> None:
        """Directories of a daemon no record names (a crash before its record was saved, records
        moved aside) and no share needs; a daemon still serving them is ended first."""
        try:
            names = os.listdir(self.base)
        except OSError:
            return
        for name in names:
            if _UUID.match(name) and name not in self.state.daemons and name not in wanted \
                    and os.path.isdir(os.path.join(self.base, name)):
                log.info("MPS directories of GPU %s belong to no recorded daemon: removed", name)
                self._end_strays(name)
                self._remove_dirs(name)

    def reconcile(self, wanted: set[str]) -> dict[str, str]:
        """Daemons for exactly the GPUs in ``wanted`` (UUIDs); -> {uuid: error} for those that
        could not be started (their claims' errors). Others are stopped."""
        errors = {}
        with self.lock:
            self.wanted = set(wanted)
            self._forget_stale()
            for uuid, rec in list(self.state.daemons.items()):
                if uuid not in wanted:
                    self._stop(rec)
            self._remove_unrecorded(wanted)
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
        self.on_change()
        return errors

    def restart(self, uuid: str) -> MpsRecord | None:
        """The supervisor's: the GPU's daemon started again (same directories and environment)
        -> its record; None when there is nothing to do (no share needs it any more, or it runs:
        prepare started it meanwhile). Raises ``MpsError``."""
        with self.lock:
            rec = self.state.daemons.get(uuid)
            if uuid not in self.wanted or self.alive(rec):
                return None
            return self._start(uuid)

    def container_edits(self, uuid: str) -> dict:
        """What a share's container needs to be a client of the GPU's daemon: its pipe directory,
        and its shm tmpfs as the container's ``/dev/shm`` (replacing the runtime's)."""
        dirs, options = self.dirs(uuid), ["rw", "nosuid", "nodev", "bind"]
        return {"env": [f"CUDA_MPS_PIPE_DIRECTORY={PIPE_IN_CONTAINER}"],
                "mounts": [{"hostPath": dirs["pipe"], "containerPath": PIPE_IN_CONTAINER, "options": options},
                           {"hostPath": dirs["shm"], "containerPath": "/dev/shm", "options": list(options)}]}
