"""A claim of the whole GPU (or of a share of it) of a GPU in MIG mode (docs/partitions.md, "The
whole GPU of a GPU in MIG mode"): CUDA sees no device on it, so the claim gets MIG mode turned off
(``nvidia_mig_enable``) or fails saying why; the mode comes back when the claim goes.

NVML is the simulated one (tests/simnvml_mig.py): libnvidia-ml cannot run without an NVIDIA GPU
and driver, and MIG mode was never switched on the lent H200. It stands in for real NVML as NVML's
documentation states it: ``nvmlDeviceSetMigMode`` sets the pending mode, a GPU reset activates it,
and where that cannot happen (a passthrough VM: NVML_ERROR_RESET_REQUIRED) the current mode stays.
Claims are allocated by the scheduler's allocator from the slices the agent publishes."""

from __future__ import annotations

import errno
import json

import pytest

from agent.kubeletplugin.types import ClaimRef
from agent.prepare import cdifiles
from agent.prepare.driver import Driver
from tests.kubelet_standin import claim as hand_claim
from tests.mig_node import BDF, GPU, MigNode, req, whole
from tests.simnvml_mig import RESET_REQUIRED, placement

OFF, ON = [0, 0], [1, 1]


def node_for(tmp_path, mig: int = 1, **settings) -> MigNode:
    return MigNode(str(tmp_path), mig=mig, **settings)


def driver_for(node: MigNode) -> Driver:
    d = Driver(node.settings, node.inventory)
    d.mig.nvml = lambda: node.nvml
    return d


def mode(node: MigNode) -> list[int]:
    return node.sim.nvmlDeviceGetMigMode(node.sim.gpus[BDF])


def switches(node: MigNode) -> list[str]:
    return [c for c in node.sim.calls if c.startswith("set-mig-mode")]


def uid_of(c: dict) -> str:
    return c["metadata"]["uid"]


def ref(c: dict) -> ClaimRef:
    m = c["metadata"]
    return ClaimRef(namespace=m["namespace"], name=m["name"], uid=m["uid"])


def prepare(d: Driver, c: dict) -> str | None:
    return d.prepare_claims([c])[uid_of(c)].error


@pytest.mark.parametrize("partitions", [True, False])
def test_without_nvidia_mig_enable_the_claim_fails_saying_why(tmp_path, partitions):
    node = node_for(tmp_path, partitions=partitions)
    d = driver_for(node)
    c = node.allocated("w", req("w", whole()))
    err = prepare(d, c)
    assert err and f"GPU {BDF} is in MIG mode (current 1, pending 1): CUDA sees no device on the whole GPU" in err
    assert f"nvidia-smi -i {BDF} -mig 0" in err and "nvidia_mig_enable" in err
    assert mode(node) == ON and switches(node) == [] and d.checkpoint.claims == {}
    node.sim.set_mig(BDF, 0)  # the operator turned it off: the claim prepares, nothing changes
    assert not prepare(d, c)
    assert "migMode" not in d.checkpoint.claims[uid_of(c)]  # nothing to give back
    assert d.unprepare_claims([ref(c)]) == {uid_of(c): None}
    assert mode(node) == OFF and switches(node) == []


@pytest.mark.parametrize("partitions", [True, False])
def test_the_agent_turns_mig_mode_off_and_back_on(tmp_path, partitions):
    node = node_for(tmp_path, partitions=partitions, nvidia_mig_enable=True)
    d = driver_for(node)
    c = node.allocated("w", req("w", whole()))
    assert not prepare(d, c)
    assert mode(node) == OFF
    assert d.checkpoint.claims[uid_of(c)]["migMode"] == [{"gpu": BDF, "restore": True}]
    with open(d._spec_path(uid_of(c))) as f:
        nodes = [n["path"] for x in json.load(f)["devices"] for n in x["containerEdits"]["deviceNodes"]]
    assert "/dev/nvidia0" in nodes and not [n for n in nodes if "nvidia-caps" in n]  # the whole GPU's own
    assert d.unprepare_claims([ref(c)]) == {uid_of(c): None}
    assert mode(node) == ON and switches(node) == [f"set-mig-mode {BDF} 0", f"set-mig-mode {BDF} 1"]
    assert node.sim.threads == {"nvml"}  # every change on NVML's own thread (discovery/nvml.py)


