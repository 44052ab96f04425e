"""The ownership table on the real driver (agent/prepare/ownership.py, issue 42 item 2): a device
held whole goes to no second claim, whatever the order and after a restart (the table is
rebuilt from the checkpoint); shares of a shared device go together within its capacity, and DRA admin access
reaches a device beside its other claims but never one bound to vfio-pci, nor another function of its
IOMMU group (the VM has the group). Real checkpoint,
spec files and (for VFIO) the simulated PCI kernel; the whole agent: tests/faults/test_ownership.py."""

from __future__ import annotations

import os

import pytest

from agent.kubeletplugin.types import ClaimRef
from agent.prepare import cdifiles
from agent.prepare.driver import Driver
from discovery.inventory import scan
from tests.kubelet_standin import claim, gpu, inventory, settings_for
from tests.test_vfio import UID, UID2, VF, VF_BDF, node, spec_nodes, vfio_claim  # noqa: F401 - node is a fixture

GPU, BDF = gpu(0).name, gpu(0).pci.bdf
UIDS = {n: f"00000000-0000-4000-8000-0000000000{i:02x}" for i, n in enumerate(("a", "b", "c", "d"))}
SHARES = {n: f"5a4e0000-0000-4000-8000-0000000000{i:02x}" for i, n in enumerate(("a", "b", "c", "d"))}


def _driver(tmp_path, share: tuple[str, ...] = ("gpu",), **kw) -> Driver:
    inv = inventory(gpu(0), gpu(1))
    d = Driver(settings_for(str(tmp_path), share=share, **kw), lambda: inv)
    d.recover()
    return d


def _claim(name: str, how: str, device: str = GPU, compute: str | None = None) -> dict:
    """Claim ``name`` holding ``device`` as ``how``: whole, share (consuming ``compute``), admin
    (whole, adminAccess)."""
    c = claim(name, [("r", device)], uid=UIDS[name], share_ids={device: SHARES[name]} if how == "share" else None)
    result = c["status"]["allocation"]["devices"]["results"][0]
    if how == "admin":
        result["adminAccess"] = True
    if compute:
        result["consumedCapacity"] = {"compute": compute}
    return c


def _prepare(d: Driver, *claims: dict) -> dict[str, str | None]:
    return {uid: r.error for uid, r in d.prepare_claims(list(claims)).items()}


def _unprepare(d: Driver, *claims: dict) -> None:
    refs = [ClaimRef(c["metadata"]["namespace"], c["metadata"]["name"], c["metadata"]["uid"]) for c in claims]
    assert d.unprepare_claims(refs) == {r.uid: None for r in refs}


def _spec(d: Driver, uid: str) -> bool:
    return os.path.exists(cdifiles.claim_spec_path(d.settings.cdi_dir, d.settings.driver_name, uid))


def _refused(d: Driver, c: dict, holder: dict) -> None:
    uid = c["metadata"]["uid"]
    err = _prepare(d, c)[uid]
    assert err and f"{GPU} ({BDF})" in err and f"default/{holder['metadata']['name']} ({holder['metadata']['uid']})" in err, err
    assert uid not in d.checkpoint.claims and not _spec(d, uid), "the refused claim left an entry or a spec"


@pytest.mark.parametrize("first, second", [("whole", "whole"), ("whole", "share"), ("share", "whole")])
def test_a_device_held_whole_goes_to_no_second_claim_in_either_order_nor_after_a_restart(tmp_path, first, second):
    d = _driver(tmp_path)
    a, b = _claim("a", first), _claim("b", second)
    assert _prepare(d, a) == {UIDS["a"]: None}
    _refused(d, b, holder=a)
    restarted = _driver(tmp_path)  # the table is rebuilt from the checkpoint
    _refused(restarted, b, holder=a)
    assert _prepare(restarted, a) == {UIDS["a"]: None}  # the same claim again: idempotent
    _unprepare(restarted, a)
    assert _prepare(restarted, b) == {UIDS["b"]: None}  # the device is free: the other claim gets it
    _refused(restarted, a, holder=b)


