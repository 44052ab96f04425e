"""Writes our ``status.devices`` entries of a ResourceClaim, through a backend
(``statusbackends.py``: the API server or the ``dir:`` store's claim files).

Writes run in the background (``submit`` only records the wish, from any thread), latest state
per claim wins, retried with backoff: status is what others read about a prepared device, never
a reason to fail or delay NodePrepareResources. They wait for a pause in the kubelet's calls
(``SETTLE``, at most ``MAX_DEFER``), long enough for the pod the prepare was for to get its
sandbox and containers first: a write in between competes with the runtime for the node's
CPUs and delayed the pod's start (issue 43). A claim prepared and unprepared within that time
is written once, with its latest state, or not at all where the backend's entries go with the
allocation (``release``).

The writes are made in a few threads of the writer's own (``slots``), never on the event
loop: a prepare's thread submits, a writer thread waits for the pause and writes, and the
loop does nothing for it (each hop between the loop and a thread cost ~0.3 ms of CPU, as much
as the write's request, measured on the real node, issue 43). A slow API server holds only
these threads.

A prepare hands over the claim it read (``seen``), so the first attempt writes without reading
it again: one GET and one apply per prepared claim. On the API server our entries need no
removal at unprepare: the server drops the status of devices that are no longer allocated, and
the claim is deallocated once no pod uses it (kube-controller-manager). ``idle()`` waits for the
pending writes (tests, shutdown). What a write puts in the claim is the driver's record of
it at that moment (``recorded``), so a state queued before a ``sysdra metadata update`` never
lands over the update's write.

Every write ends in one of ``RESULTS``, reported to the ``observer`` (the daemon's: metrics
and ``sysdra status``, agent/service/observers.py): a failure must not be only a log line.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from agent.kubeletplugin import devicestatus
from agent.kubeletplugin.statusbackends import (DirStatus, EntriesInvalid, KubeStatus, StatusBackend,
                                                StatusRefused)
from agent.kubeletplugin.types import ClaimRef
from agent.settings import Settings

log = logging.getLogger(__name__)

ATTEMPTS = 8
FIRST_DELAY, MAX_DELAY = 0.5, 30.0
# Writes wait until the kubelet's calls pause this long (at most MAX_DEFER): a burst of
# prepares is not slowed by the status writes between them, and a pod's sandbox and containers
# are created (~0.1-0.2 s after its prepare on a small node) before its claim's write.
SETTLE, MAX_DEFER = 0.5, 3.0
LINGER = 60.0  # seconds a writer thread with nothing to do waits for more before it ends

# How a write ended (the ``result`` label of sysdra_claim_status_writes_total):
WRITTEN = "written"  # applied (API), or the claim file rewritten
UNCHANGED = "unchanged"  # nothing to change: our entries already so, or a removal from a claim that is gone
REFUSED = "refused"  # the server or the claim file will not take it (4xx, replaced claim): not retried
INVALID = "invalid"  # our entries would not pass the server's validation: never sent
FAILED = "failed"  # network or server errors on every one of ATTEMPTS attempts
RESULTS = (WRITTEN, UNCHANGED, REFUSED, INVALID, FAILED)
FAILURES = frozenset({REFUSED, INVALID, FAILED})


class StatusObserver(Protocol):
    def claim_status_written(self, ref: ClaimRef, result: str, reason: str | None) -> None:
        """``result`` one of RESULTS; ``reason`` says why for the FAILURES, else None. Called
        in a writer thread, one call at a time."""


@dataclass(slots=True)
class _Pending:
    """The latest state of one claim's entries that is not written yet."""

    ref: ClaimRef
    entries: list[dict]
    queued: float  # when the claim first waited (kept when a newer state replaces this one)
    seen: dict | None = None  # the claim as its prepare read it: the first attempt reads it no more
    attempt: int = 0  # failed attempts of this state
    retry_at: float = 0.0


class Released(StatusRefused):
    """The claim was unprepared while its write was in flight: the write is dropped."""


