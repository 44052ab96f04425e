"""An NVIDIA GPU's device nodes and procfs ``information`` (discovery/gpu.py): /dev/nvidiaN and
/dev/nvidiactl take the major /proc/devices gives the driver (its registered 195 when it names
none), and the minor of the GPU's ``information`` file, which is input: nvidiactl's minor is no
GPU's, a model name that is not printable is not published, nor a UUID that is not one (it
also names the GPU's MPS directory)."""

from __future__ import annotations

import shutil

from discovery.inventory import scan
from tests.conftest import profile_root
from tests.simkernel import SimPciKernel

H200 = "gpu-0000-00-06-0"
INFO = "proc/driver/nvidia/gpus/0000:00:06.0/information"


def _node(tmp_path, edit=None):
    root = tmp_path / "root"
    shutil.copytree(profile_root("h200-vm"), root, symlinks=True)
    if edit:
        edit(root)
    return scan(str(root)).by_name()[H200]


def _nodes(gpu) -> dict[str, tuple[int, int]]:
    return {n.path: (n.major, n.minor) for n in gpu.device_nodes}


def _rewrite(path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new))


def test_the_majors_are_the_ones_proc_devices_gives(tmp_path):
    gpu = _node(tmp_path, lambda root: _rewrite(root / "proc/devices", "195 nvidia-frontend", "196 nvidia-frontend"))
    nodes = _nodes(gpu)
    assert (nodes["/dev/nvidia0"], nodes["/dev/nvidiactl"]) == ((196, 0), (196, 255))


def test_without_an_nvidia_major_in_proc_devices_the_registered_one(tmp_path):
    gpu = _node(tmp_path, lambda root: _rewrite(root / "proc/devices", "195 nvidia-frontend\n", ""))
    nodes = _nodes(gpu)
    assert (nodes["/dev/nvidia0"], nodes["/dev/nvidiactl"]) == ((195, 0), (195, 255))


def test_a_gpu_minor_of_nvidiactls_is_refused_with_a_problem(tmp_path):
    gpu = _node(tmp_path, lambda root: _rewrite(root / INFO, "Device Minor: \t 0", "Device Minor: \t 255"))
    assert gpu.gpu.nvidia_minor is None and not any(p.startswith("/dev/nvidia") for p in _nodes(gpu))
    assert any(p.what == "/dev/nvidiaN" and "bad or missing Device Minor '255'" in p.reason for p in gpu.problems)


def test_a_model_name_that_is_not_printable_is_not_published(tmp_path):
    gpu = _node(tmp_path, lambda root: _rewrite(root / INFO, "Model: \t\t NVIDIA H200", "Model: \t\t NVIDIA H200\x1b[2J"))
    assert gpu.gpu.model is None and "model" not in gpu.attributes
    assert gpu.gpu.nvidia_minor == 0  # the rest of the file stands


def test_a_uuid_that_is_not_one_is_a_problem_not_an_attribute(tmp_path):
    uuid = "GPU-7e3a1c52-0d4b-4f6e-9a81-2b3c4d5e6f70"
    gpu = _node(tmp_path, lambda root: _rewrite(root / INFO, uuid, "GPU-../../../etc\x1b"))
    assert gpu.gpu.nvidia_uuid is None and "uuid" not in gpu.attributes
    assert any(p.what == "uuid" and "is not GPU-" in p.reason for p in gpu.problems)
    assert _node(tmp_path / "b").gpu.nvidia_uuid == uuid


def test_a_gpu_on_vfio_pci_has_its_groups_nodes_and_no_drm_problem(tmp_path):
    """A GPU handed to VMs has no DRM nodes by design: that is no problem of the GPU's."""
    root = str(tmp_path / "root")
    shutil.copytree(profile_root("server-2s-gpu-nic"), root, symlinks=True)
    sim = SimPciKernel(root)
    sim.unbind("nvidia", "0000:18:00.0")
    sim.bind("vfio-pci", "0000:18:00.0")
    gpu = scan(root).by_name()["gpu-0000-18-00-0"]
    assert gpu.pci.driver == "vfio-pci" and [n.path for n in gpu.device_nodes] == ["/dev/vfio/27", "/dev/vfio/vfio"]
    assert not gpu.problems
