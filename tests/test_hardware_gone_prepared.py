"""A GPU hot-unplugged under a prepared claim (``echo 1 > remove``, a GPU fallen off the bus
and removed): the claim's unprepare finishes, what its steps made having left with the GPU
(a MIG instance; MIG mode to turn back on; a time slice), and frees the rest; a GPU plugged back has none of
its instances. Before, NVML's Not Found failed the undo for as long as the GPU was away: the
claim kept its entry and the kubelet's unprepare failed for ever."""

from __future__ import annotations

import os
import shutil

import pytest

from agent.kubeletplugin.types import ClaimRef
from tests import test_timeslice as timeslice
from tests.mig_node import BDF, MigNode, profile, req, whole
from tests.test_mig_prepare import driver_for, ref


def unplug(node: MigNode) -> None:
    """The kernel removed the GPU: its sysfs directory and link are gone, NVML knows it no more."""
    with node.sim._locked(True):
        del node.sim.gpus[BDF]
    link = os.path.join(node.root, "sys/bus/pci/devices", BDF)
    shutil.rmtree(os.path.realpath(link))
    os.unlink(link)


@pytest.mark.parametrize("shape", ["mig", "whole"])
def test_a_gpu_unplugged_under_a_prepared_claim_is_unprepared(tmp_path, shape, caplog):
    node = MigNode(str(tmp_path), nvidia_mig_enable=True)
    d = driver_for(node)
    c = node.allocated("a", req("m", profile("3g.71gb") if shape == "mig" else whole()))
    uid = c["metadata"]["uid"]
    assert not d.prepare_claims([c])[uid].error
    assert ("mig" if shape == "mig" else "migMode") in d.checkpoint.claims[uid]
    unplug(node)
    assert d.unprepare_claims([ref(c)]) == {uid: None}
    assert uid not in d.checkpoint.claims and not os.path.exists(d._spec_path(uid))
    assert f"GPU {BDF} has left the node" in caplog.text



def test_a_gpu_unplugged_under_a_time_slice_claim_is_unprepared(tmp_path, caplog):
    root = timeslice.node(tmp_path)
    d = timeslice.driver(tmp_path, root)
    assert d.prepare_claims([timeslice.claim([timeslice.GPU, timeslice.GPU2])])[timeslice.UID].error is None
    gone, stays = timeslice.uuid(root, timeslice.GPU), timeslice.uuid(root, timeslice.GPU2)
    for f in (f"fail-{gone}-0", f"fail-{stays}-0"):  # nvidia-smi fails for either GPU
        open(os.path.join(root, "usr/bin", f), "w").close()
    assert d.unprepare_claims([ClaimRef("ns", "ts", timeslice.UID)])[timeslice.UID]  # both here: kept, retried
    os.unlink(os.path.join(root, "usr/bin", f"fail-{stays}-0"))
    bdf = "0000:18:00.0"
    shutil.rmtree(os.path.join(root, "proc/driver/nvidia/gpus", bdf))  # the driver's view of the removal
    assert d.unprepare_claims([ClaimRef("ns", "ts", timeslice.UID)]) == {timeslice.UID: None}
    assert timeslice.calls(root)[-1] == f"compute-policy -i {stays} --set-timeslice 0"
    assert f"GPU {gone} has left the node" in caplog.text
