"""CUDA MPS control daemons: one per shared NVIDIA GPU, so a share's limits are enforced.

A share's environment carries MPS client limits (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``,
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, prepare/shares.py); they bind only for a client that talks
to an MPS control daemon. Measured on an H200: with the daemon's pipe directory mounted at
``/tmp/nvidia-mps`` and ``CUDA_MPS_PIPE_DIRECTORY`` pointing there, a 10 GiB allocation under a
20 GiB limit succeeds and a 30 GiB one fails (docs/sharing.md, "MPS").

Each daemon runs ``nvidia-cuda-mps-control -f`` with ``CUDA_VISIBLE_DEVICES`` = the GPU's UUID
and its pipe, log and shm directories under ``<plugin dir>/mps/<uuid>/``, started by a launcher:
as a process of the agent's (prepare/mps_process.py; the systemd service) or as a pod of its own
(prepare/mps_pods.py; the DaemonSet, whose pod may end while the daemons serve). The shm
directory is a sized tmpfs, mounted before the daemon starts (unless mountinfo shows it is: a
restart never stacks a second one), and the daemon's ``/dev/shm``: its MPS servers and the
clients, which get it at ``/dev/shm`` too, share memory there as NVIDIA's driver has them. Under
systemd the tmpfs must also be in PID 1's mount namespace, where the container runtime binds it
(``mps_records.runtime_namespace_pid``): a unit setting that gives the agent a namespace of its
own fails the claim instead of handing the shares an empty /dev/shm. Its record (prepare/mps_records.py) is
written before the daemon starts; ``reconcile`` makes the running daemons equal to the GPUs that
shares hold: it adopts a live daemon of a record (never a reused PID, never another pod of the
same name), starts missing ones, restarts dead ones, stops those no share needs and removes the
directories of records from another boot (a tmpfs below unmounted) and of daemons nobody
recorded. ``restart`` is the supervisor's (prepare/mps_watch.py): the same GPU, directories and
environment again. Both run in worker threads and block, one at a time. With
``nvidia_mps_exclusive`` the GPU's compute mode is EXCLUSIVE_PROCESS while its daemon runs
(prepare/computemode.py; the mode before is in the record before it changes).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import subprocess
import threading
import time
from typing import Callable, Protocol

from agent.fsutil import make_dirs
from agent.prepare import mps_records
from agent.prepare.computemode import ComputeModeError, DaemonModes
from agent.prepare.mps_pods import pod_name
from agent.prepare.mps_process import BINARY, STOP_TIMEOUT, LaunchError, ProcessLauncher
from agent.prepare.mps_records import MpsRecord

log = logging.getLogger(__name__)

PIPE_IN_CONTAINER = "/tmp/nvidia-mps"
ANSWER_TIMEOUT = 5.0  # seconds for ``get_server_list`` to be answered
SHM_SIZE = 1 << 30  # the shm tmpfs's size unless configured (nvidia_mps_shm_size): NVIDIA's default
_UUID = re.compile(mps_records.GPU_UUID)


class MpsError(Exception):
    """The daemon a claim needs cannot be had; the claim's error."""


class Launcher(Protocol):
    """How a daemon is run (prepare/mps_process.py, prepare/mps_pods.py). Blocking; raises ``LaunchError``."""

    start_timeout: float  # seconds for a started daemon's pipe to appear

    def describe(self, rec: MpsRecord | None) -> str: ...
    def alive(self, rec: MpsRecord | None) -> bool: ...
    def alive_all(self, recs: dict[str, MpsRecord | None]) -> dict[str, bool]: ...  # the supervisor's round
    def launch(self, uuid: str, dirs: dict[str, str], env: dict[str, str], binary: str) -> MpsRecord: ...
    def start_failed(self, rec: MpsRecord) -> str | None: ...
    def settle(self, rec: MpsRecord) -> MpsRecord: ...
    def end(self, rec: MpsRecord, quitting: bool) -> None: ...
    def end_strays(self, uuid: str, pipe: str, known: MpsRecord | None) -> None: ...
    def forget(self, rec: MpsRecord) -> None: ...
    def end_orphans(self, keep: set[str]) -> None: ...
    def pod_unseen(self, rec: MpsRecord) -> bool: ...  # a pod record's pod is not where this agent looks


