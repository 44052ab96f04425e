"""DRAPlugin v1 and v1beta1: kubelet messages <-> one version-neutral core.

The core (``Prepare``) checks every claim, fetches ResourceClaims *before* taking the
serialization lock (an API round trip must not block other calls), and answers every
requested UID; a bad claim gets its own ``error``, never a gRPC error for the call.

A prepare is one trip to a worker thread of the core's own (a trip costs as much CPU as a
claim's read, measured in issue 43): the claims' reads (a call's several claims at once, in
reader threads, within a budget), then the driver under the lock, then the results'
``status.devices`` entries handed to the status writer (whose threads write them later). The
loop only decodes the kubelet's request and encodes the answer.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Callable

import grpc

from agent.kubeletplugin.claimcheck import check_claim, check_ref
from agent.kubeletplugin.claims import ClaimError, ClaimSource
from agent.kubeletplugin.types import ClaimRef, DriverProtocol, PrepareResult, base_request
from agent.kubeletplugin.unprepared import SharedMarks
from agent.protos import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc

log = logging.getLogger(__name__)

MAX_CLAIMS = 1000  # per call; the kubelet sends the claims of one pod
THREADS = 8  # kubelet calls in worker threads at once (reading claims, or waiting for the lock)
READ_THREADS = 8  # claim reads at once, all calls together: each waits on the API server, not a CPU
GAVE_UP = "the kubelet gave up on this call (deadline or cancel)"  # how such a call's claims count in metrics
NO_RESULT = "internal error: driver returned no result"
READ_BUDGET = 30.0  # seconds for a call's claim reads: the rest of the kubelet's 45 s is the lock's and the driver's


class SerializeLock:
    """In-process mutex + ``flock`` on ``serialize.lock`` (instances of a rolling update
    share the plugin dir and must not interleave prepare/unprepare). Taken in worker threads:
    a thread waiting for it holds nothing the event loop needs."""

    def __init__(self, path: str):
        self.path = path
        self._mutex = threading.Lock()
        self._fd: int | None = None

    def open(self) -> None:
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def close(self) -> None:
        """Blocking: waits for a ``run`` under way (closing the fd drops the ``flock``, which
        another instance would then take while our driver still works under it)."""
        with self._mutex:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def run(self, fn: Callable[[Any], Any], arg: Any) -> Any:
        """``fn(arg)`` holding both locks (blocking: call it in a worker thread)."""
        with self._mutex:
            if self._fd is None:
                self.open()
            fcntl.flock(self._fd, fcntl.LOCK_EX)  # another instance (rolling update) may hold it
            try:
                return fn(arg)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)


class Prepare:
    """The version-neutral prepare/unprepare flow."""

    def __init__(self, driver: DriverProtocol, claims: ClaimSource, lock: SerializeLock, status=None,
                 observe: Callable[[str, dict, float], None] | None = None):
        self.driver = driver
        self.claims = claims
        self.lock = lock
        self.status = status  # a StatusWriter: results' status.devices, written in the background
        self.observe = observe  # ("prepare" | "unprepare", each claim's result, the call's seconds): metrics
        self.read_budget = READ_BUDGET
        # The kubelet's calls wait here for the lock, off the default executor that health
        # checks and the NRI plugin use; more calls than threads queue as they would for the lock.
        self._threads = ThreadPoolExecutor(THREADS, thread_name_prefix="kubelet-call")
        # Claim reads of calls with several claims: a pool of their own, as a call's thread
        # waiting on reads queued behind it in its own pool could wait for ever.
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="claim-read")
        # Unprepare marks: uid -> the sequence number at which its unprepare ran; a prepare
        # that began before (a smaller number) is stale for that claim. Kept only while a
        # prepare that began before them runs (``_running``): nobody else can be stale.
        self._book = threading.Lock()
        self._seq = 0
        self._running: set[int] = set()
        self._unprepared: dict[str, int] = {}
        # the same marks for the other instance of a rolling update, and its marks for us
        self._shared = SharedMarks(os.path.dirname(lock.path))

    def close(self) -> None:
        self._threads.shutdown(wait=False)  # a call still running finishes in its thread
        self._readers.shutdown(wait=False, cancel_futures=True)

    async def _in_thread(self, what: str, fn: Callable[..., Any], refs: list[ClaimRef]) -> Any:
        # A kubelet timeout cancels this coroutine, never the thread: the driver's steps are
        # not left half done; ``gone`` tells the thread the kubelet no longer waits.
        gone = threading.Event()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._threads, fn, refs, gone)
        except asyncio.CancelledError:
            gone.set()
            log.warning("the kubelet gave up on the %s of claims %s (deadline or cancel)", what,
                        ", ".join(r.uid for r in refs))
            raise

    @staticmethod
    def _screen(refs: list[ClaimRef]) -> tuple[dict[str, str], dict[str, ClaimRef]]:
        """-> (errors by uid, usable refs by uid)."""
        errors: dict[str, str] = {}
        ok: dict[str, ClaimRef] = {}
        if len(refs) > MAX_CLAIMS:
            msg = f"request has {len(refs)} claims, at most {MAX_CLAIMS} per call"
            return {r.uid: msg for r in refs}, {}
        for ref in refs:
            err = check_ref(ref)
            if err is None and ref.uid in ok and ok[ref.uid] != ref:
                err = f"claim uid {ref.uid} is requested twice with different names"
                del ok[ref.uid]
            if err is not None:
                errors[ref.uid] = err
                ok.pop(ref.uid, None)
            elif ref.uid not in errors:
                ok[ref.uid] = ref
        return errors, ok

    def _fetch(self, ref: ClaimRef) -> dict | str:
        try:
            claim = self.claims.read_claim(ref.namespace, ref.name)
        except ClaimError as err:
            return str(err)
        except Exception as err:  # a bug in a source must not fail the whole call
            log.exception("reading ResourceClaim %s/%s", ref.namespace, ref.name)
            return f"reading ResourceClaim {ref.namespace}/{ref.name}: {err}"
        return check_claim(ref, claim) or claim

    def _read(self, refs: list[ClaimRef]) -> list[dict | str]:
        """The claims (or why not), in ``refs``' order. One is read in this thread (its
        requests' timeouts bound it); several at once in the readers' threads, within
        ``read_budget`` all together: one after another, each up to the request timeout (10 s,
        twice after a 401), five claims of a slow server would outlast the kubelet's 45 s."""
        if len(refs) == 1:
            return [self._fetch(refs[0])]
        futures = [self._readers.submit(self._fetch, r) for r in refs]
        done, _ = wait(futures, timeout=self.read_budget)
        out: list[dict | str] = []
        for ref, f in zip(refs, futures):
            if f in done:
                out.append(f.result())
            else:
                f.cancel()  # one not started is never sent; one under way ends at its timeout
                out.append(f"ResourceClaim {ref.namespace}/{ref.name} not read within {self.read_budget:g} s: "
                           "the API server is slow")
        return out

    def _prepare(self, refs: list[ClaimRef], gone: threading.Event) -> dict[str, PrepareResult]:
        """In a worker thread: read the claims (without the lock: an API round trip must not
        hold up other calls), then prepare those that could be read, under the lock, and hand
        their ``status.devices`` entries to the status writer (its threads write them later)."""
        with self._book:  # before the reads: an unprepare from now on makes them stale
            self._seq += 1
            seq = self._seq
            self._running.add(seq)
        try:
            return self._read_and_prepare(refs, gone, (seq, time.monotonic()))
        finally:
            with self._book:
                self._running.discard(seq)
                if self._unprepared:
                    oldest = min(self._running, default=self._seq + 1)
                    self._unprepared = {u: s for u, s in self._unprepared.items() if s > oldest}

    def _read_and_prepare(self, refs: list[ClaimRef], gone: threading.Event,
                          seq: tuple[int, float]) -> dict[str, PrepareResult]:
        out: dict[str, PrepareResult] = {}
        claims, by_uid = [], {r.uid: r for r in refs}
        for ref, got in zip(refs, self._read(refs)):
            if isinstance(got, str):
                out[ref.uid] = PrepareResult(error=got)
                log.warning("prepare claim %s: %s", ref.uid, got)  # the driver logs the outcome of the claims it gets
            else:
                claims.append(got)
        if claims:
            try:
                results = self.lock.run(self._prepare_locked, (claims, gone, seq, by_uid))
            except Exception as err:
                log.exception("driver failed to prepare claims")
                results = {c["metadata"]["uid"]: PrepareResult(error=f"internal error: {err}") for c in claims}
            for c in claims:
                uid = c["metadata"]["uid"]
                out[uid] = results.get(uid) or PrepareResult(error=NO_RESULT)
        return out

    def _prepare_locked(self, args: tuple[list[dict], threading.Event, int, dict[str, ClaimRef]]) -> dict[str, PrepareResult]:
        """Under the lock (its results' ``status.devices`` handed to the status writer too: an
        unprepare of the claim that waits for the lock releases them after, never before). A
        prepare the kubelet gave up on does nothing: the kubelet may have
        unprepared its claims since (the lock is not FIFO), and a claim prepared after its
        unprepare would stay prepared, its devices held, for ever. So does a claim whose
        unprepare ran after this prepare began (the kubelet's cancel not seen yet)."""
        out = self._prepare_claims_locked(args[:3])
        claims, by_uid = args[0], args[3]
        for c in claims:
            uid = c["metadata"]["uid"]
            res = out[uid] = encodable(uid, out.get(uid) or PrepareResult(error=NO_RESULT))
            if self.status is not None and not res.error and res.status is not None:
                self.status.submit(by_uid[uid], res.status, seen=c)
        return out

    def _prepare_claims_locked(self, args: tuple[list[dict], threading.Event, tuple[int, float]]) -> dict[str, PrepareResult]:
        claims, gone, (seq, began) = args
        if gone.is_set():
            return {c["metadata"]["uid"]: PrepareResult(error="the kubelet gave up on this call: nothing prepared")
                    for c in claims}
        with self._book:
            stale = {c["metadata"]["uid"] for c in claims if self._unprepared.get(c["metadata"]["uid"], 0) > seq}
        stale |= self._shared.after((c["metadata"]["uid"] for c in claims), began)  # the other instance's too
        out = {uid: PrepareResult(error=f"claim {uid} was unprepared after this prepare began: not prepared")
               for uid in stale}
        for uid in stale:
            log.warning("prepare claim %s: unprepared after this prepare began: not prepared", uid)
        rest = [c for c in claims if c["metadata"]["uid"] not in stale]
        if rest:
            out.update(self.driver.prepare_claims(rest))
        return out

    async def prepare(self, refs: list[ClaimRef]) -> dict[str, PrepareResult]:
        t0 = time.perf_counter()
        errors, ok = self._screen(refs)
        out = {uid: PrepareResult(error=e) for uid, e in errors.items()}
        for uid, err in errors.items():
            log.warning("prepare claim %s: %s", uid, err)
        try:
            if ok:
                out.update(await self._in_thread("prepare", self._prepare, list(ok.values())))
        except asyncio.CancelledError:  # the kubelet gave up: to it, every claim of the call failed
            self._observed("prepare", {**dict.fromkeys(ok, PrepareResult(error=GAVE_UP)), **out}, t0)
            raise
        self._observed("prepare", out, t0)
        return out

    def _observed(self, what: str, results: dict, t0: float) -> None:
        if self.observe is not None:
            self.observe(what, results, time.perf_counter() - t0)

    def _unprepare_locked(self, refs: list[ClaimRef]) -> dict[str, str | None]:
        # An unprepare the kubelet gave up on still runs: late, it does what was asked; the
        # prepares it overtakes see its marks.
        try:
            results = self.driver.unprepare_claims(refs)
            for ref in refs:  # under the lock: after a prepare's status, before a later prepare's
                if self.status is not None and ref.uid in results and results[ref.uid] is None:
                    self.status.release(ref)  # our entries go with the prepared devices
            return results
        finally:
            self._shared.record(r.uid for r in refs)  # for the other instance of a rolling update
            with self._book:
                if self._running:  # else no prepare began before it
                    self._seq += 1
                    self._unprepared.update((r.uid, self._seq) for r in refs)

    def _unprepare(self, refs: list[ClaimRef], gone: threading.Event) -> dict[str, str | None]:
        try:
            results = self.lock.run(self._unprepare_locked, refs)
        except Exception as err:
            log.exception("driver failed to unprepare claims")
            return {r.uid: f"internal error: {err}" for r in refs}
        return {r.uid: results[r.uid] if r.uid in results else NO_RESULT for r in refs}

    async def unprepare(self, refs: list[ClaimRef]) -> dict[str, str | None]:
        t0 = time.perf_counter()
        errors, ok = self._screen(refs)
        out: dict[str, str | None] = dict(errors)
        for uid, err in errors.items():  # the driver logs the outcome of the claims it gets
            log.warning("unprepare claim %s: %s", uid, err)
        try:
            if ok:
                out.update(await self._in_thread("unprepare", self._unprepare, list(ok.values())))
        except asyncio.CancelledError:
            self._observed("unprepare", {**dict.fromkeys(ok, GAVE_UP), **out}, t0)
            raise
        self._observed("unprepare", out, t0)
        return out


