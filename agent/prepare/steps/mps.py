"""CUDA MPS as a step (docs/sharing.md, "MPS"): the shares of an NVIDIA GPU run as clients of one
MPS control daemon per GPU (prepare/mps.py), so their memory and compute limits are enforced.

Record (``mps``): the GPUs (UUIDs) whose daemon this claim's shares use, saved before any daemon
starts. ``apply`` makes the running daemons equal to what every claim's record needs (this one
included): a daemon starts with the first share of its GPU and stops with the last. ``undo``
does the same without this claim; ``recover`` (at start, after a reboot, on the kubelet's
re-prepare) starts again the daemons the prepared claims need and stops orphans (a re-prepare
fails while its claim's daemon cannot start: its pod's shares would not be enforced); ``settle`` (at
start) does so even when no claim has a record (the last share went while the agent was away)."""

from __future__ import annotations

import logging
import os
import re
from typing import Callable

from agent.prepare.allocation import ClaimFailed
from agent.prepare.mps import PIPE_IN_CONTAINER, MpsDaemons
from agent.prepare.mps_records import GPU_UUID
from agent.prepare.nvidia import needs_driver
from agent.prepare.ownership import Hold, Ownership
from agent.prepare.records import COMPLETED, MpsUse
from agent.prepare.steps import Planned, RecordOf, Undone
from discovery.models import Device

log = logging.getLogger(__name__)
GPU = re.compile(GPU_UUID)


class MpsStep(RecordOf):
    model = MpsUse
    key = "mps"
    what = "MPS control daemon"  # the stage named in a claim error

    def __init__(self, daemons: MpsDaemons, claims: Callable[[], dict[str, dict]], plans: bool = True):
        self.daemons = daemons
        self.claims = claims  # the checkpoint's entries now
        self.plans = plans  # False: MPS turned off, the step is there for the daemons of claims prepared before

    def plan(self, planned: Planned, owners: Ownership) -> MpsUse | None:
        if not self.plans:
            return None
        gpus = sorted({dev.gpu.nvidia_uuid for r in planned.results if r.share_id
                       and (dev := planned.names.get(r.device)) is not None and needs_driver(dev) and dev.gpu.nvidia_uuid})
        return MpsUse(gpus=gpus) if gpus else None

    def adopted(self, names: list[str], spec: dict) -> MpsUse | None:
        """An adopted claim's GPUs (its record lost with a corrupt checkpoint) whose daemon its spec's
        shares are clients of (they mount its pipe dir): the daemon keeps serving them until unprepare."""
        pipes = [m.get("hostPath") for d in spec.get("devices") or () for m in (d.get("containerEdits") or {}).get("mounts") or ()
                 if isinstance(m, dict) and m.get("containerPath") == PIPE_IN_CONTAINER]
        gpus = sorted({uuid for p in pipes if isinstance(p, str) and GPU.match(uuid := os.path.basename(os.path.dirname(p)))
                       and self.daemons.dirs(uuid)["pipe"] == p})
        return MpsUse(gpus=gpus) if gpus else None

    def holds(self, record: MpsUse) -> list[Hold]:
        return []  # the shares themselves are held (planner.device_holds); a daemon serves them all

    def _needed(self, entries: dict[str, dict], but: str | None = None) -> set[str]:
        out: set[str] = set()
        for uid, entry in entries.items():
            if uid != but and (rec := self.read(entry)) is not None:
                out.update(rec.gpus)
        return out

    def apply(self, planned: Planned, record: MpsUse) -> tuple[MpsUse, dict[str, Device]]:
        wanted = self._needed(planned.others, planned.uid)
        errors = self.daemons.reconcile(wanted | set(record.gpus))
        if failed := [errors[g] for g in record.gpus if g in errors]:
            self.daemons.reconcile(wanted)  # put the host back: no daemon started for this claim alone
            raise ClaimFailed("; ".join(failed))
        return record, {}

    def undo(self, record: MpsUse, others: dict[str, dict]) -> Undone:
        errors = self.daemons.reconcile(self._needed(others))
        return Undone(notes=[f"MPS: {e}" for e in errors.values()])

    def recover(self, record: MpsUse) -> bool:
        """The daemons the prepared claims need started again; ClaimFailed where this claim's cannot
        be: the kubelet's re-prepare must not start a pod whose shares no daemon enforces."""
        prepared = {u: e for u, e in self.claims().items() if e.get("state") == COMPLETED}
        errors = self.daemons.reconcile(self._needed(prepared) | set(record.gpus))
        for err in errors.values():
            log.error("MPS: %s (the shares of that GPU are not enforced until it starts)", err)
        if failed := [errors[g] for g in record.gpus if g in errors]:
            raise ClaimFailed("; ".join(failed))
        return False

    def settle(self, entries: dict[str, dict]) -> None:
        """At start: daemons only for the prepared claims' GPUs (orphans stopped, their dirs gone)."""
        prepared = {u: e for u, e in entries.items() if e.get("state") == COMPLETED}
        for err in self.daemons.reconcile(self._needed(prepared)).values():
            log.error("MPS: %s (the shares of that GPU are not enforced until it starts)", err)

    def devices_now(self, record: MpsUse, devices: dict[str, Device]) -> dict[str, Device]:
        return {}
