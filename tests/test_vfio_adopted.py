"""A VFIO claim adopted from its CDI spec (prepare/recovery.py: the checkpoint lost with the plugin
dir, or damaged) on a simulated kernel (tests/simkernel.py): its record, with the driver the
function had before, is gone, so its unprepare gives the function back to the driver the kernel
matches for it (``drivers_probe``, as at hot-plug). Before, the function stayed on vfio-pci with
the agent's ``driver_override`` for good: its netdev never came back."""

from __future__ import annotations

import os

from agent.kubeletplugin.types import ClaimRef
from agent.prepare.checkpoint import Checkpoint
from tests.test_vfio import UID, VF, VF_BDF, node, vfio_claim  # noqa: F401 - fixture


def test_an_adopted_vfio_claims_unprepare_gives_the_function_back_to_the_kernels_driver(node):
    s, sim, state, driver = node
    c = vfio_claim("vm", [VF], UID)
    assert driver().prepare_claims([c])[UID].error is None and sim.driver(VF_BDF) == "vfio-pci"
    for name in os.listdir(s.plugin_dir):
        if name.startswith("checkpoint.json"):
            os.unlink(os.path.join(s.plugin_dir, name))
    d = driver()
    assert d.recover().adopted == [UID] and sim.driver(VF_BDF) == "vfio-pci"  # the VM keeps it
    assert d.checkpoint.claims[UID]["vfio"] == [{"bdf": VF_BDF, "group": 42, "driver": None, "override": None, "probe": True}]
    assert d.prepare_claims([c])[UID].error is None  # the kubelet's re-prepare: filled in, kept
    assert Checkpoint.load(d.checkpoint_path).claims[UID]["vfio"][0]["probe"] is True
    assert d.unprepare_claims([ClaimRef("default", "vm", UID)]) == {UID: None}
    assert sim.driver(VF_BDF) == "mlx5_core" and sim.override(VF_BDF) is None
    assert os.path.isdir(os.path.join(s.root, "sys/bus/pci/devices", VF_BDF, "net"))  # its netdev is back


def test_a_function_on_vfio_pci_without_the_agents_override_is_not_taken_for_the_claims(node):
    """Only a function with the ``driver_override`` the agent's bind sets is one it moved: one the
    host put on vfio-pci itself (no override) is left as it is."""
    s, sim, state, driver = node
    c = vfio_claim("vm", [VF], UID)
    assert driver().prepare_claims([c])[UID].error is None
    os.unlink(os.path.join(s.plugin_dir, "checkpoint.json"))
    sim.stop()
    with open(os.path.join(s.root, "sys/bus/pci/devices", VF_BDF, "driver_override"), "w") as f:
        f.write("(null)\n")
    sim.start()
    d = driver()
    assert d.recover().adopted == [UID] and "vfio" not in d.checkpoint.claims[UID]
    assert d.unprepare_claims([ClaimRef("default", "vm", UID)]) == {UID: None} and sim.driver(VF_BDF) == "vfio-pci"


def test_a_function_that_cannot_be_read_leaves_the_claim_adopted(node, caplog):
    """A ``driver_override`` that cannot be read (a FIFO in its place) fails no start: the claim is
    adopted, its function left as it is, said as such."""
    s, sim, state, driver = node
    assert driver().prepare_claims([vfio_claim("vm", [VF], UID)])[UID].error is None
    os.unlink(os.path.join(s.plugin_dir, "checkpoint.json"))
    override = os.path.join(s.root, "sys/bus/pci/devices", VF_BDF, "driver_override")
    sim.stop()
    os.unlink(override)
    os.mkfifo(override)
    d = driver()
    assert d.recover().adopted == [UID] and "vfio" not in d.checkpoint.claims[UID]
    assert "the functions of an adopted claim not read" in caplog.text


def test_a_function_no_driver_matches_is_left_without_one_and_said(node, caplog):
    """No driver matches the adopted claim's function at its give-back (its module unloaded): it is
    left with no driver, and a WARNING says so with how to bind it. Before, nothing was said: the
    give-back's note was dropped at unprepare, and the NIC's netdev silently never came back."""
    s, sim, state, driver = node
    c = vfio_claim("vm", [VF], UID)
    assert driver().prepare_claims([c])[UID].error is None
    for name in os.listdir(s.plugin_dir):
        if name.startswith("checkpoint.json"):
            os.unlink(os.path.join(s.plugin_dir, name))
    d = driver()
    d.kernel.wait = 0.2  # the kernel's answer to drivers_probe is waited for this long
    assert d.recover().adopted == [UID]
    os.unlink(os.path.join(s.root, ".simkernel/stash", VF_BDF, "driver"))  # nothing the kernel would match
    assert d.unprepare_claims([ClaimRef("default", "vm", UID)]) == {UID: None}
    assert sim.driver(VF_BDF) is None and sim.override(VF_BDF) is None
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and VF_BDF in r.getMessage()]
    assert warned and "no driver matched" in warned[0] and "drivers_probe" in warned[0], warned
