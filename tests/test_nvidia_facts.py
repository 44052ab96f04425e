"""NVIDIA GPU facts (discovery/nvidia.py, discovery/nvml.py): NVML's answers on a simulated NVML
built from the real H200's, the PCI ID table without NVML, nothing for a GPU in neither; the
published attributes pass the real kube-apiserver, and a shared H200's memory is allocatable by
the upstream allocator."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading

import pytest

from agent.publish.sharing import share_plan
from agent.publish.slices import build_pool, render
from discovery.inventory import scan
from discovery.nvidia import GPU_TABLE, cuda_version, kernel_module_version, semver
from discovery.sysfs import HostFS
from tests.conftest import REPO, profile_root
from tests.controlplane import Unschedulable, allocate, unique
from tests.simnvml import SimGpu, SimNvml, open_sim
from tests.test_allocator import CLASSES, NODE, claim, exactly

H200 = "gpu-0000-00-06-0"
DRIVER = "sysdra.io"


def _gpu(inv, name: str = H200):
    return inv.by_name()[name]


def _attrs(dev) -> dict:
    return {k: next(iter(v.to_api().values())) for k, v in dev.attributes.items()}


def test_nvml_answers_are_published():
    sim = SimNvml()
    root = profile_root("h200-vm")
    gpu = _gpu(scan(root, nvml=open_sim(root, sim)))
    a = _attrs(gpu)
    assert (a["productName"], a["brand"], a["architecture"]) == ("NVIDIA H200", "Nvidia", "Hopper")
    assert a["addressingMode"] == "None"  # the real H200's answer (0): no HMM, no ATS
    assert (a["cudaComputeCapability"], a["driverVersion"], a["cudaDriverVersion"]) == ("9.0.0", "580.159.4", "13.0.0")
    assert gpu.capacity == {"memory": "143771Mi"}  # NVML's 150,754,820,096 bytes
    assert gpu.gpu.nvidia.source == "nvml" and sim.calls == ["0000:00:06.0"]


def test_without_nvml_the_table_and_the_kernel_module_answer():
    gpu = _gpu(scan(profile_root("h200-vm")))  # no libnvidia-ml under driver root /
    a = _attrs(gpu)
    assert (a["architecture"], a["cudaComputeCapability"], a["driverVersion"]) == ("Hopper", "9.0.0", "580.159.4")
    assert {"productName", "brand", "cudaDriverVersion", "addressingMode"}.isdisjoint(a)  # NVML only: never guessed
    assert gpu.capacity == {"memory": "141G"}  # the datasheet's 141 GB
    assert gpu.gpu.nvidia.source == "table"


def test_nvmls_answers_win_over_the_table():
    """The table is for what NVML does not say: where both answer, NVML's is published."""
    sim = SimNvml([SimGpu(architecture=10, compute_capability=(10, 0))])  # the table's H200: Hopper, 9.0
    root = profile_root("h200-vm")
    a = _attrs(_gpu(scan(root, nvml=open_sim(root, sim))))
    assert (a["architecture"], a["cudaComputeCapability"]) == ("Blackwell", "10.0.0")


def test_a_gpu_in_neither_gets_no_memory_and_shares_offer_none(caplog):
    root = profile_root("vm-numa-none")  # a Tesla P100 (10de:15f8): not in the table
    gpu = _gpu(scan(root), "gpu-0000-06-00-0")
    assert "memory" not in gpu.capacity and "architecture" not in gpu.attributes
    assert _attrs(gpu)["driverVersion"] == "580.159.4"
    caplog.set_level(logging.WARNING, logger="agent.publish.sharing")
    pool = build_pool(scan(root), node_name=NODE, driver_name=DRIVER, share=share_plan(("gpu",), None))
    (entry,) = [d for s in render(pool, driver_name=DRIVER, node_name=NODE, generation=1) for d in s["spec"]["devices"]
                if d["name"] == "gpu-0000-06-00-0"]
    assert set(entry["capacity"]) == {"compute"}
    assert "gpu-0000-06-00-0 has no known memory" in caplog.text


@pytest.mark.parametrize("mode, published", [(1, "HMM"), (2, "ATS"), (7, None), ("unsupported", None)])
def test_the_addressing_mode_as_nvidias_driver_names_it(mode, published):
    gpu = SimGpu(unsupported={"addressing"}) if mode == "unsupported" else SimGpu(addressing_mode=mode)
    root = profile_root("h200-vm")
    a = _attrs(_gpu(scan(root, nvml=open_sim(root, SimNvml([gpu])))))
    assert a.get("addressingMode") == published and a["productName"] == "NVIDIA H200"


