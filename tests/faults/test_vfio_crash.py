"""VFIO rebinding under SIGKILL: the real agent kills itself at every step of moving a
function to vfio-pci and back (a Driver.fault point, through tests.faults.crashpoint) on a
simulated kernel (tests/simkernel.py, running in this process across the agent's deaths),
and at a reboot in the middle. After each restart the function is in a state the
checkpoint explains: prepared on vfio-pci, or back on its original driver with no claim;
the kubelet's retry then completes the operation."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from agent.prepare.checkpoint import COMPLETED, Checkpoint
from tests.faults.harness import Node, run
from tests.faults.test_hostile import errors_of
from tests.simkernel import SimPciKernel

pytestmark = pytest.mark.slow
VF, VF_BDF, ORIGINAL = "nic-0000-06-00-2", "0000:06:00.2", "mlx5_core"
UID = "00000000-0000-4000-8000-0000000f0101"
BIND_POINTS = ["prepare:started", "vfio:override-set", "vfio:unbound", "vfio:bound", "prepare:specs-written"]
RESTORE_POINTS = ["vfio:override-restored", "vfio:restore-unbound", "vfio:restored", "unprepare:saved"]


def vfio_claim(node: Node) -> dict:
    c = node.write_claim("vm", [("vm", VF)], uid=UID)
    c["status"]["allocation"]["devices"]["config"] = [{"source": "FromClaim", "opaque": {
        "driver": "sysdra.io", "parameters": {"apiVersion": "sysdra.io/v1alpha1", "kind": "VfioConfig"}}}]
    path = os.path.join(node.cluster, "resourceclaims", "default", "vm.json")
    with open(path, "w") as f:
        json.dump(c, f)
    return c


def _state(node: Node, sim: SimPciKernel) -> str:
    cp = Checkpoint.load(os.path.join(node.plugin_dir, "checkpoint.json"), move_corrupt=False)
    entry = cp.claims.get(UID)
    drv = sim.driver(VF_BDF)
    if entry is None:
        assert drv == ORIGINAL and sim.override(VF_BDF) is None, f"no claim but the VF is on {drv}"
        return "rolled back"
    assert entry["state"] == COMPLETED and drv == "vfio-pci", f"claim {entry['state']}, VF on {drv}"
    return "prepared"


def _crash_at(node: Node, point: str, op) -> None:
    armed = node.log_tail(100000).count("crashpoint: armed")
    node.start(env={"SYSDRA_FAULT_KILL_POINT": f"driver:{point}"})
    node.proc.send_signal(signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while node.log_tail(100000).count("crashpoint: armed") == armed:  # the agent says when it is armed
        assert time.monotonic() < deadline, "the kill point was not armed"
        time.sleep(0.01)
    try:
        run(op(), timeout=30)
    except Exception:
        pass  # the agent died mid-call
    node.proc.wait(timeout=30)
    assert node.proc.returncode == -signal.SIGKILL, f"{point} not reached:\n{node.log_tail()}"


def test_sigkill_at_every_step_of_a_vfio_bind_and_give_back(tmp_path, faults):
    node = Node(tmp_path, profile="sriov-nic")
    sim = SimPciKernel(node.root).start()
    seen = {}
    try:
        c = vfio_claim(node)
        for point in BIND_POINTS:
            _crash_at(node, point, lambda: node.prepare(c))
            node.start()
            seen[point] = _state(node, sim)
            assert not errors_of(run(node.prepare(c)))[UID]  # the kubelet's retry
            assert _state(node, sim) == "prepared"
            assert not errors_of(run(node.unprepare(c)))[UID]
            assert _state(node, sim) == "rolled back"
            node.stop()
        for point in RESTORE_POINTS:
            node.start()
            assert not errors_of(run(node.prepare(c)))[UID]
            node.stop()
            _crash_at(node, point, lambda: node.unprepare(c))
            node.start()
            seen[point] = _state(node, sim)
            assert not errors_of(run(node.unprepare(c)))[UID]  # the kubelet's retry
            assert _state(node, sim) == "rolled back"
            node.check_clean()
            node.stop()
    finally:
        node.stop()
        sim.stop()
    for point, outcome in seen.items():
        faults.add("Crash anywhere", f"SIGKILL at VFIO step {point}", 1, f"after restart: {outcome}; retry completes")


def test_reboot_while_a_vm_claim_is_prepared(tmp_path, faults):
    node = Node(tmp_path, profile="sriov-nic")
    sim = SimPciKernel(node.root).start()
    try:
        c = vfio_claim(node)
        node.start()
        assert not errors_of(run(node.prepare(c)))[UID]
        node.kill()
        # the reboot: bindings and driver_override are gone, the original driver has the VF
        sim.stop()
        sim.unbind("vfio-pci", VF_BDF)
        with open(os.path.join(node.root, "sys/bus/pci/devices", VF_BDF, "driver_override"), "w") as f:
            f.write("(null)\n")
        sim.bind(ORIGINAL, VF_BDF)
        node.set_boot_id("boot-2")
        sim.start()
        node.start()
        assert _state(node, sim) == "prepared"  # re-bound at start: the claim is still prepared
        resp = run(node.prepare(c))
        assert not errors_of(resp)[UID]
        assert not errors_of(run(node.unprepare(c)))[UID]
        assert _state(node, sim) == "rolled back"
    finally:
        node.stop()
        sim.stop()
    faults.add("Reboot", "reboot while a VFIO claim is prepared", 1, "re-bound to vfio-pci at start; unprepare gives it back")


def _pending(node: Node) -> bool | None:
    """The claim's record says its unbind may still be in the kernel (None: no entry)."""
    entry = Checkpoint.load(os.path.join(node.plugin_dir, "checkpoint.json"), move_corrupt=False).claims.get(UID)
    return None if entry is None else entry["vfio"][0].get("pending", False)


