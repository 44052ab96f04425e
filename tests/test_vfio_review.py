"""Review findings for VFIO passthrough (docs/vfio.md) on the simulated kernel (tests/simkernel.py).
Each test states the documented behaviour it checks; they fail on the code as it is."""

from __future__ import annotations

import os
import shutil

from agent.kubeletplugin.types import ClaimRef
from agent.prepare.checkpoint import Checkpoint
from discovery.inventory import scan
from tests.kubelet_standin import claim
from tests.test_vfio import UID, UID2, VF, VF_BDF, node, spec_nodes, vfio_claim  # noqa: F401 - node is a fixture

HOST_VFIO, HOST_VFIO_BDF = "nic-0000-06-01-0", "0000:06:01.0"  # on vfio-pci by the host's choice, IOMMU group 48


def _into_group(root: str, bdf: str, group: int) -> None:
    """``bdf`` moved into IOMMU group ``group`` (the topology of a node whose ACS does not split
    them: both functions share the group)."""
    dev = os.path.join(root, "sys/bus/pci/devices", bdf)
    old = os.path.basename(os.readlink(os.path.join(dev, "iommu_group")))
    target = os.readlink(os.path.join(root, "sys/kernel/iommu_groups", old, "devices", bdf))
    os.unlink(os.path.join(root, "sys/kernel/iommu_groups", old, "devices", bdf))
    os.symlink(target, os.path.join(root, "sys/kernel/iommu_groups", str(group), "devices", bdf))
    os.unlink(os.path.join(dev, "iommu_group"))
    os.symlink(f"../../../../kernel/iommu_groups/{group}", os.path.join(os.path.realpath(dev), "iommu_group"))


def test_the_vms_group_never_reaches_another_claims_container_through_a_group_member(node):
    """docs/vfio.md: "a function bound to vfio-pci for one claim is refused to every other claim
    ...: its group node never reaches a container. Both orders are checked by one ownership
    table". The VF shares IOMMU group 48 with a function the host left on vfio-pci (no claim):
    binding the VF is allowed (a member on vfio-pci is fine). But then a plain claim of that
    member is prepared with /dev/vfio/48 - the group the VM of the first claim has - in its
    container. (The other order is refused: the VF's plan sees the member held.)"""
    s, sim, state, driver = node
    _into_group(s.root, VF_BDF, 48)
    state["inv"] = scan(s.root)
    d = driver()
    res = d.prepare_claims([vfio_claim("vm", [VF], UID)])[UID]
    assert res.error is None, res.error
    assert sim.driver(VF_BDF) == "vfio-pci" and spec_nodes(s, UID) == ["/dev/vfio/48", "/dev/vfio/vfio"]
    state["inv"] = scan(s.root)
    err = d.prepare_claims([claim("plain", [("dev", HOST_VFIO)], uid=UID2)])[UID2].error
    leaked = UID2 in d.checkpoint.claims and "/dev/vfio/48" in spec_nodes(s, UID2)
    assert err and not leaked, f"claim 2 got the VM's IOMMU group node: {spec_nodes(s, UID2) if leaked else err}"


def test_the_reverse_order_is_refused(node):
    """The same two claims in the other order: refused (what the test above expects too)."""
    s, sim, state, driver = node
    _into_group(s.root, VF_BDF, 48)
    state["inv"] = scan(s.root)
    d = driver()
    assert d.prepare_claims([claim("plain", [("dev", HOST_VFIO)], uid=UID2)])[UID2].error is None
    err = d.prepare_claims([vfio_claim("vm", [VF], UID)])[UID].error
    assert err and "IOMMU group 48 also holds 0000:06:01.0" in err


def _hot_remove(root: str, bdf: str) -> None:
    """The kernel removed the function (hot-unplug, ``echo 1 > remove``, or its PF's
    ``sriov_numvfs`` set to 0): its sysfs directory, its links and its group are gone."""
    dev = os.path.join(root, "sys/bus/pci/devices", bdf)
    real = os.path.realpath(dev)
    group = os.path.basename(os.readlink(os.path.join(dev, "iommu_group")))
    drv = os.path.join(dev, "driver")
    if os.path.islink(drv) and os.path.lexists(link := os.path.join(os.path.realpath(drv), bdf)):
        os.unlink(link)  # the driver's link to it
    os.unlink(dev)
    shutil.rmtree(real)
    shutil.rmtree(os.path.join(root, "sys/kernel/iommu_groups", group))
    for path in (os.path.join(root, "dev/vfio", group), os.path.join(root, "sys/class/vfio", group)):
        if os.path.lexists(path):
            os.unlink(path)


