"""What the agent has done with claims' netdevs (agent/prepare/netdevs.py plans them): the
move records, a file of their own.

A move record is written before the kernel is touched and rewritten after: after a crash
the record says which link may be where (agent/nri/netdev.py finishes or undoes it). The
records file is input on load: a bad one is moved aside, never trusted in part.
"""

from __future__ import annotations

import logging
import os
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, StringConstraints, TypeAdapter, ValidationError

from agent.fsutil import atomic_write_json
from agent.names import is_uid
from agent.prepare.netdevs import IfName

log = logging.getLogger(__name__)


def _uid(v: str) -> str:
    if not is_uid(v):
        raise ValueError("not a UID")
    return v


Uid = Annotated[str, AfterValidator(_uid)]
SandboxId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,128}$")]
NetnsPath = Annotated[str, StringConstraints(pattern=r"^/[^\x00]{1,4095}$")]


class Move(BaseModel):
    """One netdev given to one pod sandbox. ``state``: ``moving`` (recorded, kernel maybe not
    done), ``in-pod`` (done), ``returning`` (going back, maybe done)."""
    model_config = ConfigDict(frozen=True, extra="forbid")
    sandbox: SandboxId
    claim: Uid
    device: str
    host: IfName
    pod: IfName
    netns: NetnsPath
    state: Literal["moving", "in-pod", "returning"]
    mac: str | None = None  # once in the pod: tells the netdev from a host interface of its pod name

    @property
    def key(self) -> str:
        return f"{self.sandbox}/{self.device}"


_RECORDS = TypeAdapter(dict[str, Move])


class MoveRecords:
    """The move records in ``path``; every change is written (atomically, durably) before
    :meth:`put`/:meth:`drop` return. Blocking: call from a worker thread."""

    def __init__(self, path: str):
        self.path = path
        self.moves: dict[str, Move] = {}
        self.loaded = False

    def ensure_loaded(self) -> None:
        if not self.loaded:
            self.load()

    def load(self) -> MoveRecords:
        self.loaded = True
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return self
        try:
            moves = _RECORDS.validate_json(raw)
            if any(k != m.key for k, m in moves.items()):
                raise ValueError("a record's key is not its sandbox/device")
        except (ValidationError, ValueError) as err:
            aside = self.path + ".bad"
            os.replace(self.path, aside)
            log.error("netdev move records %s are unusable (moved to %s): %s", self.path, aside, str(err)[:300])
            return self
        self.moves = moves
        return self

    def _save(self) -> None:
        atomic_write_json(self.path, {k: m.model_dump() for k, m in sorted(self.moves.items())}, mode=0o600,
                          dir_mode=0o750)

    def put(self, move: Move) -> None:
        self.moves[move.key] = move
        self._save()

    def drop(self, move: Move) -> None:
        if self.moves.pop(move.key, None) is not None:
            self._save()

    def of_sandbox(self, sandbox: str) -> list[Move]:
        return [m for m in self.moves.values() if m.sandbox == sandbox]
