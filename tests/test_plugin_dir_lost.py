"""The checkpoint gone while claims are prepared (the plugin dir wiped, ``kubelet_dir`` changed in
the config before a restart) while the CDI dir still holds their specs: the claims are adopted
from their specs, as after a corrupt checkpoint (prepare/recovery.py), and their unprepare gives
back what they hold. Before, the specs were removed as orphans and the start destroyed the MIG
instance under the running pod as one no claim knew."""

from __future__ import annotations

import json
import os

from agent.prepare import planner
from agent.prepare.allocation import our_results
from agent.prepare.checkpoint import Checkpoint
from agent.prepare.metadata import layout
from tests.mig_node import MigNode, profile, req, whole
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


def test_the_kubelets_prepare_again_of_an_adopted_claim_keeps_its_instance(tmp_path):
    """The kubelet prepares every claim again after a plugin restart. The adopted entry knows no
    allocation: read as another one, the re-prepare destroyed the pod's MIG instance and made it
    again (on a real GPU NVML refuses while the pod uses it: the re-prepare failed). Its devices
    are the spec's: the entry is filled in, the instance kept."""
    node, c, uid, answer, d = adopted(tmp_path)
    calls = len(node.sim.calls)
    again = d.prepare_claims([c])[uid]
    assert not again.error and [x.device for x in again.devices] == [x.device for x in answer.devices]
    assert changes(node, calls) == []
    entry = Checkpoint.load(d.checkpoint_path).claims[uid]
    assert (entry["namespace"], entry["name"], entry["allocation"]) == ("default", "a", fingerprint(d, c))
    assert entry["devices"][0]["requests"] == ["m"] and entry["mig"][0]["start"] == 0
    assert d.prepare_claims([c])[uid].error is None and changes(node, calls) == []  # the same allocation now
    assert d.unprepare_claims([ref(c)]) == {uid: None} and node.sim.instances() == {}


def test_an_adopted_claim_allocated_other_devices_is_prepared_anew(tmp_path):
    """A claim allocated again meanwhile (deleted and made under the same UID cannot happen, but an
    entry must never be taken for devices it does not hold): the spec's devices differ, so its
    changes are undone and the claim's made."""
    node, c, uid, _, d = adopted(tmp_path)
    other = node.allocated("a", req("m", profile("1g.18gb")))
    other["metadata"]["uid"] = uid
    assert not d.prepare_claims([other])[uid].error
    assert [(g["profile"], g["size"]) for g in node.sim.instances().values()] == [(19, 1)]


def adopted(tmp_path):
    """(node, claim, its UID, the first prepare's answer, the driver after the start): a MIG claim
    prepared, then ``kubelet_dir`` changed and the agent started again, which adopts it from its spec."""
    node = MigNode(str(tmp_path))
    c = node.allocated("a", req("m", profile("3g.71gb")))
    uid = c["metadata"]["uid"]
    answer = driver_for(node).prepare_claims([c])[uid]
    assert not answer.error
    node.settings = node.settings.replace(kubelet_dir=str(tmp_path / "kubelet-moved"))
    d = driver_for(node)
    assert d.recover().adopted == [uid]
    return node, c, uid, answer, d


def changes(node: MigNode, since: int) -> list[str]:
    return [call for call in node.sim.calls[since:] if call.startswith(("destroy", "create"))]


def fingerprint(d, c) -> str:
    return planner.fingerprint(our_results(c, d.settings.driver_name)[1])


def test_the_answer_to_an_adopted_claims_prepare_again_is_the_first_ones(tmp_path):
    """The kubelet keeps the latest answer's CDI IDs for the pod's containers: the re-prepare of an
    adopted claim answered its spec's IDs alone, without the device metadata's (KEP-5304), so a
    container started afterwards lost its metadata mount. The metadata files, under the plugin dir
    wiped with the checkpoint, are written again for the mount to find."""
    node, c, uid, answer, d = adopted(tmp_path)
    assert any("metadata" in i for i in answer.devices[0].cdi_ids)  # the first answer has the metadata's ID
    again = d.prepare_claims([c])[uid]
    assert not again.error and [x.cdi_ids for x in again.devices] == [x.cdi_ids for x in answer.devices]
    assert untimed(again.status) == untimed(answer.status)  # status.devices as the first prepare wrote them
    assert d.prepare_claims([c])[uid].devices[0].cdi_ids == answer.devices[0].cdi_ids  # and from the entry after
    entry = Checkpoint.load(d.checkpoint_path).claims[uid]
    assert entry["metadata"] and os.path.isfile(metadata_file(d, entry))
    assert d.unprepare_claims([ref(c)]) == {uid: None} and not os.path.exists(metadata_file(d, entry))


def test_an_adopted_claims_metadata_spec_mounts_the_file_the_agent_keeps(tmp_path):
    """``kubelet_dir`` changed: the adopted claim's metadata spec, kept from before, mounted the file
    under the plugin dir of before, which the agent no longer writes (updates, its removal at
    unprepare): the re-prepare writes the spec again for the file it keeps."""
    node, c, uid, _, d = adopted(tmp_path)
    assert not d.prepare_claims([c])[uid].error
    entry = Checkpoint.load(d.checkpoint_path).claims[uid]
    with open(layout.spec_path(d.settings.cdi_dir, d.settings.driver_name, uid, "m")) as f:
        (mount,) = json.load(f)["devices"][0]["containerEdits"]["mounts"]
    assert mount["hostPath"] == metadata_file(d, entry)


def metadata_file(d, entry: dict) -> str:
    return layout.host_file(d.settings.plugin_dir, entry["namespace"], entry["name"], "m")


def untimed(status: list[dict]) -> list[dict]:
    return [{**d, "conditions": [{**c, "lastTransitionTime": ""} for c in d["conditions"]]} for d in status]


def test_a_refusal_names_an_adopted_claim_by_its_uid_before_its_re_prepare(tmp_path):
    """An adopted claim's entry knows no namespace nor name until the kubelet prepares it again:
    a claim refused for its devices named it ``prepared claim / (uid)``; now by its UID, as adopted."""
    node, c, uid, _, d = adopted(tmp_path)
    w = node.allocated("w", req("w", whole()))
    err = d.prepare_claims([w])[w["metadata"]["uid"]].error
    assert err and f"held by prepared claim {uid} (adopted from its CDI spec" in err and "claim / " not in err


def test_sysdra_status_names_an_adopted_claim_as_such(tmp_path):
    """``sysdra status`` listed an adopted claim, before the kubelet's re-prepare, as ``/ (uid)``."""
    from agent.cli.status import render_text
    from agent.service.status import StatusBoard

    node, c, uid, _, d = adopted(tmp_path)
    board = StatusBoard("node-a", "sysdra.io")
    board.set_prepared_claims(d.checkpoint.claims)
    text = render_text(board.snapshot())
    assert f"  {uid} (adopted from its CDI spec, not prepared again by the kubelet yet) PrepareCompleted:" in text and "/ (" not in text
