"""The claim-status writer's ordering and coalescing, with backends the test controls: per
claim the latest state wins, a later state is never overtaken by an earlier one's write, a
failed write waits for its retry without holding up other claims, and a claim prepared and
unprepared before its write costs no rewrite of the claim file. The writes are made in the
writer's own threads, never on an event loop. Every wait is on an event the backend sets;
nothing here depends on how long anything takes."""

from __future__ import annotations

import json
import os
import threading

import pytest

from agent.kubeletplugin import statuswriter
from agent.kubeletplugin.statusbackends import StatusRefused
from agent.kubeletplugin.statuswriter import StatusWriter, status_writer
from agent.kubeletplugin.types import ClaimRef
from tests.kubelet_standin import claim, settings_for, store_claim


def _ref(n: int) -> ClaimRef:
    return ClaimRef("default", f"c{n}", f"00000000-0000-4000-8000-{n:012d}")


def _entries(device: str) -> list[dict]:
    return [{"driver": "sysdra.io", "pool": "node-1", "device": device}]


@pytest.fixture(autouse=True)
def _no_pause(monkeypatch):
    """No wait for a pause in the kubelet's calls: the tests order writes with events."""
    monkeypatch.setattr(statuswriter, "SETTLE", 0.0)


class GatedBackend:
    """Records every write (uid, entries) in the order it starts; a write waits until the test
    opens the claim's gate. Counts writes in flight, per claim and in all."""

    def __init__(self):
        self.writes: list[tuple[str, list[dict]]] = []
        self.gates: dict[str, threading.Event] = {}
        self.started: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self.inflight: dict[str, int] = {}
        self.most_per_claim = 0
        self.most_at_once = 0
        self.fail_first: set[str] = set()  # uids whose first write raises a retryable error

    def gate(self, uid: str) -> threading.Event:
        with self._lock:
            return self.gates.setdefault(uid, threading.Event())

    def began(self, uid: str) -> threading.Event:
        with self._lock:
            return self.started.setdefault(uid, threading.Event())

    def wait_began(self, uid: str) -> None:
        assert self.began(uid).wait(10), f"no write of {uid} began"

    def write(self, ref: ClaimRef, entries: list[dict]) -> None:
        with self._lock:
            self.writes.append((ref.uid, entries))
            self.inflight[ref.uid] = self.inflight.get(ref.uid, 0) + 1
            self.most_per_claim = max(self.most_per_claim, self.inflight[ref.uid])
            self.most_at_once = max(self.most_at_once, sum(self.inflight.values()))
        self.began(ref.uid).set()
        try:
            assert self.gate(ref.uid).wait(10), f"the gate of {ref.uid} never opened"
            if ref.uid in self.fail_first:
                self.fail_first.discard(ref.uid)
                raise ConnectionResetError("reset by the test")
        finally:
            with self._lock:
                self.inflight[ref.uid] -= 1


def _held(writer: StatusWriter):
    """Submits made inside reach the writer's threads together (they wait for its lock)."""
    return writer._lock


def test_an_unprepare_submitted_during_the_prepares_write_is_written_after_it():
    backend = GatedBackend()
    writer = StatusWriter(backend)
    a = _ref(1)
    writer.submit(a, _entries("gpu-0"))
    backend.wait_began(a.uid)  # the prepare's write is in flight
    writer.submit(a, [])  # the unprepare's removal
    writer.submit(a, [])
    backend.gate(a.uid).set()
    assert writer.wait_idle(10)
    assert backend.writes == [(a.uid, _entries("gpu-0")), (a.uid, [])]
    assert backend.most_per_claim == 1 and (writer.written, writer.failed) == (2, 0)


def test_states_submitted_before_the_write_starts_are_coalesced_into_the_latest():
    backend = GatedBackend()
    writer = StatusWriter(backend)
    a, b = _ref(1), _ref(2)
    backend.gate(a.uid).set()
    backend.gate(b.uid).set()
    with _held(writer):
        writer.submit(a, _entries("gpu-0"))  # prepared ...
        writer.submit(b, _entries("gpu-1"))
        writer.submit(a, [])  # ... and unprepared before anything was written
    assert writer.wait_idle(10)
    assert backend.writes == [(a.uid, []), (b.uid, _entries("gpu-1"))]  # the longest-waiting claim first


def test_several_writes_in_flight_never_two_for_one_claim():
    backend = GatedBackend()
    writer = StatusWriter(backend, slots=3)
    refs = [_ref(n) for n in range(6)]
    for r in refs:
        writer.submit(r, _entries("gpu-0"))
    for r in refs[:3]:
        backend.wait_began(r.uid)
    for r in refs:  # the three in flight get a newer state, the three waiting are replaced
        writer.submit(r, _entries("gpu-1"))
    for r in refs:
        backend.gate(r.uid).set()
    assert writer.wait_idle(10)
    assert backend.most_per_claim == 1 and backend.most_at_once == 3
    for r in refs[:3]:
        assert [e for u, e in backend.writes if u == r.uid] == [_entries("gpu-0"), _entries("gpu-1")]
    for r in refs[3:]:
        assert [e for u, e in backend.writes if u == r.uid] == [_entries("gpu-1")]


