"""VFIO passthrough at prepare on a simulated kernel (tests/simkernel.py): bind, give back,
refusals, a bind that fails, recovery after a crash and after a reboot."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from agent.kubeletplugin.types import ClaimRef
from agent.prepare import cdifiles
from agent.prepare.checkpoint import Checkpoint
from agent.prepare.driver import Driver
from discovery.inventory import scan
from tests.conftest import profile_root
from tests.kubelet_standin import claim, settings_for
from tests.simkernel import SimPciKernel

VF = "nic-0000-06-00-2"  # mlx5 VF with a netdev, alone in IOMMU group 42
VF_BDF = "0000:06:00.2"
VF2 = "nic-0000-06-00-3"
PF = "nic-0000-06-00-0"
UID = "00000000-0000-4000-8000-0000000f0001"
UID2 = "00000000-0000-4000-8000-0000000f0002"


def node_root(tmp_path, profile: str) -> str:
    """A private copy of a fixture node, with a boot ID."""
    root = str(tmp_path / "root")
    shutil.copytree(profile_root(profile), root, symlinks=True)
    os.makedirs(os.path.join(root, "proc/sys/kernel/random"))
    with open(os.path.join(root, "proc/sys/kernel/random/boot_id"), "w") as f:
        f.write("boot-1\n")
    return root


@pytest.fixture
def node(tmp_path):
    root = node_root(tmp_path, "sriov-nic")
    sim = SimPciKernel(root).start()
    yield from served(tmp_path, root, sim)


def served(tmp_path, root: str, sim):
    """(settings, the running simulated kernel, the inventory a driver sees, a driver maker) for ``root``."""
    s = settings_for(str(tmp_path), root=root)
    state = {"inv": scan(root)}

    def driver() -> Driver:
        d = Driver(s, lambda: state["inv"])
        d.kernel.wait = 3.0
        return d

    yield s, sim, state, driver
    sim.stop()


def vfio_claim(name: str, devices: list[str], uid: str, requests: list[str] | None = None, params: dict | None = None) -> dict:
    c = claim(name, [("vm", d) for d in devices], uid=uid)
    c["status"]["allocation"]["devices"]["config"] = [{
        "source": "FromClaim", **({"requests": requests} if requests else {}),
        "opaque": {"driver": "sysdra.io", "parameters": params or {"apiVersion": "sysdra.io/v1alpha1", "kind": "VfioConfig"}}}]
    return c


def spec_nodes(s, uid: str) -> list[str]:
    spec = cdifiles.read_spec(cdifiles.claim_spec_path(s.cdi_dir, s.driver_name, uid))
    return sorted(n["path"] for d in spec["devices"] for n in d["containerEdits"].get("deviceNodes", []))


def test_prepare_binds_to_vfio_and_unprepare_gives_back(node):
    s, sim, state, driver = node
    d = driver()
    assert sim.driver(VF_BDF) == "mlx5_core"
    res = d.prepare_claims([vfio_claim("vm", [VF], UID)])[UID]
    assert res.error is None, res.error
    assert sim.driver(VF_BDF) == "vfio-pci" and sim.override(VF_BDF) == "vfio-pci"
    assert spec_nodes(s, UID) == ["/dev/vfio/42", "/dev/vfio/vfio"]
    rec = d.checkpoint.claims[UID]["vfio"]
    assert rec == [{"bdf": VF_BDF, "group": 42, "driver": "mlx5_core", "override": None}]
    # the slice follows: discovery sees the function on vfio-pci with its group node, same name
    dev = scan(s.root).by_name()[VF]
    assert dev.pci.driver == "vfio-pci" and any(n.path == "/dev/vfio/42" for n in dev.device_nodes)
    # idempotent re-prepare answers the same
    assert d.prepare_claims([vfio_claim("vm", [VF], UID)])[UID].error is None
    assert d.unprepare_claims([ClaimRef("default", "vm", UID)]) == {UID: None}
    assert sim.driver(VF_BDF) == "mlx5_core" and sim.override(VF_BDF) is None
    assert os.path.isdir(os.path.join(s.root, "sys/bus/pci/devices", VF_BDF, "net"))  # netdev is back
    assert UID not in d.checkpoint.claims


def test_a_function_already_on_vfio_keeps_its_driver_and_gets_its_override_back(node):
    """bind_all sets the override of a function that is on vfio-pci already: unprepare (after a
    crash at its write, again) leaves the driver and clears the override it found unset."""
    s, sim, state, driver = node
    sim.stop()
    sim.unbind("mlx5_core", VF_BDF)
    sim.bind("vfio-pci", VF_BDF)  # the host's own choice, no override
    sim.start()
    d = driver()
    assert d.prepare_claims([vfio_claim("vm", [VF], UID)])[UID].error is None
    assert d.checkpoint.claims[UID]["vfio"] == [{"bdf": VF_BDF, "group": 42, "driver": "vfio-pci", "override": None}]
    assert sim.override(VF_BDF) == "vfio-pci"

    class Crash(BaseException):
        pass

    d.fault = lambda point: (_ for _ in ()).throw(Crash()) if point == "vfio:override-restored" else None
    with pytest.raises(Crash):
        d.unprepare_claims([ClaimRef("default", "vm", UID)])
    assert driver().unprepare_claims([ClaimRef("default", "vm", UID)]) == {UID: None}
    assert sim.driver(VF_BDF) == "vfio-pci" and sim.override(VF_BDF) is None
    assert "unbind 0000:06:00.2 vfio-pci" not in sim.log


def test_only_the_requests_the_config_names(node):
    s, sim, state, driver = node
    c = claim("mixed", [("vm", VF), ("net", VF2)], uid=UID)
    c["status"]["allocation"]["devices"]["config"] = [{"source": "FromClass", "requests": ["vm"], "opaque": {
        "driver": "sysdra.io", "parameters": {"apiVersion": "sysdra.io/v1alpha1", "kind": "VfioConfig"}}}]
    assert driver().prepare_claims([c])[UID].error is None
    assert sim.driver(VF_BDF) == "vfio-pci" and sim.driver("0000:06:00.3") == "mlx5_core"


def test_a_bind_that_fails_restores_the_original_driver(node):
    s, sim, state, driver = node
    sim.fail_binds("vfio-pci")
    d = driver()
    err = d.prepare_claims([vfio_claim("vm", [VF], UID)])[UID].error
    assert err and "bind to vfio-pci" in err and "original drivers restored" in err
    assert sim.driver(VF_BDF) == "mlx5_core" and sim.override(VF_BDF) is None
    assert "unbind 0000:06:00.2 mlx5_core" in sim.log and sim.log[-1] == "bind 0000:06:00.2 mlx5_core"
    assert UID not in Checkpoint.load(d.checkpoint_path, move_corrupt=False).claims
    assert not os.path.exists(cdifiles.claim_spec_path(s.cdi_dir, s.driver_name, UID))
    sim.fail_binds("vfio-pci", False)  # the kubelet retries: now it works
    assert d.prepare_claims([vfio_claim("vm", [VF], UID)])[UID].error is None


def test_a_bind_that_fails_and_cannot_give_back_keeps_the_entry(node):
    s, sim, state, driver = node
    sim.fail_binds("vfio-pci")
    sim.fail_binds("mlx5_core")  # the original driver does not take it back either
    d = driver()
    err = d.prepare_claims([vfio_claim("vm", [VF], UID)])[UID].error
    assert "bind to vfio-pci" in err and "undoing it failed (retried)" in err
    entry = Checkpoint.load(d.checkpoint_path, move_corrupt=False).claims[UID]
    assert entry["state"] == "PrepareStarted" and entry["vfio"][0]["driver"] == "mlx5_core"
    assert sim.driver(VF_BDF) is None
    assert d.unprepare_claims([ClaimRef("default", "vm", UID)])[UID]  # still not given back: kept
    sim.fail_binds("mlx5_core", False)
    assert d.unprepare_claims([ClaimRef("default", "vm", UID)]) == {UID: None}
    assert sim.driver(VF_BDF) == "mlx5_core" and UID not in d.checkpoint.claims


def test_no_group_node_after_binding_gives_the_function_back(node, monkeypatch):
    from agent.prepare import vfio

    def no_node(root, device):
        raise vfio.VfioError(f"{device.pci.bdf}: no VFIO group node after binding (injected)")

    s, sim, state, driver = node
    monkeypatch.setattr(vfio, "with_vfio_nodes", no_node)
    d = driver()
    assert "no VFIO group node after binding" in d.prepare_claims([vfio_claim("vm", [VF], UID)])[UID].error
    assert sim.driver(VF_BDF) == "mlx5_core" and sim.override(VF_BDF) is None and UID not in d.checkpoint.claims


def _route(root: str, iface: str) -> None:
    os.makedirs(os.path.join(root, "proc/net"), exist_ok=True)
    with open(os.path.join(root, "proc/net/route"), "w") as f:
        f.write("Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\tMTU\tWindow\tIRTT\n"
                f"{iface}\t00000000\t0100000A\t0003\t0\t0\t0\t00000000\t0\t0\t0\n")


def test_refusals_are_clear_and_write_nothing(node):
    s, sim, state, driver = node
    d = driver()
    cases = []
    # the host's own: the VF's netdev carries the default route
    _route(s.root, "enp6s0f0v0")
    cases.append(("default route", [VF], "host's own"))
    # a PF with VFs enabled
    cases.append(("PF with VFs", [PF], "SR-IOV VFs enabled"))
    for what, devs, words in cases:
        before = list(sim.log)
        err = d.prepare_claims([vfio_claim("vm", devs, UID)])[UID].error
        assert err and words in err, (what, err)
        assert sim.log == before, what
    os.unlink(os.path.join(s.root, "proc/net/route"))
    # IOMMU group shared with a function in use that the claim does not have
    members = os.path.join(s.root, "sys/kernel/iommu_groups/42/devices")
    os.symlink(os.readlink(os.path.join(s.root, "sys/kernel/iommu_groups/43/devices/0000:06:00.3")),
               os.path.join(members, "0000:06:00.3"))
    err = d.prepare_claims([vfio_claim("vm", [VF], UID)])[UID].error
    assert err and "IOMMU group 42 also holds 0000:06:00.3" in err
    # ... fine when the claim has both
    assert d.prepare_claims([vfio_claim("vm", [VF, VF2], UID)])[UID].error is None
    d.unprepare_claims([ClaimRef("default", "vm", UID)])
    os.unlink(os.path.join(members, "0000:06:00.3"))
    # IOMMU off
    os.unlink(os.path.join(s.root, "sys/bus/pci/devices", VF_BDF, "iommu_group"))
    err = d.prepare_claims([vfio_claim("vm", [VF], UID)])[UID].error
    assert err and "IOMMU is off" in err
    # a strict config: unknown fields are that claim's error
    err = d.prepare_claims([vfio_claim("vm", [VF], UID2, params={"apiVersion": "sysdra.io/v1alpha1", "kind": "VfioConfig",
                                                                "mode": "x"})])[UID2].error
    assert err and "VfioConfig: mode" in err


def test_a_function_held_by_another_claim_is_refused(node):
    s, sim, state, driver = node
    d = driver()
    assert d.prepare_claims([claim("plain", [("net", VF)], uid=UID2)])[UID2].error is None
    err = d.prepare_claims([vfio_claim("vm", [VF], UID)])[UID].error
    assert err and "in use by another prepared claim" in err
    assert sim.driver(VF_BDF) == "mlx5_core"


def rebooted(root: str, sim, bdf: str, driver: str, boot: str | None = "rebooted") -> None:
    """The node rebooted: the kernel comes back with ``bdf`` on its own ``driver``, no override
    (``boot`` None: no reboot, someone gave it back by hand)."""
    sim.stop()
    sim.unbind("vfio-pci", bdf)
    with open(os.path.join(root, "sys/bus/pci/devices", bdf, "driver_override"), "w") as f:
        f.write("(null)\n")
    sim.bind(driver, bdf)
    if boot is not None:
        with open(os.path.join(root, "proc/sys/kernel/random/boot_id"), "w") as f:
            f.write(boot + "\n")
    sim.start()


def test_recovery_gives_back_an_interrupted_bind_and_rebinds_after_reboot(node):
    s, sim, state, driver = node

    class Crash(BaseException):
        pass

    d = driver()

    def crash_at(point):
        if point == "vfio:unbound":
            raise Crash()
    d.fault = crash_at
    with pytest.raises(Crash):
        d.prepare_claims([vfio_claim("vm", [VF], UID)])
    assert sim.driver(VF_BDF) is None  # left unbound mid-switch
    report = driver().recover()
    assert UID in report.rolled_back and sim.driver(VF_BDF) == "mlx5_core" and sim.override(VF_BDF) is None
    # prepared, then the node reboots: the kernel comes back with the original driver
    d = driver()
    assert d.prepare_claims([vfio_claim("vm", [VF], UID)])[UID].error is None
    rebooted(s.root, sim, VF_BDF, "mlx5_core")
    report = driver().recover()
    assert report.boot_changed and UID in report.rebuilt
    assert sim.driver(VF_BDF) == "vfio-pci"
    assert spec_nodes(s, UID) == ["/dev/vfio/42", "/dev/vfio/vfio"]


def test_a_function_given_back_by_hand_is_bound_again_with_a_spec_of_its_new_node(node):
    """No reboot: someone gave a prepared VM claim's function back to its driver. The next start
    binds it to vfio-pci again, and the group node the kernel made now (another minor: the
    kernel allocates it when the group is made) is what the claim's CDI spec gives the VM."""
    s, sim, state, driver = node
    assert driver().prepare_claims([vfio_claim("vm", [VF], UID)])[UID].error is None
    assert spec_numbers(s, UID)["/dev/vfio/42"] == (241, 42)
    sim.minors["42"] = 7
    rebooted(s.root, sim, VF_BDF, "mlx5_core", boot=None)
    report = driver().recover()
    assert not report.boot_changed and report.kernel_changed and sim.driver(VF_BDF) == "vfio-pci"
    assert spec_numbers(s, UID)["/dev/vfio/42"] == (241, 7) and UID in report.rebuilt


