"""Static MIG with NVML (``nvidia_mig: static``, docs/partitions.md): the operator's instances
(nvidia-smi, mig-parted) published as they are, with NVML's profiles, never changed by the agent.
On the simulated NVML (tests/simnvml_mig.py), whose instances write the driver's procfs files."""

from __future__ import annotations

import pytest

from agent.prepare.driver import Driver
from tests.controlplane import Unschedulable, allocate, claim_from, with_allocation
from tests.mig_node import BDF, GPU, NODE, MigNode, profile, req, whole
from tests.simnvml_mig import placement
from tests.test_allocator import CLASSES, claim, devices
from tests.test_mig_prepare import ref

GI_1G, GI_3G = 19, 9  # NVML profile IDs of 1g.18gb and 3g.71gb on an H200


def layout(node: MigNode) -> None:
    """The operator's: a 1g.18gb GPU instance at slice 0 with one compute instance, a 3g.71gb at
    slice 4 split into two one-slice compute instances."""
    nv = node.sim
    h = nv.nvmlDeviceGetHandleByPciBusId(BDF)
    one = nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, GI_1G, placement(0, 1))
    nv.nvmlGpuInstanceCreateComputeInstance(one, 0)
    three = nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, GI_3G, placement(4, 4))
    nv.nvmlGpuInstanceCreateComputeInstance(three, 0)
    nv.nvmlGpuInstanceCreateComputeInstance(three, 0)
    node.inv = node.scan()


@pytest.fixture
def static(tmp_path):
    node = MigNode(str(tmp_path), nvidia_mig="static")
    layout(node)
    return node


def driver_for(node: MigNode) -> Driver:
    d = Driver(node.settings, node.inventory)
    d.mig.nvml = lambda: node.nvml
    return d


def test_the_operators_instances_are_published_with_their_profiles(static):
    got = {n: d for n, d in devices(static.slices()).items() if n.startswith(GPU)}
    assert sorted(got) == [f"{GPU}-mig-gi1-ci0", f"{GPU}-mig-gi2-ci0", f"{GPU}-mig-gi2-ci1"]  # no whole GPU, no placements
    one = got[f"{GPU}-mig-gi1-ci0"]
    assert one["attributes"]["migProfile"] == {"string": "1g.18gb"} and one["attributes"]["migPlacementStart"] == {"int": 0}
    assert one["capacity"]["memory"] == {"value": "16Gi"} and one["capacity"]["multiprocessors"] == {"value": "16"}
    for ci in (0, 1):  # two compute instances split the GI's engines: its memory only, which they share
        split = got[f"{GPU}-mig-gi2-ci{ci}"]
        assert split["attributes"]["migProfile"] == {"string": "3g.71gb"}
        assert split["attributes"]["migPlacementStart"] == {"int": 4}
        assert split["attributes"]["migComputeInstance"] == {"int": ci}
        assert sorted(split["capacity"]) == ["memory"] and split["capacity"]["memory"] == {"value": "71424Mi"}
    assert [p for d in static.inv.devices for p in d.problems] == []


def test_claims_select_the_operators_instances_by_profile(static):
    slices = static.slices()
    (a,) = allocate(slices, CLASSES, claim_from(claim("a", req("m", profile("1g.18gb")))), node=NODE)
    assert [r["device"] for r in a["devices"]["results"]] == [f"{GPU}-mig-gi1-ci0"]
    taken = with_allocation(claim_from(claim("a", req("m", profile("1g.18gb")))), a)
    with pytest.raises(Unschedulable):  # the one 1g.18gb instance is taken; none is made for a second claim
        allocate(slices, CLASSES, claim_from(claim("b", req("m", profile("1g.18gb")))), node=NODE, allocated=[taken])
    with pytest.raises(Unschedulable):  # in MIG mode with instances: no whole GPU
        allocate(slices, CLASSES, claim_from(claim("w", req("w", whole()))), node=NODE)