def test_an_unbind_that_hangs_frees_the_node_and_survives_sigkill(tmp_path, faults):
    """The unbind write blocks (tests/simkernel.py ``hang``: a writer waits in write() with the
    file open, as in a driver's remove that waits for the device's users). The real agent
    answers the claim's prepare with its error after the kernel deadline (10 s), another
    claim's prepare completes while the write is still in the kernel, and the record says the
    unbind is pending. SIGKILL before and after that record is saved, and once the claim failed:
    after each restart the function is back on its driver with no claim (the killed write
    died with its process: no process has the unbind file open), and once the kernel lets go the
    kubelet's retry prepares it."""
    node = Node(tmp_path, profile="sriov-nic")
    sim = SimPciKernel(node.root).start()
    plain = node.write_claim("net", [("net", "nic-0000-06-00-3")], uid="00000000-0000-4000-8000-0000000f0102")
    seen = {}
    try:
        c = vfio_claim(node)
        sim.hang(ORIGINAL)
        for point in ("prepare:specs-written", "prepare:completed"):  # the pending record not saved, saved
            _crash_at(node, point, lambda: node.prepare(c))
            seen[point] = _pending(node)
            node.start()
            assert _state(node, sim) == "rolled back"
            node.stop()
        node.start()
        err = errors_of(run(node.prepare(c), timeout=60))[UID]
        assert f"{VF_BDF}: the kernel has not finished unbinding it from {ORIGINAL} after 10s" in err, err
        assert _pending(node) is True
        assert not errors_of(run(node.prepare(plain)))[plain["metadata"]["uid"]]  # the node goes on meanwhile
        assert "the kernel has not finished it" in errors_of(run(node.unprepare(c)))[UID]  # nothing races the write
        node.kill()
        node.start()
        assert _state(node, sim) == "rolled back"
        sim.release(ORIGINAL)
        assert not errors_of(run(node.prepare(c)))[UID]  # the kubelet's retry
        assert _state(node, sim) == "prepared"
        assert not errors_of(run(node.unprepare(c)))[UID]
        assert _state(node, sim) == "rolled back"
    finally:
        node.stop()
        sim.close()
    assert seen == {"prepare:specs-written": False, "prepare:completed": True}
    faults.add("Crash anywhere", "SIGKILL while a VFIO unbind hangs (before/after its pending record)", 2,
               "after restart: given back, no claim; retry completes once the kernel lets go")
    faults.add("Hung kernel", "unbind write that does not return", 1,
               "claim fails after 10 s, lock freed (another claim prepared meanwhile), record pending; retry completes")