def spec_numbers(s, uid: str) -> dict[str, tuple[int, int]]:
    spec = cdifiles.read_spec(cdifiles.claim_spec_path(s.cdi_dir, s.driver_name, uid))
    return {n["path"]: (n["major"], n["minor"]) for d in spec["devices"] for n in d["containerEdits"].get("deviceNodes", [])}


def test_checkpoint_vfio_records_are_checked(node):
    s, sim, state, driver = node
    d = driver()
    assert d.prepare_claims([vfio_claim("vm", [VF], UID)])[UID].error is None
    path = d.checkpoint_path
    cp = Checkpoint.load(path, move_corrupt=False)
    cp.claims[UID]["vfio"][0]["driver"] = "../../evil"
    cp.save()
    d2 = driver()
    report = d2.recover()
    # not a record we wrote: moved aside, nothing written to sysfs from it, the claim adopted from its spec
    assert report.rejected == [UID] and report.adopted == [UID] and not report.corrupt_checkpoint
    assert sim.driver(VF_BDF) == "vfio-pci" and "evil" not in " ".join(sim.log)
    kept = json.load(open(d2.checkpoint.rejected_path))  # kept for the operator
    assert kept[UID]["entry"]["vfio"][0]["driver"] == "../../evil" and "vfio.0.driver" in kept[UID]["why"]


