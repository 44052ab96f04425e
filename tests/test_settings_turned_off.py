"""A setting turned off and the agent restarted while claims it made possible are prepared
(docs/operations.md, "Configuration"): the claims stay prepared (the kubelet's re-prepare gets the
same answer) and their unprepare gives back what their steps made (a MIG instance destroyed, an
MPS daemon stopped), though the agent makes no new ones; the slices do not offer the whole GPU
under a MIG claim's instance meanwhile. Before, the steps of a kind turned off
were gone with the setting: the instance and the daemon stayed for ever."""

from __future__ import annotations

import asyncio

import psutil
import pytest

from agent.prepare.driver import Driver
from agent.service.daemon import Agent
from discovery.inventory import scan
from tests.conftest import profile_root
from tests.kubelet_standin import settings_for
from tests.mig_node import BDF, GPU, MigNode, profile, req, whole
from tests.kubelet_standin import claim as hand_claim
from tests.partition_node import CPX_GPU, SPX_GPU, Node as PartitionNode, mode_of, part_of
from tests.test_mig_prepare import driver_for, ref
from tests.test_partitions_prepare import driver_for as partition_driver, prepare
from tests.test_mps_prepare import PROFILE, _allocated, _driver, _running, memory_claim, one_gpu, published, share_plan
from tests.test_agent_reload import _published, _running as _serving, _until
from tests.test_allocator import NODE


def test_partitions_turned_off_the_mig_instance_of_a_prepared_claim_is_destroyed_at_its_unprepare(tmp_path):
    node = MigNode(str(tmp_path))
    c = node.allocated("a", req("m", profile("3g.71gb")))
    uid = c["metadata"]["uid"]
    first = driver_for(node).prepare_claims([c])[uid]
    assert not first.error and len(node.sim.instances()) == 1
    node.settings = node.settings.replace(partitions=False)  # the restart with another config
    node.inv = node.scan()
    d = driver_for(node)
    d.recover()
    assert len(node.sim.instances()) == 1  # kept: the claim's pod runs on it
    again = d.prepare_claims([c])[uid]
    assert not again.error and [x.device for x in again.devices] == [x.device for x in first.devices]
    assert d.unprepare_claims([ref(c)]) == {uid: None}
    assert node.sim.instances() == {}


def test_partitions_turned_off_the_gpu_of_a_prepared_mig_claim_is_not_offered_whole_until_it_goes(tmp_path):
    """The scheduler cannot see the MIG claim hold the GPU once MIG devices are no longer published:
    the whole GPU offered, a claim of it would fail at prepare. It comes back when the unprepare
    destroyed the instance (the daemon rescans)."""
    node = MigNode(str(tmp_path))
    c = node.allocated("a", req("m", profile("3g.71gb")))
    uid = c["metadata"]["uid"]
    assert not driver_for(node).prepare_claims([c])[uid].error
    node.settings = node.settings.replace(partitions=False)
    node.inv = node.scan()
    assert GPU not in published_devices(node)
    d, rescans = driver_for(node), []
    d.hardware_changed = lambda: rescans.append(True)
    d.recover()
    assert d.unprepare_claims([ref(c)]) == {uid: None} and rescans
    assert GPU in published_devices(node)


def test_partitions_turned_off_an_amd_gpu_whose_partitions_are_claimed_is_refused_whole(tmp_path):
    """The partitions of a prepared claim still hold their GPU: before, the ownership table knew
    partitions only while they were published, and a claim of the whole GPU was prepared beside
    them (both pods on one GPU, in the partitions' mode)."""
    node = PartitionNode(str(tmp_path))
    with node.sim:
        c = node.allocated("cpx", part_of(CPX_GPU, "CPX/NPS1"), count=2)
        assert not prepare(partition_driver(node), c).error
        node.settings = node.settings.replace(partitions=False)
        d = partition_driver(node)
        d.recover()
        err = prepare(d, hand_claim("w", [("gpu", CPX_GPU)])).error
        assert err and f"is held by prepared claim default/cpx ({c['metadata']['uid']}) partition {CPX_GPU}-cpx-nps1-0" in err
        assert mode_of(node.root, "0000:05:00.0") == "CPX/NPS1" and node.sim.switches == []
        assert d.unprepare_claims([ref(c)]) == {c["metadata"]["uid"]: None}
        assert not prepare(d, hand_claim("w", [("gpu", CPX_GPU)])).error  # free now


def test_partitions_turned_off_the_agent_does_not_offer_a_gpu_whose_partitions_are_claimed(tmp_path):
    """The whole agent: the scheduler cannot see the partition claim hold the GPU once its partitions
    are not published; the GPU is offered whole again once the claim is unprepared."""
    node = PartitionNode(str(tmp_path))
    with node.sim:
        c = node.allocated("cpx", part_of(CPX_GPU, "CPX/NPS1"), count=2)
        assert not prepare(partition_driver(node), c).error
    agent = Agent(node.settings.replace(partitions=False, metrics_address="", resync_interval=0, debounce=0.05))

    async def run() -> None:
        async with _serving(agent):  # (publishing to a directory, the first publish comes before the checkpoint is read)
            await _until(lambda: published(lambda names: CPX_GPU not in names and SPX_GPU in names), "the GPU left out")
            await asyncio.to_thread(agent.kubelet_plugin.driver.unprepare_claims, [ref(c)])
            await _until(lambda: published(lambda names: CPX_GPU in names), "the GPU offered again")

    async def published(check) -> bool:
        return check({d["name"] for d in await _published(agent)})

    asyncio.run(run())


