"""The MPS control daemons supervised: a daemon that dies is noticed, its GPU reported unhealthy
(its shares run unenforced, or not at all, until it is back), started again with the same
directories and environment, and the GPU reported healthy once the new daemon answers a client.

One thread of its own (never the event loop: waiting, starting and asking a daemon block). It
holds a pidfd per running daemon, opened and then checked against the record (PID, start time,
command line, boot: prepare/mps_records.py), so the pidfd is that daemon's and not a reused PID's,
and waits in ``poll`` on them and on a wake-up pipe: a death is seen at once, without polling
``/proc``. Where pidfds are missing (Linux < 5.3), and for daemons in pods of their own, every ``interval``
re-checks each record (the pods in one cached listing of the node's: one request a round, whatever
the number of GPUs; a daemon it misses is confirmed gone by a read of its pod before it counts as dead).

Restarts are bounded: at most ``max_restarts`` within ``window`` seconds, the n-th after
``backoff * 2**(n-1)`` seconds (the first at once), capped at ``backoff_max``; past the bound
the GPU stays unhealthy (an error logged) until prepare or the next start reconciles it.
Every restart is a log line and counts in ``sysdra_mps_daemon_restarts_total{result}``. After a
round whose outcome changed, ``on_round`` gets each supervised daemon's row for ``sysdra status``.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from collections import deque
from typing import Callable

from agent.counts import Count
from agent.prepare.computemode import NAMES
from agent.prepare.mps import MpsDaemons, MpsError
from agent.prepare.mps_records import MpsRecord

log = logging.getLogger("agent.prepare.mps")

RESTARTS = Count("sysdra_mps_daemon_restarts_total", "MPS control daemons started again after they died, by result",
                 ("result",), known=("started", "failed"))
Fault = tuple[str, str] | None  # (code, message) for device health; None: healthy again


class MpsSupervisor:
    def __init__(self, daemons: MpsDaemons, on_health: Callable[[str, Fault], None], interval: float = 5.0,
                 max_restarts: int = 5, window: float = 600.0, backoff: float = 1.0, backoff_max: float = 30.0,
                 on_round: Callable[[list[dict]], None] = lambda rows: None):
        self.daemons = daemons
        self.on_health = on_health  # (GPU UUID, fault or None), from this thread
        self.on_round = on_round  # the daemons' rows, from this thread, when they changed
        self._rows: list[dict] | None = None
        self.interval, self.max_restarts, self.window = interval, max_restarts, window
        self.backoff, self.backoff_max = backoff, backoff_max
        self.faulted: set[str] = set()
        self.rounds = 0  # rounds done (tests wait for them)
        self._recent: dict[str, deque[float]] = {}  # monotonic times of each GPU's restarts
        self._due: dict[str, float] = {}  # GPUs whose daemon is dead -> when to start it again
        self._pidfds: dict[str, tuple[MpsRecord, int]] = {}
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.daemons.on_change = self.wake
        self._thread = threading.Thread(target=self._run, name="mps-supervisor", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Look now (prepare changed the daemons)."""
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:  # already woken
            pass

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.wake()
        if self._thread is not None:
            self._thread.join(timeout)
        for _, fd in self._pidfds.values():
            os.close(fd)
        self._pidfds.clear()

    # --- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.check()
            except Exception:  # noqa: BLE001 - a bug here must not end supervision
                log.exception("MPS supervision round failed")
            self.rounds += 1
            self._wait()

    def _wait(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        for _, fd in self._pidfds.values():
            poller.register(fd, select.POLLIN)
        timeout = self.interval
        if self._due:
            timeout = min(timeout, max(0.0, min(self._due.values()) - time.monotonic()))
        poller.poll(timeout * 1000)
        try:
            while os.read(self._wake_r, 64):
                pass
        except BlockingIOError:
            pass

    def check(self) -> None:
        """One round: every needed GPU's daemon looked at, dead ones started when due (the
        thread's own: never called beside it)."""
        watched = self.daemons.watched()
        self._track(watched)
        now = time.monotonic()
        up = self.daemons.alive_all(watched)
        for uuid, rec in watched.items():
            if up[uuid]:
                self._due.pop(uuid, None)
                if uuid in self.faulted and self.daemons.answers(uuid):
                    self._healthy(uuid, "answers again")
            elif uuid not in self._due:
                if self.daemons.dead(uuid, rec):  # not just stopped or replaced by prepare
                    self._died(uuid, rec, now)
            elif now >= self._due[uuid]:
                self._restart(uuid)
        for uuid in list(self._due):
            if uuid not in watched:
                del self._due[uuid]
        for uuid in list(self.faulted):
            if uuid not in watched:  # no share needs it any more: nothing is missing
                self._healthy(uuid, "no longer needed")
        self._report(self.daemons.watched())

    def _report(self, watched: dict[str, MpsRecord | None]) -> None:
        now = time.monotonic()
        rows = [{"gpu": uuid, "daemon": self.daemons.describe(rec), "state": self._state(uuid),
                 "restarts": sum(now - t <= self.window for t in self._recent.get(uuid, ())),
                 **({"modeBefore": NAMES[rec.mode_before]} if rec is not None and rec.mode_before is not None else {})}
                for uuid, rec in watched.items()]
        if rows != self._rows:
            self._rows = rows
            self.on_round(rows)

    def _state(self, uuid: str) -> str:
        if self._due.get(uuid) == float("inf"):
            return "gave up"
        if uuid in self._due:
            return "restarting"
        return "down" if uuid in self.faulted else "serving"

    def _track(self, watched: dict[str, MpsRecord | None]) -> None:
        """A pidfd per running daemon, checked to be the recorded process after it was opened."""
        for uuid, (rec, fd) in list(self._pidfds.items()):
            if watched.get(uuid) != rec or uuid in self._due:  # an ended process's pidfd stays readable
                os.close(fd)
                del self._pidfds[uuid]
        for uuid, rec in watched.items():
            if rec is None or rec.pid is None or uuid in self._pidfds or uuid in self._due:
                continue
            try:
                fd = os.pidfd_open(rec.pid)
            except (OSError, AttributeError):  # gone, or no pidfds here: the interval's re-check
                continue
            if self.daemons.alive(rec):
                self._pidfds[uuid] = (rec, fd)
            else:
                os.close(fd)

    def _died(self, uuid: str, rec: MpsRecord | None, now: float) -> None:
        recent = self._recent.setdefault(uuid, deque())
        while recent and now - recent[0] > self.window:
            recent.popleft()
        what = self.daemons.describe(rec)
        if len(recent) >= self.max_restarts:
            self._due[uuid] = float("inf")
            log.error("MPS control daemon for GPU %s (%s) died again after %d restarts in %.0f s: not started "
                      "again until the next prepare or agent start", uuid, what, len(recent), self.window)
            self._fault(uuid, f"MPS control daemon ({what}) gave up after {len(recent)} restarts")
            return
        delay = 0.0 if not recent else min(self.backoff * 2 ** (len(recent) - 1), self.backoff_max)
        self._due[uuid] = now + delay
        log.warning("MPS control daemon for GPU %s (%s) died: starting it again in %.1f s", uuid, what, delay)
        self._fault(uuid, f"MPS control daemon ({what}) died: being restarted; the shares' limits are not enforced")
        if delay == 0.0:
            self._restart(uuid)

    def _restart(self, uuid: str) -> None:
        recent = self._recent.setdefault(uuid, deque())
        recent.append(time.monotonic())
        try:
            rec = self.daemons.restart(uuid)
        except MpsError as err:
            RESTARTS.labels("failed").inc()
            log.error("MPS control daemon for GPU %s: restart %d failed: %s", uuid, len(recent), err)
            self._due.pop(uuid, None)  # the next round counts it as died again: backoff or the bound
            return
        self._due.pop(uuid, None)
        if rec is None:  # prepare stopped or started it meanwhile
            recent.pop()
            return
        RESTARTS.labels("started").inc()
        log.warning("MPS control daemon for GPU %s started again (%s; restart %d of at most %d in %.0f s)",
                    uuid, self.daemons.describe(rec), len(recent), self.max_restarts, self.window)
        if self.daemons.answers(uuid):
            self._healthy(uuid, f"restarted as {self.daemons.describe(rec)}")

    def _fault(self, uuid: str, message: str) -> None:
        self.faulted.add(uuid)
        self.on_health(uuid, ("mps-daemon-down", message))

    def _healthy(self, uuid: str, why: str) -> None:
        self.faulted.discard(uuid)
        log.info("MPS control daemon for GPU %s: %s", uuid, why)
        self.on_health(uuid, None)