def test_unprepare_of_a_claim_whose_function_was_removed_completes(node):
    """A VM claim's VF is removed from the node (its PF's VFs reconfigured once the VM stopped,
    or a surprise removal). There is nothing left to give back: the kubelet's unprepare must
    complete, as it does for a GPU that left the node during a mode switch (docs/partitions.md:
    "a GPU that left the node has nothing to restore (noted, the entry goes)"; retrying "would only
    keep the claim's entry, and fail its unprepare, for as long as it is away"). Instead every
    unprepare fails (cannot read driver_override) and the claim's entry, holding the address,
    stays for good."""
    s, sim, state, driver = node
    d = driver()
    assert d.prepare_claims([vfio_claim("vm", [VF], UID)])[UID].error is None
    sim.stop()
    _hot_remove(s.root, VF_BDF)
    sim.start()
    state["inv"] = scan(s.root)
    out = d.unprepare_claims([ClaimRef("default", "vm", UID)])
    assert out == {UID: None}, out
    assert UID not in Checkpoint.load(d.checkpoint_path, move_corrupt=False).claims


def test_a_function_removed_before_its_bind_does_not_wedge_the_claim(node):
    """The function vanishes between the plan and the first write (hot-removed): the bind fails
    (that claim's error), but with nothing left to give back the claim must not keep a
    PrepareStarted entry that makes every later prepare and unprepare of it fail."""
    s, sim, state, driver = node
    d = driver()
    real_set = d.kernel.set_override
    removed = []

    def vanish_then_set(bdf, drv):
        if not removed:
            removed.append(bdf)
            sim.stop()
            _hot_remove(s.root, bdf)
            sim.start()
        return real_set(bdf, drv)

    d.kernel.set_override = vanish_then_set
    err = d.prepare_claims([vfio_claim("vm", [VF], UID)])[UID].error
    assert err, "the bind of a removed function cannot succeed"
    d.kernel.set_override = real_set
    state["inv"] = scan(s.root)
    assert d.unprepare_claims([ClaimRef("default", "vm", UID)]) == {UID: None}
    assert UID not in Checkpoint.load(d.checkpoint_path, move_corrupt=False).claims


def test_a_function_found_with_an_override_naming_another_driver_is_given_back_as_found(node):
    """docs/vfio.md: "Unprepare writes the original driver_override back, unbinds from vfio-pci and
    binds the original driver". The VF is on mlx5_core with ``driver_override`` already set to
    vfio-pci (written, the rebind not done yet: the first half of the usual two-step move). The
    claim is prepared (the agent does not refuse it), but the give-back writes the override first,
    and the kernel then refuses binding mlx5_core (only the override's driver may bind): every
    unprepare fails and the VF is left with no driver at all."""
    s, sim, state, driver = node
    with open(os.path.join(s.root, "sys/bus/pci/devices", VF_BDF, "driver_override"), "w") as f:
        f.write("vfio-pci\n")
    d = driver()
    d.kernel.wait = 1.0
    res = d.prepare_claims([vfio_claim("vm", [VF], UID)])[UID]
    if res.error is not None:  # refusing a function in that state up front would be fine too
        assert sim.driver(VF_BDF) == "mlx5_core"
        return
    assert d.checkpoint.claims[UID]["vfio"][0]["override"] == "vfio-pci"
    out = d.unprepare_claims([ClaimRef("default", "vm", UID)])
    assert out == {UID: None}, out
    assert sim.driver(VF_BDF) == "mlx5_core", f"the VF is left on {sim.driver(VF_BDF)}"