def test_the_second_of_one_call_is_refused_and_the_other_device_is_not_held(tmp_path):
    d = _driver(tmp_path)
    a, b, c = _claim("a", "whole"), _claim("b", "whole"), _claim("c", "whole", device=gpu(1).name)
    errors = _prepare(d, a, b, c)
    assert errors[UIDS["a"]] is None and errors[UIDS["c"]] is None
    assert errors[UIDS["b"]] and f"default/a ({UIDS['a']})" in errors[UIDS["b"]]


def test_a_claim_allocated_again_lets_go_of_its_old_device_at_once(tmp_path):
    """Claim a was prepared with GPU 0 and is allocated again with GPU 1 (same UID, the kubelet
    prepares it again): undoing its earlier prepare releases GPU 0 in that very call, so claim b,
    allocated GPU 0 and prepared in the same call after it, gets it."""
    d = _driver(tmp_path)
    assert _prepare(d, _claim("a", "whole")) == {UIDS["a"]: None}
    moved, b = _claim("a", "whole", device=gpu(1).name), _claim("b", "whole")
    assert _prepare(d, moved, b) == {UIDS["a"]: None, UIDS["b"]: None}
    assert [e["devices"][0]["device"] for e in (d.checkpoint.claims[UIDS["a"]], d.checkpoint.claims[UIDS["b"]])] == [
        gpu(1).name, GPU]
    _refused(_driver(tmp_path), _claim("c", "whole"), holder=b)  # and b holds it, after a restart too


def test_shares_of_a_shared_device_and_admin_access_go_together(tmp_path):
    d = _driver(tmp_path)
    s1, s2, admin, whole = _claim("a", "share"), _claim("b", "share"), _claim("c", "admin"), _claim("d", "whole")
    assert _prepare(d, s1, s2, admin) == {UIDS["a"]: None, UIDS["b"]: None, UIDS["c"]: None}
    assert d.checkpoint.claims[UIDS["c"]]["devices"][0]["adminAccess"] is True
    _refused(d, whole, holder=s1)  # admin access holds nothing the whole device's claim would wait for
    _unprepare(d, s1, s2)
    restarted = _driver(tmp_path)  # admin access is read back from the checkpoint
    assert _prepare(restarted, whole) == {UIDS["d"]: None}
    assert _prepare(restarted, admin) == {UIDS["c"]: None}
    _unprepare(restarted, admin)
    assert _prepare(restarted, admin) == {UIDS["c"]: None}  # admin access after the whole device's claim


def test_shares_beyond_the_devices_capacity_are_refused_also_after_a_restart(tmp_path):
    d = _driver(tmp_path)  # compute: 100 per GPU (docs/sharing.md); memory unknown here: not accounted
    a, b, c = _claim("a", "share", compute="60"), _claim("b", "share", compute="50"), _claim("c", "share", compute="40")
    assert _prepare(d, a) == {UIDS["a"]: None}
    for driver in (d, _driver(tmp_path)):  # what a share consumes is read back from the checkpoint
        err = _prepare(driver, b)[UIDS["b"]]
        assert err and f"{GPU} ({BDF}): its shares would consume 110 of compute, more than its 100" in err, err
        assert f"default/a ({UIDS['a']})" in err and UIDS["b"] not in driver.checkpoint.claims
    assert _prepare(driver, c) == {UIDS["c"]: None}  # 100 of 100


def test_shares_are_accounted_against_the_operators_capacity_values(tmp_path):
    policy = {"value": "200", "default": "10", "validRange": {"min": "1", "max": "200", "step": "1"}}
    d = _driver(tmp_path, share_policies={"gpu": {"compute": policy}})  # published as 200 (docs/sharing.md)
    a, b, c = _claim("a", "share", compute="60"), _claim("b", "share", compute="50"), _claim("c", "share", compute="91")
    assert _prepare(d, a, b) == {UIDS["a"]: None, UIDS["b"]: None}
    assert "consume 201 of compute, more than its 200" in _prepare(d, c)[UIDS["c"]]


