"""Device logic behind the kubelet plugin: allocation -> devices, host changes -> CDI spec.

Prepare is two-phase in the checkpoint so a crash at any point is repaired at the next start
(``recover``):

1. ``PrepareStarted`` entries saved, with each host-change step's record (prepare/steps/);
   durably when there is one (it is the intent recovery undoes)   - crash: rolled back at start
2. the steps applied, then CDI specs and metadata files written   - crash: rolled back at start
3. full ``PrepareCompleted`` entries saved durably                - crash: claim stays prepared

Every claim of a call is planned first (planner.py), against one ownership table of what
every other claim holds (ownership.py), before anything is written; any failure of one claim,
expected or not, is that claim's error: what was applied for it is undone in reverse and its
files removed (an undo with problems keeps its PrepareStarted entry: retried), and the other
claims of the call go on.

Unprepare undoes the steps (VFIO functions given back) while the claim is still recorded,
then saves the checkpoint without it, then removes the specs and metadata; a crash in between
leaves orphans that ``recover`` (or the kubelet's retry) deletes. ``fault`` is a test hook
called at each of these points.

Claims and the checkpoint are input: allocation results are checked before anything is
recorded (allocation.py), checkpoint entries are typed records checked on load (records.py; one
a newer sysdra wrote is answered from what this one knows, never rewritten: checkpoint_entries.py),
names are checked before they become paths, and the only files written or removed are ours
(claimfiles.py).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Callable, Iterable

from agent.kubeletplugin.types import ClaimRef, PrepareResult
from agent.prepare import cdifiles, claimstatus, computemode, planner, recovery
from agent.prepare.allocation import ClaimFailed, our_results
from agent.bootid import read_boot_id
from agent.prepare.checkpoint import COMPLETED, Checkpoint
from agent.prepare.checkpoint_entries import again_refusal
from agent.prepare.checkpoint_view import Saved
from agent.prepare.claimconfig import opaque_configs
from agent.prepare.claimfiles import ClaimFiles
from agent.prepare.metadata import store as metadata
from agent.prepare.mps_watch import MpsSupervisor
from agent.prepare.netdevs import reserved_pods
from agent.prepare.netmove import host_netns
from agent.prepare.ownership import Hold, Ownership
from agent.prepare.nvidia import NvidiaDriver
from agent.prepare.outcome import claim_error, log_outcome
from agent.prepare.partitions import Partitions
from agent.prepare.recovery import RecoveryReport
from agent.prepare.steps import NotRecovered, NotUndone, Planned
from agent.prepare.mig import MigDevices, shared_nvml
from agent.prepare.steps.mig import MigStep
from agent.prepare.steps.migmode import MigModeStep
from agent.prepare.steps.mps import MpsStep
from cdi.nodegroup import group_reader
from agent.prepare.steps.netdev import NetdevStep
from agent.prepare.steps.partition import PartitionStep
from agent.prepare.steps.timeslice import TimeSliceStep
from agent.prepare.steps.vfio import VfioStep
from agent.prepare.vfio_kernel import PciKernel
from agent.quantity import parse_quantity
from agent.settings import Settings
from agent.sharecaps import capacity_values, merged_policies, published_shared
from discovery.models import Device, Inventory

log = logging.getLogger(__name__)


@dataclass
class _Call:
    """One prepare call's bookkeeping."""

    before: dict[str, dict]  # what the checkpoint files hold
    out: dict[str, PrepareResult] = field(default_factory=dict)
    changed: set[str] = field(default_factory=set)  # entries to journal
    todo: list[str] = field(default_factory=list)  # claims planned, to apply
    plans: dict[str, tuple[dict, Planned, dict]] = field(default_factory=dict)  # uid -> (entry, planned, records)
    started: dict[str, dict] = field(default_factory=dict)  # uid -> its PrepareStarted entry, as saved
    owners: Ownership | None = None  # built when a claim is planned (a re-prepare reads no inventory)