def test_shares_of_the_whole_gpu_keep_it_off_until_the_last_goes(tmp_path):
    node = node_for(tmp_path, partitions=False, share=("gpu",), nvidia_mps=False, nvidia_mig_enable=True)
    d = driver_for(node)
    a = node.allocated("a", req("g", whole()))
    b = node.allocated("b", req("g", whole()), prepared=[a])
    shares = [r for c in (a, b) for r in c["status"]["allocation"]["devices"]["results"]]
    assert [r["device"] for r in shares] == [GPU, GPU] and all(r.get("shareID") for r in shares)
    assert not prepare(d, a) and not prepare(d, b)
    # b found MIG mode off, turned off by a: the mode before them both is b's to give back
    assert [d.checkpoint.claims[uid_of(c)]["migMode"] for c in (a, b)] == [[{"gpu": BDF, "restore": True}]] * 2
    assert d.unprepare_claims([ref(a)]) == {uid_of(a): None}
    assert mode(node) == OFF  # b still runs on the whole GPU
    assert d.unprepare_claims([ref(b)]) == {uid_of(b): None}
    assert mode(node) == ON and len(switches(node)) == 2


def test_shares_prepared_together_whose_last_save_fails_give_mig_mode_back(tmp_path):
    """Two shares of the whole GPU in one call, and the disk full at their PrepareCompleted save:
    both are undone. The last of them undone gives MIG mode back (each undo counting only the
    claims still on the GPU, not the one undone before it)."""
    node = node_for(tmp_path, partitions=False, share=("gpu",), nvidia_mps=False, nvidia_mig_enable=True)
    d = driver_for(node)
    a = node.allocated("a", req("g", whole()))
    b = node.allocated("b", req("g", whole()), prepared=[a])
    d.recover()
    saves, save = [], d.checkpoint.save

    def full_at_completed(**kw):
        saves.append(kw)
        if len(saves) == 2:  # the first is PrepareStarted's
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(**kw)

    d.checkpoint.save = full_at_completed
    out = d.prepare_claims([a, b])
    assert [r.error for r in out.values()] == ["saving checkpoint: [Errno 28] No space left on device"] * 2
    assert mode(node) == ON and len(switches(node)) == 2


# ClaimEntry's fields in the agents from before MIG mode off (db866f6 and older): they move an entry
# with any other key aside and adopt its claim from its spec, its other records (MPS daemons, time
# slice) lost with it, so a rolled-back DaemonSet would stop the MPS daemons under running shares
BEFORE_MIG_MODE = {"state", "namespace", "name", "bootID", "allocation", "devices", "cdiSpec", "metadata",
                   "deviceStatus", "vfio", "partitions", "mig", "mps", "timeslice", "netdevs", "pods"}


@pytest.mark.parametrize("enable", [True, False])
def test_a_claim_that_found_mig_mode_off_writes_what_an_older_agent_reads(tmp_path, enable):
    """Every whole-GPU claim of an H100/H200 (NVML lists MIG profiles whatever the mode) goes
    through the step: only a claim whose MIG mode the agent turned off, or that takes over such a
    claim's, carries ``migMode``; one that found it off (nearly all) writes nothing new, so rolling
    the agent back leaves it alone (docs/kubelet-plugin.md, "Checkpoint compatibility")."""
    from agent.prepare.records import ClaimEntry

    assert set(ClaimEntry.model_fields) - BEFORE_MIG_MODE == {"migMode", "netdevsLost"}, "a new field: say what an older agent does"
    node = node_for(tmp_path, mig=0, partitions=False, share=("gpu",), nvidia_mps=False, nvidia_mig_enable=enable)
    d = driver_for(node)
    c = node.allocated("w", req("w", whole()))
    assert not prepare(d, c)
    assert set(d.checkpoint.claims[uid_of(c)]) <= BEFORE_MIG_MODE and mode(node) == OFF