def test_a_share_of_a_device_not_published_shared_holds_it_whole(tmp_path):
    d = _driver(tmp_path, share=())
    a, b = _claim("a", "share"), _claim("b", "share")
    assert _prepare(d, a) == {UIDS["a"]: None}
    _refused(d, b, holder=a)


def test_a_share_of_a_gpu_on_vfio_pci_holds_it_whole(tmp_path):
    """``share: [gpu]``, the GPU bound to vfio-pci (shares allocated before the bind, or from an older
    agent's slice): it is published whole (agent/publish/sharing.is_shared), so a share holds it whole,
    and a second container never gets the same /dev/vfio/<group>."""
    vm_gpu = gpu(0).replace(pci=gpu(0).pci.replace(driver="vfio-pci"))
    d = Driver(settings_for(str(tmp_path), share=("gpu",)), lambda: inventory(vm_gpu, gpu(1)))
    d.recover()
    a, b = _claim("a", "share", compute="10"), _claim("b", "share", compute="10")
    assert _prepare(d, a) == {UIDS["a"]: None}
    _refused(d, b, holder=a)


def test_admin_access_never_reaches_a_function_bound_to_vfio_pci(node):  # noqa: F811
    s, sim, state, driver = node
    d = driver()
    vm = vfio_claim("vm", [VF], UIDS["a"])
    admin = claim("admin", [("r", VF)], uid=UIDS["b"])
    admin["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
    for first, second in ((vm, admin), (admin, vm)):
        assert _prepare(d, first) == {first["metadata"]["uid"]: None}
        err = _prepare(d, second)[second["metadata"]["uid"]]
        assert err and VF_BDF in err, err
        assert sim.driver(VF_BDF) == ("vfio-pci" if first is vm else "mlx5_core")
        _unprepare(d, first)
        assert sim.driver(VF_BDF) == "mlx5_core"


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


@pytest.mark.parametrize("vm_first", [True, False])
def test_the_vms_group_reaches_no_other_claim_through_a_group_member_in_either_order(node, vm_first):  # noqa: F811
    """docs/vfio.md: a function bound to vfio-pci for one claim is refused to every other claim: its
    group node never reaches a container, both orders checked by one ownership table. The VF shares
    IOMMU group 48 with a function the host left on vfio-pci (no claim): binding the VF is allowed (a
    member on vfio-pci is fine), and the VM claim then holds the whole group, so a plain claim of that
    member (whose spec would give its container /dev/vfio/48) is refused; the other way round the
    VF's plan sees the member held."""
    s, sim, state, driver = node
    _into_group(s.root, VF_BDF, 48)
    state["inv"] = scan(s.root)
    d = driver()
    vm, plain = vfio_claim("vm", [VF], UID), claim("plain", [("dev", HOST_VFIO)], uid=UID2)
    if vm_first:
        assert _prepare(d, vm) == {UID: None}
        assert sim.driver(VF_BDF) == "vfio-pci" and spec_nodes(s, UID) == ["/dev/vfio/48", "/dev/vfio/vfio"]
        state["inv"] = scan(s.root)
        err = _prepare(d, plain)[UID2]
        assert err and (f"{HOST_VFIO} ({HOST_VFIO_BDF}) is held by prepared claim default/vm ({UID}) with "
                       f"{VF_BDF}'s IOMMU group 48 bound to vfio-pci") in err, err
        assert UID2 not in d.checkpoint.claims and not _spec(d, UID2)
        assert _prepare(driver(), plain)[UID2] == err  # after a restart too: the table is rebuilt from the checkpoint
    else:
        assert _prepare(d, plain) == {UID2: None}
        err = _prepare(d, vm)[UID]
        # the plain claim holds the rest of the member's group (its container has /dev/vfio/48)
        assert err and f"{VF_BDF} is in use by another prepared claim" in err and "IOMMU group" in err, err
        assert sim.driver(VF_BDF) == "mlx5_core" and UID not in d.checkpoint.claims