def test_an_unsupported_query_leaves_the_table_to_answer():
    sim = SimNvml([SimGpu(unsupported={"memory", "architecture"})])
    root = profile_root("h200-vm")
    gpu = _gpu(scan(root, nvml=open_sim(root, sim)))
    assert gpu.capacity == {"memory": "141G"} and _attrs(gpu)["architecture"] == "Hopper"
    assert _attrs(gpu)["productName"] == "NVIDIA H200"


def test_nvml_answers_are_input():
    sim = SimNvml([SimGpu(name="H200\x1b[31m", memory_total=-5, architecture=99, brand=True,
                          compute_capability=(9, "x"), addressing_mode="ATS")], driver="not a version", cuda=-1)
    root = profile_root("h200-vm")
    gpu = _gpu(scan(root, nvml=open_sim(root, sim)))
    a = _attrs(gpu)
    assert {"productName", "brand", "cudaDriverVersion", "addressingMode"}.isdisjoint(a)
    assert a["architecture"] == "Hopper" and a["cudaComputeCapability"] == "9.0.0"  # the table's
    assert a["driverVersion"] == "580.159.4"  # the kernel module's
    assert gpu.capacity == {"memory": "141G"}  # the table's, not NVML's -5


def test_numbers_past_an_int64_or_below_zero_are_not_nvmls_answers():
    root = profile_root("h200-vm")
    gpu = _gpu(scan(root, nvml=open_sim(root, SimNvml([SimGpu(memory_total=2**64, compute_capability=(9, -1))]))))
    assert gpu.capacity == {"memory": "141G"} and _attrs(gpu)["cudaComputeCapability"] == "9.0.0"  # the table's
    assert _attrs(gpu)["productName"] == "NVIDIA H200"  # the rest of NVML's answer stands


def test_a_hung_nvml_is_given_up_and_never_asked_again(caplog):
    sim = SimNvml()
    sim.hang = threading.Event()
    root = profile_root("h200-vm")
    nvml = open_sim(root, sim, timeout=0.2)
    try:
        gpu = _gpu(scan(root, nvml=nvml))
        assert gpu.gpu.nvidia.source == "table" and gpu.capacity == {"memory": "141G"}
        assert nvml.failed and "timed out" in caplog.text
        scan(root, nvml=nvml)
        assert sim.calls == ["0000:00:06.0"]  # not asked again
    finally:
        sim.hang.set()


def test_a_hung_nvml_that_answers_again_is_still_not_asked():
    """Once given up, NVML stays given up: the facts never flap between NVML's and the table's."""
    sim = SimNvml()
    sim.hang = threading.Event()
    root = profile_root("h200-vm")
    nvml = open_sim(root, sim, timeout=0.2)
    try:
        assert _gpu(scan(root, nvml=nvml)).gpu.nvidia.source == "table"
    finally:
        sim.hang.set()
    with nvml.worker.changed:  # the hung query ends
        assert nvml.worker.changed.wait_for(lambda: nvml.worker.running is None, timeout=30)
    gpu = _gpu(scan(root, nvml=nvml))
    assert gpu.gpu.nvidia.source == "table" and sim.calls == ["0000:00:06.0"]


def test_no_library_under_the_driver_root_means_no_nvml(caplog):
    caplog.set_level(logging.INFO, logger="discovery.nvml")
    assert open_sim(profile_root("h200-vm"), SimNvml(), driver_root="/") is None
    assert "no libnvidia-ml.so.1" in caplog.text


@pytest.mark.parametrize("has_node", [True, False])
def test_an_nvml_that_cannot_start_says_why_and_the_table_answers(tmp_path, monkeypatch, caplog, has_node):
    """NVML opens /dev/nvidiactl in the agent's own /dev: where that is missing (an unprivileged
    container), the warning names it and what gives it."""
    from discovery import nvml as nvml_module

    node = tmp_path / "nvidiactl"
    if has_node:
        node.write_text("")
    monkeypatch.setattr(nvml_module, "CONTROL_NODE", str(node))

    class Refusing(SimNvml):
        def nvmlInit(self):
            raise self.NVMLError(9)  # NVML_ERROR_DRIVER_NOT_LOADED

    root = profile_root("h200-vm")
    assert open_sim(root, Refusing()) is None
    assert "failed to initialise" in caplog.text and "PCI ID table" in caplog.text
    assert (f"this process has no {node}" in caplog.text) is not has_node
    assert ("privileged" in caplog.text) is not has_node
    assert _gpu(scan(root, nvml=None)).gpu.nvidia.source == "table"


