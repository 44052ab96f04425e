"""An NVIDIA GPU's memory repairs (row remapping, A100 and later), read from NVML every health
round (docs/health.md, "GPU memory").

A row that gave an uncorrectable ECC error is remapped to a spare one. The remap takes effect at
the GPU's next reset: until then it is *pending*, and a program may meet the bad row again. A GPU
out of spare rows *fails* the remap: NVIDIA's guidance is to replace it. Both are faults of the
GPU (no new claims; running ones are the operator's call, `taint_effects`). They are read fresh
each round, never kept: a reset that applied the remap clears the pending one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

# NVML_ERROR_*: a GPU (before Ampere) or a driver without row remapping
NOT_SUPPORTED, FUNCTION_NOT_FOUND = 3, 13
_UNSUPPORTED = object()


@dataclass(frozen=True)
class RowRemaps:
    correctable: int  # rows remapped for correctable errors
    uncorrectable: int  # ... for uncorrectable ones
    pending: bool  # a remap waits for the GPU's reset
    failed: bool  # a remap failed: no spare row left


def fault(remaps: RowRemaps) -> tuple[str, str] | None:
    """(reason, message) of a GPU whose memory needs the operator, else None."""
    rows = f"{remaps.uncorrectable} rows remapped for uncorrectable errors, {remaps.correctable} for correctable ones"
    if remaps.failed:
        return "row-remap-failure", f"GPU memory row remapping failed ({rows}): NVIDIA advises replacing the GPU"
    if remaps.pending:
        return "row-remap-pending", f"a GPU memory row remap is pending ({rows}): drain the GPU and reset it to apply it"
    return None


def _parse(answer) -> RowRemaps | None:
    """NVML's (corrRows, uncRows, isPending, failureOccurred); anything else is no answer."""
    if not (isinstance(answer, (tuple, list)) and len(answer) == 4):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in answer):
        return None
    corr, unc, pending, failed = answer
    return RowRemaps(corr, unc, bool(pending), bool(failed))


class RowRemapReader:
    """``read(bdf)``: the GPU's row remapping, asked on NVML's own thread and waited for with its
    timeout (call it from a worker thread), or None when NVML is off, gave up, or cannot say. A
    GPU that does not support the query is not asked again (no warning every round)."""

    def __init__(self, nvml):
        self.nvml = nvml  # discovery.nvml.Nvml, or None
        self.unsupported: set[str] = set()

    def read(self, bdf: str) -> RowRemaps | None:
        nvml = self.nvml
        if nvml is None or nvml.failed or bdf in self.unsupported:
            return None
        nv = nvml.pynvml

        def ask():
            try:
                return nv.nvmlDeviceGetRemappedRows(nv.nvmlDeviceGetHandleByPciBusId(bdf))
            except nv.NVMLError as err:
                if getattr(err, "value", None) in (NOT_SUPPORTED, FUNCTION_NOT_FOUND):
                    return _UNSUPPORTED
                raise

        answer = nvml.call(f"remapped rows of GPU {bdf}", ask)
        if answer is _UNSUPPORTED:
            self.unsupported.add(bdf)
            log.info("GPU %s: NVML has no row remapping for it (before Ampere?): its memory repairs are not watched", bdf)
            return None
        return _parse(answer)