def test_a_failed_write_waits_for_its_retry_without_holding_up_other_claims(monkeypatch):
    monkeypatch.setattr(statuswriter, "FIRST_DELAY", 3600.0)  # the retry is not due during the test
    backend = GatedBackend()
    writer = StatusWriter(backend)
    a, b = _ref(1), _ref(2)
    backend.fail_first.add(a.uid)
    backend.gate(a.uid).set()
    writer.submit(a, _entries("gpu-0"))
    writer.submit(b, _entries("gpu-1"))
    backend.gate(b.uid).set()
    backend.wait_began(b.uid)  # written while a waits for its retry
    while writer.written < 1:  # b's write is reported right after it returns
        threading.Event().wait(0.005)
    writer.submit(a, [])  # a newer state replaces the one waiting: written at once
    assert writer.wait_idle(10)
    assert backend.writes == [(a.uid, _entries("gpu-0")), (b.uid, _entries("gpu-1")), (a.uid, [])]
    assert (writer.written, writer.failed) == (2, 0)


def test_a_refused_write_is_logged_and_not_retried(caplog):
    class Refusing:
        calls = 0

        def write(self, ref, entries):
            Refusing.calls += 1
            raise StatusRefused("API error 422: no")

    writer = StatusWriter(Refusing())
    writer.submit(_ref(1), _entries("gpu-0"))
    assert writer.wait_idle(10)
    assert Refusing.calls == 1 and writer.failed == 1 and "422" in writer.last_error
    assert "status.devices not written" in caplog.text


def test_the_claim_file_is_not_rewritten_when_our_entries_would_not_change(tmp_path):
    s = settings_for(str(tmp_path))
    c = store_claim(s, claim("c", [("gpu", "gpu-0000-1b-00-0")]))
    ref = ClaimRef("default", "c", c["metadata"]["uid"])
    path = os.path.join(s.cluster_dir, "resourceclaims", "default", "c.json")
    results = []

    class Results:
        def claim_status_written(self, ref, result, reason):
            results.append(result)
            raise RuntimeError("a broken observer")  # must not stop the writer

    writer = status_writer(s, observer=Results())

    def stamp():
        st = os.stat(path)
        return st.st_ino, st.st_mtime_ns

    def write(*states):
        with _held(writer):  # all submitted before the writer's first turn
            for entries in states:
                writer.submit(ref, entries)
        assert writer.wait_idle(10)

    original = stamp()
    write(_entries("gpu-0000-1b-00-0"), [])  # prepared and unprepared before the write
    assert stamp() == original and writer.written == 1
    write(_entries("gpu-0000-1b-00-0"))
    prepared = stamp()
    assert prepared != original and json.load(open(path))["status"]["devices"] == _entries("gpu-0000-1b-00-0")
    write(_entries("gpu-0000-1b-00-0"))  # re-prepared: the same entries
    assert stamp() == prepared
    write([])
    assert "devices" not in json.load(open(path))["status"] and writer.failed == 0
    assert results == ["unchanged", "written", "unchanged", "written"]


def test_writes_are_made_in_the_writers_threads_without_an_event_loop():
    """Submitted from a prepare's thread, written in the writer's own: the event loop (there is
    none here) never takes part, and the submitting thread does not wait for the write."""
    import asyncio

    threads: list[str] = []
    gate = threading.Event()

    class Recording:
        def write(self, ref, entries):
            with pytest.raises(RuntimeError):
                asyncio.get_running_loop()
            threads.append(threading.current_thread().name)
            assert gate.wait(10)

    writer = StatusWriter(Recording(), slots=2)
    submitter = threading.Thread(target=lambda: [writer.submit(_ref(n), _entries("gpu-0")) for n in range(3)])
    submitter.start()
    submitter.join(10)
    assert not submitter.is_alive()  # it returned while the writes wait for the gate
    gate.set()
    assert writer.wait_idle(10)
    assert len(threads) == 3 and set(threads) == {"claim-status-writer"} and writer.written == 3


