"""What the reconciler needs from a place that holds ResourceSlices, and its errors."""

from __future__ import annotations

from typing import Protocol


class StoreError(Exception):
    """A failed read or write that is worth retrying later (5xx, timeout, I/O error)."""


class Conflict(StoreError):
    """Stale resourceVersion / failed precondition / name taken (HTTP 409): re-list and retry."""


class Invalid(StoreError):
    """The server refused the object (HTTP 422); ``fields``: the paths its field errors name."""

    def __init__(self, message: str, fields: tuple[str, ...] = ()):
        super().__init__(message)
        self.fields = fields


class NotFound(StoreError):
    """The object is gone (HTTP 404)."""


class Gone(StoreError):
    """A watch asked for a resourceVersion the server no longer has (HTTP 410): re-list."""


class SliceStore(Protocol):
    # True when the store needs full names (offline dir); False: the API generates them
    full_names: bool

    async def list_slices(self) -> list[dict]:
        """All slices of this node and driver, with metadata.name/uid/resourceVersion."""

    async def create(self, obj: dict) -> dict: ...

    async def update(self, obj: dict) -> dict:
        """Replace; ``obj.metadata.resourceVersion`` must match (else Conflict)."""

    async def delete(self, name: str, uid: str, resource_version: str) -> None:
        """Delete with UID + resourceVersion preconditions (mismatch -> Conflict)."""
