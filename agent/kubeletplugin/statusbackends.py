"""Where our ``status.devices`` entries of a ResourceClaim are written (the status writer,
``statuswriter.py``, decides when): to the API server by server-side apply, or into the claim
file of the ``dir:`` store.

- **API**: one apply of ``status.devices`` on ``resourceclaims/status`` with field manager =
  our driver name. The list is a map keyed by (driver, pool, device, shareID), so the apply
  owns only our entries: other drivers' entries stay untouched (and the server's per-driver
  check, ``resourceclaims/driver``, only asks about us). Applying ``[]`` removes ours.
  ``metadata.uid`` is part of the apply, so a claim that was replaced is never written.
- **dir**: ``resourceclaims/<ns>/<name>.json`` rewritten atomically with our entries replaced
  and everyone else's kept.

Both read the claim right before writing and write only if our entries change. What they write
is then asked for (``latest``): the writer's is the checkpoint's record of the claim, which
``sysdra metadata update`` (another process) changes before it writes the same entries itself.
The write is conditional on the claim as read (``metadata.resourceVersion`` in the apply, retried
on a 409 with a fresh read; a ``flock`` on the claim's namespace directory for the files), so a
state queued before an update can never land over the update's write.
"""

from __future__ import annotations

import fcntl
import os
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Protocol

from agent.fsutil import atomic_write, clean_stale_temps, json_bytes
from agent.kubeletplugin.claims import ClaimError, DirClaimSource, _claim_resource
from agent.kubeletplugin.types import ClaimRef

CONFLICTS = 5  # fresh reads after a 409 before the write counts as one failed attempt


class StatusRefused(Exception):
    """The server (or the claim file) will not take this write as it is: retrying cannot help."""


class EntriesInvalid(StatusRefused):
    """The entries to write now would not pass the server's validation: never sent."""


class StatusConflict(Exception):
    """The claim changed between our read and our write, again and again: retried later."""


class StatusBackend(Protocol):
    async def write(self, ref: ClaimRef, entries: list[dict], latest: Latest | None = None) -> bool | None:
        """Our entries of the claim := ``latest()`` (called after the claim was read), else
        ``entries``. Raises StatusRefused, or any error to have it retried; False: nothing had to change."""


Latest = Callable[[], list[dict]]


def apply_body(ref: ClaimRef, entries: list[dict]) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": ref.name, "namespace": ref.namespace, "uid": ref.uid},
            "status": {"devices": entries}}  # fmt: skip


class KubeStatus:
    """Server-side apply with lightkube's AsyncClient (created lazily)."""

    def __init__(self, driver_name: str, client=None):
        self.driver_name = driver_name
        self._client = client
        self._claims = _claim_resource()  # read with `get` on resourceclaims (deploy/rbac.yaml)
        self._status = self._claims.Status

    async def write(self, ref: ClaimRef, entries: list[dict], latest: Latest | None = None) -> bool:
        from lightkube import ApiError, AsyncClient
        from lightkube.types import PatchType

        if self._client is None:
            self._client = AsyncClient(field_manager=self.driver_name)
        for _ in range(CONFLICTS):
            try:
                claim = await self._client.get(self._claims, ref.name, namespace=ref.namespace)
            except ApiError as err:
                code = getattr(err.status, "code", None)
                if code == 404 and not entries:
                    return False  # claim gone: nothing of ours is left to remove
                if code in (400, 403, 404, 422):
                    raise StatusRefused(f"API error {code}: {err}") from err
                raise
            claim = claim.to_dict() if hasattr(claim, "to_dict") else dict(claim)
            meta = claim.get("metadata") or {}
            if meta.get("uid") != ref.uid:
                raise StatusRefused(f"ResourceClaim {ref.namespace}/{ref.name} has another UID: it was replaced")
            now = latest() if latest is not None else entries
            ours = [e for e in (claim.get("status") or {}).get("devices") or [] if e.get("driver") == self.driver_name]
            if ours == now:
                return False
            body = apply_body(ref, now)
            body["metadata"]["resourceVersion"] = meta.get("resourceVersion")  # the apply's precondition
            try:
                await self._client.patch(self._status, ref.name, body, namespace=ref.namespace,
                                         patch_type=PatchType.APPLY, field_manager=self.driver_name, force=True)
                return True
            except ApiError as err:
                code = getattr(err.status, "code", None)
                if code == 409:  # changed since our read (or replaced: the next read tells)
                    continue
                if code in (400, 403, 404, 422):
                    raise StatusRefused(f"API error {code}: {err}") from err
                raise
        raise StatusConflict(f"ResourceClaim {ref.namespace}/{ref.name} changed during each of {CONFLICTS} writes")


class DirStatus:
    """The ``dir:`` store's claim file, rewritten atomically."""

    def __init__(self, path: str, driver_name: str, lock_timeout: float = 0.0):
        self.source = DirClaimSource(path)
        self.driver_name = driver_name
        self.lock_timeout = lock_timeout  # 0: the agent, on its loop, never waits (a busy lock is retried later)

    def clean_temps(self) -> None:
        """At the agent's start: temps of claim-file rewrites a crash interrupted."""
        claims = os.path.join(self.source.path, "resourceclaims")
        for ns in os.listdir(claims) if os.path.isdir(claims) else ():
            clean_stale_temps(os.path.join(claims, ns), prefix=".")

    async def write(self, ref: ClaimRef, entries: list[dict], latest: Latest | None = None) -> bool:
        # On the loop, like the claim read at prepare: one small local file, one claim at a
        # time (the writer yields between claims). In a worker thread it fought the loop
        # for the GIL on every system call of the prepares running meanwhile.
        with self._locked(ref.namespace):
            return self._write(ref, entries, latest)

    @contextmanager
    def _locked(self, namespace: str) -> Iterator[None]:
        """``flock`` on the namespace's directory, against the other writer of our entries
        (``sysdra metadata update``): read, decide and rename as one step."""
        try:
            fd = os.open(os.path.join(self.source.path, "resourceclaims", namespace), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:  # no such namespace: the read says the claim is not found
            yield
            return
        try:
            deadline = time.monotonic() + self.lock_timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise StatusConflict(f"ResourceClaims of {namespace} are being written by another process") from None
                    time.sleep(0.01)
            yield
        finally:
            os.close(fd)  # (releases the lock)

    def _write(self, ref: ClaimRef, entries: list[dict], latest: Latest | None = None) -> bool:
        try:
            claim = self.source._read(ref.namespace, ref.name)
        except ClaimError as err:
            if not entries and "not found" in str(err):
                return False
            raise StatusRefused(str(err)) from err
        if (claim.get("metadata") or {}).get("uid") != ref.uid:
            raise StatusRefused(f"ResourceClaim {ref.namespace}/{ref.name} has another UID: it was replaced")
        status = claim.get("status") if isinstance(claim.get("status"), dict) else {}
        others = [e for e in status.get("devices") or [] if not (isinstance(e, dict) and e.get("driver") == self.driver_name)]
        entries = latest() if latest is not None else entries
        if entries and not status.get("allocation"):
            raise StatusRefused(f"ResourceClaim {ref.namespace}/{ref.name} is not allocated")
        devices = others + entries
        if devices == (status.get("devices") or []):  # already so (re-prepare; prepared and unprepared before the write)
            return False
        if devices:
            status["devices"] = devices
        else:
            status.pop("devices", None)
        claim["status"] = status
        # atomic, not durable: status is informational, and two fsyncs per claim showed in prepare latency
        atomic_write(self.source.claim_path(ref.namespace, ref.name), json_bytes(claim), durable=False)
        return True
