"""NVIDIA time-slicing as a step (docs/sharing.md, "Time-slicing"): a claim whose ``GpuConfig``
asks for ``sharing.strategy: TimeSlicing`` gets the driver's time slice of each of its whole
NVIDIA GPUs set (``nvidia-smi compute-policy -i <uuid> --set-timeslice <n>``: Default 0, Short 1,
Medium 2, Long 3), for the pods of the claim that share the GPU.

Record (``timeslice``): the GPUs and intervals, saved before the first ``nvidia-smi`` call. A
failure sets the GPUs already changed back to Default; ``undo`` sets them back when the claim
goes; ``recover`` sets them again after a reboot (the driver forgets its policy), failing the
kubelet's re-prepare while it cannot. Never run on a
GPU whose settings must stay as they are: a claim has to ask for it, and one with admin access
(beside the GPU's other claims, prepare/ownership.py) cannot."""

from __future__ import annotations

import logging
import os
import subprocess
from typing import Callable

from agent.prepare.allocation import ClaimFailed
from agent.prepare.claimconfig import GpuConfig, config_for, opaque_configs
from agent.prepare.nvidia import needs_driver
from agent.prepare.ownership import Hold, Ownership
from agent.prepare.records import TimeSlice
from agent.prepare.steps import NotUndone, Planned, RecordsOf, Undone
from discovery.gpu import parse_nvidia_information
from discovery.models import Device
from discovery.sysfs import AttrError, HostFS

log = logging.getLogger(__name__)

SLICES = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}
TIMEOUT = 30.0
Record = tuple[TimeSlice, ...]


class TimeSliceStep(RecordsOf):
    model = TimeSlice
    key = "timeslice"
    what = "GPU time-slice"  # the stage named in a claim error

    def __init__(self, driver_name: str, smi: Callable[[], tuple[str | None, dict[str, str]]],
                 fault: Callable[[str], None] = lambda point: None, root: str = "/"):
        self.driver_name = driver_name
        self.fs = HostFS(root)  # the driver's GPU list in procfs: whether a GPU has left the node
        self.smi = smi  # -> (nvidia-smi as the agent runs it, its environment), None: the node has none
        self.fault = fault  # a test hook, after each time slice the driver took (tests/faults)

    def plan(self, planned: Planned, owners: Ownership) -> Record | None:
        configs = opaque_configs(planned.claim, self.driver_name)
        out: dict[str, TimeSlice] = {}
        for r in planned.results:
            dev = planned.names.get(r.device)
            cfg = config_for(configs, r.request, dev.kind, dev.name) if dev is not None else None
            if not isinstance(cfg, GpuConfig) or cfg.sharing.strategy != "TimeSlicing":
                continue
            if r.share_id or not needs_driver(dev) or not dev.gpu.nvidia_uuid:
                raise ClaimFailed(f"request {r.request!r}: time-slicing is for whole NVIDIA GPUs, not {dev.name}"
                                  + (" (a share)" if r.share_id else ""))
            if r.admin:  # it would set (and at unprepare reset) the slice of the claims holding the GPU
                raise ClaimFailed(f"request {r.request!r}: time-slicing changes {dev.name} for every claim on it, "
                                  "not for one with admin access")
            interval = (cfg.sharing.timeSlicingConfig.interval if cfg.sharing.timeSlicingConfig else "Default")
            out[dev.gpu.nvidia_uuid] = TimeSlice(gpu=dev.gpu.nvidia_uuid, interval=interval)
        return tuple(out.values()) or None

    def holds(self, record: Record) -> list[Hold]:
        return []  # the whole GPU is held as such (planner.device_holds)

    def _set(self, gpu: str, interval: str) -> None:
        try:
            smi, env = self.smi()
        except OSError as err:  # its libraries not linked (a DaemonSet's /host): as a failed run, set back
            raise ClaimFailed(f"GPU {gpu}: nvidia-smi cannot be run: {err}") from err
        if smi is None:
            raise ClaimFailed(f"GPU {gpu}: no nvidia-smi in the driver root: its time slice cannot be set")
        argv = [smi, "compute-policy", "-i", gpu, "--set-timeslice", str(SLICES[interval])]
        try:
            out = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=TIMEOUT)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise ClaimFailed(f"GPU {gpu}: nvidia-smi compute-policy: {err}") from err
        if out.returncode != 0:
            raise ClaimFailed(f"GPU {gpu}: nvidia-smi compute-policy --set-timeslice {SLICES[interval]} failed: "
                              f"{(out.stderr or out.stdout).strip()[:300]}")
        self.fault("timeslice:set")
        log.info("GPU %s: time slice %s", gpu, interval)

    def apply(self, planned: Planned, record: Record) -> tuple[Record, dict[str, Device]]:
        done = []
        try:
            for ts in record:
                self._set(ts.gpu, ts.interval)
                done.append(ts)
        except ClaimFailed as err:
            if (undone := self.undo(tuple(done), {})).problems:
                raise NotUndone(err, undone.problems) from err
            raise
        return record, {}

    def undo(self, record: Record, others: dict[str, dict]) -> Undone:
        problems = []
        for ts in record:
            if ts.interval == "Default":
                continue
            try:
                self._set(ts.gpu, "Default")
            except ClaimFailed as err:
                if not self._gone(ts.gpu):
                    problems.append(str(err))
        return Undone(problems=problems)

    def _gone(self, uuid: str) -> bool:
        """Whether no GPU of the NVIDIA driver is ``uuid`` (hot-unplugged, ``remove``: it leaves
        ``/proc/driver/nvidia/gpus``), its time slice gone with it: nvidia-smi would fail for as long as it
        is away, the claim keeping its entry and its unprepare failing. False when that cannot be read."""
        base = self.fs.path("proc/driver/nvidia/gpus")
        try:
            infos = [parse_nvidia_information(self.fs.read_text(os.path.join(base, d, "information"), limit=16384))
                     for d in self.fs.subdirs(base)]
        except AttrError:
            return False
        if any(i.get("GPU UUID") == uuid for i in infos):
            return False
        log.warning("GPU %s has left the node (not in %s): its time slice went with it", uuid, self.fs.rel(base))
        return True

    def recover(self, record: Record) -> bool:
        """Each GPU's slice set again (after a reboot the driver forgot it); ClaimFailed naming those
        that failed, after trying all: the kubelet's re-prepare must not start a pod on a slice its claim
        did not ask for while the record says it has it (at start: logged, the re-prepare tries again)."""
        failed = []
        for ts in record:
            try:
                self._set(ts.gpu, ts.interval)
            except ClaimFailed as err:
                failed.append(str(err))
        if failed:
            raise ClaimFailed("; ".join(failed))
        return False

    def devices_now(self, record: Record, devices: dict[str, Device]) -> dict[str, Device]:
        return {}