@pytest.mark.slow
@pytest.mark.root
def test_podman_sees_the_vfio_nodes(tmp_path):
    """The prepared claim's CDI spec gives a container the group node and /dev/vfio/vfio."""
    import asyncio

    from tests.conftest import require_podman
    from tests.test_podman_cdi import Podman

    busybox = require_podman()
    root = str(tmp_path / "root")
    shutil.copytree(profile_root("sriov-nic"), root, symlinks=True)
    sim = SimPciKernel(root, real_nodes=True).start()
    s = settings_for(str(tmp_path), root=root)
    d = Driver(s, lambda: scan(root))
    podman = Podman(str(tmp_path), s.cdi_dir)
    try:
        podman.import_busybox(busybox)
        res = d.prepare_claims([vfio_claim("vm", [VF], UID)])[UID]
        assert res.error is None, res.error
        ids = [i for dev in res.devices for i in dev.cdi_ids if "/claim=" in i]
        out = asyncio.run(asyncio.to_thread(podman.run, ids, "/bin/busybox stat -c '%n %F %t:%T' /dev/vfio/42 /dev/vfio/vfio"))
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines() == ["/dev/vfio/42 character special file 1:3", "/dev/vfio/vfio character special file 1:3"]
        assert d.unprepare_claims([ClaimRef("default", "vm", UID)]) == {UID: None}
        assert sim.driver(VF_BDF) == "mlx5_core"
    finally:
        podman.cleanup()
        sim.stop()


