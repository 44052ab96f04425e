"""Optional node operations (KEP-5945, ``DRAOptionalNodeOperations``, alpha in 1.37): the
``skipNodeOperations`` values of a ResourceSlice and of the allocation results the scheduler
copies them into, and upstream's rule for them (``validateSkipNodeOperations``).

Neutral: the settings check the operator's choice with it, publish/ puts it on slices,
prepare/ reads it from allocation results."""

from __future__ import annotations

PREPARE = "NodePrepareResources"
UNPREPARE = "NodeUnprepareResources"
ALL = "*"
KNOWN = (PREPARE, UNPREPARE, ALL)


def rule_problem(ops: object) -> str | None:
    """Why the API server would reject ``ops`` as a slice's skipNodeOperations, or None."""
    if not isinstance(ops, list) or not ops or not all(isinstance(op, str) for op in ops):
        return "must be a non-empty list of operation names"
    unknown = [op for op in ops if op not in KNOWN]
    if unknown:
        return f"unknown operation(s) {', '.join(map(repr, unknown))} (known: {', '.join(KNOWN)})"
    if len(set(ops)) != len(ops):
        return "lists an operation twice"
    if PREPARE in ops and UNPREPARE not in ops and ALL not in ops:
        return f"{PREPARE} may only be skipped together with {UNPREPARE} (or {ALL!r}): a pod must not start without the plugin and then hang in Terminating"
    return None


def skips(ops: object, operation: str) -> bool:
    """Whether an allocation result's ``skipNodeOperations`` skips ``operation``. Values this
    agent does not know are ignored, as the kubelet must ignore them."""
    return isinstance(ops, list) and (ALL in ops or operation in ops)
