"""Dynamic MIG discovery (discovery/mig.py) on the simulated NVML, and the simulator's own
refusals, which the prepare and allocator tests rely on being NVML's."""

from __future__ import annotations

import pytest

from discovery.inventory import scan
from tests.conftest import profile_root
from tests.mig_node import MigNode
from tests.simnvml import NVMLError, SimGpu, SimNvml, open_sim
from tests.simnvml_mig import H200_PROFILES, SimMigNvml, placement


def _gpu(inv):
    (gpu,) = [d for d in inv.devices if d.kind == "gpu"]
    return gpu


def test_the_h200_profiles_as_discovery_reads_them(tmp_path):
    node = MigNode(str(tmp_path))
    got = {p.name: (p.id, p.slices, p.memory_mb, p.multiprocessors, list(p.placements))
           for p in _gpu(node.inv).gpu.partitioning.profiles}
    want = {r[2][4:]: (r[1], r[3], r[4], r[5], list(r[12])) for r in H200_PROFILES}
    assert got == want and len(got) == 7


def test_a_gpu_without_mig_has_no_profiles_and_stays_whole():
    root = profile_root("h200-vm")
    inv = scan(root, nvml=open_sim(root, SimNvml()))  # NVML answers NOT_SUPPORTED for MIG mode
    assert _gpu(inv).gpu.partitioning is None


def test_a_profile_nvml_names_oddly_is_left_out(tmp_path):
    class Odd(SimMigNvml):
        def nvmlDeviceGetGpuInstanceProfileInfo(self, h, index, version=2):
            info = super().nvmlDeviceGetGpuInstanceProfileInfo(h, index, version)
            if info.id == 9:
                info.name = b"MIG 3g.71gb; rm -rf /"
            return info

    root = profile_root("h200-vm")
    inv = scan(root, nvml=open_sim(root, Odd([SimGpu(mig_capable=True)])))
    names = [p.name for p in _gpu(inv).gpu.partitioning.profiles]
    assert "3g.71gb" not in names and len(names) == 6 and not any(";" in n for n in names)


def test_the_simulator_refuses_as_nvml_does(tmp_path):
    nv = SimMigNvml([SimGpu(mig_capable=True, mig=[1, 1])])
    h = nv.nvmlDeviceGetHandleByPciBusId("0000:00:06.0")
    P = placement

    def refused(code, fn, *args):
        with pytest.raises(NVMLError) as err:
            fn(*args)
        assert err.value.value == code

    gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, 14, P(2, 2))  # 2g.35gb on slices 2-3
    refused(23, nv.nvmlDeviceCreateGpuInstanceWithPlacement, h, 9, P(0, 4))  # overlaps: Insufficient Resources
    refused(2, nv.nvmlDeviceCreateGpuInstanceWithPlacement, h, 14, P(1, 2))  # not a 2g placement: Invalid Argument
    nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, 20, P(0, 1))  # 1g.18gb+me
    refused(23, nv.nvmlDeviceCreateGpuInstanceWithPlacement, h, 20, P(1, 1))  # one OFA
    ci = nv.nvmlGpuInstanceCreateComputeInstance(gi, 1)
    refused(23, nv.nvmlGpuInstanceCreateComputeInstance, gi, 0)  # the 2-slice CI took the GI
    refused(19, nv.nvmlGpuInstanceDestroy, gi)  # a GI with a CI: In use
    refused(19, nv.nvmlDeviceSetMigMode, h, 0)  # MIG mode off with instances: In use
    nv.nvmlComputeInstanceDestroy(ci)
    nv.nvmlGpuInstanceDestroy(gi)
    assert [g["profile"] for g in nv.instances().values()] == [20]
    off = SimMigNvml([SimGpu(mig_capable=True)])
    refused(3, off.nvmlDeviceCreateGpuInstanceWithPlacement, off.nvmlDeviceGetHandleByPciBusId("0000:00:06.0"), 19, P(0, 1))


def test_a_gpu_whose_minor_is_unknown_offers_no_mig_devices(tmp_path):
    """A MIG device is the GPU's nodes plus its instance's cap nodes, all named by the GPU's minor:
    without a readable Device Minor the GPU is published whole (with the problem), never its placements."""
    node = MigNode(str(tmp_path))
    info = f"{node.root}/proc/driver/nvidia/gpus/0000:00:06.0/information"
    text = open(info).read()
    with open(info, "w") as f:
        f.write(text.replace("Device Minor: \t 0\n", ""))
    gpu = _gpu(node.scan())
    assert gpu.gpu.partitioning is None
    assert any(p.what == "/dev/nvidiaN" for p in gpu.problems)
    assert not [n for n in node.slices()[-1]["spec"]["devices"] if "-mig-" in n["name"]]
