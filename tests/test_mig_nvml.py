"""Dynamic MIG prepare when NVML misbehaves (the simulated NVML, tests/simnvml_mig.py): a create
that outlasts its timeout or fails after NVML made the instance, IDs out of range, a query queued
behind a slow change, a hung query, and NVML's thread (discovery/nvml.py) skipping a call whose
caller gave up."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from agent.prepare import mig as prepare_mig
from agent.prepare.allocation import ClaimFailed
from agent.prepare.driver import Driver
from agent.prepare.records import MigDevice
from discovery.nvml import _Worker
from tests.controlplane import wait_until
from tests.kubelet_standin import claim as hand_claim
from tests.mig_node import BDF, GPU, MigNode
from tests.simnvml import NVMLError, open_sim
from tests.simnvml_mig import INVALID_ARGUMENT, placement

DEVICE = f"{GPU}-mig-2g-35gb-2"  # profile 14 at placement (2, 2)


@pytest.fixture
def node(tmp_path):
    return MigNode(str(tmp_path))


def driver_for(node: MigNode, nvml=None) -> Driver:
    d = Driver(node.settings, node.inventory)
    d.mig.nvml = lambda: nvml or node.nvml
    return d


def prepare(d: Driver, c: dict) -> str | None:
    return d.prepare_claims([c])[c["metadata"]["uid"]].error


def slow(sim, name: str, seconds: float, entered: threading.Event | None = None) -> None:
    """``sim.<name>`` answers after ``seconds`` (a driver busy for that long); ``del`` undoes it."""
    real = getattr(sim, name)

    def call(*args):
        if entered is not None:
            entered.set()
        time.sleep(seconds)
        return real(*args)

    setattr(sim, name, call)


def once(sim, name: str, answer) -> None:
    """``sim.<name>``'s first call gets ``answer()`` (raised when an exception), later ones the real."""
    real, calls = getattr(sim, name), []

    def call(*args):
        calls.append(args)
        if len(calls) > 1:
            return real(*args)
        out = answer(real(*args))
        if isinstance(out, Exception):
            raise out
        return out

    setattr(sim, name, call)


def test_a_create_that_times_out_is_destroyed_once_it_ends(node, monkeypatch):
    monkeypatch.setattr(prepare_mig, "TIMEOUT", 0.3)
    d = driver_for(node)
    slow(node.sim, "nvmlDeviceCreateGpuInstanceWithPlacement", 1.0)
    c = hand_claim("a", [("m", DEVICE)])
    err = prepare(d, c)
    assert err and "did not answer in time" in err and d.checkpoint.claims == {}
    # the create still completes on NVML's thread; the destroy queued behind it finds the instance
    wait_until(lambda: any(x.startswith("destroy-gi") for x in node.sim.calls), 30, what="the queued destroy")
    assert any(x.startswith("create-gi") for x in node.sim.calls) and node.sim.instances() == {}
    del node.sim.nvmlDeviceCreateGpuInstanceWithPlacement
    monkeypatch.setattr(prepare_mig, "TIMEOUT", 60.0)
    assert prepare(d, c) is None  # the retry finds the placement free
    assert [(g["profile"], g["start"]) for g in node.sim.instances().values()] == [(14, 2)]


def test_a_failure_after_the_create_returned_destroys_the_instance(node):
    d = driver_for(node)
    once(node.sim, "nvmlGpuInstanceGetInfo", lambda info: NVMLError(INVALID_ARGUMENT))
    c = hand_claim("a", [("m", DEVICE)])
    err = prepare(d, c)
    assert err and "Invalid Argument" in err and d.checkpoint.claims == {}
    assert node.sim.instances() == {}


def test_a_refused_create_leaves_the_instance_someone_else_made(node):
    d = driver_for(node)
    d.recover()
    h = node.sim.nvmlDeviceGetHandleByPciBusId(BDF)
    node.sim.nvmlDeviceCreateGpuInstanceWithPlacement(h, 14, placement(2, 2))  # by hand, at the claim's placement
    c = hand_claim("a", [("m", DEVICE)])
    err = prepare(d, c)
    assert err and "Insufficient Resources" in err
    assert [(g["profile"], g["start"]) for g in node.sim.instances().values()] == [(14, 2)]


@pytest.mark.parametrize("ci", [-1, 4096, True])
def test_ids_out_of_range_fail_the_create_and_destroy_the_instance(node, ci):
    """Checked where the record is made: the spec's cap-node lookup would catch only IDs the
    driver does not list, and is skipped for a GPU whose minor is unknown."""
    d = driver_for(node)
    once(node.sim, "nvmlComputeInstanceGetInfo", lambda info: SimpleNamespace(id=ci))
    with pytest.raises(ClaimFailed, match="not IDs it hands out"):
        d.mig.create(MigDevice(gpu=BDF, device=DEVICE, profile=14, start=2, size=2))
    assert node.sim.instances() == {}


def test_a_query_behind_a_slow_change_waits_and_nvml_stays_on(node):
    nvml = open_sim(node.root, node.sim, timeout=0.2)  # a query's timeout, far below the create's
    d = driver_for(node, nvml)
    entered = threading.Event()
    slow(node.sim, "nvmlDeviceCreateGpuInstanceWithPlacement", 1.0, entered)
    a = hand_claim("a", [("m", DEVICE)])
    errors: dict = {}
    t = threading.Thread(target=lambda: errors.update(a=prepare(d, a)))
    t.start()
    wait_until(entered.is_set, 30, what="the create")
    assert nvml.system() == ("580.159.04", 13000)  # answered once the create ended
    t.join()
    assert errors == {"a": None} and nvml.failed is None
    del node.sim.nvmlDeviceCreateGpuInstanceWithPlacement
    b = hand_claim("b", [("m", f"{GPU}-mig-1g-18gb-6")])
    assert prepare(d, b) is None and len(node.sim.instances()) == 2


def test_changes_are_refused_only_while_nvml_hangs(node):
    nvml = open_sim(node.root, node.sim, timeout=0.2)
    d = driver_for(node, nvml)
    node.sim.hang = threading.Event()
    try:
        assert nvml.device(BDF) is None and nvml.failed  # the query gave up: facts from the table
        c = hand_claim("a", [("m", DEVICE)])
        err = prepare(d, c)
        assert err and "NVML is not answering" in err and d.checkpoint.claims == {}
    finally:
        node.sim.hang.set()
    wait_until(lambda: nvml.worker.stuck() is None, 30, what="NVML's thread answering")
    assert prepare(d, c) is None and len(node.sim.instances()) == 1
    assert nvml.system() == (None, None)  # queries stay off: the facts do not flap


def test_a_call_whose_caller_gave_up_before_it_began_never_runs():
    w = _Worker(timeout=5.0)
    gate, ran = threading.Event(), []
    w.submit(gate.wait, timeout=0.1, what="a hung call")
    with pytest.raises(TimeoutError, match="a hung call"):
        w.call(lambda: ran.append(1))
    gate.set()
    wait_until(lambda: w.stuck() is None, 30, what="NVML's thread answering")
    assert w.call(lambda: "answered") == "answered" and ran == []
