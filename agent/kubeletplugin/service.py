"""DRAPlugin v1 and v1beta1: kubelet messages <-> one version-neutral core.

The core (``Prepare``) checks every claim, fetches ResourceClaims *before* taking the
serialization lock (an API round trip must not block other calls), and answers every
requested UID; a bad claim gets its own ``error``, never a gRPC error for the call.
"""

from __future__ import annotations

import asyncio
import fcntl
import inspect
import logging
import os
from typing import Any, Callable

import grpc

from agent import names
from agent.kubeletplugin.claims import ClaimError, ClaimSource
from agent.kubeletplugin.types import ClaimRef, DriverProtocol, PrepareResult, base_request
from agent.protos import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc

log = logging.getLogger(__name__)

MAX_CLAIMS = 1000  # per call; the kubelet sends the claims of one pod
FETCH_TIMEOUT = 30.0  # seconds; the kubelet gives up after 45


def check_ref(ref: ClaimRef) -> str | None:
    """Why the kubelet's claim reference is unusable, or None. Nothing unchecked reaches a path."""
    for field, value in (("uid", ref.uid), ("namespace", ref.namespace), ("name", ref.name)):
        if not value:
            return f"claim {field} is empty"
        if len(value) > 253:
            return f"claim {field} is {len(value)} characters long (at most 253)"
        if "/" in value or "\\" in value or ".." in value or "\x00" in value:
            return f"claim {field} {value!r} contains a path separator or '..'"
    if not names.is_uid(ref.uid):
        return f"claim uid {ref.uid!r} is malformed"
    if not names.is_label(ref.namespace):
        return f"claim namespace {ref.namespace!r} is not a DNS label"
    if not names.is_subdomain(ref.name):
        return f"claim name {ref.name!r} is not a DNS subdomain"
    return None


def check_claim(ref: ClaimRef, claim: object) -> str | None:
    """Why the fetched ResourceClaim cannot be used for ``ref``, or None. Its identity must be
    the request's (the object, not the kubelet, would otherwise choose our paths), and the
    parts the driver reads must have their API types."""
    what = f"ResourceClaim {ref.namespace}/{ref.name}"
    if not isinstance(claim, dict):
        return f"{what} is not an object"
    meta = claim.get("metadata")
    if not isinstance(meta, dict):
        return f"{what}: metadata is not an object"
    for field, want in (("namespace", ref.namespace), ("name", ref.name)):
        if meta.get(field) != want:
            return f"{what}: its metadata.{field} is {meta.get(field)!r}, not the requested {want!r}"
    uid = meta.get("uid")
    if uid != ref.uid:
        return f"{what} has UID {uid}, not {ref.uid}: it was replaced"
    annotations = meta.get("annotations")
    if annotations is not None and not (isinstance(annotations, dict)
                                        and all(isinstance(k, str) and isinstance(v, str) for k, v in annotations.items())):
        return f"{what}: metadata.annotations is not a map of strings"
    status = claim.get("status")
    if status is not None and not isinstance(status, dict):
        return f"{what}: status is not an object"
    alloc = (status or {}).get("allocation")
    if not alloc:
        return f"{what} is not allocated"
    if not isinstance(alloc, dict):
        return f"{what}: status.allocation is not an object"
    devices = alloc.get("devices")
    if devices is not None and not isinstance(devices, dict):
        return f"{what}: status.allocation.devices is not an object"
    results = (devices or {}).get("results")
    if results is not None and not isinstance(results, list):
        return f"{what}: status.allocation.devices.results is not a list"
    return None


class SerializeLock:
    """In-process mutex + ``flock`` on ``serialize.lock`` (instances of a rolling update
    share the plugin dir and must not interleave prepare/unprepare)."""

    def __init__(self, path: str):
        self.path = path
        self._mutex = asyncio.Lock()
        self._fd: int | None = None

    def open(self) -> None:
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    async def run(self, fn: Callable[[Any], Any], arg: Any) -> Any:
        """``fn(arg)`` holding both locks: a coroutine function is awaited on the loop (it must
        never block), anything else runs in a worker thread, so health streams, registration,
        the status socket and the publisher keep running while the driver works."""
        async with self._mutex:
            if self._fd is None:
                self.open()
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # another instance (rolling update) holds it
                await asyncio.to_thread(fcntl.flock, self._fd, fcntl.LOCK_EX)
            try:
                if inspect.iscoroutinefunction(fn):
                    return await fn(arg)
                return await asyncio.to_thread(fn, arg)
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)


