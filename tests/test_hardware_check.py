"""The real-GPU check (tests/hardware/nvidia_check.py) rehearsed where no GPU is, so that its
first run on a lent GPU, whose time is short, is not also its first run at all: the whole check,
unchanged, on a copy of the h200-vm fixture (the lent H200's tree) with the simulated NVML (MIG and
events, from the H200's real answers) in every process it starts (tests/hardware/rehearsal/
sitecustomize.py) and an ``nvidia-smi`` that prints the H200's MIG tables in nvidia-smi's layout.

Everything but CUDA runs for real: ``sysdra scan`` and ``run``, the claim prepared over the kubelet
protocol, the MPS control daemon (the fixture's simulated ``nvidia-cuda-mps-control``) with its shm
tmpfs, the MIG comparison, unprepare and the agent's stop. No CUDA program can run here, so nvcc
is kept off PATH: the check must report exactly that one failure, and skip (and say so) the
program's runs. Any other failure is a fault of the check or of the agent."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import psutil

from tests.conftest import REPO, profile_root, require_root
from tests.hardware.mig_check import parse_lgip, parse_lgipp
from tests.simnvml import SimGpu
from tests.simnvml_mig import H200_PROFILES, SimMigNvml, write_mig_minors

REHEARSAL = os.path.join(REPO, "tests", "hardware", "rehearsal")
SMI_DATA = os.path.join(REPO, "tests", "data", "nvidia-smi")


def _read(name: str) -> str:
    with open(os.path.join(SMI_DATA, name)) as f:
        return f.read()


def test_nvidia_smi_mig_tables_parse_as_the_h200s_profiles():
    """One placement is printed ``Placement :`` (singular), as NVIDIA's own listings show."""
    lgip, lgipp = parse_lgip(_read("h200-mig-lgip.txt")), parse_lgipp(_read("h200-mig-lgipp.txt"))
    want = {row[2].removeprefix("MIG "): row for row in H200_PROFILES}
    assert sorted(lgip) == sorted(want)
    for name, row in want.items():
        got = lgip[name]
        assert (got["id"], got["memory_gib"], got["sms"]) == (row[1], row[4] / 1024, row[5])
        assert (got["ce"], got["dec"], got["enc"], got["jpeg"], got["ofa"]) == row[6:11]
        assert lgipp[row[1]] == row[12]
    assert lgipp[0] == [(0, 8)] and lgipp[5] == [(0, 4)]


def _daemons() -> set[int]:
    return {p.pid for p in psutil.process_iter(["cmdline"]) if "nvidia-cuda-mps-control" in " ".join(p.info["cmdline"] or [])}


def test_the_whole_check_on_a_simulated_h200(tmp_path):
    require_root()  # the MPS daemon's shm tmpfs
    root = tmp_path / "host"
    shutil.copytree(profile_root("h200-vm"), root, symlinks=True)
    write_mig_minors(str(root))
    state = tmp_path / "nvml.json"
    SimMigNvml([SimGpu(mig_capable=True)], state=str(state), root=str(root))  # MIG disabled, as on the lent H200
    out = tmp_path / "out"
    no_nvcc = [d for d in os.environ["PATH"].split(os.pathsep) if not os.path.exists(os.path.join(d, "nvcc"))]
    env = dict(os.environ, PYTHONPATH=f"{REHEARSAL}{os.pathsep}{REPO}", SYSDRA_SIMNVML=str(state),
               PATH=os.pathsep.join([os.path.join(REHEARSAL, "bin"), *no_nvcc]))
    before = _daemons()
    run = subprocess.run([sys.executable, "-m", "tests.hardware.nvidia_check", "--root", str(root), "--driver-root",
                          "/usr/local/nvidia", "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)  # fmt: skip
    log = (out / "check.log").read_text()
    assert run.returncode == 1, run.stdout + run.stderr
    assert log.splitlines()[-1].endswith("done: 1 failure(s) ['nvcc on PATH (CUDA toolkit)']"), log
    for passed in ("scan found 1 GPU(s)", "uuid equals NVML's", "--share gpu offers memory and compute",
                   "NVML lists 7 MIG profiles", "the same profiles as nvidia-smi mig -lgip",
                   "7g.141gb: placements [(0, 8)] equal -lgipp's [(0, 8)]", "--partitions publishes 25 placement devices",
                   "MIG mode unchanged by the check", "sysdra reads the GPU's row remapping as NVML answers it",
                   "sysdra reads the GPU's compute mode as nvidia-smi shows it",
                   "the claim for the GPU prepared",
                   "the share is a client of the agent's MPS daemon", "the share's /dev/shm is the daemon's shm tmpfs",
                   "the claim's CDI spec is gone after unprepare", "the MPS control daemon stopped with the last share",
                   "the agent watches the GPU's XID/ECC events", "the agent stopped cleanly (exit 0)"):
        assert f"PASS {passed}" in log, passed
    assert "SKIP the CUDA program from the spec" in log and "SKIP the MPS clients' allocations" in log
    assert "the simulator's table equals this GPU's" in log
    for name in ("scan.json", "slices.json", "nvml.json", "mig-profiles.json", "slices-partitions.json",
                 "nvidia-smi-mig-lgip.txt", "spec.json", "agent.log"):
        assert (out / name).stat().st_size > 0, name
    spec = json.loads((out / "spec.json").read_text())
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20480M" in spec["devices"][0]["containerEdits"]["env"]
    assert _daemons() <= before  # nothing of the check's left running