def test_a_process_on_a_gpu_partitions_render_node_is_seen_as_a_user(tmp_path):
    """docs/vfio.md, "In use on the host": a process holding one of the function's device files
    open refuses the claim, nothing written (DRM's card and render nodes named). An MI300X in CPX
    mode has eight render nodes: partition 0's below the PCI function, partitions 1..7's below
    ``/sys/devices/platform/amdgpu_xcp_<N>/drm/`` (docs/partitions.md). A process holding
    partition 0's node refuses the claim; one holding partition 1's does not: the GPU is unbound
    from amdgpu under it."""
    import subprocess

    from agent.prepare.driver import Driver
    from tests.kubelet_standin import settings_for
    from tests.partition_node import copy_node
    from tests.simkernel import SimPciKernel
    from tests.test_vfio_inuse import FULL, hold

    gpu, bdf = "gpu-0000-05-00-0", "0000:05:00.0"
    results = {}
    for which, dev_file in (("partition 0", "sys/bus/pci/devices/0000:05:00.0/drm/renderD128/dev"),
                            ("partition 1", "sys/devices/platform/amdgpu_xcp_0/drm/renderD129/dev")):
        root = copy_node(str(tmp_path / which.replace(" ", "")))
        os.makedirs(os.path.join(root, "proc/sys/kernel/random"), exist_ok=True)
        with open(os.path.join(root, "proc/sys/kernel/random/boot_id"), "w") as f:
            f.write("boot-1\n")
        with open(os.path.join(root, dev_file), "w") as f:
            f.write(f"{FULL[0]}:{FULL[1]}\n")  # the render node as /dev/full's numbers: a real process can hold it
        node = "/dev/dri/" + dev_file.split("/")[-2]
        children: list[subprocess.Popen] = []
        sim = SimPciKernel(root, real_nodes=True).start()
        try:
            hold(root, children, node, FULL, "rocm-smi")
            d = Driver(settings_for(str(tmp_path / which.replace(" ", "") / "state"), root=root), lambda r=root: scan(r))
            d.kernel.wait = 2.0
            err = d.prepare_claims([vfio_claim("vm", [gpu], UID)])[UID].error
            results[which] = (err, sim.driver(bdf))
        finally:
            for child in children:
                child.kill()
                child.wait()
            sim.close()
    err0, drv0 = results["partition 0"]
    assert err0 and "is in use on the host" in err0 and drv0 == "amdgpu", results  # the control: refused
    err1, drv1 = results["partition 1"]
    assert err1 and "is in use on the host" in err1 and drv1 == "amdgpu", \
        f"a process on partition 1's render node was not seen: error {err1!r}, the GPU now on {drv1}"


def test_a_rebind_after_a_reboot_does_not_destroy_vfs_the_pf_has_now(node):
    """docs/vfio.md refuses "a PF with SR-IOV VFs enabled (unbinding it would destroy them)". A
    claim passes a PF through while it has no VFs; the node reboots and the host's SR-IOV setup
    (a boot-time unit, an operator) enables VFs on it again before the agent starts. Start-up
    recovery re-binds the claim's functions with no check: it unbinds the PF, destroying VFs the
    host now has (and may use)."""
    from tests.test_vfio import PF, rebooted

    pf_bdf = "0000:06:00.0"
    s, sim, state, driver = node
    numvfs = os.path.join(s.root, "sys/bus/pci/devices", pf_bdf, "sriov_numvfs")
    with open(numvfs, "w") as f:
        f.write("0\n")
    state["inv"] = scan(s.root)
    d = driver()
    res = d.prepare_claims([vfio_claim("vm", [PF], UID)])[UID]
    assert res.error is None, res.error
    assert sim.driver(pf_bdf) == "vfio-pci"
    rebooted(s.root, sim, pf_bdf, "mlx5_core")
    with open(numvfs, "w") as f:
        f.write("8\n")  # enabled at boot
    state["inv"] = scan(s.root)
    log_before = len(sim.log)
    driver().recover()
    assert f"unbind {pf_bdf} mlx5_core" not in sim.log[log_before:], \
        "the PF with 8 VFs enabled was unbound from mlx5_core at start-up (its VFs destroyed)"


