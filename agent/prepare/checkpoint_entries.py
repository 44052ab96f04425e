"""Which checkpoint entries this agent uses (docs/kubelet-plugin.md, "Checkpoint compatibility").

Every entry read back from the files (a snapshot's, a journal record's) is sorted (``sort_entry``):

- *ours*: it passes the typed records (records.py) as it is, and is used.
- *foreign*: it fails them only by fields this agent does not know (pydantic's ``extra_forbidden``,
  at any depth) and passes once they are left out: a newer sysdra wrote it (the other instance of a
  rolling update, or the version before a rollback). Its *known part* (the entry without those
  fields) is used as a claim's entry; the entry itself is kept as the files hold it (its canonical
  JSON, ``Foreign.raw``), and every save writes that while the claim has an entry (checkpoint.py),
  so the newer agent finds it whole. The unknown fields are never interpreted: their names are said
  (logged once, counted, ``sysdra doctor``), truncated and escaped.
- *damaged*: anything else (a known field of a bad type or value, a new value of a known field, a
  bad UID or name): rejected, moved aside to ``checkpoint.json.rejected-<time>`` and never used
  (its claim is adopted from its CDI spec: prepare/recovery.py).

Why not a stricter rule (a foreign entry left out, as before): the older agent of a rolling update
reads the newer one's saves, and its next compaction wrote the files without the entries it did not
use, losing the newer agent's records of host changes (MIG mode turned off, a netdev in a pod).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

from agent.counts import Count
from agent.fsutil import WriteError, atomic_write, json_bytes
from agent.prepare.checkpoint_format import COMPLETED, canonical

log = logging.getLogger("agent.prepare.checkpoint")

REJECTED_ENTRIES = Count("sysdra_checkpoint_entries_rejected_total",
                         "Checkpoint entries that passed their checksum but not their checks, moved aside")
FOREIGN_ENTRIES = Count("sysdra_checkpoint_entries_foreign_total",
                        "Checkpoint entries with fields this sysdra does not know (a newer one wrote them), "
                        "kept as written; each counted once")

SHOWN = 8  # unknown fields named in one line
KEPT_NAMES = 64  # unknown fields' names kept per entry (a hostile entry may have any number)
NAME_CHARS = 80


@dataclass(frozen=True)
class Foreign:
    """An entry a newer sysdra wrote: ``raw``, what every save writes for it; ``unknown``, the
    paths of the fields this agent does not know (``futureThing``, ``netdevs.*.newField``)."""

    raw: bytes
    unknown: tuple[str, ...]
    count: int  # unknown fields in all (``unknown`` keeps the first KEPT_NAMES)

    @property
    def fields(self) -> str:
        more = f" ({self.count} in all)" if self.count > SHOWN else ""
        return ", ".join(self.unknown[:SHOWN]) + more


def sort_entry(path: str, uid: object, entry: object) -> tuple[dict | None, Foreign | None, str | None]:
    """-> (the entry to use, its Foreign if a newer sysdra wrote it, None), or (None, None, why it
    is damaged: one line). A foreign entry is logged and counted the first time it is seen."""
    from pydantic import ValidationError

    from agent.prepare.records import check_entry, describe

    try:
        check_entry(uid, entry)
        return entry, None, None  # type: ignore[return-value]  # checked: a dict
    except ValidationError as err:
        if any(e["type"] != "extra_forbidden" for e in err.errors()):
            return None, None, describe(err)
        locs, why = [e["loc"] for e in err.errors()], describe(err)
    except ValueError as err:
        return None, None, describe(err)
    raw = canonical(entry)
    known = _without(json.loads(raw), locs)  # a copy: what the agent does to it never reaches ``raw``
    try:
        if known is None:  # an unknown field where the entry has none: not pydantic's entry
            return None, None, why
        check_entry(uid, known)
    except ValueError as err:
        return None, None, describe(err)
    names = sorted({_name(loc) for loc in locs})
    foreign = Foreign(raw, tuple(names[:KEPT_NAMES]), len(names))
    _report(path, uid, foreign)  # type: ignore[arg-type]  # checked: a UID
    return known, foreign, None


def _without(entry: object, locs: list[tuple]) -> dict | None:
    """``entry`` without the fields at ``locs`` (each a path of keys and list indexes), or None."""
    for loc in locs:
        parent = entry
        try:
            for step in loc[:-1]:
                parent = parent[step]
            del parent[loc[-1]]
        except (KeyError, IndexError, TypeError):
            return None
    return entry if isinstance(entry, dict) else None


def _name(loc: tuple) -> str:
    """A field's path for a log line: list indexes as ``*``, non-ASCII and control characters escaped."""
    text = ".".join("*" if isinstance(p, int) else str(p) for p in loc)
    return text.encode("unicode_escape").decode("ascii")[:NAME_CHARS]