def test_the_agent_never_destroys_the_operators_instances(static):
    before, calls = static.sim.instances(), len(static.sim.calls)
    d = driver_for(static)
    d.recover()  # at start, dynamic MIG destroys every instance no claim made
    c = static.allocated("m", req("m", profile("3g.71gb")))
    assert not d.prepare_claims([c])[c["metadata"]["uid"]].error
    assert d.unprepare_claims([ref(c)]) == {c["metadata"]["uid"]: None}
    assert static.sim.instances() == before
    assert not [call for call in static.sim.calls[calls:] if call.startswith(("create-", "destroy-"))]


def test_dynamic_mig_destroys_the_same_layout_at_start(tmp_path):
    """What ``static`` is for: the default (dynamic) owns the GPU and sweeps what no claim made."""
    node = MigNode(str(tmp_path))
    layout(node)
    assert any(n.startswith(f"{GPU}-mig-1g-18gb-") for n in devices(node.slices()))  # NVML's placements instead
    driver_for(node).recover()
    assert node.sim.instances() == {}


def test_a_gpu_instance_nvml_does_not_list_keeps_its_device_without_a_profile(static, monkeypatch):
    real = static.nvml.mig_instances
    monkeypatch.setattr(static.nvml, "mig_instances", lambda bdf: [g for g in real(bdf) if g.gi != 2])
    inv = static.scan()
    (gpu,) = [d for d in inv.devices if d.kind == "gpu"]
    assert [p.profile.name if p.profile else None for p in gpu.gpu.partitioning.partitions] == ["1g.18gb", None, None]
    assert [p.what for p in gpu.problems] == ["MIG gi2", "MIG gi2"]
    monkeypatch.setattr(static.nvml, "mig_instances", lambda bdf: None)  # NVML did not answer
    (gpu,) = [d for d in static.scan().devices if d.kind == "gpu"]
    assert all(p.profile is None for p in gpu.gpu.partitioning.partitions) and [p.what for p in gpu.problems] == ["MIG"]


def test_sysdra_scan_shows_the_profiles_of_the_instances(static):
    from discovery.render import render_tree

    assert "MIG: 3 instances (1g.18gb, 3g.71gb)" in render_tree(static.scan())


def test_doctor_names_the_instances_dynamic_mig_would_destroy(tmp_path, monkeypatch):
    """``sysdra doctor``'s ``mig`` check, read-only: under dynamic MIG the operator's layout is named
    before the agent's start destroys it; a claim's own instance is not; under static all is well."""
    from agent.tools.doctor_mig import check_mig
    from discovery.nvml import Nvml

    node = MigNode(str(tmp_path))
    layout(node)
    monkeypatch.setattr(Nvml, "probe", classmethod(lambda cls, *a, **kw: (node.nvml, "")))
    (found,) = check_mig(node.settings)
    assert found.level == "warn" and "the agent destroys them at its next start" in found.message
    assert f"{BDF} gi1 (1g.18gb at slice 0)" in found.message and f"{BDF} gi2 (3g.71gb at slice 4)" in found.message
    assert "nvidia_mig: static" in found.fix
    d = driver_for(node)
    d.recover()  # the sweep the warning foretold; then a claim's own instance
    c = node.allocated("m", req("m", profile("2g.35gb")))
    assert not d.prepare_claims([c])[c["metadata"]["uid"]].error
    (found,) = check_mig(node.settings)
    assert found.level == "ok" and "each made for a prepared claim" in found.message
    layout_static = MigNode(str(tmp_path / "static"), nvidia_mig="static")
    layout(layout_static)
    monkeypatch.setattr(Nvml, "probe", classmethod(lambda cls, *a, **kw: (layout_static.nvml, "")))
    (found,) = check_mig(layout_static.settings)
    assert found.level == "ok" and "published as they are" in found.message
    assert check_mig(layout_static.settings.replace(partitions=False)) == []


