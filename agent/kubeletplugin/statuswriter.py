"""Writes our ``status.devices`` entries of a ResourceClaim: to the API server by server-side
apply, or into the claim file of the ``dir:`` store.

- **API**: one apply of ``status.devices`` on ``resourceclaims/status`` with field manager =
  our driver name. The list is a map keyed by (driver, pool, device, shareID), so the apply
  owns only our entries: other drivers' entries stay untouched (and the server's per-driver
  check, ``resourceclaims/driver``, only asks about us). Applying ``[]`` removes ours.
  ``metadata.uid`` is part of the apply, so a claim that was replaced is never written.
- **dir**: ``resourceclaims/<ns>/<name>.json`` rewritten atomically with our entries replaced
  and everyone else's kept.

Writes run in the background (``submit``), one worker per claim, latest state wins, retried
with backoff: status is what others read about a prepared device, never a reason to fail
or delay NodePrepareResources (they wait for a pause in the kubelet's calls, ``SETTLE``).
``idle()`` waits for the pending writes (tests, shutdown).
"""

from __future__ import annotations

import asyncio
import os
import logging
import random
from typing import Protocol

from agent.fsutil import atomic_write, clean_stale_temps, json_bytes
from agent.kubeletplugin import devicestatus
from agent.kubeletplugin.claims import ClaimError, DirClaimSource, _claim_resource
from agent.kubeletplugin.types import ClaimRef
from agent.settings import Settings

log = logging.getLogger(__name__)

ATTEMPTS = 8
FIRST_DELAY, MAX_DELAY = 0.5, 30.0
# Writes wait until the kubelet's calls pause this long (at most MAX_DEFER): a burst of
# prepares is not slowed by the status writes between them, which follow right after it.
SETTLE, MAX_DEFER = 0.05, 2.0


class StatusRefused(Exception):
    """The server (or the claim file) will not take this write as it is: retrying cannot help."""


class StatusBackend(Protocol):
    async def write(self, ref: ClaimRef, entries: list[dict]) -> None: ...


def apply_body(ref: ClaimRef, entries: list[dict]) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": ref.name, "namespace": ref.namespace, "uid": ref.uid},
            "status": {"devices": entries}}  # fmt: skip


class KubeStatus:
    """Server-side apply with lightkube's AsyncClient (created lazily)."""

    def __init__(self, driver_name: str, client=None):
        self.driver_name = driver_name
        self._client = client
        self._status = _claim_resource().Status

    async def write(self, ref: ClaimRef, entries: list[dict]) -> None:
        from lightkube import ApiError, AsyncClient
        from lightkube.types import PatchType

        if self._client is None:
            self._client = AsyncClient(field_manager=self.driver_name)
        try:
            await self._client.patch(self._status, ref.name, apply_body(ref, entries), namespace=ref.namespace,
                                     patch_type=PatchType.APPLY, field_manager=self.driver_name, force=True)
        except ApiError as err:
            code = getattr(err.status, "code", None)
            if code == 404 and not entries:
                return  # claim gone: nothing of ours is left to remove
            if code in (400, 403, 404, 409, 422):  # 409: the UID changed (a replaced claim)
                raise StatusRefused(f"API error {code}: {err}") from err
            raise


class DirStatus:
    """The ``dir:`` store's claim file, rewritten atomically."""

    def __init__(self, path: str, driver_name: str):
        self.source = DirClaimSource(path)
        self.driver_name = driver_name

    def clean_temps(self) -> None:
        """At the agent's start: temps of claim-file rewrites a crash interrupted."""
        claims = os.path.join(self.source.path, "resourceclaims")
        for ns in os.listdir(claims) if os.path.isdir(claims) else ():
            clean_stale_temps(os.path.join(claims, ns), prefix=".")

    async def write(self, ref: ClaimRef, entries: list[dict]) -> None:
        # a thread: the loop keeps serving the kubelet while the file is read and replaced
        await asyncio.to_thread(self._write, ref, entries)

    def _write(self, ref: ClaimRef, entries: list[dict]) -> None:
        try:
            claim = self.source._read(ref.namespace, ref.name)
        except ClaimError as err:
            if not entries and "not found" in str(err):
                return
            raise StatusRefused(str(err)) from err
        if (claim.get("metadata") or {}).get("uid") != ref.uid:
            raise StatusRefused(f"ResourceClaim {ref.namespace}/{ref.name} has another UID: it was replaced")
        status = claim.get("status") if isinstance(claim.get("status"), dict) else {}
        others = [e for e in status.get("devices") or [] if not (isinstance(e, dict) and e.get("driver") == self.driver_name)]
        if entries and not status.get("allocation"):
            raise StatusRefused(f"ResourceClaim {ref.namespace}/{ref.name} is not allocated")
        devices = others + entries
        if devices:
            status["devices"] = devices
        else:
            status.pop("devices", None)
        claim["status"] = status
        # atomic, not durable: status is informational, and two fsyncs per claim showed in prepare latency
        atomic_write(self.source.claim_path(ref.namespace, ref.name), json_bytes(claim), durable=False)


