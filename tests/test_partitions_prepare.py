"""Prepare of partition devices on the simulated amdgpu (fixtures/simkernel/amdgpu.py): claims
allocated by the scheduler's allocator from the agent's slices, mode switches as transactions,
refusals, restores and start-up recovery. The MIG side needs no switch: its nodes are checked
here too. A partitioned GPU and VFIO: a config asking it for a partition, and a process on a
partition's render node (on the simulated PCI kernel, tests/simkernel.py)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import time

import pytest

from agent.prepare.checkpoint import Checkpoint
from agent.prepare.driver import Driver
from agent.prepare.partitions import Partitions, intent
from discovery.inventory import scan
from tests.kubelet_standin import settings_for
from tests.partition_node import CPX_GPU, SPX_GPU, Node, copy_node, devices_of, mode_of, part_of, whole
from tests.controlplane import Unschedulable
from tests.simkernel import SimPciKernel
from tests.test_partitions_allocator import gpu_bdf
from tests.test_vfio import UID, vfio_claim
from tests.test_vfio_inuse import FULL, hold


def spec_nodes(driver: Driver, uid: str) -> dict[str, list[str]]:
    """CDI device name suffix (our device) -> its device node paths, from the spec on disk."""
    with open(driver._spec_path(uid)) as f:
        spec = json.load(f)
    return {d["name"][len(uid) + 1:]: [n["path"] for n in d["containerEdits"].get("deviceNodes", [])] for d in spec["devices"]}


@pytest.fixture
def node(tmp_path):
    n = Node(str(tmp_path))
    with n.sim:
        yield n


def driver_for(node: Node) -> Driver:
    d = Driver(node.settings, node.inventory)
    d.hardware_changed = node.rescan
    return d


def prepare(driver: Driver, claim: dict) -> object:
    return driver.prepare_claims([claim])[claim["metadata"]["uid"]]


def test_partition_in_the_current_mode_needs_no_switch(node):
    d = driver_for(node)
    c = node.allocated("cpx", part_of(CPX_GPU, "CPX/NPS1"), count=2)
    res = prepare(d, c)
    assert not res.error, res.error
    assert node.sim.switches == [] and node.rescans == 0
    got = spec_nodes(d, c["metadata"]["uid"])
    assert got == {f"{CPX_GPU}-cpx-nps1-0": ["/dev/dri/renderD128", "/dev/kfd"],
                   f"{CPX_GPU}-cpx-nps1-1": ["/dev/dri/renderD129", "/dev/kfd"]}
    assert d.checkpoint.claims[c["metadata"]["uid"]]["partitions"] == {"uses": {gpu_bdf(CPX_GPU): "CPX/NPS1"}}


def test_prepare_switches_the_mode_and_builds_the_spec_from_the_new_partitions(node):
    d = driver_for(node)
    a = node.allocated("a", part_of(SPX_GPU, "DPX/NPS1"))
    assert devices_of(a) == [f"{SPX_GPU}-dpx-nps1-0"]
    res = prepare(d, a)
    assert not res.error, res.error
    assert mode_of(node.root, gpu_bdf(SPX_GPU)) == "DPX/NPS1" and node.rescans == 1  # republished after the switch
    assert spec_nodes(d, a["metadata"]["uid"]) == {f"{SPX_GPU}-dpx-nps1-0": ["/dev/dri/renderD136", "/dev/kfd"]}
    entry = d.checkpoint.claims[a["metadata"]["uid"]]
    assert entry["partitions"] == {"uses": {gpu_bdf(SPX_GPU): "DPX/NPS1"}}  # the intent is gone once done
    # the second DPX partition, allocated knowing about the first: no switch, the xcp render node
    b = node.allocated("b", part_of(SPX_GPU, "DPX/NPS1"), prepared=[a])
    assert not prepare(d, b).error
    assert spec_nodes(d, b["metadata"]["uid"]) == {f"{SPX_GPU}-dpx-nps1-1": ["/dev/dri/renderD137", "/dev/kfd"]}
    assert len(node.sim.switches) == 1
    # once both are gone the GPU may switch again
    assert d.unprepare_claims([ref(a), ref(b)]) == {a["metadata"]["uid"]: None, b["metadata"]["uid"]: None}
    c = node.allocated("c", part_of(SPX_GPU, "CPX/NPS1"), count=8)
    assert not prepare(d, c).error
    assert mode_of(node.root, gpu_bdf(SPX_GPU)) == "CPX/NPS1"
    assert sorted(n for ns in spec_nodes(d, c["metadata"]["uid"]).values() for n in ns if "render" in n) == \
        sorted(f"/dev/dri/renderD{136 + i}" for i in range(8))


def ref(c: dict):
    from agent.kubeletplugin.types import ClaimRef

    m = c["metadata"]
    return ClaimRef(namespace=m["namespace"], name=m["name"], uid=m["uid"])


def test_compute_switches_within_the_memory_mode_and_never_write_it(node):
    """A compute mode switches at once, within the GPU's memory mode: SPX/NPS1 to QPX/NPS1 and back
    to the whole GPU, one write of current_compute_partition each. current_memory_partition is
    never written (amdgpu applies it only at a driver reload: tests/test_partitions_nps.py), and
    no partition of another memory mode is published for the allocator to pick."""
    d = driver_for(node)
    bdf = gpu_bdf(SPX_GPU)
    memory = os.path.join(node.root, "sys/bus/pci/devices", bdf, "current_memory_partition")
    untouched = os.stat(memory).st_mtime_ns
    a = node.allocated("q", part_of(SPX_GPU, "QPX/NPS1"))
    assert not prepare(d, a).error
    assert mode_of(node.root, bdf) == "QPX/NPS1"
    d.unprepare_claims([ref(a)])
    w = node.allocated("w", whole(SPX_GPU))
    assert not prepare(d, w).error, "back to the whole GPU: SPX, in NPS1 as before"
    assert mode_of(node.root, bdf) == "SPX/NPS1"
    deadline = time.monotonic() + 5
    while len(node.sim.switches) < 2 and time.monotonic() < deadline:  # recorded once its partitions are up
        time.sleep(0.01)
    assert [s[1:] for s in node.sim.switches] == [("QPX", "NPS1"), ("SPX", "NPS1")]  # one compute write each
    assert os.stat(memory).st_mtime_ns == untouched and node.sim.gpus[bdf].requested_nps is None
    with pytest.raises(Unschedulable):  # QPX/NPS4 needs a driver reload: not published
        node.allocated("q4", part_of(SPX_GPU, "QPX/NPS4"))


def test_whole_gpu_in_partition_mode_switches_to_spx(node):
    d = driver_for(node)
    w = node.allocated("w", whole(CPX_GPU))
    assert not prepare(d, w).error
    assert mode_of(node.root, gpu_bdf(CPX_GPU)) == "SPX/NPS1"
    assert spec_nodes(d, w["metadata"]["uid"]) == {CPX_GPU: ["/dev/dri/card1", "/dev/dri/renderD128", "/dev/kfd"]}


def test_a_mode_that_conflicts_with_a_prepared_claim_is_refused(node):
    d = driver_for(node)
    a = node.allocated("a", part_of(SPX_GPU, "DPX/NPS1"))
    assert not prepare(d, a).error
    # a scheduler that did not see claim a (or a stale slice) allocates another mode: refused here
    b = node.allocated("b", part_of(SPX_GPU, "CPX/NPS1"))
    res = prepare(d, b)
    assert "runs in DPX/NPS1 for prepared claim default/a" in res.error and "needs CPX/NPS1" in res.error
    assert mode_of(node.root, gpu_bdf(SPX_GPU)) == "DPX/NPS1" and b["metadata"]["uid"] not in d.checkpoint.claims
    w = node.allocated("w", whole(SPX_GPU))
    assert "needs SPX/NPS1" in prepare(d, w).error
    assert not prepare(d, a).error  # the prepared claim is untouched (idempotent re-prepare)


@pytest.mark.parametrize("failure", ["reject", "stall", "partial"])
def test_a_failed_switch_restores_the_previous_mode(tmp_path, failure):
    node = Node(str(tmp_path), partition_switch_timeout=0.5)
    with node.sim:
        node.sim.fail, node.sim.fail_modes = failure, {"CPX"}
        d = driver_for(node)
        c = node.allocated("c", part_of(SPX_GPU, "CPX/NPS1"))
        res = prepare(d, c)
        assert res.error.startswith(f"switching GPU {gpu_bdf(SPX_GPU)} from SPX/NPS1 to CPX/NPS1 failed: the kernel shows")
        assert res.error.endswith("restored SPX/NPS1"), res.error
        assert mode_of(node.root, gpu_bdf(SPX_GPU)) == "SPX/NPS1"
        assert c["metadata"]["uid"] not in d.checkpoint.claims and not os.path.exists(d._spec_path(c["metadata"]["uid"]))
        pt, problems = d.partitions.read(node.inv.by_name()[SPX_GPU])
        assert len(pt.partitions) == 1 and not problems  # the kernel shows the old mode whole again
        node.sim.fail = None  # the kubelet's retry then works
        assert not prepare(d, c).error and mode_of(node.root, gpu_bdf(SPX_GPU)) == "CPX/NPS1"


def _refuse_spx(monkeypatch) -> None:
    """The kernel refuses SPX (EBUSY) for any driver made from now on: the mode cannot be restored."""
    real = Partitions._write

    def refusing(self, gpu, what, value):
        if value == "SPX":
            raise OSError(errno.EBUSY, "Device or resource busy")
        return real(self, gpu, what, value)

    monkeypatch.setattr(Partitions, "_write", refusing)


def test_a_failed_switch_not_restored_keeps_the_intent_until_the_retry(tmp_path, monkeypatch):
    node = Node(str(tmp_path), partition_switch_timeout=0.5)
    with node.sim:
        node.sim.fail, node.sim.fail_modes = "stall", {"CPX"}
        _refuse_spx(monkeypatch)
        d = driver_for(node)
        c = node.allocated("c", part_of(SPX_GPU, "CPX/NPS1"))
        uid, bdf = c["metadata"]["uid"], gpu_bdf(SPX_GPU)
        err = prepare(d, c).error
        assert err.startswith(f"switching GPU {bdf} from SPX/NPS1 to CPX/NPS1 failed: the kernel shows"), err
        assert err.endswith(f"undoing it failed (retried): GPU {bdf}: restoring SPX/NPS1 failed too: "
                            "[Errno 16] Device or resource busy"), err
        entry = Checkpoint.load(d.checkpoint_path, move_corrupt=False).claims[uid]
        assert entry["state"] == "PrepareStarted" and intent(entry) == {"gpu": bdf, "from": "SPX/NPS1", "to": "CPX/NPS1"}
        node.sim.fail = None
        monkeypatch.undo()
        assert not prepare(d, c).error  # the kubelet's retry: SPX back first, then the switch again
        assert mode_of(node.root, bdf) == "CPX/NPS1" and d.checkpoint.claims[uid]["state"] == "PrepareCompleted"


def test_an_interrupted_switch_not_undone_at_start_is_kept_and_retried(node, monkeypatch):
    d = driver_for(node)
    c = node.allocated("c", part_of(SPX_GPU, "CPX/NPS1"))
    uid, bdf = c["metadata"]["uid"], gpu_bdf(SPX_GPU)
    prepare_crashing_at(d, c, "partition:exposed")
    _refuse_spx(monkeypatch)
    report = Driver(node.settings, node.inventory).recover()
    assert report.rolled_back == [] and report.host_restored == [] and mode_of(node.root, bdf) == "CPX/NPS1"
    entry = Checkpoint.load(d.checkpoint_path, move_corrupt=False).claims[uid]
    assert intent(entry) == {"gpu": bdf, "from": "SPX/NPS1", "to": "CPX/NPS1"}  # the next start tries again
    monkeypatch.undo()
    report = Driver(node.settings, node.inventory).recover()
    assert report.rolled_back == [uid] and report.host_restored == [f"{bdf}: restored SPX/NPS1"]
    assert mode_of(node.root, bdf) == "SPX/NPS1"


class Crash(BaseException):
    """Stands in for the process dying at a fault point (tests/faults does it with SIGKILL)."""


def prepare_crashing_at(d: Driver, c: dict, point: str) -> None:
    """Prepare ``c``, the process dying (``Crash``) at fault point ``point``."""
    def crash(at: str) -> None:
        if at == point:
            raise Crash(at)

    d.fault = crash
    with pytest.raises(Crash):
        prepare(d, c)


@pytest.mark.parametrize("point", ["partition:compute-written", "partition:exposed", "prepare:specs-written"])
def test_recovery_undoes_a_switch_interrupted_before_the_claim_completed(node, point):
    d = driver_for(node)
    c = node.allocated("c", part_of(SPX_GPU, "CPX/NPS1"))
    prepare_crashing_at(d, c, point)
    uid = c["metadata"]["uid"]
    on_disk = Driver(node.settings, node.inventory)  # a new process: checkpoint from disk
    report = on_disk.recover()
    assert report.rolled_back == [uid] and report.host_restored == [f"{gpu_bdf(SPX_GPU)}: restored SPX/NPS1"]
    assert mode_of(node.root, gpu_bdf(SPX_GPU)) == "SPX/NPS1" and uid not in on_disk.checkpoint.claims
    pt, problems = on_disk.partitions.read(node.inv.by_name()[SPX_GPU])
    assert pt.compute_mode == "SPX" and len(pt.partitions) == 1 and not problems


def test_an_intent_is_on_disk_before_the_first_kernel_write(node):
    d = driver_for(node)
    c = node.allocated("c", part_of(SPX_GPU, "QPX/NPS1"))
    seen = {}

    def look(at: str) -> None:
        if at == "partition:compute-written":
            from agent.prepare.checkpoint import Checkpoint

            seen["disk"] = Checkpoint.load(d.checkpoint_path).claims[c["metadata"]["uid"]]

    d.fault = look
    assert not prepare(d, c).error
    assert intent(seen["disk"]) == {"gpu": gpu_bdf(SPX_GPU), "from": "SPX/NPS1", "to": "QPX/NPS1"}


def test_mig_instances_get_their_cap_nodes(tmp_path):
    from tests.partition_node import copy_node

    root = copy_node(str(tmp_path / "host"), "h100-mig")
    n = Node.__new__(Node)
    n.root, n.rescans = root, 0
    from discovery.inventory import scan
    from tests.kubelet_standin import settings_for

    n.settings = settings_for(str(tmp_path), root=root, partitions=True)
    n.inv = scan(root)
    d = driver_for(n)
    c = n.allocated("m", part_of("gpu-0000-18-00-0"), count=2)
    assert not prepare(d, c).error
    got = spec_nodes(d, c["metadata"]["uid"])
    assert got == {
        "gpu-0000-18-00-0-mig-gi1-ci0": ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
                                         "/dev/nvidia-caps/nvidia-cap12", "/dev/nvidia-caps/nvidia-cap13"],
        "gpu-0000-18-00-0-mig-gi2-ci0": ["/dev/nvidia0", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
                                         "/dev/nvidia-caps/nvidia-cap21", "/dev/nvidia-caps/nvidia-cap22"],
    }
    assert "partitions" not in d.checkpoint.claims[c["metadata"]["uid"]]  # MIG instances need no mode



@pytest.mark.parametrize("partitions", [True, False])
def test_whole_gpu_in_mig_mode_without_nvml_fails_clearly(tmp_path, partitions):
    """Not published (a GPU with MIG instances is in MIG mode: CUDA sees no device on the whole
    GPU), so only a claim from a slice of before its instances were made asks for it: it fails,
    saying why and what to do, and nothing is recorded; the GPU beside it prepares."""
    from discovery.inventory import scan
    from tests.kubelet_standin import claim as hand_claim, settings_for
    from tests.partition_node import copy_node

    root = copy_node(str(tmp_path / "host"), "h100-mig")
    inv = scan(root)
    d = Driver(settings_for(str(tmp_path), root=root, partitions=partitions), lambda: inv)
    c = hand_claim("w", [("w", "gpu-0000-18-00-0")])
    err = prepare(d, c).error
    assert err and "GPU 0000:18:00.0 is in MIG mode (MIG instances gi1/ci0, gi2/ci0, gi2/ci1, gi9/ci0)" in err
    assert "CUDA sees no device" in err and "nvidia-smi -i 0000:18:00.0 -mig 0" in err
    assert d.checkpoint.claims == {}
    ok = hand_claim("ok", [("g", "gpu-0000-3a-00-0")])
    assert not prepare(d, ok).error


def test_a_vfio_config_for_a_gpu_partition_is_the_claims_error(node):
    """docs/vfio.md: a ``VfioConfig`` names the requests that go to a VM. A request that got an AMD
    partition (kind gpu: the config applies) cannot: the GPU is one PCI function. The claim's
    error, nothing prepared, rather than the partition prepared as an ordinary one (its render
    node and /dev/kfd in a container) with the config dropped."""
    d = driver_for(node)
    c = node.allocated("c", part_of(CPX_GPU, "CPX/NPS1"))
    c["status"]["allocation"]["devices"]["config"] = [{
        "source": "FromClaim", "requests": ["gpu"],
        "opaque": {"driver": "sysdra.io", "parameters": {"apiVersion": "sysdra.io/v1alpha1", "kind": "VfioConfig"}}}]
    res = prepare(d, c)
    assert res.error and "only a whole PCI function can be bound to vfio-pci" in res.error, res.error
    assert c["metadata"]["uid"] not in d.checkpoint.claims and not os.path.exists(d._spec_path(c["metadata"]["uid"]))


@pytest.mark.parametrize("partition, dev_file", [
    (0, "sys/bus/pci/devices/0000:05:00.0/drm/renderD128/dev"),  # below the function, as any DRM node
    (1, "sys/devices/platform/amdgpu_xcp_0/drm/renderD129/dev"),  # below an amdgpu_xcp platform device
])
def test_a_process_on_any_partitions_render_node_keeps_the_gpu_from_vfio(tmp_path, partition, dev_file):
    """docs/vfio.md, "In use on the host": a process holding one of the function's device files
    refuses its VFIO claim, nothing written (amdgpu's unbind would wait for it). An MI300X in CPX
    mode has eight render nodes; partitions 1..7's are below ``amdgpu_xcp_<N>`` (docs/partitions.md),
    found as discovery finds them (KFD's drm_render_minor)."""
    root = copy_node(str(tmp_path / "host"))
    os.makedirs(os.path.join(root, "proc/sys/kernel/random"), exist_ok=True)
    open(os.path.join(root, "proc/sys/kernel/random/boot_id"), "w").write("boot-1\n")
    open(os.path.join(root, dev_file), "w").write(f"{FULL[0]}:{FULL[1]}\n")  # /dev/full's numbers: a real process holds it
    children: list[subprocess.Popen] = []
    sim = SimPciKernel(root, real_nodes=True).start()
    try:
        child = hold(root, children, "/dev/dri/" + dev_file.split("/")[-2], FULL, "rocm-smi")
        d = Driver(settings_for(str(tmp_path / "state"), root=root), lambda: scan(root))
        d.kernel.wait = 2.0
        err = d.prepare_claims([vfio_claim("vm", [CPX_GPU], UID)])[UID].error
        assert err and err.startswith(f"0000:05:00.0 is in use on the host: {root}/dev/dri/renderD{128 + partition} "
                                      f"is open by pid {child.pid} (rocm-smi)"), err
        assert sim.driver("0000:05:00.0") == "amdgpu" and sim.log == []
    finally:
        for child in children:
            child.kill()
            child.wait()
        sim.close()