def test_reboot_in_the_middle_of_a_bind(node):
    """The node reboots between unbind and bind: the kernel comes up with the original driver
    and no override; recovery finds the intent, has nothing to undo and rolls the claim back."""
    s, sim, state, driver = node

    class Crash(BaseException):
        pass

    d = driver()
    d.fault = lambda point: (_ for _ in ()).throw(Crash()) if point == "vfio:unbound" else None
    with pytest.raises(Crash):
        d.prepare_claims([vfio_claim("vm", [VF], UID)])
    sim.stop()
    with open(os.path.join(s.root, "sys/bus/pci/devices", VF_BDF, "driver_override"), "w") as f:
        f.write("(null)\n")
    sim.bind("mlx5_core", VF_BDF)  # the boot's probe
    with open(os.path.join(s.root, "proc/sys/kernel/random/boot_id"), "w") as f:
        f.write("rebooted\n")
    sim.start()
    report = driver().recover()
    assert UID in report.rolled_back and sim.driver(VF_BDF) == "mlx5_core"
    assert UID not in Checkpoint.load(os.path.join(s.plugin_dir, "checkpoint.json"), move_corrupt=False).claims


def _hot_remove(sim: SimPciKernel, root: str, bdf: str) -> None:
    """The kernel removed the function (hot-unplug, ``echo 1 > remove``, or its PF's
    ``sriov_numvfs`` set to 0): its sysfs directory, its links and its group are gone."""
    sim.stop()
    dev = os.path.join(root, "sys/bus/pci/devices", bdf)
    real, group = os.path.realpath(dev), os.path.basename(os.readlink(os.path.join(dev, "iommu_group")))
    drv = os.path.join(dev, "driver")
    if os.path.islink(drv) and os.path.lexists(link := os.path.join(os.path.realpath(drv), bdf)):
        os.unlink(link)  # the driver's link to it
    os.unlink(dev)
    shutil.rmtree(real)
    shutil.rmtree(os.path.join(root, "sys/kernel/iommu_groups", group))
    for path in (os.path.join(root, "dev/vfio", group), os.path.join(root, "sys/class/vfio", group)):
        if os.path.lexists(path):
            os.unlink(path)
    sim.start()


