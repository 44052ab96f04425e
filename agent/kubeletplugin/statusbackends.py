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

Both read the claim right before writing (the API backend's first attempt uses the claim its
prepare just read) and write only if our entries change. An unprepare writes nothing to the API
server: it drops the entries of devices that are no longer allocated by itself. What they write
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
from agent.kubeletplugin.claimapi import ApiFailure, ClaimApi
from agent.kubeletplugin.claims import ClaimError, DirClaimSource
from agent.kubeletplugin.types import ClaimRef

CONFLICTS = 5  # fresh reads after a 409 before the write counts as one failed attempt


class StatusRefused(Exception):
    """The server (or the claim file) will not take this write as it is: retrying cannot help."""


class EntriesInvalid(StatusRefused):
    """The entries to write now would not pass the server's validation: never sent."""


class StatusConflict(Exception):
    """The claim changed between our read and our write, again and again: retried later."""


class StatusBackend(Protocol):
    def write(self, ref: ClaimRef, entries: list[dict], latest: Latest | None = None) -> bool | None:
        """Our entries of the claim := ``latest()`` (called after the claim was read), else
        ``entries``. Raises StatusRefused, or any error to have it retried; False: nothing had to change.
        A backend may take ``seen=`` (the claim as just read) and ``drops_with_allocation``.
        Blocking: called in the status writer's threads."""


Latest = Callable[[], list[dict]]


def apply_body(ref: ClaimRef, entries: list[dict]) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": ref.name, "namespace": ref.namespace, "uid": ref.uid},
            "status": {"devices": entries}}  # fmt: skip


class KubeStatus:
    """Server-side apply on ``resourceclaims/status`` (``claimapi.ClaimApi``)."""

    # the server drops status.devices entries of devices no longer allocated (its strategy's
    # dropDeallocatedStatusDevices): an unprepare needs no write
    drops_with_allocation = True

    def __init__(self, driver_name: str, client=None):
        self.driver_name = driver_name
        # a ClaimApi to share (the claim source's), or a lightkube client whose configuration to use
        self.api = client if isinstance(client, ClaimApi) else ClaimApi(client, field_manager=driver_name)

    def write(self, ref: ClaimRef, entries: list[dict], latest: Latest | None = None,
              seen: dict | None = None) -> bool:
        for _ in range(CONFLICTS):
            claim, seen = seen, None
            if claim is None:
                try:
                    claim = self.api.read(ref.namespace, ref.name)
                except ApiFailure as err:
                    if err.code == 404 and not entries:
                        return False  # claim gone: nothing of ours is left to remove
                    if err.code in (400, 403, 404, 422):
                        raise StatusRefused(str(err)) from err
                    raise
            meta = claim.get("metadata") or {}
            if meta.get("uid") != ref.uid:
                raise StatusRefused(f"ResourceClaim {ref.namespace}/{ref.name} has another UID: it was replaced")
            now = latest() if latest is not None else entries
            status = claim.get("status") or {}
            ours = [e for e in status.get("devices") or [] if e.get("driver") == self.driver_name]
            if ours == now:
                return False
            if now and not status.get("allocation"):
                raise StatusRefused(f"ResourceClaim {ref.namespace}/{ref.name} is not allocated (any more)")
            try:
                self.api.apply_status(apply_body(ref, now), meta.get("resourceVersion"))
                return True
            except ApiFailure as err:
                if err.code == 409:  # changed since our read (or replaced: the next read tells)
                    continue
                if err.code in (400, 403, 404, 422):
                    raise StatusRefused(str(err)) from err
                raise
        raise StatusConflict(f"ResourceClaim {ref.namespace}/{ref.name} changed during each of {CONFLICTS} writes")

    def close(self) -> None:
        self.api.close()


class DirStatus:
    """The ``dir:`` store's claim file, rewritten atomically."""

    def __init__(self, path: str, driver_name: str, lock_timeout: float = 0.0):
        self.source = DirClaimSource(path)
        self.driver_name = driver_name
        self.lock_timeout = lock_timeout  # 0: the agent's writer does not wait (a busy lock is retried later)

    def clean_temps(self) -> None:
        """At the agent's start: temps of claim-file rewrites a crash interrupted."""
        claims = os.path.join(self.source.path, "resourceclaims")
        for ns in os.listdir(claims) if os.path.isdir(claims) else ():
            clean_stale_temps(os.path.join(claims, ns), prefix=".")

    def write(self, ref: ClaimRef, entries: list[dict], latest: Latest | None = None) -> bool:
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
            claim = self.source.read_claim(ref.namespace, ref.name)
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