def test_a_claim_file_another_writer_holds_is_written_once_it_is_free(tmp_path, monkeypatch):
    """`sysdra metadata update` holds the namespace's lock while it rewrites a claim file: the
    agent's writer does not wait for it, it retries."""
    import fcntl

    monkeypatch.setattr(statuswriter, "FIRST_DELAY", 0.01)
    s = settings_for(str(tmp_path))
    c = store_claim(s, claim("c", [("gpu", "gpu-0000-1b-00-0")]))
    ref = ClaimRef("default", "c", c["metadata"]["uid"])
    ns_dir = os.path.join(s.cluster_dir, "resourceclaims", "default")
    writer = status_writer(s)
    held = os.open(ns_dir, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(held, fcntl.LOCK_EX)

    def retrying() -> bool:
        with _held(writer):
            return any(p.attempt for p in writer._pending.values())

    writer.submit(ref, _entries("gpu-0000-1b-00-0"))
    while not retrying():  # refused while held, its retry waits
        threading.Event().wait(0.005)
    assert "devices" not in json.load(open(os.path.join(ns_dir, "c.json")))["status"]
    os.close(held)  # the other writer is done
    assert writer.wait_idle(10)
    assert json.load(open(os.path.join(ns_dir, "c.json")))["status"]["devices"] == _entries("gpu-0000-1b-00-0")
    assert (writer.written, writer.failed) == (1, 0)


class ApiLikeBackend(GatedBackend):
    """As the API server: our entries go with the claim's allocation, an unprepare writes nothing."""

    drops_with_allocation = True


def test_release_drops_a_waiting_write_and_a_failed_one_is_not_retried():
    backend = ApiLikeBackend()
    writer = StatusWriter(backend, slots=2)
    a, b = _ref(1), _ref(2)
    backend.fail_first.add(a.uid)
    writer.submit(a, _entries("gpu-0"))
    backend.wait_began(a.uid)  # a's write is in flight (and will fail)
    with _held(writer):
        writer.submit(b, _entries("gpu-1"))
        writer.release(b)  # unprepared before its write started: dropped
        writer.release(a)  # in flight: its failure is not retried
    backend.gate(a.uid).set()
    backend.gate(b.uid).set()
    assert writer.wait_idle(5)
    assert backend.writes == [(a.uid, _entries("gpu-0"))]


class ReadingApiBackend(ApiLikeBackend):
    """As the API backend: reads the claim (here: waits at the gate), then asks ``latest()`` what to
    write now; records what it wrote."""

    sent: list[tuple[str, list[dict]]]

    def write(self, ref: ClaimRef, entries: list[dict], latest=None) -> None:
        super().write(ref, entries)  # counts and gates: the claim read
        now = latest() if latest is not None else entries
        with self._lock:
            self.sent = [*getattr(self, "sent", []), (ref.uid, now)]


def test_a_write_in_flight_when_its_claim_is_unprepared_writes_nothing():
    """Its claim read, its entries not yet sent: the unprepare (``release``) comes; the Ready
    entries of the released devices are not written."""
    backend = ReadingApiBackend()
    writer = StatusWriter(backend)
    writer.recorded = lambda ref: None  # no longer prepared
    a = _ref(1)
    writer.submit(a, _entries("gpu-0"))
    backend.wait_began(a.uid)
    writer.release(a)
    backend.gate(a.uid).set()
    assert writer.wait_idle(5)
    assert len(backend.writes) == 1 and getattr(backend, "sent", []) == [] and writer.failed == 0  # read, not sent


def test_release_on_a_backend_without_it_removes_our_entries():
    backend = GatedBackend()
    backend.gate(_ref(1).uid).set()
    writer = StatusWriter(backend)
    writer.submit(_ref(1), _entries("gpu-0"))
    assert writer.wait_idle(5)
    writer.release(_ref(1))
    assert writer.wait_idle(5)
    assert backend.writes == [(_ref(1).uid, _entries("gpu-0")), (_ref(1).uid, [])]


def test_idle_on_the_event_loop_and_close_drops_what_waits(monkeypatch):
    """``idle()`` waits without blocking the loop; after ``close()`` nothing waiting is written."""
    import asyncio

    monkeypatch.setattr(statuswriter, "FIRST_DELAY", 3600.0)
    backend = GatedBackend()
    writer = StatusWriter(backend)
    a = _ref(1)
    backend.fail_first.add(a.uid)
    backend.gate(a.uid).set()

    async def go():
        writer.submit(a, _entries("gpu-0"))
        with pytest.raises(TimeoutError):  # its retry is an hour away
            await writer.idle(0.2)
        writer.close()
        await writer.idle(5)

    asyncio.run(go())
    assert backend.writes == [(a.uid, _entries("gpu-0"))] and writer.written == 0


def test_after_close_nothing_is_queued():
    """A submit after ``close()`` (an NRI event while the agent stops) is dropped, and a failed
    write in flight at close is not queued for a retry: ``idle`` never waits for them."""
    backend = GatedBackend()
    writer = StatusWriter(backend)
    a, b = _ref(1), _ref(2)
    backend.fail_first.add(a.uid)
    writer.submit(a, _entries("gpu-0"))
    backend.wait_began(a.uid)  # in flight, and will fail
    writer.close()
    writer.submit(b, _entries("gpu-1"))
    backend.gate(a.uid).set()
    assert writer.wait_idle(5)
    assert backend.writes == [(a.uid, _entries("gpu-0"))] and writer._pending == {}