class Prepare:
    """The version-neutral prepare/unprepare flow."""

    def __init__(self, driver: DriverProtocol, claims: ClaimSource, lock: SerializeLock, status=None):
        self.driver = driver
        self.claims = claims
        self.lock = lock
        self.status = status  # a StatusWriter: results' status.devices, written in the background

    async def _serialized(self, fn: Callable[[Any], Any], arg: Any) -> Any:
        # Shielded: a kubelet timeout must not release the lock while the driver still runs.
        return await asyncio.shield(asyncio.ensure_future(self.lock.run(fn, arg)))

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

    async def _fetch(self, ref: ClaimRef) -> dict | str:
        try:  # asyncio.timeout, not wait_for: no extra task, so a local read never yields
            async with asyncio.timeout(FETCH_TIMEOUT):
                claim = await self.claims.get_claim(ref.namespace, ref.name)
        except ClaimError as err:
            return str(err)
        except asyncio.TimeoutError:
            return f"reading ResourceClaim {ref.namespace}/{ref.name} timed out after {FETCH_TIMEOUT:.0f}s"
        except Exception as err:  # a bug in a source must not fail the whole call
            log.exception("reading ResourceClaim %s/%s", ref.namespace, ref.name)
            return f"reading ResourceClaim {ref.namespace}/{ref.name}: {err}"
        return check_claim(ref, claim) or claim

    async def prepare(self, refs: list[ClaimRef]) -> dict[str, PrepareResult]:
        errors, ok = self._screen(refs)
        out = {uid: PrepareResult(error=e) for uid, e in errors.items()}
        if len(ok) == 1:  # gather would wrap the one fetch in a task
            fetched = [await self._fetch(next(iter(ok.values())))]
        else:
            fetched = await asyncio.gather(*(self._fetch(r) for r in ok.values()))
        claims = []
        for ref, got in zip(ok.values(), fetched):
            if isinstance(got, str):
                out[ref.uid] = PrepareResult(error=got)
            else:
                claims.append(got)
        for uid, res in out.items():  # the driver logs the outcome of the claims it gets
            log.warning("prepare claim %s: %s", uid, res.error)
        if claims:
            try:
                results = await self._serialized(self.driver.prepare_claims, claims)
            except Exception as err:
                log.exception("driver failed to prepare claims")
                results = {c["metadata"]["uid"]: PrepareResult(error=f"internal error: {err}") for c in claims}
            for c in claims:
                ref = ok[uid := c["metadata"]["uid"]]
                out[uid] = res = results.get(uid) or PrepareResult(error="internal error: driver returned no result")
                if self.status is not None and not res.error and res.status is not None:
                    self.status.submit(ref, res.status, seen=c)
        return out

    async def unprepare(self, refs: list[ClaimRef]) -> dict[str, str | None]:
        errors, ok = self._screen(refs)
        out: dict[str, str | None] = dict(errors)
        for uid, err in errors.items():  # the driver logs the outcome of the claims it gets
            log.warning("unprepare claim %s: %s", uid, err)
        if ok:
            try:
                results = await self._serialized(self.driver.unprepare_claims, list(ok.values()))
            except Exception as err:
                log.exception("driver failed to unprepare claims")
                results = {uid: f"internal error: {err}" for uid in ok}
            for uid, ref in ok.items():
                out[uid] = results[uid] if uid in results else "internal error: driver returned no result"
                if self.status is not None and out[uid] is None:
                    self.status.release(ref)  # our entries go with the prepared devices
        return out


def _refs(request: Any) -> list[ClaimRef]:
    return [ClaimRef(c.namespace, c.name, c.uid) for c in request.claims]


def _request_names(requests: list[str]) -> list[str]:
    return list(dict.fromkeys(base_request(r) for r in requests))


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
            try:
                for d in res.devices:
                    dev = entry.devices.add(
                        request_names=_request_names(d.requests), pool_name=d.pool, device_name=d.device,
                        cdi_device_ids=d.cdi_ids,
                    )
                    if d.share_id and self.has_share_id:
                        dev.share_id = d.share_id
            except (TypeError, ValueError) as err:  # the driver validates; this only keeps one claim's bug its own
                log.exception("claim %s: cannot encode the prepare result", uid)
                entry.Clear()
                entry.error = f"internal error encoding the result: {err}"
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
