"""The claim-status writer's ordering and coalescing, with backends the test controls: per
claim the latest state wins, a later state is never overtaken by an earlier one's write, a
failed write waits for its retry without holding up other claims, and a claim prepared and
unprepared before its write costs no rewrite of the claim file. Every wait is on an event the
backend sets; nothing here depends on how long anything takes."""

from __future__ import annotations

import asyncio
import json
import os

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
        self.gates: dict[str, asyncio.Event] = {}
        self.started: dict[str, asyncio.Event] = {}
        self.inflight: dict[str, int] = {}
        self.most_per_claim = 0
        self.most_at_once = 0
        self.fail_first: set[str] = set()  # uids whose first write raises a retryable error

    def gate(self, uid: str) -> asyncio.Event:
        return self.gates.setdefault(uid, asyncio.Event())

    def began(self, uid: str) -> asyncio.Event:
        return self.started.setdefault(uid, asyncio.Event())

    async def write(self, ref: ClaimRef, entries: list[dict]) -> None:
        self.writes.append((ref.uid, entries))
        self.inflight[ref.uid] = self.inflight.get(ref.uid, 0) + 1
        self.most_per_claim = max(self.most_per_claim, self.inflight[ref.uid])
        self.most_at_once = max(self.most_at_once, sum(self.inflight.values()))
        self.began(ref.uid).set()
        try:
            await self.gate(ref.uid).wait()
            if ref.uid in self.fail_first:
                self.fail_first.discard(ref.uid)
                raise ConnectionResetError("reset by the test")
        finally:
            self.inflight[ref.uid] -= 1


def test_an_unprepare_submitted_during_the_prepares_write_is_written_after_it():
    backend = GatedBackend()
    writer = StatusWriter(backend)
    a = _ref(1)

    async def go():
        writer.submit(a, _entries("gpu-0"))
        await backend.began(a.uid).wait()  # the prepare's write is in flight
        writer.submit(a, [])  # the unprepare's removal
        writer.submit(a, [])
        backend.gate(a.uid).set()
        await writer.idle(10)

    asyncio.run(go())
    assert backend.writes == [(a.uid, _entries("gpu-0")), (a.uid, [])]
    assert backend.most_per_claim == 1 and (writer.written, writer.failed) == (2, 0)


def test_states_submitted_before_the_write_starts_are_coalesced_into_the_latest():
    backend = GatedBackend()
    writer = StatusWriter(backend)
    a, b = _ref(1), _ref(2)

    async def go():
        backend.gate(a.uid).set()
        backend.gate(b.uid).set()
        writer.submit(a, _entries("gpu-0"))  # prepared ...
        writer.submit(b, _entries("gpu-1"))
        writer.submit(a, [])  # ... and unprepared before anything was written
        await writer.idle(10)

    asyncio.run(go())
    assert backend.writes == [(a.uid, []), (b.uid, _entries("gpu-1"))]  # the longest-waiting claim first


def test_several_writes_in_flight_never_two_for_one_claim():
    backend = GatedBackend()
    writer = StatusWriter(backend, slots=3)
    refs = [_ref(n) for n in range(6)]

    async def go():
        for r in refs:
            writer.submit(r, _entries("gpu-0"))
        await asyncio.gather(*(backend.began(r.uid).wait() for r in refs[:3]))
        for r in refs:  # the three in flight get a newer state, the three waiting are replaced
            writer.submit(r, _entries("gpu-1"))
        for r in refs:
            backend.gate(r.uid).set()
        await writer.idle(10)

    asyncio.run(go())
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

    async def go():
        backend.gate(a.uid).set()
        writer.submit(a, _entries("gpu-0"))
        writer.submit(b, _entries("gpu-1"))
        backend.gate(b.uid).set()
        await backend.began(b.uid).wait()  # written while a waits for its retry
        while writer.written < 1:  # b's write returns on the next turn of the loop
            await asyncio.sleep(0)
        writer.submit(a, [])  # a newer state replaces the one waiting: written at once
        await writer.idle(10)

    asyncio.run(go())
    assert backend.writes == [(a.uid, _entries("gpu-0")), (b.uid, _entries("gpu-1")), (a.uid, [])]
    assert (writer.written, writer.failed) == (2, 0)