@pytest.mark.parametrize("when", ["prepared", "before its first write"])
def test_a_function_that_left_the_node_is_given_back_as_gone(node, when):
    """A VM claim's VF is removed from the node (its PF's VFs reconfigured once the VM stopped, a
    surprise removal), once prepared or between the plan and the first write (that claim's error).
    Nothing is left to give back: the unprepare completes and the entry goes, as for a GPU that left
    the node during a mode switch (docs/partitions.md), instead of failing for as long as it is away."""
    s, sim, state, driver = node
    d = driver()
    d.fault = lambda point: _hot_remove(sim, s.root, VF_BDF) if point == "prepare:started" and when != "prepared" else None
    err = d.prepare_claims([vfio_claim("vm", [VF], UID)])[UID].error
    assert (err is None) == (when == "prepared"), err
    if when == "prepared":
        _hot_remove(sim, s.root, VF_BDF)
    else:  # given back as gone at once: no PrepareStarted entry left holding the address
        assert "original drivers restored" in err and UID not in d.checkpoint.claims, err
    state["inv"] = scan(s.root)
    assert d.unprepare_claims([ClaimRef("default", "vm", UID)]) == {UID: None}
    assert UID not in Checkpoint.load(d.checkpoint_path, move_corrupt=False).claims


def test_a_function_whose_override_names_another_driver_is_refused(node):
    """The VF is on mlx5_core with ``driver_override`` already vfio-pci (the first half of someone
    else's two-step move). Taking it would race that move, and the give-back could not bind
    mlx5_core back (only the override's driver may bind it): refused, nothing written."""
    s, sim, state, driver = node
    with open(os.path.join(s.root, "sys/bus/pci/devices", VF_BDF, "driver_override"), "w") as f:
        f.write("vfio-pci\n")
    err = driver().prepare_claims([vfio_claim("vm", [VF], UID)])[UID].error
    assert err and "its driver_override names vfio-pci while it is bound to mlx5_core" in err, err
    assert sim.driver(VF_BDF) == "mlx5_core" and sim.log == []
