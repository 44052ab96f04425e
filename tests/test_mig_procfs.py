"""MIG instances without NVML (discovery/partitions.py ``read_mig``), on copies of the h100-mig
fixture: an instance is published only while its access files say it is created and agree with
``mig-minors`` (the minors of the cap nodes a claim gets), in the order of its GPU and compute
instance numbers."""

from __future__ import annotations

import os
import shutil

from discovery.inventory import scan
from tests.conftest import profile_root

GPU = "gpu-0000-18-00-0"
MIG = "proc/driver/nvidia/capabilities/gpu0/mig"


def _root(tmp_path) -> str:
    root = str(tmp_path / "root")
    shutil.copytree(profile_root("h100-mig"), root, symlinks=True)
    return root


def _access(root: str, rel: str, minor: int) -> None:
    path = os.path.join(root, MIG, rel, "access")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(f"DeviceFileMinor: {minor}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")


def _gpu(root: str):
    return scan(root).by_name()[GPU]


def _instances(root: str) -> list[tuple[int, int, int]]:
    return [(p.index, p.gi, p.ci) for p in _gpu(root).gpu.partitioning.partitions]


def test_instances_are_in_the_order_of_their_numbers(tmp_path):
    root = _root(tmp_path)
    before = [(gi, ci) for _, gi, ci in _instances(root)]
    _access(root, "gi10", 93)  # mig-minors: gpu0/gi10/access 93, gpu0/gi10/ci0/access 94
    _access(root, "gi10/ci0", 94)
    got = _instances(root)
    assert [(gi, ci) for _, gi, ci in got] == sorted(before + [(10, 0)])  # gi10 after gi9, not after gi1
    assert [i for i, _, _ in got] == list(range(len(got)))


def test_an_instance_without_its_access_files_is_not_there(tmp_path):
    root = _root(tmp_path)
    assert {(1, 0), (2, 0), (2, 1)} <= {(gi, ci) for _, gi, ci in _instances(root)}
    os.unlink(os.path.join(root, MIG, "gi1/ci0/access"))  # the compute instance destroyed
    os.unlink(os.path.join(root, MIG, "gi2/access"))  # the GPU instance destroyed
    left = {(gi, ci) for _, gi, ci in _instances(root)}
    assert (1, 0) not in left and not any(gi == 2 for gi, _ in left)


def test_an_access_file_that_disagrees_with_mig_minors_is_a_problem(tmp_path):
    root = _root(tmp_path)
    _access(root, "gi9/ci0", 86)  # mig-minors says 85
    gpu = _gpu(root)
    assert (9, 0) not in {(p.gi, p.ci) for p in gpu.gpu.partitioning.partitions}
    assert any(p.what == "MIG gi9/ci0" and "disagrees" in p.reason for p in gpu.problems)


def test_an_instance_destroyed_while_it_is_read_costs_only_that_instance(tmp_path, monkeypatch):
    """MIG instances come and go while a scan reads them (the agent's own prepare makes and
    destroys them): one whose directory goes between the check of its access file and its
    listing is not there; the GPU keeps its device nodes and the other instances."""
    from discovery.sysfs import HostFS

    root = _root(tmp_path)
    before = _gpu(root)
    gone = os.path.join(root, MIG, "gi1")
    real_exists = HostFS.exists

    def racing(self, path):
        found = real_exists(self, path)
        if path == os.path.join(gone, "access") and os.path.isdir(gone):
            shutil.rmtree(gone)  # destroyed just after it was seen
        return found

    monkeypatch.setattr(HostFS, "exists", racing)
    gpu = _gpu(root)
    assert not any(p.what == "details" for p in gpu.problems), gpu.problems
    assert gpu.device_nodes == before.device_nodes
    assert {(p.gi, p.ci) for p in gpu.gpu.partitioning.partitions} == {
        (p.gi, p.ci) for p in before.gpu.partitioning.partitions if p.gi != 1}