def test_the_agent_and_sysdra_scan_scan_with_the_setting(static, monkeypatch, capsys):
    """The daemon's scans (agent/service/scanning.py) and ``sysdra scan --nvidia-mig`` take ``nvidia_mig``."""
    from agent.cli import main as cli
    from agent.cli import scan as scan_cmd
    from agent.service import scanning

    monkeypatch.setattr(scanning, "open_nvml", lambda settings: static.nvml)
    monkeypatch.setattr(scan_cmd, "_nvml", lambda args, settings: static.nvml)

    def profiles(inv) -> list:
        (gpu,) = [d for d in inv.devices if d.kind == "gpu"]
        return [p.profile.name if p.profile else None for p in gpu.gpu.partitioning.partitions]

    assert profiles(scanning.default_scan(static.settings)) == ["1g.18gb", "3g.71gb", "3g.71gb"]
    _, inv = scanning.update(None, static.settings, None)
    assert profiles(inv) == ["1g.18gb", "3g.71gb", "3g.71gb"]
    assert profiles(scanning.default_scan(static.settings.replace(nvidia_mig="dynamic"))) == [None, None, None]
    assert cli.main(["scan", "--root", static.root, "-o", "tree", "--nvidia-mig", "static"]) == 0
    assert "MIG: 3 instances (1g.18gb, 3g.71gb)" in capsys.readouterr().out
    assert cli.main(["scan", "--root", static.root, "-o", "tree"]) == 0
    assert "MIG: 3 instances, 7 profiles (NVML)" in capsys.readouterr().out
    assert cli.main(["scan", "--root", static.root, "--nvidia-mig", "statik"]) == 2
    assert "--nvidia-mig: dynamic or static, not 'statik'" in capsys.readouterr().err


def test_an_instance_of_a_profile_nvml_does_not_list_keeps_no_profile(static, monkeypatch):
    from discovery.mig import GpuInstanceNow

    monkeypatch.setattr(static.nvml, "mig_instances", lambda bdf: [GpuInstanceNow(gi=1, profile=999, start=0, size=1, cis=(0,))])
    (gpu,) = [d for d in static.scan().devices if d.kind == "gpu"]
    assert all(p.profile is None for p in gpu.gpu.partitioning.partitions)
    assert [p.what for p in gpu.problems] == ["MIG gi1", "MIG gi2", "MIG gi2"]


def test_turned_dynamic_while_an_instance_is_claimed_its_instance_is_kept(static, monkeypatch):
    """``nvidia_mig`` changed to dynamic at a restart while a claim holds an operator's instance:
    the start sweeps the instances no claim made, and the claimed one is a claim's (before, it was
    destroyed under the running pod as one no record knew). Its unprepare leaves it: not the agent's."""
    c = static.allocated("m", req("m", profile("3g.71gb")))
    uid = c["metadata"]["uid"]
    d = driver_for(static)
    d.recover()
    assert not d.prepare_claims([c])[uid].error
    static.settings = static.settings.replace(nvidia_mig="dynamic")
    static.inv = static.scan()
    from agent.tools.doctor_mig import check_mig
    from discovery.nvml import Nvml

    monkeypatch.setattr(Nvml, "probe", classmethod(lambda cls, *a, **kw: (static.nvml, "")))
    (said,) = check_mig(static.settings)  # sysdra doctor, before the restart: the unclaimed one goes
    assert "0000:00:06.0 gi1 (1g.18gb at slice 0):" in said.message and "gi2" not in said.message
    d = driver_for(static)
    assert [line.split(": ")[1] for line in d.recover().host_restored] == [
        "MIG GPU instance 1 (profile 19, placement 0) no claim knows, destroyed"]
    assert [(g["profile"], g["start"]) for g in static.sim.instances().values()] == [(GI_3G, 4)]
    assert d.unprepare_claims([ref(c)]) == {uid: None} and len(static.sim.instances()) == 1