def test_gpu_instances_someone_made_refuse_the_claim(tmp_path):
    """NVML refuses a mode change while a GPU instance exists, and it is not the agent's to
    destroy: the claim fails naming them and the command that removes them."""
    node = node_for(tmp_path, nvidia_mig_enable=True)
    d = driver_for(node)
    d.recover()
    h = node.sim.nvmlDeviceGetHandleByPciBusId(BDF)
    node.sim.nvmlGpuInstanceCreateComputeInstance(node.sim.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, placement(3, 1)), 0)
    c = hand_claim("w", [("w", GPU)])
    err = prepare(d, c)
    assert err and f"GPU {BDF} is in MIG mode with GPU instances" in err and "1 (profile 19, placement 3)" in err
    assert f"nvidia-smi mig -i {BDF} -dci" in err
    assert mode(node) == ON and switches(node) == [] and len(node.sim.instances()) == 1 and d.checkpoint.claims == {}


def test_a_mode_left_pending_fails_the_claim_and_is_set_back(tmp_path):
    """Where NVML cannot reset the GPU (a passthrough VM: NVML_ERROR_RESET_REQUIRED) the mode
    stays on, pending off: the claim fails saying so, and the pending mode is set back on."""
    node = node_for(tmp_path, nvidia_mig_enable=True)
    node.sim.set_activation(BDF, RESET_REQUIRED)
    d = driver_for(node)
    c = node.allocated("w", req("w", whole()))
    err = prepare(d, c)
    assert err and "MIG mode turned off but still on until the GPU is reset (mode (1, 0); NVML: GPU requires restart)" in err
    assert f"nvidia-smi -r -i {BDF}" in err
    assert mode(node) == ON and switches(node) == [f"set-mig-mode {BDF} 0", f"set-mig-mode {BDF} 1"]
    assert d.checkpoint.claims == {}


def test_a_pending_off_the_operator_asked_for_is_never_turned_back_on(tmp_path):
    """``nvidia-smi -mig 0`` where the GPU cannot be reset at once (a passthrough VM) leaves MIG
    mode on, pending off until a reboot: the mode the GPU will have is off. A claim that finds it
    so and fails (the switch is still pending) sets nothing back on, nor does one that turns it off
    and goes: the operator's off stays."""
    node = node_for(tmp_path, nvidia_mig_enable=True)
    node.sim.set_mig(BDF, 1, pending=0)
    node.sim.set_activation(BDF, RESET_REQUIRED)
    d = driver_for(node)
    c = node.allocated("w", req("w", whole()))
    assert "still on until the GPU is reset" in prepare(d, c)
    assert mode(node) == [1, 0] and d.checkpoint.claims == {}
    node.sim.set_activation(BDF, 0)  # a GPU that can be reset now
    assert not prepare(d, c) and mode(node) == OFF
    assert d.unprepare_claims([ref(c)]) == {uid_of(c): None}
    assert mode(node) == OFF


def test_a_later_failure_turns_mig_mode_back_on(tmp_path, monkeypatch):
    node = node_for(tmp_path, nvidia_mig_enable=True)
    d = driver_for(node)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cdifiles, "write_spec", full)
    c = node.allocated("w", req("w", whole()))
    assert "No space left on device" in prepare(d, c)
    assert mode(node) == ON and len(switches(node)) == 2 and d.checkpoint.claims == {}


class Crash(BaseException):
    """The agent dying at a point: nothing after it runs (tests/faults/test_mig_crash.py: SIGKILL)."""


def test_an_interrupted_prepare_is_rolled_back_at_start(tmp_path):
    node = node_for(tmp_path, nvidia_mig_enable=True)
    d = driver_for(node)

    def die(point: str) -> None:
        if point == "prepare:specs-written":
            raise Crash(point)

    d.fault = die
    c = node.allocated("w", req("w", whole()))
    with pytest.raises(Crash):
        prepare(d, c)
    assert mode(node) == OFF
    again = driver_for(node)
    report = again.recover()
    assert report.rolled_back == [uid_of(c)] and f"{BDF}: MIG mode back on" in report.host_restored
    assert mode(node) == ON and again.checkpoint.claims == {}