class StatusWriter:
    """Per claim, the latest submitted state wins and at most one write is in flight: a later
    state (an unprepare's ``[]``) is written after the earlier one's write finished, never
    overtaken by it. A failed write waits for its retry without holding up other claims."""

    def __init__(self, backend: StatusBackend, slots: int = 1, observer: StatusObserver | None = None,
                 recorded: Callable[[ClaimRef], list[dict] | None] | None = None):
        self.backend = backend
        self.slots = slots
        self.observer = observer
        # the driver's record of a prepared claim's entries as they are now (a metadata update
        # included), None if it has none; set by KubeletPlugin from DriverProtocol.recorded_status
        self.recorded = recorded
        self._lock = threading.RLock()  # tests hold it to hand over several submits at once
        self._work = threading.Condition(self._lock)  # writer threads with nothing due wait here
        self._pause = threading.Condition(self._lock)  # ... and for the pause before a write here
        self._done = threading.Condition(self._lock)  # idle() waits here
        self._pending: dict[str, _Pending] = {}  # by uid, the longest-waiting first
        self._inflight: set[str] = set()
        self._released: set[str] = set()  # in flight when released: not retried
        self._threads = 0
        self._waiting = 0  # threads waiting in _work
        self._closed = False
        self._last_submit = 0.0
        self.written = 0  # writes that succeeded (WRITTEN or UNCHANGED)
        self.failed = 0  # writes that ended in one of FAILURES
        self.last_error: str | None = None

    def submit(self, ref: ClaimRef, entries: list[dict], seen: dict | None = None) -> None:
        """Make our entries of ``ref`` equal ``entries`` ([] removes them), in the background.
        ``seen``: the claim as just read (a prepare's), to write without reading it again.
        Only records the wish: nothing is checked, encoded or written on the caller's time."""
        with self._lock:
            if self._closed:  # stopping: what comes now would be dropped anyway
                return
            now = time.monotonic()
            old = self._pending.get(ref.uid)
            self._released.discard(ref.uid)
            self._pending[ref.uid] = _Pending(ref, entries, old.queued if old else now, seen)  # attempts start over
            self._last_submit = now
            if self._waiting:
                self._work.notify()
            elif self._threads < self.slots:
                self._threads += 1
                threading.Thread(target=self._run, name="claim-status-writer", daemon=True).start()

    def release(self, ref: ClaimRef) -> None:
        """The claim's devices were unprepared: our entries go. Where the backend's entries go
        with the claim's allocation (the API server), nothing is written: a write still waiting
        is dropped and one in flight is not retried."""
        if not getattr(self.backend, "drops_with_allocation", False):
            self.submit(ref, [])
            return
        with self._lock:
            self._pending.pop(ref.uid, None)
            if ref.uid in self._inflight:
                self._released.add(ref.uid)
            self._done.notify_all()

    def _next_due(self, now: float) -> tuple[str | None, float | None]:
        """-> (the longest-waiting claim to write now, or None; else seconds to its retry or None)."""
        soonest = None
        for uid, p in self._pending.items():
            if uid in self._inflight:  # its newer state waits for the write in flight
                continue
            if p.retry_at <= now:
                return uid, None
            soonest = p.retry_at if soonest is None else min(soonest, p.retry_at)
        return None, None if soonest is None else soonest - now

    def _take(self) -> _Pending | None:
        """Holding the lock: the next state to write, after the pause; None: this thread ends."""
        while not self._closed:
            uid, wait = self._next_due(time.monotonic())
            if uid is None:  # a retry's time, or a new submit
                self._waiting += 1
                try:
                    woken = self._work.wait(LINGER if wait is None else wait)
                finally:
                    self._waiting -= 1
                if not woken and wait is None and not self._pending:
                    return None
                continue
            deadline = self._pending[uid].queued + MAX_DEFER
            while (pause := min(self._last_submit + SETTLE, deadline) - time.monotonic()) > 0 and not self._closed:
                self._pause.wait(pause)
            p = self._pending.get(uid)
            if p is None or uid in self._inflight or p.retry_at > time.monotonic():  # another thread wrote it meanwhile
                continue
            del self._pending[uid]
            self._inflight.add(uid)
            return p
        return None

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    p = self._take()
                    if p is None:
                        return
                try:
                    retry = self._write(p)
                except Exception:  # a bug here must not leave the claim in flight for ever
                    log.exception("claim %s/%s: status write failed", p.ref.namespace, p.ref.name)
                    retry = False
                with self._lock:
                    uid = p.ref.uid
                    self._inflight.discard(uid)
                    superseded = uid in self._pending or uid in self._released  # a newer state, or unprepared
                    if retry and not superseded and not self._closed:
                        self._pending[uid] = p
                    self._released.discard(uid)
                    if uid in self._pending:  # a newer state of this claim may wait for this write
                        self._work.notify()
                    self._done.notify_all()
        finally:
            with self._lock:
                self._threads -= 1
                self._done.notify_all()
                if self._pending and not self._threads and not self._closed:  # submitted while this one ended
                    self._threads += 1
                    threading.Thread(target=self._run, name="claim-status-writer", daemon=True).start()

    def _write(self, p: _Pending) -> bool:
        """One attempt; True if it should be retried (then ``p`` carries the retry's time)."""
        ref, entries = p.ref, p.entries
        bad = [why for e in entries for why in devicestatus.problems(e)]
        if bad:  # the builder checks too: a write the server would refuse as a whole is not sent
            self._fail(ref, entries, INVALID, "our entries would not pass validation: " + "; ".join(bad))
            return False
        kw = {} if p.seen is None else {"seen": p.seen}
        p.seen = None  # a retry reads the claim afresh
        try:
            if self.recorded is None:
                changed = self.backend.write(ref, entries, **kw)
            else:
                changed = self.backend.write(ref, entries, lambda: self._latest(p), **kw)
        except Released as err:
            log.debug("%s: nothing written", err)
            return False
        except EntriesInvalid as err:
            self._fail(ref, entries, INVALID, str(err))
            return False
        except StatusRefused as err:
            self._fail(ref, entries, REFUSED, str(err))
            return False
        except Exception as err:  # network, server errors: try again
            p.attempt += 1
            if p.attempt == ATTEMPTS:
                self._fail(ref, entries, FAILED, f"{type(err).__name__}: {err} (after {ATTEMPTS} attempts)")
                return False
            log.debug("claim %s/%s: status write failed (%s), retrying", ref.namespace, ref.name, err)
            delay = min(FIRST_DELAY * 2 ** (p.attempt - 1), MAX_DELAY)
            p.retry_at = time.monotonic() + delay * random.uniform(0.8, 1.2)
            return True
        self._report(ref, UNCHANGED if changed is False else WRITTEN, None)
        return False

    def _latest(self, p: _Pending) -> list[dict]:
        """What to write, asked right after the backend read the claim: a prepare's entries as the
        driver records them now (``sysdra metadata update`` may have changed them since the
        submit); a removal stays a removal. A prepare's entries of a claim unprepared since the
        write began are not written (``Released``): they would say Ready for released devices."""
        with self._lock:
            if p.entries and p.ref.uid in self._released:
                raise Released(f"claim {p.ref.namespace}/{p.ref.name} was unprepared while its status was being written")
        recorded = self.recorded(p.ref) if p.entries else None
        if recorded is None or recorded == p.entries:
            return p.entries
        if bad := [why for e in recorded for why in devicestatus.problems(e)]:
            raise EntriesInvalid("our entries would not pass validation: " + "; ".join(bad))
        return recorded

    def _fail(self, ref: ClaimRef, entries: list[dict], result: str, why: str) -> None:
        log.warning("claim %s/%s: %s status.devices not written: %s", ref.namespace, ref.name,
                    "adding" if entries else "removing", why)
        self._report(ref, result, why)

    def _report(self, ref: ClaimRef, result: str, reason: str | None) -> None:
        with self._lock:  # one report at a time: the observer's counters are not thread-safe
            if result in FAILURES:
                self.failed += 1
                self.last_error = f"{ref.namespace}/{ref.name}: {reason}"
            else:
                self.written += 1
            if self.observer is None:
                return
            try:
                self.observer.claim_status_written(ref, result, reason)
            except Exception:  # noqa: BLE001 - reporting must not stop the writer
                log.exception("claim %s/%s: status write result not reported", ref.namespace, ref.name)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every submitted write has finished; False if ``timeout`` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._pending or self._inflight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._done.wait(left)
        return True

    async def idle(self, timeout: float | None = None) -> None:
        """:meth:`wait_idle` for the event loop; raises TimeoutError if ``timeout`` passed."""
        if not await asyncio.to_thread(self.wait_idle, timeout):
            raise TimeoutError("claim status writes still pending")

    def close(self) -> None:
        """Drop what is still waiting and what is submitted from now on; a write in flight
        finishes in its thread."""
        with self._lock:
            self._closed = True
            self._pending.clear()
            self._work.notify_all()
            self._pause.notify_all()
            self._done.notify_all()


def status_writer(settings: Settings, client=None, observer: StatusObserver | None = None) -> StatusWriter:
    """The writer matching ``--cluster``: the ``dir:PATH`` store's files or the API server."""
    if settings.cluster_dir is not None:
        backend = DirStatus(settings.cluster_dir, settings.driver_name)
        backend.clean_temps()  # the daemon's writer, made once at start
        return StatusWriter(backend, observer=observer)
    # a few applies in flight: one slow answer does not hold up the other claims' status
    return StatusWriter(KubeStatus(settings.driver_name, client), slots=4, observer=observer)