class MpsDaemons:
    def __init__(self, plugin_dir: str, binary: str | None | Callable[[], str | None],
                 env: dict[str, str] | Callable[[], dict[str, str]] | None = None, boot_id: str = "",
                 shm_size: int = SHM_SIZE, launcher: Launcher | None = None, modes: DaemonModes | None = None):
        self.base = os.path.join(plugin_dir, "mps")
        self.path = os.path.join(self.base, "daemons.json")
        # as the agent runs it (under --root), or how to find it when needed; None: the node has none
        self._binary = binary
        self._env = env if env is not None else {}  # e.g. LD_LIBRARY_PATH to the driver root's libraries
        self.boot_id = boot_id  # this boot's (agent/bootid.py): records of another are stale
        self.shm_size = shm_size  # bytes
        self.runtime_pid = mps_records.runtime_namespace_pid()  # where the shm tmpfs must be seen too; None: not checked
        self.lock = threading.RLock()  # prepare's reconcile and the supervisor's restart, one at a time
        self._flock: int | None = None  # the records' lock file, held while ``lock`` is (``_exclusive``)
        self._depth = 0
        self.launcher = launcher or ProcessLauncher(boot_id)
        # a process's record under pods (nvidia_mps_pod turned on at a restart while its shares ran): ``_by``
        self.processes = self.launcher if isinstance(self.launcher, ProcessLauncher) else ProcessLauncher(boot_id)
        self.modes = modes or DaemonModes(None, exclusive=False)  # the GPUs' compute modes while daemons run
        self.fault: Callable[[str], None] = lambda point: None  # tests: a crash between steps
        self.wanted: set[str] = set()  # the GPUs shares need, as the last reconcile was told
        self.on_change: Callable[[], None] = lambda: None  # the supervisor looks again
        self.state = mps_records.load(self.path)
        self._saved = self._file_version()

    @property
    def binary(self) -> str | None:
        return self._binary() if callable(self._binary) else self._binary

    @property
    def env(self) -> dict[str, str]:
        return self._env() if callable(self._env) else self._env

    def _save(self) -> None:
        mps_records.save(self.path, self.state)
        self._saved = self._file_version()

    @contextlib.contextmanager
    def _exclusive(self):
        """This agent's threads one at a time (``lock``), and the agents sharing the records too: the two pods of a
        surge update on one node (``flock`` of ``daemons.lock`` beside them). What one starts, stops or records, the
        other reads under the same lock (``_changed_by_another``)."""
        with self.lock:
            if self._depth == 0:
                make_dirs(self.base, 0o755)
                if self._flock is None:
                    self._flock = os.open(os.path.join(self.base, "daemons.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                fcntl.flock(self._flock, fcntl.LOCK_EX)
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    fcntl.flock(self._flock, fcntl.LOCK_UN)

    def _file_version(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns

    def _changed_by_another(self) -> bool:
        """Another agent saved the records since this one did (two pods of a surge update): its daemons are its own to
        restart or stop, this one's view of them is out of date. The records are read again, and a GPU whose record
        the other removed is no longer this one's to supervise (the next reconcile says what its claims need)."""
        if self._file_version() == self._saved:
            return False
        before = set(self.state.daemons)
        self.state = mps_records.load(self.path)
        self._saved = self._file_version()
        self.wanted -= before - set(self.state.daemons)
        return True

    def dirs(self, uuid: str) -> dict[str, str]:
        d = os.path.join(self.base, uuid)
        return {"pipe": os.path.join(d, "pipe"), "log": os.path.join(d, "log"), "shm": os.path.join(d, "shm")}

    def watched(self) -> dict[str, MpsRecord | None]:
        """The GPUs that need a daemon and its record now (None: none started) for the supervisor."""
        with self.lock:
            return {u: self.state.daemons.get(u) for u in sorted(self.wanted)}

    def dead(self, uuid: str, rec: MpsRecord | None) -> bool:
        """Still needed, still recorded as ``rec``, and not running: prepare, which may have just stopped or started it,
        is done (the supervisor's snapshot may be older)."""
        with self._exclusive():
            if self._changed_by_another():
                return False  # the supervisor looks again, at the records as they are now
            return uuid in self.wanted and self.state.daemons.get(uuid) == rec and not self.alive(rec)

    # --- the daemons ------------------------------------------------------------------------
    def _by(self, rec: MpsRecord | None) -> Launcher:
        """The launcher of ``rec``'s kind: a daemon the agent's process started before pods were turned
        on keeps serving its shares' running containers (their pipe is its), and is supervised and
        ended as the process it is; the next start is a pod."""
        return self.processes if rec is not None and rec.pid is not None else self.launcher

    def alive(self, rec: MpsRecord | None) -> bool:
        return self._by(rec).alive(rec)

    def alive_all(self, recs: dict[str, MpsRecord | None]) -> dict[str, bool]:
        """Every supervised daemon looked at at once (the supervisor's round): for pods, one
        listing of the node's, where ``alive`` asks for each; a daemon it finds gone is looked at
        again by ``dead``."""
        processes = {u: r for u, r in recs.items() if self._by(r) is not self.launcher}
        return {**self.launcher.alive_all({u: r for u, r in recs.items() if u not in processes}),
                **self.processes.alive_all(processes)}

    def describe(self, rec: MpsRecord | None) -> str:
        """The daemon as logs name it: its PID, or its pod."""
        return self._by(rec).describe(rec)

    def _daemon_env(self, uuid: str) -> dict[str, str]:
        dirs = self.dirs(uuid)
        return {**os.environ, **self.env, "CUDA_VISIBLE_DEVICES": uuid,
                "CUDA_MPS_PIPE_DIRECTORY": dirs["pipe"], "CUDA_MPS_LOG_DIRECTORY": dirs["log"]}

    def _end_strays(self, uuid: str) -> None:  # (a record-less daemon serving wanted shares is adopted first: _adopted)
        self.launcher.end_strays(uuid, self.dirs(uuid)["pipe"], self.state.daemons.get(uuid))

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

    def _start(self, uuid: str) -> MpsRecord:
        if self.binary is None:
            raise MpsError(f"GPU {uuid}: no {BINARY} on this node (the NVIDIA driver's tools): MPS limits cannot be enforced")
        dirs = self.dirs(uuid)
        for d in dirs.values():
            make_dirs(d, 0o755)
        control = os.path.join(dirs["pipe"], "control")
        with contextlib.suppress(FileNotFoundError):  # a killed daemon's: its readiness is this appearing
            os.unlink(control)
        known = self.state.daemons.get(uuid)  # a start that did not finish, a dead daemon: the mode before stays
        self.state.daemons[uuid] = MpsRecord(uuid=uuid, boot_id=self.boot_id, mode_before=known.mode_before if known else None)
        self._save()  # before the daemon
        try:
            self._end_strays(uuid)
            self._mount_shm(uuid)
            mode_before = self._exclusive_mode(uuid)
            rec = self.launcher.launch(uuid, dirs, self._daemon_env(uuid), str(self.binary))
            self.fault("launched")  # the daemon runs; its record is still the intent only
        except (MpsError, LaunchError) as err:
            self._stop(self.state.daemons[uuid], keep_dirs=True)  # nothing runs: the intent goes (the dirs: see _stop)
            raise MpsError(str(err) if isinstance(err, MpsError) else f"GPU {uuid}: {err}") from err
        rec = self.state.daemons[uuid] = rec.model_copy(update={"mode_before": mode_before})
        self._save()
        deadline = time.monotonic() + self.launcher.start_timeout
        while not os.path.exists(control):
            why = self.launcher.start_failed(rec)
            if why is not None or time.monotonic() > deadline:
                self._stop(rec, keep_dirs=True)
                raise MpsError(f"GPU {uuid}: {BINARY} did not start: {why or 'no pipe within the start timeout'} "
                               f"(see {dirs['log']})")
            time.sleep(0.02)
        rec = self.state.daemons[uuid] = self.launcher.settle(rec)
        self._save()
        log.info("MPS control daemon for GPU %s started (%s)", uuid, self.describe(rec))
        return rec

    def _stop(self, rec: MpsRecord, keep_dirs: bool = False) -> None:
        """``quit`` through its pipe (it stops its servers cleanly), then signals; its directories go, unless kept: a
        start that failed keeps them for the shares' running containers, bound to the pipe dir and tmpfs, which the
        next start uses again (a reconcile removes them once no share needs them: ``_remove_unrecorded``)."""
        quitting = False
        if self.alive(rec) and self.binary is not None:
            try:
                quitting = subprocess.run([self.binary], input=b"quit\n", env=self._daemon_env(rec.uuid),
                                          timeout=STOP_TIMEOUT, capture_output=True).returncode == 0
            except (OSError, subprocess.TimeoutExpired) as err:
                log.warning("MPS control daemon for GPU %s: quit failed: %s", rec.uuid, err)
        self._by(rec).end(rec, quitting)
        if rec.pid is None and rec.pod_uid is None:  # the intent only: a daemon started but never recorded ends too
            try:
                self._end_strays(rec.uuid)
            except LaunchError as err:
                log.warning("MPS control daemon for GPU %s: an unrecorded daemon not looked for: %s", rec.uuid, err)
        self.fault("ended")
        self.modes.set_back(rec.uuid, rec.mode_before)
        self.fault("mode-back")
        self.state.daemons.pop(rec.uuid, None)
        self._save()
        if not keep_dirs:
            self._remove_dirs(rec.uuid)
        log.info("MPS control daemon for GPU %s stopped%s", rec.uuid, " (its directories kept)" if keep_dirs else "")

    def _exclusive_mode(self, uuid: str) -> int | None:
        """EXCLUSIVE_PROCESS for the GPU (prepare/computemode.py), the mode before saved in its
        record first -> that mode (None: unchanged). Raises ``MpsError``."""
        rec = self.state.daemons[uuid]
        try:
            if (before := self.modes.before(uuid, rec.mode_before)) != rec.mode_before:
                self.state.daemons[uuid] = rec.model_copy(update={"mode_before": before})
                self._save()
                self.fault("mode-recorded")
            self.modes.make_exclusive(uuid, before)
            self.fault("exclusive")
        except ComputeModeError as err:
            raise MpsError(f"{err} (nvidia_mps_exclusive; docs/sharing.md)") from err
        return before

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
                self._by(rec).forget(rec)
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
                try:
                    self._end_strays(name)
                except LaunchError as err:  # a daemon may still serve them: kept until the next look
                    log.warning("MPS directories of GPU %s belong to no recorded daemon, kept: %s", name, err)
                    continue
                log.info("MPS directories of GPU %s belong to no recorded daemon: removed", name)
                self._remove_dirs(name)

    def reconcile(self, wanted: set[str]) -> dict[str, str]:
        """Daemons for exactly the GPUs in ``wanted`` (UUIDs); -> {uuid: error} for those that
        could not be started (their claims' errors). Others are stopped."""
        errors = {}
        with self._exclusive():
            self._changed_by_another()
            self.wanted = set(wanted)
            self._forget_stale()
            for uuid, rec in list(self.state.daemons.items()):
                if uuid not in wanted:
                    self._stop(rec)
            self._remove_unrecorded(wanted)
            self.launcher.end_orphans(set(self.state.daemons) | wanted)
            for uuid in sorted(wanted):
                rec = self.state.daemons.get(uuid)
                if self.alive(rec) or self._adopted(uuid, rec):
                    continue
                if rec is not None and (rec.pid is not None or rec.pod_uid is not None):
                    log.warning("MPS control daemon for GPU %s (%s) is gone: starting it again", uuid, self.describe(rec))
                try:
                    self._start(uuid)
                except MpsError as err:
                    errors[uuid] = str(err)
        self.on_change()
        return errors

    def _adopted(self, uuid: str, rec: MpsRecord | None) -> bool:
        """A daemon serving the GPU's pipe dir with no record (the plugin dir wiped under running shares: a stray ended
        under them) or a pod's the agent does not see (pods off, another namespace) keeps serving: taken as a process."""
        found = self.processes.serving(uuid, self.dirs(uuid)["pipe"]) if rec is None or rec.pod_uid is not None else None
        if found is None or (rec is not None and not self.launcher.pod_unseen(rec)):  # asked only where a process serves
            return False
        self.state.daemons[uuid] = found.model_copy(update={"mode_before": rec.mode_before if rec else None})
        self._save()
        why = (f"its pod {pod_name(uuid)} (nvidia_mps_pod off now, or its namespace changed) serves as pid {found.pid}: adopted "
               "as a process; the pod stays until deleted by hand" if rec else f"pid {found.pid} serves with no record (the "
               "plugin dir wiped while its shares ran?): adopted as a process, stopped with its last share; containers "
               f"that start before then cannot reach it where its pipe dir {self.dirs(uuid)['pipe']} went{self.modes.lost_before(uuid)}")
        log.warning("MPS control daemon for GPU %s: %s", uuid, why)
        return True

    def restart(self, uuid: str) -> MpsRecord | None:
        """The supervisor's: the GPU's daemon started again (same directories and environment)
        -> its record; None when there is nothing to do (no share needs it any more, or it runs:
        prepare started it meanwhile, or another agent's pod serves it: adopted). Raises ``MpsError``."""
        with self._exclusive():
            self._changed_by_another()
            rec = self.state.daemons.get(uuid)
            if uuid not in self.wanted or self.alive(rec) or self._adopted(uuid, rec):
                return None
            return self._start(uuid)

    def container_edits(self, uuid: str) -> dict:
        """What a share's container needs to be a client of the GPU's daemon: its pipe directory,
        and its shm tmpfs as the container's ``/dev/shm`` (replacing the runtime's)."""
        dirs, options = self.dirs(uuid), ["rw", "nosuid", "nodev", "bind"]
        return {"env": [f"CUDA_MPS_PIPE_DIRECTORY={PIPE_IN_CONTAINER}"],
                "mounts": [{"hostPath": dirs["pipe"], "containerPath": PIPE_IN_CONTAINER, "options": options},
                           {"hostPath": dirs["shm"], "containerPath": "/dev/shm", "options": list(options)}]}
