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
