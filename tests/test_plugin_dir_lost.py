"""The checkpoint gone while claims are prepared (the plugin dir wiped, ``kubelet_dir`` changed in
the config before a restart) while the CDI dir still holds their specs: the claims are adopted
from their specs, as after a corrupt checkpoint (prepare/recovery.py), and their unprepare gives
back what they hold. Before, the specs were removed as orphans and the start destroyed the MIG
instance under the running pod as one no claim knew."""

from __future__ import annotations

import os

from tests.mig_node import MigNode, profile, req
from tests.test_mig_prepare import driver_for, ref


def test_claims_whose_checkpoint_went_are_adopted_from_their_specs(tmp_path, caplog):
    node = MigNode(str(tmp_path))
    c = node.allocated("a", req("m", profile("3g.71gb")))
    uid = c["metadata"]["uid"]
    first = driver_for(node)
    assert not first.prepare_claims([c])[uid].error
    spec = first._spec_path(uid)
    node.settings = node.settings.replace(kubelet_dir=str(tmp_path / "kubelet-moved"))
    d = driver_for(node)
    report = d.recover()
    assert report.adopted == [uid] and not report.orphans_removed and not report.host_restored
    assert os.path.exists(spec) and len(node.sim.instances()) == 1  # the pod's instance and spec kept
    assert "no checkpoint at" in caplog.text and "kubelet_dir changed" in caplog.text
    assert d.unprepare_claims([ref(c)]) == {uid: None}
    assert node.sim.instances() == {} and not os.path.exists(spec)


def test_a_first_start_without_specs_adopts_nothing(tmp_path):
    node = MigNode(str(tmp_path))
    report = driver_for(node).recover()
    assert not report.adopted and not os.path.exists(os.path.join(node.settings.plugin_dir, "checkpoint.json"))
