"""Changing ``skip_node_operations`` (KEP-5945) safely: refused while claims of the affected
device kinds are prepared.

A claim keeps the rule it was allocated with (the scheduler copied the slice's list into its
allocation results), so a kind switched to "skip" while one of its claims is prepared would
publish a rule that no longer says what the node did for that device, and switching back
would let the kubelet skip calls for devices we still hold. The agent therefore keeps the
rule it last published (``<plugin dir>/skip-node-operations.json``) until no prepared claim
uses a device of a kind whose rule changes, and says which claims stand in the way.
"""

from __future__ import annotations

import logging
import os

import orjson

from agent.fsutil import atomic_write, json_bytes, read_bounded
from agent.nodeops import rule_problem
from agent.prepare.checkpoint import COMPLETED, Checkpoint
from discovery.models import KINDS

log = logging.getLogger(__name__)

APPLIED_FILE = "skip-node-operations.json"


def _norm(value: dict) -> dict[str, list[str]]:
    return {k: sorted(v) for k, v in value.items() if v}


def changed_kinds(old: dict, new: dict) -> set[str]:
    a, b = _norm(old), _norm(new)
    return {k for k in set(a) | set(b) if a.get(k) != b.get(k)}


def kind_of(device: str) -> str | None:
    """Our device names start with their kind (``discovery.inventory.device_name``)."""
    kind = device.split("-", 1)[0]
    return kind if kind in KINDS else None


def blocking_claims(kinds: set[str], claims: dict[str, dict]) -> list[str]:
    """``namespace/name (device)`` of the prepared claims that hold a device of ``kinds``."""
    out = []
    for uid, entry in claims.items():
        if entry.get("state") != COMPLETED:
            continue
        held = [d.get("device", "") for d in entry.get("devices") or [] if kind_of(d.get("device", "")) in kinds]
        if held:
            who = f"{entry.get('namespace')}/{entry.get('name')}" if entry.get("name") else uid
            out.append(f"{who} ({', '.join(held)})")
    return sorted(out)


def refusal(old: dict, new: dict, claims: dict[str, dict]) -> str | None:
    """Why ``old`` may not become ``new`` now, or None."""
    kinds = changed_kinds(old, new)
    if not kinds:
        return None
    held = blocking_claims(kinds, claims)
    if not held:
        return None
    shown = "; ".join(held[:5]) + (f"; and {len(held) - 5} more" if len(held) > 5 else "")
    return (f"skip_node_operations of {', '.join(sorted(kinds))} not changed: prepared claims hold such devices "
            f"and keep the rule they were allocated with ({shown}); change it once they are unprepared")


def load_applied(plugin_dir: str) -> dict | None:
    try:
        value = orjson.loads(read_bounded(os.path.join(plugin_dir, APPLIED_FILE), 1 << 16))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        log.warning("%s unreadable (%s): taking the configured skip_node_operations", APPLIED_FILE, err)
        return None
    if why := _record_problem(value):  # the agent writes only values its settings allowed
        log.warning("%s damaged (%s): taking the configured skip_node_operations", APPLIED_FILE, why)
        return None
    return value


def _record_problem(value: object) -> str | None:
    """Why ``value`` is no rule the settings allow (so none this agent recorded), or None."""
    if not isinstance(value, dict):
        return "not a mapping"
    for kind, ops in value.items():
        if kind not in KINDS:
            return f"{kind!r} is not a device kind"
        if problem := rule_problem(ops):
            return f"{kind}: {problem}"
    return None


def save_applied(plugin_dir: str, value: dict) -> None:
    try:
        atomic_write(os.path.join(plugin_dir, APPLIED_FILE), json_bytes(value), mode=0o600)
    except OSError as err:
        log.warning("cannot record skip_node_operations in %s: %s", plugin_dir, err)


def prepared_claims(plugin_dir: str, live: Checkpoint | None = None) -> dict[str, dict]:
    """The prepared claims: the running driver's, or read from its checkpoint (read-only)."""
    if live is not None:  # a copy in one step: a prepare's thread may add or remove claims meanwhile
        return dict(live.claims)
    try:
        return Checkpoint.load(os.path.join(plugin_dir, "checkpoint.json"), move_corrupt=False).claims
    except Exception as err:  # unreadable: recovery deals with it; nothing is known to be held
        log.warning("checkpoint not read for the skip_node_operations check: %s", err)
        return {}


def settle(configured: dict, plugin_dir: str, live: Checkpoint | None = None, applied: dict | None = None) -> dict:
    """The skip_node_operations to publish: ``configured``, unless prepared claims forbid the
    change from the one last applied (``applied``, default: the recorded one)."""
    if applied is None:
        applied = load_applied(plugin_dir)
    if applied is not None and (why := refusal(applied, configured, prepared_claims(plugin_dir, live))):
        log.error("%s", why)
        return applied
    if applied != configured and os.path.isdir(plugin_dir):
        save_applied(plugin_dir, configured)
    return configured