def test_a_give_back_whose_unbind_does_not_return_is_written_down_as_pending(tmp_path):
    """docs/vfio.md, "Crash safety": "A function whose write did not return is marked `pending` in its
    record", so that another instance (after a restart, a rolling update's) "first looks for any
    process with the driver's unbind/bind or the function's driver_override open, and waits while
    there is one" instead of writing under it. At unprepare the VM's group is closed, but the
    unbind from vfio-pci does not return (vfio-pci's remove waits for a user no file shows). The
    claim keeps its entry, but its record is not marked pending; a new instance (the old one's
    write, here a real ``sh``, still in the kernel) then writes the function's driver_override and
    a second unbind under it."""
    import subprocess

    from agent.prepare import vfio_kernel
    from tests.test_vfio_inuse import NIC, NIC_BDF, see, wait_until
    from tests.simkernel import SimPciKernel
    from tests.test_vfio import node_root
    from agent.prepare.driver import Driver
    from tests.kubelet_standin import settings_for

    root = node_root(tmp_path, "server-2s-gpu-nic")
    sim = SimPciKernel(root, real_nodes=True).start()
    s = settings_for(str(tmp_path), root=root)
    children = []

    def driver() -> Driver:
        d = Driver(s, lambda: scan(root))
        d.kernel.wait = 1.0
        return d

    try:
        d = driver()
        assert d.prepare_claims([vfio_claim("vm", [NIC], UID)])[UID].error is None
        sim.hang("vfio-pci")
        err = d.unprepare_claims([ClaimRef("default", "vm", UID)])[UID]
        assert err and "not finished" in err, err
        (rec,) = Checkpoint.load(d.checkpoint_path, move_corrupt=False).claims[UID]["vfio"]
        # the old instance's write, still in the kernel (a real process blocked in write())
        unbind = os.path.join(root, "sys/bus/pci/drivers/vfio-pci/unbind")
        old = subprocess.Popen(["sh", "-c", f"echo {NIC_BDF} > {unbind}"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # no /dev/null: the sim's group node numbers
        children.append(old)
        see(root, old.pid)
        vfio_kernel._IN_FLIGHT.clear()  # a new instance knows nothing of the old one's threads
        wait_until(lambda: driver().kernel.writers(NIC_BDF, ["vfio-pci"]), "no process blocked in its write")
        again = driver().unprepare_claims([ClaimRef("default", "vm", UID)])[UID]
        wrote = sim.override(NIC_BDF) != "vfio-pci"
        assert rec.get("pending") is True and not wrote, (
            f"record on disk {rec}; the new instance's unprepare: {again!r}; "
            f"driver_override {'rewritten' if wrote else 'untouched'} while the old unbind is in the kernel")
    finally:
        for child in children:
            child.kill()
            child.wait()
        sim.close()
        vfio_kernel._IN_FLIGHT.clear()


def test_vfio_pci_not_loaded_is_refused_before_anything_is_written(tmp_path):
    """docs/vfio.md, "What is refused (that claim's error; nothing is written)": "`vfio-pci` is not
    loaded (`modprobe vfio-pci`)". The plan does not look: the claim's function gets its
    driver_override written, is unbound from its driver (the NIC drops its link, a GPU's users
    lose it) and bound back, and only then does the claim fail."""
    from agent.prepare.driver import Driver
    from tests.kubelet_standin import settings_for
    from tests.simkernel import SimPciKernel
    from tests.test_vfio import node_root
    from tests.test_vfio_inuse import NIC, NIC_BDF

    root = node_root(tmp_path, "server-2s-gpu-nic")
    sim = SimPciKernel(root, vfio_loaded=False).start()
    try:
        d = Driver(settings_for(str(tmp_path), root=root), lambda: scan(root))
        d.kernel.wait = 2.0
        err = d.prepare_claims([vfio_claim("vm", [NIC], UID)])[UID].error
        assert err and "vfio-pci is not loaded" in err, err
        assert sim.driver(NIC_BDF) == "mlx5_core"
        assert sim.log == [], f"written before the refusal: {sim.log}"
    finally:
        sim.close()


def test_a_vfio_config_for_a_gpu_partition_is_not_silently_dropped(tmp_path):
    """docs/vfio.md: a claim asks for passthrough with a ``VfioConfig`` "for the requests that go to a
    VM"; docs/claim-config.md/claimconfig.config_for: a config naming a request it cannot configure is
    the claim's error. A VfioConfig naming a request that got an AMD partition (kind gpu, so the
    config applies) is neither done nor refused: the VFIO step only looks for the result in the
    inventory's whole devices, so the VM's request is prepared as an ordinary partition (a render
    node and /dev/kfd) with no error."""
    from agent.prepare.driver import Driver
    from tests.partition_node import CPX_GPU, Node, part_of

    n = Node(str(tmp_path))
    with n.sim:
        d = Driver(n.settings, n.inventory)
        d.hardware_changed = n.rescan
        c = n.allocated("c", part_of(CPX_GPU, "CPX/NPS1"))
        c["status"]["allocation"]["devices"]["config"] = [{
            "source": "FromClaim", "requests": ["gpu"],
            "opaque": {"driver": "sysdra.io", "parameters": {"apiVersion": "sysdra.io/v1alpha1", "kind": "VfioConfig"}}}]
        uid = c["metadata"]["uid"]
        res = d.prepare_claims([c])[uid]
        entry = d.checkpoint.claims.get(uid) or {}
        assert res.error or entry.get("vfio"), \
            f"prepared {[x.device for x in res.devices]} with no VFIO and no error (the VfioConfig ignored)"