_REPORTED: set[tuple[str, str, tuple[str, ...]]] = set()  # (checkpoint, claim, fields) said in this process


def _report(path: str, uid: str, foreign: Foreign) -> None:
    key = (os.path.abspath(path), uid, foreign.unknown)
    if key in _REPORTED:
        return
    if len(_REPORTED) > 10_000:  # bounded: a hostile file's entries are said again at worst
        _REPORTED.clear()
    _REPORTED.add(key)
    FOREIGN_ENTRIES.inc()
    log.warning("CHECKPOINT ENTRY OF A NEWER SYSDRA: claim %s in %s has fields this sysdra does not know (%s): "
                "kept as written; its claim is held as prepared from the fields it knows, and what the others "
                "record is left to the sysdra that wrote them (docs/kubelet-plugin.md, \"Checkpoint compatibility\")",
                uid, path, foreign.fields)


def removed(path: str, uid: str, foreign: Foreign) -> None:
    """A foreign entry left the files (its claim unprepared): said loudly, what it alone knew is lost."""
    log.error("CHECKPOINT ENTRY OF A NEWER SYSDRA REMOVED: claim %s in %s: this sysdra undid what its known fields "
              "record; whatever its fields %s recorded on the host is NOT undone (a GPU mode, a device of the "
              "newer version's: see that version's docs)", uid, path, foreign.fields)


def again_refusal(foreign: Foreign, entry: dict, same_allocation: bool, claim: dict) -> str | None:
    """Why a prepare of a claim whose entry is foreign is refused, or None: it is answered as for a
    prepared claim where the known part says prepared, of this allocation, and the answer changes
    nothing in the entry (which this agent cannot write without the unknown fields)."""
    from agent.prepare.netdevs import reserved_pods

    if entry["state"] != COMPLETED:
        what = "its prepare was interrupted"
    elif not same_allocation:
        what = "its allocation changed"
    elif entry.get("netdevs") and reserved_pods(claim) != entry.get("pods"):
        what = "the pods it is reserved for changed"
    else:
        return None
    return (f"its checkpoint entry was written by a newer sysdra (fields this one does not know: {foreign.fields}) "
            f"and {what}: preparing it again would drop those fields, so this sysdra leaves it as it is. The newer "
            "sysdra prepares it; or delete the claim's pods, and the kubelet unprepares it")


def keep_rejected_aside(path: str, rejected: dict[object, tuple[object, str]], when: int) -> str | None:
    """The rejected entries kept for the operator in ``<path>.rejected-<when>`` (None: could not
    be written); they are never used (their claims are adopted from their spec files)."""
    aside: str | None = f"{path}.rejected-{when}"
    body = {str(uid): {"entry": entry, "why": why} for uid, (entry, why) in rejected.items()}
    try:
        atomic_write(aside, json_bytes(body), mode=0o600, durable=True)
    except WriteError as err:
        log.error("cannot keep the rejected checkpoint entries in %s: %s", aside, err)
        aside = None
    for uid, (_, why) in rejected.items():
        REJECTED_ENTRIES.inc()
        log.error("CHECKPOINT CORRUPT ENTRY: claim %s in %s: %s; moved aside to %s, not used", str(uid)[:80], path, why, aside)
    return aside