def test_a_library_that_does_not_load_is_not_blamed_on_device_nodes(tmp_path, monkeypatch, caplog):
    from discovery import nvml as nvml_module
    from discovery.nvml import Nvml

    monkeypatch.setattr(nvml_module, "CONTROL_NODE", str(tmp_path / "nvidiactl"))  # missing

    def bad_elf(path):
        raise OSError(f"{path}: invalid ELF header")

    assert Nvml.open(profile_root("h200-vm"), "/usr/local/nvidia", pynvml=SimNvml(), load=bad_elf) is None
    assert "invalid ELF header" in caplog.text and "device nodes" not in caplog.text


def test_a_library_that_does_not_load_costs_no_pynvml():
    """nvidia-ml-py (~2.7 MB of the process) is imported once the library has loaded, not before:
    a node with a library that does not load (a driver not ready, a stub) never imports it."""
    code = ("import sys\nfrom discovery.nvml import Nvml\n"
            f"nvml, why = Nvml.probe({profile_root('h200-vm')!r}, '/usr/local/nvidia')\n"
            "print(nvml is None, 'failed to initialise' in why, 'pynvml' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["True", "True", "False"], out.stderr[-2000:]


def test_doctor_says_whether_nvml_answers(monkeypatch, tmp_path):
    """``sysdra doctor``'s NVML check: ok with the driver's version and its GPUs, a warning with
    the reason and what is lost when NVML does not start, skip with ``nvml: false``."""
    from agent.tools.doctor import check_nvml
    from discovery import nvml as nvml_module
    from discovery.nvml import Nvml

    root, real = profile_root("h200-vm"), Nvml.probe.__func__
    sim = SimNvml()
    monkeypatch.setattr(Nvml, "probe", classmethod(lambda cls, r, d="/", timeout=5.0, **kw: real(
        cls, r, d, timeout, pynvml=sim, load=lambda path: None)))
    (found,) = check_nvml(root, "/usr/local/nvidia")
    assert (found.level, found.message) == ("ok", "NVML of driver 580.159.04 answers for 1 GPU(s)")

    class Refusing(SimNvml):
        def nvmlInit(self):
            raise self.NVMLError(9)

    sim = Refusing()
    monkeypatch.setattr(nvml_module, "CONTROL_NODE", str(tmp_path / "nvidiactl"))
    (found,) = check_nvml(root, "/usr/local/nvidia")
    assert found.level == "warn" and "failed to initialise" in found.message and "no XID/ECC health events" in found.message
    assert f"this process has no {tmp_path / 'nvidiactl'}" in found.message and found.fix
    assert [f.level for f in check_nvml(root, "/usr/local/nvidia", enabled=False)] == ["skip"]
    assert check_nvml(profile_root("sriov-nic"), "/") == []  # no NVIDIA driver: nothing to say


@pytest.mark.parametrize("text,want", [("580.159.04", "580.159.4"), ("550.54", "550.54.0"), ("9.0", "9.0.0"),
                                       ("", None), ("v1", None), ("1.2.3.4", None), (None, None)])
def test_semver(text, want):
    assert semver(text) == want


def test_cuda_version():
    assert (cuda_version(13000), cuda_version(12040), cuda_version(0), cuda_version(True)) == ("13.0.0", "12.4.0", None, None)
    assert cuda_version(12100) == "12.10.0"  # NVML's 1000 * major + 10 * minor: a two-digit minor


def test_the_kernel_modules_version_is_its_first_lines_not_the_compilers(tmp_path):
    """A /proc/driver/nvidia/version whose first line names no version gives none: the GCC
    version on the next line is not the driver's."""
    (tmp_path / "proc/driver/nvidia").mkdir(parents=True)
    (tmp_path / "proc/driver/nvidia/version").write_text(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64\nGCC version:  gcc version 12.2.0\n")
    assert kernel_module_version(HostFS(str(tmp_path))) is None


def test_every_table_row_has_a_source_and_a_valid_version():
    for device_id, row in GPU_TABLE.items():
        assert len(device_id) == 4 and int(device_id, 16) >= 0
        assert row.source and row.memory_gb > 0 and semver(row.compute_capability)


def test_nvidia_attributes_pass_the_real_apiserver(apiserver):
    node = apiserver.create_node(unique("nvidia"))
    root = profile_root("h200-vm")
    inv = scan(root, nvml=open_sim(root, SimNvml()))
    pool = build_pool(inv, node_name=node["metadata"]["name"], driver_name=DRIVER, share=share_plan(("gpu",), None))
    assert not pool.rejected
    for obj in render(pool, driver_name=DRIVER, node_name=node["metadata"]["name"], generation=1,
                      node_uid=node["metadata"]["uid"]):
        stored = apiserver.create(obj)
        assert stored["spec"]["devices"] == obj["spec"]["devices"]
    apiserver.delete("Node", node["metadata"]["name"])


def _shared_h200(nvml) -> list[dict]:
    root = profile_root("h200-vm")
    inv = scan(root, list_attributes=True, nvml=nvml)
    pool = build_pool(inv, node_name=NODE, driver_name=DRIVER, list_attributes=True, share=share_plan(("gpu",), None))
    return render(pool, driver_name=DRIVER, node_name=NODE, generation=1, full_name=True)


@pytest.mark.parametrize("source", ["nvml", "table"])
def test_a_claim_for_20gi_of_a_shared_h200_is_allocated(source):
    root = profile_root("h200-vm")
    slices = _shared_h200(open_sim(root, SimNvml()) if source == "nvml" else None)
    c = claim("infer", exactly("gpu", "gpu-share.sysdra.io", capacity={"requests": {"memory": "20Gi"}}))
    (a,) = allocate(slices, CLASSES, c, node=NODE)
    (result,) = a["devices"]["results"]
    assert result["device"] == H200 and result["consumedCapacity"]["memory"] == "20Gi"


def test_a_memory_request_cannot_land_on_a_gpu_whose_memory_is_unknown():
    root = profile_root("vm-numa-none")
    pool = build_pool(scan(root), node_name=NODE, driver_name=DRIVER, share=share_plan(("gpu",), None))
    slices = render(pool, driver_name=DRIVER, node_name=NODE, generation=1, full_name=True)
    c = claim("infer", exactly("gpu", "gpu-share.sysdra.io", capacity={"requests": {"memory": "20Gi"}}))
    with pytest.raises(Unschedulable):
        allocate(slices, CLASSES, c, node=NODE)


def test_another_gpu_put_in_the_slot_gets_its_own_nvml_facts(tmp_path):
    """A GPU swapped for another at the same PCI address while the agent runs (a VM's GPU hot-plugged
    out and another in; a hot-swap): the rescan its events start reads the new UUID from the driver,
    and NVML's facts are the new GPU's. NVML's answers were kept by address, and the new GPU was
    published with the old one's name, memory and compute capability (MIG profiles too)."""
    import shutil

    from discovery.inventory import IncrementalScanner

    root = str(tmp_path / "node")
    shutil.copytree(profile_root("h200-vm"), root, symlinks=True)
    sim = SimNvml()
    scanner = IncrementalScanner(root, nvml=open_sim(root, sim))
    assert _attrs(_gpu(scanner.full()))["productName"] == "NVIDIA H200"
    new_uuid = "GPU-0b9c8d7e-6f5a-4b3c-2d1e-0f9a8b7c6d5e"
    sim.gpus["0000:00:06.0"] = SimGpu(name="NVIDIA H100 NVL", uuid=new_uuid, memory_total=100_485_038_080, compute_capability=(9, 0))
    info = f"{root}/proc/driver/nvidia/gpus/0000:00:06.0/information"
    with open(info) as f:
        text = f.read()
    with open(info, "w") as f:
        f.write(text.replace("NVIDIA H200", "NVIDIA H100 NVL").replace("GPU-7e3a1c52-0d4b-4f6e-9a81-2b3c4d5e6f70", new_uuid))
    gpu = _gpu(scanner.update({"0000:00:06.0"}))
    assert gpu.gpu.nvidia_uuid == new_uuid
    assert _attrs(gpu)["productName"] == "NVIDIA H100 NVL" and gpu.capacity == {"memory": "95830Mi"}