def _refs(request: Any) -> list[ClaimRef]:
    return [ClaimRef(c.namespace, c.name, c.uid) for c in request.claims]


def _request_names(requests: list[str]) -> list[str]:
    return list(dict.fromkeys(base_request(r) for r in requests))


def encode_devices(entry: Any, devices: list, share_id: bool) -> None:
    """A claim's prepared devices into its answer ``entry`` (either version's message)."""
    for d in devices:
        dev = entry.devices.add(request_names=_request_names(d.requests), pool_name=d.pool, device_name=d.device,
                                cdi_device_ids=d.cdi_ids)
        if d.share_id and share_id:
            dev.share_id = d.share_id


def encodable(uid: str, res: PrepareResult) -> PrepareResult:
    """``res``, or an error when the kubelet cannot be sent it: a driver bug stays one claim's
    error, and is counted so (metrics count before the answer is encoded)."""
    if res.error:
        return res
    try:
        encode_devices(dra_v1_pb2.NodePrepareResourceResponse(), res.devices, True)  # v1 is v1beta1 + share_id
    except (TypeError, ValueError, AttributeError) as err:
        log.exception("claim %s: cannot encode the prepare result", uid)
        return PrepareResult(error=f"internal error encoding the result: {err}")
    return res


class _DRAPluginServicer:
    """NodePrepare/NodeUnprepare for one API version; ``pb`` is that version's messages.

    The versions differ only in ``Device.share_id`` (v1 has it, v1beta1 does not)."""

    pb: Any = None
    has_share_id = False

    def __init__(self, core: Prepare):
        self.core = core

    async def NodePrepareResources(self, request, context: grpc.aio.ServicerContext):
        results = await self.core.prepare(_refs(request))
        resp = self.pb.NodePrepareResourcesResponse()
        for uid, res in results.items():
            entry = resp.claims[uid]
            if res.error:
                entry.error = res.error
                continue
            encode_devices(entry, res.devices, self.has_share_id)  # the core made sure it can
        return resp

    async def NodeUnprepareResources(self, request, context: grpc.aio.ServicerContext):
        results = await self.core.unprepare(_refs(request))
        resp = self.pb.NodeUnprepareResourcesResponse()
        for uid, err in results.items():
            resp.claims[uid].error = err or ""
        return resp


class DRAPluginV1(_DRAPluginServicer, dra_v1_pb2_grpc.DRAPluginServicer):
    pb = dra_v1_pb2
    has_share_id = True


class DRAPluginV1beta1(_DRAPluginServicer, dra_v1beta1_pb2_grpc.DRAPluginServicer):
    pb = dra_v1beta1_pb2
