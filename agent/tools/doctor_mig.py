"""``sysdra doctor``'s MIG check: whose the MIG instances on the node's GPUs are, against
``nvidia_mig`` (docs/partitions.md). Dynamic MIG (``partitions`` with NVML) destroys at the agent's
start every GPU instance no prepared claim made, so an operator's layout there is lost; with
``nvidia_mig: static`` it is published as it is. Read-only: NVML is asked, nothing is changed."""

from __future__ import annotations

import os

from agent.tools.findings import Finding, ok
from discovery import mig
from discovery.inventory import device_name
from discovery.mig import GpuInstanceNow


def check_mig(settings) -> list[Finding]:
    if not (settings.partitions and settings.nvml):
        return []
    from discovery.nvml import Nvml

    nvml, _why = Nvml.probe(settings.root, settings.nvidia_driver_root)
    if nvml is None:
        return []  # the nvml check says why
    found = nvml.call("listing MIG instances", lambda: _instances(nvml.pynvml))
    if not found:
        return []  # no GPU in MIG mode with an instance, or NVML did not answer (the nvml check says so)
    total = sum(len(gis) for gis in found.values())
    if settings.nvidia_mig == "static":
        return [ok("mig", f"{total} MIG GPU instance(s) on {len(found)} GPU(s), published as they are (nvidia_mig: static)")]
    known, claimed = _recorded(settings.plugin_dir)
    foreign = [f"{bdf} gi{g.gi} ({name} at slice {g.start})" for bdf, gis in sorted(found.items())
               for name, g in gis if (bdf, g.profile, g.start) not in known and (device_name("gpu", bdf), g.gi) not in claimed]
    if not foreign:
        return [ok("mig", f"{total} MIG GPU instance(s), each made for a prepared claim (nvidia_mig: dynamic)")]
    return [Finding("mig", "warn", f"MIG GPU instances no claim made: {', '.join(foreign[:8])}"
                    + (", ..." if len(foreign) > 8 else "") + ": the agent destroys them at its next start (nvidia_mig: dynamic)",
                    "an operator's layout (nvidia-smi, mig-parted) wants nvidia_mig: static; else leave them to the agent")]


def _instances(nv) -> dict[str, list[tuple[str, GpuInstanceNow]]]:
    """PCI address -> (profile name, GPU instance) of every GPU in MIG mode (on NVML's thread)."""
    out: dict[str, list] = {}
    for i in range(nv.nvmlDeviceGetCount()):
        h = nv.nvmlDeviceGetHandleByIndex(i)
        if (mig.mig_mode(nv, h) or (0, 0))[0] != 1:
            continue
        bus = nv.nvmlDeviceGetPciInfo(h).busId
        bdf = (bus.decode() if isinstance(bus, bytes) else str(bus))[-12:].lower()  # NVML's 8-digit domain
        names = {p.id: p.name for p in mig.profiles(nv, h)}
        if gis := [(names[g.profile], g) for g in mig.gpu_instances(nv, h, list(names))]:
            out[bdf] = gis
    return out


def _recorded(plugin_dir: str) -> tuple[set[tuple[str, int, int]], set[tuple[str, int]]]:
    """The placements prepared claims' MIG devices hold and the operator's instances claims prepared
    under ``nvidia_mig: static`` hold, as the agent's start-up sweep reads them."""
    from agent.prepare.checkpoint import Checkpoint
    from agent.prepare.steps.mig import claimed_instances, placements_recorded

    try:
        claims = Checkpoint.load(os.path.join(plugin_dir, "checkpoint.json"), move_corrupt=False).claims
    except Exception:  # noqa: BLE001 - the checkpoint check says what is wrong with it
        return set(), set()
    return placements_recorded(claims), claimed_instances(claims)