class StatusWriter:
    def __init__(self, backend: StatusBackend):
        self.backend = backend
        self._desired: dict[str, tuple[ClaimRef, list[dict]]] = {}
        self._workers: dict[str, asyncio.Task] = {}
        self._last_submit = 0.0
        self.written = 0
        self.failed = 0
        self.last_error: str | None = None

    def submit(self, ref: ClaimRef, entries: list[dict]) -> None:
        """Make our entries of ``ref`` equal ``entries`` ([] removes them), in the background."""
        bad = [p for e in entries for p in devicestatus.problems(e)]
        if bad:  # the builder checks too: a write the server would refuse as a whole is not sent
            log.error("claim %s/%s: status not written: %s", ref.namespace, ref.name, "; ".join(bad))
            return
        self._desired[ref.uid] = (ref, entries)
        self._last_submit = asyncio.get_running_loop().time()
        if ref.uid not in self._workers:
            self._workers[ref.uid] = asyncio.get_running_loop().create_task(self._run(ref.uid), name=f"claim-status-{ref.uid}")

    async def _settle(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + MAX_DEFER
        while (wait := min(self._last_submit + SETTLE, deadline) - loop.time()) > 0:
            await asyncio.sleep(wait)

    async def _run(self, uid: str) -> None:
        try:
            await self._settle()
            while uid in self._desired:
                ref, entries = self._desired.pop(uid)
                await self._write(ref, entries, uid)
        finally:
            self._workers.pop(uid, None)

    async def _write(self, ref: ClaimRef, entries: list[dict], uid: str) -> None:
        delay = FIRST_DELAY
        for attempt in range(1, ATTEMPTS + 1):
            if uid in self._desired:  # superseded while we waited: the newer state is written next
                return
            try:
                await self.backend.write(ref, entries)
                self.written += 1
                return
            except StatusRefused as err:
                self._fail(ref, entries, str(err))
                return
            except Exception as err:  # network, server errors: try again
                if attempt == ATTEMPTS:
                    self._fail(ref, entries, f"{type(err).__name__}: {err} (after {ATTEMPTS} attempts)")
                    return
                log.debug("claim %s/%s: status write failed (%s), retrying", ref.namespace, ref.name, err)
                await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(delay * 2, MAX_DELAY)

    def _fail(self, ref: ClaimRef, entries: list[dict], why: str) -> None:
        self.failed += 1
        self.last_error = f"{ref.namespace}/{ref.name}: {why}"
        log.warning("claim %s/%s: %s status.devices not written: %s", ref.namespace, ref.name,
                    "adding" if entries else "removing", why)

    async def idle(self, timeout: float | None = None) -> None:
        """Wait until every submitted write has finished (or ``timeout`` passed)."""
        async with asyncio.timeout(timeout):
            while self._workers:
                await asyncio.gather(*list(self._workers.values()), return_exceptions=True)


def status_writer(settings: Settings, client=None) -> StatusWriter:
    """The writer matching ``--cluster``: the ``dir:PATH`` store's files or the API server."""
    if settings.cluster_dir is not None:
        backend = DirStatus(settings.cluster_dir, settings.driver_name)
        backend.clean_temps()  # the daemon's writer, made once at start
        return StatusWriter(backend)
    return StatusWriter(KubeStatus(settings.driver_name, client))