@pytest.mark.parametrize("kind", ["instance", "mode"])
def test_nvml_turned_off_the_mig_changes_of_a_prepared_claim_are_undone_at_its_unprepare(tmp_path, kind):
    """A dynamic-MIG claim (its instance) or a whole-GPU claim (MIG mode turned off for it) prepared,
    then ``nvml`` turned off: the kubelet's re-prepare gets the same answer, the unprepare destroys the
    instance or turns MIG mode back on (NVML opened for it alone). Before, the MIG steps went with the
    setting: the instance (or MIG mode off) stayed for good, with no log."""
    node = MigNode(str(tmp_path), nvidia_mig_enable=True)
    c = node.allocated("a", req("m", profile("3g.71gb")) if kind == "instance" else req("w", whole()))
    uid = c["metadata"]["uid"]
    first = driver_for(node).prepare_claims([c])[uid]
    assert not first.error and (len(node.sim.instances()) == 1 if kind == "instance" else mig_mode(node) == [0, 0])
    node.settings = node.settings.replace(nvml=False)  # the restart with another config
    node.inv = scan(node.root, list_attributes=True)  # no NVML facts
    d = Driver(node.settings, node.inventory)
    if hasattr(d, "mig"):
        d.mig.nvml = lambda: node.nvml  # the lazily opened NVML, simulated
    d.recover()
    again = d.prepare_claims([c])[uid]
    assert not again.error and [x.cdi_ids for x in again.devices] == [x.cdi_ids for x in first.devices]
    assert d.unprepare_claims([ref(c)]) == {uid: None}
    assert node.sim.instances() == {} and mig_mode(node) == [1, 1]


def mig_mode(node: MigNode) -> list[int]:
    return node.sim.nvmlDeviceGetMigMode(node.sim.gpus[BDF])


def published_devices(node: MigNode) -> set[str]:
    return {dev["name"] for s in node.slices() for dev in s["spec"].get("devices", [])}


def _stopped(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.parametrize("off", [{"share": ()}, {"share": ("gpu",), "nvidia_mps": False}])
def test_mps_turned_off_the_daemon_of_prepared_shares_is_kept_and_stopped_with_the_last(tmp_path, off):
    slices, _ = one_gpu(published(PROFILE, share=share_plan(("gpu",), None)))
    a, b = _allocated(slices, memory_claim("a", "8Gi"), memory_claim("b", "8Gi"))
    first = _driver(tmp_path)
    assert all(r.error is None for r in first.prepare_claims([a, b]).values())
    (pid,) = _running(first).values()
    try:
        s = settings_for(str(tmp_path), root=profile_root(PROFILE), node_name=NODE, **off)
        inv = scan(profile_root(PROFILE))
        d = Driver(s, lambda: inv)
        d.recover()
        assert list(_running(d).values()) == [pid]  # adopted, not left unknown
        mounts = first.checkpoint.claims[a["metadata"]["uid"]]["cdiSpec"]["spec"]["devices"][0]["containerEdits"]["mounts"]
        again = d.prepare_claims([a])[a["metadata"]["uid"]]
        assert again.error is None and d.checkpoint.claims[a["metadata"]["uid"]]["cdiSpec"]["spec"]["devices"][0][
            "containerEdits"]["mounts"] == mounts
        d.unprepare_claims([ref(a)])
        assert list(_running(d).values()) == [pid]  # b's share still runs under it
        d.unprepare_claims([ref(b)])
        assert _stopped(pid) and _running(d) == {}
    finally:
        if not _stopped(pid):
            psutil.Process(pid).kill()


def test_mps_turned_off_an_orphan_daemon_is_stopped_at_start(tmp_path):
    """Its last share went while the agent was away (the kubelet unprepared it through another
    agent that crashed before stopping it): recorded, needed by no claim."""
    slices, _ = one_gpu(published(PROFILE, share=share_plan(("gpu",), None)))
    (a,) = _allocated(slices, memory_claim("a", "8Gi"))
    first = _driver(tmp_path)
    assert first.prepare_claims([a])[a["metadata"]["uid"]].error is None
    (pid,) = _running(first).values()
    try:
        first.checkpoint.claims.clear()
        first.checkpoint.save()
        s = settings_for(str(tmp_path), root=profile_root(PROFILE), node_name=NODE)
        inv = scan(profile_root(PROFILE))
        Driver(s, lambda: inv).recover()
        assert _stopped(pid)
    finally:
        if not _stopped(pid):
            psutil.Process(pid).kill()


def test_mps_turned_off_a_new_share_is_no_client_of_the_daemon_of_before(tmp_path):
    slices, _ = one_gpu(published(PROFILE, share=share_plan(("gpu",), None)))
    a, c = _allocated(slices, memory_claim("a", "8Gi"), memory_claim("c", "8Gi"))
    first = _driver(tmp_path)
    assert first.prepare_claims([a])[a["metadata"]["uid"]].error is None
    (pid,) = _running(first).values()
    try:
        d = _driver(tmp_path, nvidia_mps=False)
        d.recover()
        assert d.prepare_claims([c])[c["metadata"]["uid"]].error is None
        entry = d.checkpoint.claims[c["metadata"]["uid"]]
        assert "mps" not in entry and "mounts" not in entry["cdiSpec"]["spec"]["devices"][0]["containerEdits"]
        d.unprepare_claims([ref(a)])
        assert _stopped(pid) and _running(d) == {}
    finally:
        if not _stopped(pid):
            psutil.Process(pid).kill()
