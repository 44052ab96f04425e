"""MPS control daemons as the agent's own processes (prepare/mps.py's default launcher): the
systemd service's way, where ``KillMode=process`` keeps them serving through an agent restart.

Each runs ``nvidia-cuda-mps-control -f`` (in the foreground, so its PID is ours to know) in a
session of its own behind ``unshare``: a private mount namespace with the shm tmpfs bound on
``/dev/shm``, then ``exec``, so the PID stays the daemon's and its command line ends as the
binary's. A record names the process by PID, start time, command line and boot
(prepare/mps_records.py): a PID the kernel gave to another process is never taken for it.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess

import psutil
from pydantic import ValidationError

from agent.prepare import mps_records
from agent.prepare.mps_records import MpsRecord, is_process

log = logging.getLogger("agent.prepare.mps")

BINARY = "nvidia-cuda-mps-control"
START_TIMEOUT = 10.0  # seconds for the daemon's pipe to appear
STOP_TIMEOUT = 10.0
# the daemon's own mount namespace, private (so nothing of it reaches the agent's), with the shm
# tmpfs bound on /dev/shm; then exec: the PID stays the daemon's, its command line ends as the binary's
_BIND_SHM = 'mount --bind "$0" /dev/shm && exec "$@"'


class LaunchError(Exception):
    """The daemon could not be started; the message says why."""


class ProcessLauncher:
    start_timeout = START_TIMEOUT

    def __init__(self, boot_id: str):
        self.boot_id = boot_id
        self._procs: dict[str, subprocess.Popen] = {}  # daemons this process started: reaped when they end

    def describe(self, rec: MpsRecord | None) -> str:
        return f"pid {rec.pid}" if rec is not None and rec.pid else "not running"

    def alive(self, rec: MpsRecord | None) -> bool:
        if rec is not None and (proc := self._procs.get(rec.uuid)) is not None and proc.pid == rec.pid:
            proc.poll()  # our child: reaped once it ended, so it is no zombie of ours
        return is_process(rec, self.boot_id)

    def alive_all(self, recs: dict[str, MpsRecord | None]) -> dict[str, bool]:
        return {uuid: self.alive(rec) for uuid, rec in recs.items()}

    def _command(self, binary: str, shm: str) -> list[str]:
        """The daemon behind ``unshare``: the agent has threads, so no preexec_fn can unshare."""
        unshare, sh = shutil.which("unshare"), shutil.which("sh")
        if unshare is None or sh is None:
            raise LaunchError("no unshare or sh on the agent's PATH (util-linux): the daemon's /dev/shm cannot be set")
        return [unshare, "--mount", "--propagation", "private", sh, "-c", _BIND_SHM, shm, binary, "-f"]

    def launch(self, uuid: str, dirs: dict[str, str], env: dict[str, str], binary: str) -> MpsRecord:
        command = self._command(binary, dirs["shm"])
        log_file = open(os.path.join(dirs["log"], "agent-started.log"), "ab")
        try:
            proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=log_file,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as err:
            raise LaunchError(f"starting {BINARY}: {err}") from err
        finally:
            log_file.close()
        self._procs[uuid] = proc
        try:
            started = psutil.Process(proc.pid).create_time()
        except psutil.Error:  # it ended at once
            started = 0.0
        return MpsRecord(uuid=uuid, pid=proc.pid, started=started, ticks=mps_records.start_ticks(proc.pid) or 0,
                         boot_id=self.boot_id)

    def start_failed(self, rec: MpsRecord) -> str | None:
        """Why the daemon being started will not serve (it ended), or None while it may."""
        proc = self._procs.get(rec.uuid)
        return f"it exited with {proc.returncode}" if proc is not None and proc.poll() is not None else None

    def settle(self, rec: MpsRecord) -> MpsRecord:
        """The record of a serving daemon: any exec of a wrapper (env, a script's interpreter) is
        done, so its command line is final and recorded."""
        try:
            return MpsRecord.model_validate({**rec.model_dump(), "cmdline": psutil.Process(rec.pid).cmdline()})
        except (psutil.Error, ValidationError):  # gone (the supervisor sees it) or an odd command line: not checked
            return rec

    def end(self, rec: MpsRecord, quitting: bool) -> None:
        """SIGTERM, then SIGKILL (after a moment to quit, if asked to), each only while the
        recorded process (checked each time) runs."""
        for sig in ((None,) if quitting else ()) + (signal.SIGTERM, signal.SIGKILL):
            if not self.alive(rec):
                break
            if sig is not None:
                try:
                    os.kill(rec.pid, sig)
                except ProcessLookupError:
                    break
            try:
                psutil.Process(rec.pid).wait(timeout=STOP_TIMEOUT / 2)
            except psutil.Error:
                pass
        self._procs.pop(rec.uuid, None)

    def end_strays(self, uuid: str, pipe: str, known: MpsRecord | None) -> None:
        """Daemons of this GPU's pipe dir that no record names: an agent killed between starting
        one and recording its PID. Ended before another starts."""
        for p in _serving(pipe):
            if known is not None and p.pid == known.pid:
                continue
            log.warning("MPS control daemon for GPU %s with no record (pid %d): ended", uuid, p.pid)
            try:
                p.kill()
                p.wait(STOP_TIMEOUT / 2)
            except psutil.Error:
                continue

    def serving(self, uuid: str, pipe: str) -> MpsRecord | None:
        """The daemon serving this GPU's pipe dir as a record of this launcher's, if one does: a pod's
        (``nvidia_mps_pod`` turned off at a restart while its shares ran), a process of the node."""
        for p in _serving(pipe):
            try:
                rec = MpsRecord(uuid=uuid, pid=p.pid, started=p.create_time(), ticks=mps_records.start_ticks(p.pid) or 0,
                                boot_id=self.boot_id, cmdline=p.cmdline())
            except (psutil.Error, ValidationError):
                continue
            if is_process(rec, self.boot_id):
                return rec
        return None

    def pod_unseen(self, rec: MpsRecord) -> bool:
        return True  # no pod settings: no pod is looked at

    def forget(self, rec: MpsRecord) -> None:
        """A record of another boot: its PID is someone else's now, never signalled."""

    def end_orphans(self, keep: set[str]) -> None:
        """Daemons of GPUs not in ``keep`` that no record names: found by their directories."""


def _serving(pipe: str):
    """The control daemons of ``pipe``, found by command line, then environment (only processes the
    agent can see: in a pod, those of its PID namespace; the chart's has the host's)."""
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if cmd[-1:] != ["-f"] or not any(os.path.basename(a) == BINARY for a in cmd[:-1]):
            continue
        try:
            if p.environ().get("CUDA_MPS_PIPE_DIRECTORY") == pipe:
                yield p
        except psutil.Error:
            continue
