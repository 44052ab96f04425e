"""A claim's outcome said, for the kubelet and the operator (prepare/driver.py): its error text,
and one log line per claim and call."""

from __future__ import annotations

import logging

from agent.fsutil import UnsafePath
from agent.names import InvalidName
from agent.prepare.allocation import ClaimFailed
from agent.prepare.vfio import VfioError
from agent.prepare.vfio_kernel import KernelError
from cdi.spec import SpecError

log = logging.getLogger("agent.prepare.driver")  # the driver's lines, as operators filter them
# a claim's own error, said as it is; anything else is a bug, logged with its trace
EXPECTED = (ClaimFailed, VfioError, KernelError, SpecError, InvalidName, UnsafePath, OSError)


def log_outcome(what: str, namespace: str, name: str, uid: str, devices: list, error: str | None, seconds: float) -> None:
    """One line per claim and call, for the operator: which claim, its devices, the result."""
    level, result = (logging.WARNING, f"failed: {error}") if error else (logging.INFO, "ok")
    log.log(level, "%s claim %s/%s (%s), devices %s: %s in %.1f ms", what, namespace, name, uid,
            ", ".join(map(str, devices)) or "none", result, seconds * 1e3)


def claim_error(uid: str, stage: str, err: Exception) -> str:
    """The claim's error for ``err`` raised at ``stage`` (a step's or a file's; "" while planning)."""
    if isinstance(err, EXPECTED):
        return f"{stage}: {err}" if stage and not isinstance(err, ClaimFailed) else str(err)
    log.error("claim %s: %s failed", uid, stage or "planning", exc_info=err)
    return f"internal error{f' ({stage})' if stage else ''}: {err}"