class Driver:
    LATER = frozenset({"netdevs"})  # steps whose apply changes nothing on the host (the NRI plugin does, later)

    def __init__(self, settings: Settings, inventory: Callable[[], Inventory]):
        self.settings, self.inventory = settings, inventory
        self.checkpoint_path = os.path.join(settings.plugin_dir, "checkpoint.json")
        self.checkpoint: Checkpoint | None = None
        self.saved: Saved | None = None  # the files as our last save left them, for the NRI plugin's look
        self.boot_id, self.kernel = read_boot_id(settings.root), PciKernel(settings.root)  # the boot ID: recovery's reboot test
        self.recovery: RecoveryReport | None = None  # of the last recover()
        self.fault: Callable[[str], None] = lambda point: None
        self.hardware_changed: Callable[[], None] = lambda: None  # the daemon rescans and republishes
        self.recorded_status = claimstatus.RecordedStatus(lambda: self.checkpoint)  # for the status writer
        self.nvidia = NvidiaDriver.of(settings, self.boot_id, computemode.DaemonModes.of(settings))
        mechanics = Partitions(settings.root, inventory, settings.partition_switch_timeout, fault=lambda point: self.fault(point))
        self.partitions = mechanics if settings.partitions else None
        self.all_ways = mechanics.ways  # what claims hold: partitions of claims prepared before partitions went off too
        # host changes, applied in this order and undone in reverse (prepare/steps/). A kind the settings turned
        # off keeps its step: what claims prepared before recorded is undone at their unprepare (never planned: no ways)
        self.steps = [PartitionStep(mechanics, lambda: self.hardware_changed())]
        # dynamic MIG, MIG mode off for a whole GPU; with nvml off too (no profiles: nothing planned, earlier records undone)
        self.mig = MigDevices(settings.root, shared_nvml(settings.root, settings.nvidia_driver_root), settings.nvidia_mig_enable, lambda p: self.fault(p))
        mig = MigStep(self.mig, self.partitions.ways) if self.partitions else MigStep(self.mig, dict, lambda: self.hardware_changed())
        self.steps += [mig, MigModeStep(self.mig, inventory)]
        self.steps.append(VfioStep(settings.root, settings.driver_name, self.kernel, lambda point: self.fault(point), inventory,
                                   lambda: host_netns(settings.root), settings.allow_host_in_use_nics))
        self.steps.append(NetdevStep(settings, lambda: host_netns(settings.root)))
        self.steps.append(TimeSliceStep(settings.driver_name, lambda: self.nvidia.tool("nvidia-smi"), lambda p: self.fault(p), settings.root))
        if self.nvidia.mps is not None:  # (also MPS turned off while daemons are recorded: stopped as their shares go)
            self.steps.append(MpsStep(self.nvidia.mps, lambda: self.checkpoint.claims if self.checkpoint else {}, self.nvidia.mps_shares))
        # what shared devices offer, as published (the policies are checked at start: exit 78)
        self.share_policies = {kind: list(merged_policies(kind, settings.share_policies).items()) for kind in settings.share}
        self.mps_watch = None  # prepare/mps_watch.MpsSupervisor once supervise_mps is called
        self.files = ClaimFiles(settings, inventory, self.steps, lambda: self.checkpoint, self.nvidia, self.all_ways)

    # --- helpers -------------------------------------------------------------
    def _cp(self) -> Checkpoint:
        if self.checkpoint is None:
            self.recover()
        else:  # called under the serialize lock: another process may have saved meanwhile
            try:
                self.checkpoint.reload_if_changed()
            except ValueError:  # damaged meanwhile: repaired as at start, never written on from stale memory
                self.repair_checkpoint()
        assert self.checkpoint is not None
        return self.checkpoint

    def _spec_path(self, uid: str) -> str:
        return self.files.spec_path(uid)

    def holds(self, uid: str, entry: dict) -> list[Hold]:
        """What a claim's entry holds: its devices, and what its steps changed."""
        out = planner.device_holds(entry, self.inventory().by_name(), self.all_ways(), self._capacities)
        return out + [h for step in self.steps if (rec := step.read(entry)) is not None for h in step.holds(rec)]

    def _capacities(self, dev: Device) -> dict[str, Fraction] | None:
        """The capacities ``dev``'s shares are accounted against, as published (None: not shared)."""
        if not published_shared(dev, self.share_policies):
            return None
        return {name: parse_quantity(v) for name, v in capacity_values(dev, self.share_policies[dev.kind]).items()}

    def _undo(self, entry: dict, others: dict[str, dict], steps=None) -> tuple[list[str], dict]:
        """The entry's host changes undone in reverse -> (problems (empty: all undone), the entry
        to keep while there are: with the records the undos left, e.g. a VFIO write ``pending``)."""
        problems, kept = [], entry
        for step in reversed(self.steps if steps is None else steps):
            if (rec := step.read(entry)) is not None:
                problems += (undone := step.undo(rec, others)).problems
                if undone.record is not None:
                    kept = {**kept, step.key: step.write(undone.record)}
        return problems, kept

    # --- prepare ---------------------------------------------------------------
    def prepare_claims(self, claims: list[dict]) -> dict[str, PrepareResult]:
        t0 = time.monotonic()
        out = self._prepare_claims(claims)
        for m in (c["metadata"] for c in claims):
            res = out.get(m["uid"]) or PrepareResult(error="no result")
            log_outcome("prepare", m["namespace"], m["name"], m["uid"], [d.device for d in res.devices], res.error,
                        time.monotonic() - t0)
        return out

    def _prepare_claims(self, claims: list[dict]) -> dict[str, PrepareResult]:
        cp = self._cp()
        call = _Call(before=dict(cp.claims))  # entries are replaced, not mutated
        for claim in claims:
            uid = claim["metadata"]["uid"]
            try:
                self._begin(cp, call, claim)
            except Exception as err:  # noqa: BLE001 - one claim's failure, whatever it is, stays its own
                call.out[uid] = PrepareResult(error=claim_error(uid, "", err))
        if not call.todo:
            if call.changed and (err := self._save(cp, call.before, call.changed)):
                call.out = {uid: PrepareResult(error=err) for uid in call.out}
            return call.out
        # a host change's intent; a netdev's waits for its pod (its record needs no fsync yet)
        durable = any(k not in self.LATER for planned in call.plans.values() for k in planned[2])
        if err := self._save(cp, call.before, call.changed, durable=durable):
            for uid in call.todo:  # nothing written yet; memory is back to what the file says
                call.out[uid] = PrepareResult(error=err)
            return call.out
        self.fault("prepare:started")
        for uid in call.todo:
            self._apply(cp, call, uid)
        self.fault("prepare:specs-written")
        started = {uid: call.started[uid] for uid in call.todo if uid in cp.claims}
        if err := self._save(cp, {**cp.claims, **started}, call.todo):
            others = dict(cp.claims)  # the file still says PrepareStarted: a retry starts clean
            for uid, entry in started.items():  # each undo counts the claims not undone yet (the last gives back)
                del others[uid]
                self._undo(entry, others)
                self.files.remove(entry, uid, entry["namespace"], entry["name"])
                call.out[uid] = PrepareResult(error=err)
            return call.out
        self.fault("prepare:completed")
        return call.out

    def _begin(self, cp: Checkpoint, call: _Call, claim: dict) -> None:
        """Plan one claim (or answer a re-prepare); its PrepareStarted entry goes into memory."""
        meta = claim["metadata"]  # checked by the plugin: identity equals the request's
        uid = meta["uid"]
        raw, results = our_results(claim, self.settings.driver_name)
        configs = opaque_configs(claim, self.settings.driver_name)
        fp = planner.fingerprint(results)
        entry = cp.claims.get(uid)
        if entry is not None and (filled := planner.filled_in(uid, entry, claim, results, fp, self.settings, self.nvidia,
                                                              self.inventory, self.all_ways)) is not None:
            entry = cp.claims[uid] = self._replanned(uid, filled, claim, results, configs)  # an adopted entry
            call.changed.add(uid)
        same = entry is not None and planner.same_allocation(entry, raw, results)
        if uid in cp.foreign and (why := again_refusal(cp.foreign[uid], entry, same, claim)):  # a newer sysdra's entry
            raise ClaimFailed(why)
        if entry and entry["state"] == COMPLETED and same:
            call.out[uid] = self._again(cp, call, uid, entry, claim)
            return
        owners = call.owners = call.owners or Ownership.of(cp.claims, self.holds)
        if entry:  # half-prepared or allocation changed: undo before redoing
            self._forget(cp, call, uid, entry, owners)
        inv = self.inventory()  # the daemon may rescan meanwhile: one inventory for the claim
        by_name = inv.by_name()
        planned = Planned(uid, claim, results, configs, inventory=by_name, names=by_name,
                          others={u: e for u, e in cp.claims.items() if u != uid},
                          ways=self.partitions.ways(inv) if self.partitions else {})
        records = {st.key: rec for st in self.steps if (rec := st.plan(planned, owners)) is not None}
        devices, entry_plan = planner.entry(planned, fp, records, self.steps, self.settings, self.boot_id,
                                            self._spec_path, self.nvidia)
        if why := owners.refusal(uid, holds := self.holds(uid, entry_plan)):
            raise ClaimFailed(why)
        planner.add_records(entry_plan, planned, devices, records, self.settings, earlier=entry)
        owners.take(uid, holds, f"{meta['namespace']}/{meta['name']}")
        cp.claims[uid] = call.started[uid] = planner.started(entry_plan, records)
        call.plans[uid] = (entry_plan, planned, records)
        call.out[uid] = PrepareResult(devices, status=entry_plan.get("deviceStatus"))
        call.todo.append(uid)
        call.changed.add(uid)

    def _replanned(self, uid: str, entry: dict, claim: dict, results: list, configs: list) -> dict:
        """An adopted entry filled in with planned records ``_again`` makes good: netdevs (or their loss), time slices."""
        by_name, out = self.inventory().by_name(), dict(entry)
        planned = Planned(uid, claim, results, configs, by_name, by_name, others={})
        for st in (st for st in self.steps if isinstance(st, (NetdevStep, TimeSliceStep)) and not entry.get(st.key)):
            if isinstance(st, NetdevStep) and not entry.get("netdevsLost"):
                out.update(st.replanned(planned, reserved_pods(claim)))
            elif isinstance(st, TimeSliceStep) and (rec := st.plan(planned, Ownership())):
                out[st.key] = st.write(rec)
        return out

    def _forget(self, cp: Checkpoint, call: _Call, uid: str, entry: dict, owners: Ownership) -> None:
        """The claim's earlier prepare undone, its files and entry gone, what it held released."""
        problems, cp.claims[uid] = self._undo(entry, {u: e for u, e in cp.claims.items() if u != uid})
        if problems:  # the entry kept as the undo left it (a VFIO write pending), saved with the call's
            call.changed.add(uid)
            raise ClaimFailed("undoing the earlier prepare's host changes failed: " + "; ".join(problems))
        self.files.remove(entry, uid, entry.get("namespace", ""), entry.get("name", ""))
        del cp.claims[uid]
        owners.release(uid)
        call.changed.add(uid)

    def _again(self, cp: Checkpoint, call: _Call, uid: str, entry: dict, claim: dict) -> PrepareResult:
        """Idempotent re-prepare: the same answer; the steps' changes and the files made again where gone (a
        rewrite changes the entry); the pods a claim with netdevs is reserved for followed (one re-prepare a pod)."""
        if entry.get("netdevs") and (pods := reserved_pods(claim)) != entry.get("pods"):
            entry = cp.claims[uid] = {**entry, "pods": pods}  # entries are replaced, never changed in place
            call.changed.add(uid)
        try:
            moved = any([st.recover(rec) for st in self.steps if (rec := st.read(entry)) is not None])
        except NotRecovered as err:  # the claim's error; its entry keeps what is left to undo
            cp.claims[uid] = {**entry, err.key: err.record}
            call.changed.add(uid)
            raise err.err from None
        changed, entry = self.files.again(uid, entry, moved, self.boot_id)  # ClaimFailed: a device gone since a reboot
        if changed | metadata.ensure_claim(self.settings, uid, entry):
            cp.claims[uid] = entry
            call.changed.add(uid)
        return PrepareResult([planner.device_from_record(d) for d in entry["devices"]], status=entry.get("deviceStatus"))

    def _apply(self, cp: Checkpoint, call: _Call, uid: str) -> None:
        """Apply the claim's steps, then write its spec and metadata; on any failure undo what
        was applied, in reverse, and remove its files: the claim's error."""
        entry, planned, records = call.plans[uid]
        # the others as they are now: a claim of this call that failed since is gone, its host changes undone
        planned = replace(planned, others={u: e for u, e in cp.claims.items() if u != uid})
        applied, stage = [], ""
        try:
            now = {}
            for step in self.steps:
                if step.key in records:
                    stage = step.what
                    done, got = step.apply(planned, records[step.key])
                    applied.append(step)
                    entry[step.key] = step.write(done)
                    now.update(got)
            stage = "CDI spec"
            if now:  # devices as the host changes left them (new partitions, VFIO group nodes)
                s = self.settings
                _, spec, _ = planner.devices_and_spec(s.driver_name, s.node_name, s.root, uid, planned.results,
                                                      {**planned.names, **now}, planned.configs, self.nvidia,
                                                      group_reader(s.cdi_additional_gids))
                entry["cdiSpec"] = {"path": self._spec_path(uid), "spec": spec} if spec else None
            if entry["cdiSpec"]:  # built by cdi.spec.finish just now: already valid
                cdifiles.write_spec(entry["cdiSpec"]["path"], entry["cdiSpec"]["spec"], check=False)
            stage = "device metadata"
            metadata.write_claim(self.settings, uid, entry)
        except Exception as err:  # noqa: BLE001 - one claim's failure, whatever it is, stays its own
            problems, kept = self._undo(call.started[uid], {u: e for u, e in cp.claims.items() if u != uid}, steps=applied)
            if isinstance(err, NotUndone):  # raised by the step being applied (``step``)
                if err.record is not None:
                    kept = {**kept, step.key: step.write(err.record)}
                err, problems = err.err, err.problems + problems
            self.files.remove(entry, uid, entry["namespace"], entry["name"])
            if problems:  # the host is not as before: its PrepareStarted entry stays, devices held, the undo retried
                cp.claims[uid] = {**kept, "devices": entry["devices"]}
            else:
                del cp.claims[uid]
            call.out[uid] = PrepareResult(error=claim_error(uid, stage, err) + (
                "; undoing it failed (retried): " + "; ".join(problems) if problems else ""))
            return
        cp.claims[uid] = entry

    def _save(self, cp: Checkpoint, fallback: dict[str, dict], changed: Iterable[str], durable: bool = True) -> str | None:
        """Save the ``changed`` entries; on failure put ``fallback`` (what the files still
        hold) back in memory so memory never claims more than disk, and return the
        per-claim error text."""
        try:
            cp.save(durable=durable, changed=changed)
        except OSError as err:
            cp.claims = fallback
            log.error("checkpoint %s not saved: %s", cp.path, err)
            return f"saving checkpoint: {err}"
        self.saved = Saved.of(cp)
        return None

    # --- unprepare ---------------------------------------------------------------
    def unprepare_claims(self, claims: list[ClaimRef]) -> dict[str, str | None]:
        t0 = time.monotonic()
        cp = self._cp()
        held = {c.uid: [d.get("device") for d in (cp.claims.get(c.uid) or {}).get("devices", ())] for c in claims}
        out = self._unprepare_claims(cp, claims)
        for c in claims:
            log_outcome("unprepare", c.namespace, c.name, c.uid, held[c.uid], out.get(c.uid), time.monotonic() - t0)
        return out

    def _unprepare_claims(self, cp: Checkpoint, claims: list[ClaimRef]) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        undone: set[str] = set()  # claims of this call already undone: no longer holding anything
        before = dict(cp.claims)  # what the files hold
        for ref in claims:  # host changes undone before the claim leaves the checkpoint (a crash: retried)
            entry = cp.claims.get(ref.uid)
            others = {u: e for u, e in cp.claims.items() if u != ref.uid and u not in undone}
            try:
                if entry and (undo := self._undo(entry, others))[0]:
                    out[ref.uid] = "undoing the claim's host changes failed: " + "; ".join(undo[0])
                    cp.claims[ref.uid] = undo[1]  # as the undo left it (a VFIO write pending): saved below
            except Exception as err:  # noqa: BLE001 - stays this claim's error
                out[ref.uid] = claim_error(ref.uid, "undoing host changes", err)
            if ref.uid not in out:
                undone.add(ref.uid)
        claims = [c for c in claims if c.uid not in out]
        removed = {c.uid: cp.claims.pop(c.uid, None) for c in claims}
        if (any(removed.values()) or out) and (err := self._save(cp, before, {*removed, *out})):
            return {**out, **{c.uid: err for c in claims}}  # files kept: the kubelet retries unprepare
        self.fault("unprepare:saved")
        for ref in claims:
            try:
                self.files.remove(removed[ref.uid], ref.uid, ref.namespace, ref.name)
                out[ref.uid] = None
            except OSError as err:
                out[ref.uid] = f"removing CDI spec or device metadata: {err}"
        self.fault("unprepare:done")
        return out

    # --- files and start-up --------------------------------------------------------
    def supervise_mps(self, on_health: Callable[[str, tuple[str, str] | None], None],
                      on_round: Callable[[list[dict]], None] = lambda rows: None) -> None:
        """The MPS daemons supervised from now on (prepare/mps_watch.py): ``on_health(GPU UUID,
        fault or None)`` and ``on_round(rows)`` from its thread. Call after ``recover``; ``close``
        ends it."""
        if self.nvidia.mps is not None and self.mps_watch is None and (self.nvidia.mps_shares or self.nvidia.mps.state.daemons):
            self.mps_watch = MpsSupervisor(self.nvidia.mps, on_health, on_round=on_round)
            self.mps_watch.start()

    def close(self) -> None:
        if self.mps_watch is not None:
            self.mps_watch.stop()
            self.mps_watch = None

    def recover(self) -> RecoveryReport:
        """Load the checkpoint and make the CDI dir (and the kernel) match it. Call before serving."""
        return recovery.recover(self)

    def repair_checkpoint(self) -> RecoveryReport:
        """The same recovery for a checkpoint found damaged while serving (the caller holds the lock)."""
        return recovery.repair(self)
