"""Host changes at prepare, one step per kind (docs/architecture.md, "Prepare"): a step is a
module here with a class of five methods and a typed record (prepare/records.py) kept in the
claim's checkpoint entry under the step's ``key``:

- ``plan(planned, owners)`` -> its record, or None when the claim needs no such change; checks
  only (``ClaimFailed``/its own error for a refusal), nothing written. The record is saved
  durably (in the PrepareStarted entry) before ``apply`` runs.
- ``holds(record)`` -> what the change holds (prepare/ownership.py), refused on conflict.
- ``apply(planned, record)`` -> (the record to keep once prepared, devices as they are after
  the change); on its own failure it puts the host back as it was and raises, ``NotUndone``
  when it could not (the claim keeps its entry, as for ``undo``'s problems, with the record
  ``NotUndone`` gives, if any).
- ``undo(record, others)`` -> ``Undone``: on a later failure, on unprepare, and at start for an
  interrupted prepare. ``others``: the other claims' entries. With problems the host is not
  as before: the claim keeps its entry (with ``Undone.record`` in place of its record, if any)
  and the undo is retried.
- ``recover(record)`` -> True if the host had to be changed again: a prepared claim's change
  made again (after a reboot the kernel forgot it), at start and on the kubelet's re-prepare.
- ``settle(entries)``, optional: at start, after every claim was recovered, what no entry's
  record needs any more is removed (MPS daemons whose last share went while the agent was away).
- ``devices_now(record, devices)`` -> the claim's devices the change gives other nodes, as the
  kernel shows them now (a spec rebuilt after a reboot).
- optional ``orphans(entries)`` -> notes: at start, once interrupted prepares are rolled back,
  changes of its kind that no entry records are undone (MIG devices, prepare/recovery.py).

A new kind of host change (MIG instances, MPS daemons, netdev moves) is one module and one
record type, added to ``Driver.steps``; the driver applies them in that order and undoes them in reverse."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from agent.prepare.allocation import Result
from agent.prepare.ownership import Hold, Ownership
from discovery.models import Device


@dataclass
class Planned:
    """One claim as the driver planned it; what the steps plan from."""

    uid: str
    claim: dict
    results: list[Result]
    configs: list
    inventory: dict[str, Device]  # device name -> device, of the inventory
    names: dict[str, Device]  # the inventory's devices and those a step plans (partition ways)
    others: dict[str, dict]  # the other claims' checkpoint entries (at apply: as they are then)
    ways: dict = field(default_factory=dict)  # GPU ways (discovery/gpuways.py) of the inventory planned against


@dataclass
class Undone:
    problems: list[str] = field(default_factory=list)  # what could not be put back
    notes: list[str] = field(default_factory=list)  # what was put back, for the recovery report
    # with problems: the step's record to keep in the claim's entry instead of the one undone (what
    # is left to undo is not what was recorded: a VFIO give-back still in the kernel, ``pending``), or None
    record: Any = None


class NotUndone(Exception):
    """``apply`` failed (``err``, the claim's error) and could not put the host back (``problems``).
    ``record``: the step's record to keep in the claim's entry instead of the planned one (what
    is left to undo is not what was planned: a VFIO write still in the kernel), or None."""

    def __init__(self, err: Exception, problems: list[str], record: Any = None):
        super().__init__(f"{err}; not undone: {'; '.join(problems)}")
        self.err, self.problems, self.record = err, problems, record


class NotRecovered(Exception):
    """``recover`` failed (``err``) and what is left to undo is not the claim's record: ``record``
    (written form) goes into the claim's entry under ``key`` (a VFIO write still in the kernel:
    ``pending``, so that an agent started later does not give the function back under it)."""

    def __init__(self, err: Exception, key: str, record: Any):
        super().__init__(str(err))
        self.err, self.key, self.record = err, key, record


class RecordsOf:
    """``read``/``write`` of a step whose record is a tuple of ``model`` (a records.py model)."""

    key: str
    model: Any

    def read(self, entry: dict) -> tuple | None:
        recs = entry.get(self.key)
        return tuple(self.model.model_validate(r) for r in recs) if recs else None

    def write(self, record: tuple) -> list[dict]:
        return [r.dump() for r in record]


class RecordOf:
    """``read``/``write`` of a step whose record is one ``model``."""

    key: str
    model: Any

    def read(self, entry: dict) -> Any | None:
        rec = entry.get(self.key)
        return self.model.model_validate(rec) if rec else None

    def write(self, record: Any) -> dict:
        return record.dump()


class Step(Protocol):
    key: str  # the record's key in the checkpoint entry
    what: str  # the stage a claim's error names when applying it fails

    def read(self, entry: dict) -> Any | None: ...  # the typed record of an entry, or None

    def write(self, record: Any) -> object: ...  # the record's JSON form for the entry

    def plan(self, planned: Planned, owners: Ownership) -> Any | None: ...

    def holds(self, record: Any) -> list[Hold]: ...

    def apply(self, planned: Planned, record: Any) -> tuple[Any, dict[str, Device]]: ...

    def undo(self, record: Any, others: dict[str, dict]) -> Undone: ...

    def recover(self, record: Any) -> bool: ...

    def devices_now(self, record: Any, devices: dict[str, Device]) -> dict[str, Device]: ...