def test_a_refused_write_is_logged_and_not_retried(caplog):
    class Refusing:
        calls = 0

        async def write(self, ref, entries):
            Refusing.calls += 1
            raise StatusRefused("API error 422: no")

    writer = StatusWriter(Refusing())

    async def go():
        writer.submit(_ref(1), _entries("gpu-0"))
        await writer.idle(10)

    asyncio.run(go())
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

    async def write(*states):
        for entries in states:  # all submitted before the writer's first turn
            writer.submit(ref, entries)
        await writer.idle(10)

    original = stamp()
    asyncio.run(write(_entries("gpu-0000-1b-00-0"), []))  # prepared and unprepared before the write
    assert stamp() == original and writer.written == 1
    asyncio.run(write(_entries("gpu-0000-1b-00-0")))
    prepared = stamp()
    assert prepared != original and json.load(open(path))["status"]["devices"] == _entries("gpu-0000-1b-00-0")
    asyncio.run(write(_entries("gpu-0000-1b-00-0")))  # re-prepared: the same entries
    assert stamp() == prepared
    asyncio.run(write([]))
    assert "devices" not in json.load(open(path))["status"] and writer.failed == 0
    assert results == ["unchanged", "written", "unchanged", "written"]


def test_writes_that_do_not_yield_still_let_other_work_run_between_them():
    log: list[str] = []

    class Blocking:  # like the dir store: the write never awaits
        async def write(self, ref, entries):
            log.append("write")

    writer = StatusWriter(Blocking())

    async def other_work():  # stands for the kubelet's calls
        while len([e for e in log if e == "write"]) < 3:
            log.append("other")
            await asyncio.sleep(0)

    async def go():
        for n in range(3):
            writer.submit(_ref(n), _entries("gpu-0"))
        await asyncio.gather(other_work(), writer.idle(10))

    asyncio.run(go())
    writes = [i for i, e in enumerate(log) if e == "write"]
    assert len(writes) == 3 and all(b - a > 1 for a, b in zip(writes, writes[1:])), log


def test_a_claim_file_another_writer_holds_is_written_once_it_is_free(tmp_path, monkeypatch):
    """`sysdra metadata update` holds the namespace's lock while it rewrites a claim file: the
    agent's writer does not wait on its loop, it retries."""
    import fcntl

    monkeypatch.setattr(statuswriter, "FIRST_DELAY", 0.01)
    s = settings_for(str(tmp_path))
    c = store_claim(s, claim("c", [("gpu", "gpu-0000-1b-00-0")]))
    ref = ClaimRef("default", "c", c["metadata"]["uid"])
    ns_dir = os.path.join(s.cluster_dir, "resourceclaims", "default")
    writer = status_writer(s)
    held = os.open(ns_dir, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(held, fcntl.LOCK_EX)

    async def go():
        writer.submit(ref, _entries("gpu-0000-1b-00-0"))
        while not any(p.attempt for p in writer._pending.values()):  # refused while held, its retry waits
            await asyncio.sleep(0.005)
        assert "devices" not in json.load(open(os.path.join(ns_dir, "c.json")))["status"]
        os.close(held)  # the other writer is done
        await writer.idle(10)

    asyncio.run(go())
    assert json.load(open(os.path.join(ns_dir, "c.json")))["status"]["devices"] == _entries("gpu-0000-1b-00-0")
    assert (writer.written, writer.failed) == (1, 0)


class ApiLikeBackend(GatedBackend):
    """As the API server: our entries go with the claim's allocation, an unprepare writes nothing."""

    drops_with_allocation = True


def test_release_drops_a_waiting_write_and_a_failed_one_is_not_retried():
    async def scenario():
        backend = ApiLikeBackend()
        writer = StatusWriter(backend, slots=2)
        a, b = _ref(1), _ref(2)
        backend.fail_first.add(a.uid)
        writer.submit(a, _entries("gpu-0"))
        await backend.began(a.uid).wait()  # a's write is in flight (and will fail)
        writer.submit(b, _entries("gpu-1"))
        writer.release(b)  # unprepared before its write started: dropped
        writer.release(a)  # in flight: its failure is not retried
        backend.gate(a.uid).set()
        backend.gate(b.uid).set()
        await writer.idle(5)
        return backend.writes

    assert asyncio.run(scenario()) == [(_ref(1).uid, _entries("gpu-0"))]


def test_release_on_a_backend_without_it_removes_our_entries():
    async def scenario():
        backend = GatedBackend()
        backend.gate(_ref(1).uid).set()
        writer = StatusWriter(backend)
        writer.submit(_ref(1), _entries("gpu-0"))
        await writer.idle(5)
        writer.release(_ref(1))
        await writer.idle(5)
        return backend.writes

    assert asyncio.run(scenario()) == [(_ref(1).uid, _entries("gpu-0")), (_ref(1).uid, [])]