def test_mig_mode_turned_on_under_a_prepared_claim_is_turned_off_again(tmp_path):
    """Someone (or a reboot that took a pending mode) turned MIG mode on under a claim the agent
    turned it off for: the start and the kubelet's re-prepare turn it off again. A claim that found
    it off records nothing (an older agent reads its entry): the mode under it is the operator's,
    as before this step, so neither the start nor the re-prepare touches it or fails for it."""
    node = node_for(tmp_path, nvidia_mig_enable=True)
    d = driver_for(node)
    c = node.allocated("w", req("w", whole()))
    assert not prepare(d, c)
    node.sim.set_mig(BDF, 1)
    again = driver_for(node)
    assert again.recover().kernel_changed and mode(node) == OFF
    node.sim.set_mig(BDF, 1)
    assert not prepare(again, c) and mode(node) == OFF  # the kubelet prepares it again for a new pod

    strict = node_for(tmp_path / "strict", mig=0)
    d = driver_for(strict)
    c = strict.allocated("w", req("w", whole()))
    assert not prepare(d, c)
    strict.sim.set_mig(BDF, 1)
    again = driver_for(strict)
    again.recover()
    assert again.checkpoint.claims[uid_of(c)]["state"] == "PrepareCompleted"
    assert not prepare(again, c) and mode(strict) == ON and switches(strict) == []


def test_a_mig_device_beside_a_prepared_whole_gpu_is_refused_before_nvml(tmp_path):
    node = node_for(tmp_path, nvidia_mig_enable=True)
    d = driver_for(node)
    w = hand_claim("w", [("w", GPU)])
    assert not prepare(d, w)
    calls = len(node.sim.calls)
    m = hand_claim("m", [("m", f"{GPU}-mig-1g-18gb-3")])
    err = prepare(d, m)
    assert err and "held by prepared claim default/w" in err
    assert node.sim.calls[calls:] == [] and mode(node) == OFF and node.sim.instances() == {}


def test_admin_access_takes_the_gpu_as_it_is(tmp_path):
    """Monitoring beside the GPU's other claims: its mode is not theirs to change."""
    node = node_for(tmp_path)
    d = driver_for(node)
    c = hand_claim("admin", [("w", GPU)])
    c["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
    assert not prepare(d, c)
    assert "migMode" not in d.checkpoint.claims[uid_of(c)] and mode(node) == ON and switches(node) == []


def test_a_claim_adopted_after_a_corrupt_checkpoint_keeps_the_gpu_off(tmp_path):
    """Its record lost with the checkpoint: the whole GPU tells it again, with the mode before it
    unknown, so its unprepare leaves MIG mode off."""
    node = node_for(tmp_path, nvidia_mig_enable=True)
    d = driver_for(node)
    c = hand_claim("w", [("w", GPU)])
    assert not prepare(d, c)
    with open(d.checkpoint_path, "wb") as f:
        f.write(b"{not json")
    again = driver_for(node)
    assert again.recover().adopted == [uid_of(c)]
    assert again.checkpoint.claims[uid_of(c)]["migMode"] == [{"gpu": BDF, "restore": False}]
    assert again.unprepare_claims([ClaimRef(namespace="", name="", uid=uid_of(c))]) == {uid_of(c): None}
    assert mode(node) == OFF


def test_the_whole_gpu_beside_a_prepared_mig_device_is_refused_before_nvml(tmp_path):
    """The claim conflicts with the MIG device's (ownership.py): that is its error, not NVML's
    view of the GPU instance, and MIG mode is not read or touched for it."""
    node = node_for(tmp_path, nvidia_mig_enable=True)
    d = driver_for(node)
    m = hand_claim("m", [("m", f"{GPU}-mig-1g-18gb-3")])
    assert not prepare(d, m)
    calls = len(node.sim.calls)
    w = hand_claim("w", [("w", GPU)])
    err = prepare(d, w)
    assert err and "held by prepared claim default/m" in err and "partition" in err
    assert node.sim.calls[calls:] == [] and mode(node) == ON and len(node.sim.instances()) == 1


def test_shares_unprepared_together_give_mig_mode_back(tmp_path):
    """Two shares of the whole GPU unprepared in one call (the kubelet sends a pod's claims
    together): the last of them undone gives MIG mode back, as when they go one call each."""
    node = node_for(tmp_path, partitions=False, share=("gpu",), nvidia_mps=False, nvidia_mig_enable=True)
    d = driver_for(node)
    a = node.allocated("a", req("g", whole()))
    b = node.allocated("b", req("g", whole()), prepared=[a])
    assert not prepare(d, a) and not prepare(d, b)
    assert mode(node) == OFF
    assert d.unprepare_claims([ref(a), ref(b)]) == {uid_of(a): None, uid_of(b): None}
    assert d.checkpoint.claims == {}
    assert mode(node) == ON and len(switches(node)) == 2
