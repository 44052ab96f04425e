"""The real-GPU check's MIG step, read-only: the GPU-instance profiles and placements the agent
reads through NVML (``discovery/mig.py``, as dynamic MIG publishes them) against ``nvidia-smi mig
-lgip`` / ``-lgipp``, against the simulator's table (tests/simnvml_mig.py, from the facts file),
and the ``--partitions`` slices. Nothing is created and the MIG mode is not changed (checked
before and after). Part of ``nvidia_check.py``; alone:

    python3 -m tests.hardware.mig_check --driver-root /usr/local/nvidia --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys

from tests.hardware.nvidia_check import Log, nvidia_smi, sysdra, write

# | 0  MIG 1g.18gb  19  7/7  16.00  No  16  1  0 |  then  |  1  1  0 |  (SM DEC ENC, then CE JPEG OFA)
_LGIP = re.compile(r"^\|\s*(\d+)\s+MIG\s+(\S+)\s+(\d+)\s+(\d+)/(\d+)\s+([\d.]+)\s+\S+\s+(\d+)\s+(\d+)\s+(\d+)\s*\|")
_LGIP2 = re.compile(r"^\|\s+(\d+)\s+(\d+)\s+(\d+)\s*\|")
# GPU  0 Profile ID 19 Placements: {0,1,2,3,4,5,6}:1  and, for one placement,  ... Placement : {0}:8
_LGIPP = re.compile(r"GPU\s+(\d+)\s+Profile ID\s+(\d+)\s+Placements?\s*:\s*\{([\d,\s]*)\}:(\d+)")


def parse_lgip(text: str) -> dict[str, dict]:
    """``nvidia-smi mig -lgip`` -> profile name -> its numbers (first GPU only)."""
    out: dict[str, dict] = {}
    last = None
    for line in text.splitlines():
        if (m := _LGIP.match(line)) and m.group(1) == "0":
            last = out[m.group(2)] = {"id": int(m.group(3)), "total": int(m.group(5)), "memory_gib": float(m.group(6)),
                                      "sms": int(m.group(7)), "dec": int(m.group(8)), "enc": int(m.group(9))}
        elif last is not None and (m := _LGIP2.match(line)):
            last.update(ce=int(m.group(1)), jpeg=int(m.group(2)), ofa=int(m.group(3)))
            last = None
    return out


def parse_lgipp(text: str) -> dict[int, list[tuple[int, int]]]:
    """``nvidia-smi mig -lgipp`` -> profile ID -> [(start, size)] (first GPU only)."""
    return {int(m.group(2)): [(int(s), int(m.group(4))) for s in m.group(3).split(",") if s.strip()]
            for m in _LGIPP.finditer(text) if m.group(1) == "0"}


def _mode(bdf: str):
    import pynvml

    pynvml.nvmlInit()
    try:
        return list(pynvml.nvmlDeviceGetMigMode(pynvml.nvmlDeviceGetHandleByPciBusId(bdf)))
    except pynvml.NVMLError as err:
        return str(err)
    finally:
        pynvml.nvmlShutdown()


def step_mig(log: Log, out: str, root: str, driver_root: str, bdf: str) -> None:
    from discovery.nvml import Nvml

    before = _mode(bdf)
    log(f"MIG mode of {bdf} (current, pending): {before}")
    nvml = Nvml.open(root, driver_root)
    ours = nvml.mig_profiles(bdf) if nvml is not None else ()
    write(out, "mig-profiles.json", [dataclasses.asdict(p) for p in ours])
    if not log.check(bool(ours), f"NVML lists {len(ours)} MIG profiles through discovery/mig.py"):
        return
    smi_path = nvidia_smi(driver_root) or "nvidia-smi"
    lgip = subprocess.run([smi_path, "mig", "-lgip"], capture_output=True, text=True)
    lgipp = subprocess.run([smi_path, "mig", "-lgipp"], capture_output=True, text=True)
    write(out, "nvidia-smi-mig-lgip.txt", lgip.stdout + lgip.stderr)
    write(out, "nvidia-smi-mig-lgipp.txt", lgipp.stdout + lgipp.stderr)
    smi, places = parse_lgip(lgip.stdout), parse_lgipp(lgipp.stdout)
    log(f"nvidia-smi mig -lgip: {json.dumps(smi)}")
    log.check(sorted(smi) == sorted(p.name for p in ours), f"the same profiles as nvidia-smi mig -lgip ({sorted(smi)})")
    for p in ours:
        s = smi.get(p.name, {})
        mine = {"id": p.id, "memory_gib": round(p.memory_mb / 1024, 2), "sms": p.multiprocessors, "dec": p.decoders,
                "enc": p.encoders, "ce": p.copy_engines, "jpeg": p.jpeg, "ofa": p.ofa}
        log.check(all(s.get(k) == v for k, v in mine.items()), f"{p.name}: {mine} equals nvidia-smi's {s}")
        if places:
            log.check(places.get(p.id) == list(p.placements), f"{p.name}: placements {list(p.placements)} equal -lgipp's {places.get(p.id)}")
    from tests.simnvml_mig import H200_PROFILES

    sim = {r[2].removeprefix("MIG "): (r[1], r[3], r[4], r[5], r[6], r[7], r[8], r[9], r[10], [tuple(x) for x in r[12]]) for r in H200_PROFILES}
    real = {p.name: (p.id, p.slices, p.memory_mb, p.multiprocessors, p.copy_engines, p.decoders, p.encoders, p.jpeg, p.ofa,
                     list(p.placements)) for p in ours}
    log(f"the simulator's table {'equals' if sim == real else 'differs from'} this GPU's (an H200's should equal)")
    slices = sysdra("scan", "--root", root, "-o", "slices", "--partitions", "--nvidia-driver-root", driver_root)
    write(out, "slices-partitions.json", slices.stdout)
    devices = [d for s in json.loads(slices.stdout or '{"items": []}').get("items", []) for d in s["spec"].get("devices", [])]
    mig = [d for d in devices if "migProfile" in d.get("attributes", {})]
    log.check(len(mig) == sum(len(p.placements) for p in ours), f"--partitions publishes {len(mig)} placement devices")
    after = _mode(bdf)
    log.check(after == before, f"MIG mode unchanged by the check ({before} -> {after})")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default="/")
    p.add_argument("--driver-root", default="/")
    p.add_argument("--bdf", default="0000:00:06.0", help="the GPU's PCI address (the lent H200's by default)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    log = Log(args.out)
    try:
        step_mig(log, args.out, args.root, args.driver_root, args.bdf)
    except Exception as err:  # noqa: BLE001 - reported, like every step of the check
        log.check(False, f"MIG step: {type(err).__name__}: {err}")
    log(f"done: {len(log.failures)} failure(s) {log.failures}")
    return 1 if log.failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def step_memory(log: Log, root: str, driver_root: str, bdf: str) -> None:
    """Read-only: the row remapping sysdra's health rounds read (agent/health/gpumemory.py)
    against NVML's own answer, and the verdict it gives."""
    import pynvml

    from agent.health.gpumemory import RowRemapReader, fault
    from discovery.nvml import Nvml

    pynvml.nvmlInit()
    try:
        direct = pynvml.nvmlDeviceGetRemappedRows(pynvml.nvmlDeviceGetHandleByPciBusId(bdf))
    except pynvml.NVMLError as err:
        direct = str(err)
    finally:
        pynvml.nvmlShutdown()
    nvml = Nvml.open(root, driver_root)
    ours = RowRemapReader(nvml).read(bdf) if nvml is not None else None
    log(f"row remapping of {bdf}: NVML {direct}; sysdra reads {ours}, fault {fault(ours) if ours else None}")
    mine = (ours.correctable, ours.uncorrectable, int(ours.pending), int(ours.failed)) if ours else None
    log.check(mine is not None and mine == tuple(direct), "sysdra reads the GPU's row remapping as NVML answers it")


def step_compute_mode(log: Log, root: str, driver_root: str, uuid: str) -> None:
    """Read-only: the compute mode sysdra reads before an MPS daemon with ``nvidia_mps_exclusive``
    (agent/prepare/computemode.py) against ``nvidia-smi``'s. Never set here: the lent GPU's
    settings stay as they are."""
    from agent.prepare.computemode import NAMES, ComputeModes
    from discovery.nvml import Nvml

    nvml = Nvml.open(root, driver_root)
    ours = ComputeModes(lambda: nvml).get(uuid)
    smi = subprocess.run([nvidia_smi(driver_root) or "nvidia-smi", "--query-gpu=compute_mode", "--format=csv,noheader",
                          "-i", uuid], capture_output=True, text=True, timeout=60)  # fmt: skip
    log(f"compute mode of {uuid}: sysdra reads {ours} ({NAMES[ours]}); nvidia-smi says {smi.stdout.strip()!r}")
    log.check(NAMES[ours] == smi.stdout.strip(), "sysdra reads the GPU's compute mode as nvidia-smi shows it")
