"""The agent's own rebinds are no faults: a health round that falls between VFIO's bind to
vfio-pci (or its give-back) and the rescan that follows must not report the function
``driver-unbound`` / ``driver-changed`` (a taint for ``taint_hold``, two slice writes, the
kubelet told the claim's device is unhealthy). The window is hit deterministically: a timer
round runs at the step's own fault points (``Driver.fault``) and after each step, before the
test hands the monitor the rescan's inventory. A function the agent's move left without a
driver is still a fault."""

from __future__ import annotations

import asyncio
import functools

import pytest

from agent.health.checks import UNHEALTHY
from agent.health.monitor import HealthMonitor
from agent.kubeletplugin.types import ClaimRef
from agent.prepare.driver import Driver
from discovery.inventory import scan
from tests.kubelet_standin import settings_for
from tests.simkernel import SimPciKernel
from tests.test_vfio import UID, VF, VF_BDF, node_root, vfio_claim


@pytest.fixture
def node(tmp_path):
    root = node_root(tmp_path, "sriov-nic")
    sim = SimPciKernel(root).start()
    s = settings_for(str(tmp_path), root=root, taint_unhealthy=True)
    state = {"inv": scan(root)}
    monitor = HealthMonitor(s, lambda: state["inv"])
    monitor.events_report(lambda: (True, True))  # uevents and link events: a timer round polls what they do not say
    driver = Driver(s, lambda: state["inv"])
    driver.kernel.wait = 3.0
    yield s, sim, state, monitor, driver
    sim.stop()


def a_round(monitor: HealthMonitor, full: bool = False) -> tuple[tuple[str, str, str], dict]:
    """A round now (from the prepare's thread): a timer round, or a full one (the 60-s sweep, or
    the one a rescan that the unbind's uevent started hands over mid-move)."""
    asyncio.run(monitor.check_now(full=full))
    return monitor.snapshot()[VF], monitor.taints()


def rescan(state: dict, monitor: HealthMonitor) -> None:
    state["inv"] = scan(monitor.settings.root)
    monitor.on_inventory(state["inv"])


@pytest.mark.parametrize("full", [False, True])
def test_a_round_between_the_agents_rebind_and_its_rescan_sees_no_fault(node, full):
    s, sim, state, monitor, d = node
    timer_round = functools.partial(a_round, full=full)
    asyncio.run(monitor.check_now())
    assert monitor.snapshot()[VF][0] != UNHEALTHY and not monitor.taints()
    seen = []
    d.fault = lambda point: seen.append((point, *timer_round(monitor)))
    assert d.prepare_claims([vfio_claim("vm", [VF], UID)])[UID].error is None
    assert sim.driver(VF_BDF) == "vfio-pci"
    seen.append(("bound, not rescanned", *timer_round(monitor)))
    rescan(state, monitor)
    seen.append(("rescanned", *timer_round(monitor)))
    assert d.unprepare_claims([ClaimRef("default", "vm", UID)]) == {UID: None}
    assert sim.driver(VF_BDF) == "mlx5_core"
    seen.append(("given back, not rescanned", *timer_round(monitor)))
    rescan(state, monitor)
    seen.append(("given back, rescanned", *timer_round(monitor)))
    points = {p for p, *_ in seen}
    assert {"vfio:unbound", "vfio:bound", "vfio:restore-unbound", "vfio:restored"} <= points
    faults = [(p, v) for p, v, taints in seen if v[0] == UNHEALTHY or taints]
    assert not faults, faults


def test_a_function_the_agents_move_left_without_a_driver_is_a_fault(node):
    """The bind to vfio-pci fails and so does the give-back: the function has no driver, the
    claim failed; that is what the health stream says, not the verdict of before."""
    s, sim, state, monitor, d = node
    asyncio.run(monitor.check_now())
    sim.fail_binds("vfio-pci")
    sim.fail_binds("mlx5_core")
    d.kernel.wait = 0.3
    assert d.prepare_claims([vfio_claim("vm", [VF], UID)])[UID].error is not None
    assert sim.driver(VF_BDF) is None
    verdict, taints = a_round(monitor, full=True)
    assert (verdict[0], verdict[2]) == (UNHEALTHY, "driver-unbound")
    assert taints[VF][0]["value"] == "driver-unbound"


def test_a_rescan_in_the_middle_of_the_move_is_no_fault_either(node):
    """The unbind's uevent may start a rescan before the bind: the function, without a driver,
    is not in that inventory (discovery offers no function without one): not ``not-discovered``."""
    s, sim, state, monitor, d = node
    asyncio.run(monitor.check_now())
    seen = []

    def at(point):
        if point in ("vfio:unbound", "vfio:restore-unbound"):
            rescan(state, monitor)
            assert VF not in state["inv"].by_name()
            seen.append((point, *a_round(monitor, full=True)))

    d.fault = at
    assert d.prepare_claims([vfio_claim("vm", [VF], UID)])[UID].error is None
    seen.append(("bound", *a_round(monitor, full=True)))
    rescan(state, monitor)
    assert d.unprepare_claims([ClaimRef("default", "vm", UID)]) == {UID: None}
    seen.append(("given back", *a_round(monitor, full=True)))
    assert len(seen) == 4 and not [x for x in seen if x[1][0] == UNHEALTHY or x[2]], seen
