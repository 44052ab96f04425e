"""The ownership table's rules (agent/prepare/ownership.py), as a table: which holds of two
claims on one PCI function go together; the real agent's cases are tests/faults/test_ownership.py."""

from __future__ import annotations

from fractions import Fraction

import pytest

from agent.prepare.ownership import Hold, Ownership

GPU = "0000:18:00.0"
WHOLE, SHARE, VFIO = Hold(GPU, "exclusive"), Hold(GPU, "shared"), Hold(GPU, "vfio")
P0, P1 = Hold(GPU, "partition", "p0", "CPX/NPS1"), Hold(GPU, "partition", "p1", "CPX/NPS1")
P1_DPX, MIG = Hold(GPU, "partition", "p1", "DPX/NPS1"), Hold(GPU, "partition", "mig-gi1-ci0")
# with DRA admin access (adminAccess: true)
A_WHOLE, A_SHARE = Hold(GPU, "exclusive", admin=True), Hold(GPU, "shared", admin=True)
A_P0, A_P1_DPX = Hold(GPU, "partition", "p0", "CPX/NPS1", admin=True), Hold(GPU, "partition", "p1", "DPX/NPS1", admin=True)
NETDEV = Hold(GPU, "netdev")  # a NIC's function in truth; the rules do not look at kinds


@pytest.mark.parametrize("first, second, refused", [
    (VFIO, WHOLE, True), (VFIO, SHARE, True), (VFIO, P0, True), (VFIO, MIG, True),
    (P0, VFIO, True), (MIG, VFIO, True), (SHARE, VFIO, True),
    (P0, WHOLE, True), (SHARE, MIG, True), (P0, P0, True), (P0, P1_DPX, True),
    (P0, P1, False), (MIG, Hold(GPU, "partition", "mig-gi2-ci0"), False), (SHARE, SHARE, False),
    (WHOLE, WHOLE, True), (WHOLE, SHARE, True), (SHARE, WHOLE, True), (WHOLE, MIG, True),
    # admin access reaches a device however another claim holds it, but never one bound to vfio-pci
    (WHOLE, A_WHOLE, False), (A_WHOLE, WHOLE, False), (SHARE, A_WHOLE, False), (A_SHARE, WHOLE, False),
    (P0, A_WHOLE, False), (A_P0, P0, False), (A_WHOLE, A_WHOLE, False), (MIG, A_WHOLE, False),
    (VFIO, A_WHOLE, True), (A_WHOLE, VFIO, True), (A_SHARE, VFIO, True), (VFIO, A_P0, True),
    (A_P0, P1_DPX, True), (P0, A_P1_DPX, True),  # one GPU runs in one mode
    (VFIO, Hold("0000:3a:00.0", "exclusive"), False),  # another function
    (NETDEV, SHARE, True), (SHARE, NETDEV, True), (NETDEV, WHOLE, True), (NETDEV, NETDEV, True),
    (NETDEV, A_WHOLE, True), (A_SHARE, NETDEV, True),  # admin access would lose the interface too
    (NETDEV, Hold("0000:3a:00.0", "shared"), False),
])
def test_two_claims_on_one_function(first, second, refused):
    table = Ownership()
    table.take("a", [first], "ns/a")
    why = table.refusal("b", [second])
    assert (why is not None) is refused, why
    if refused:
        assert "ns/a (a)" in why and second.bdf in why and first.describe() in why
    assert table.refusal("a", [second]) is None  # a claim never conflicts with itself


def test_built_from_entries_and_released():
    entries = {"a": {"namespace": "ns", "name": "a"}, "b": {"namespace": "ns", "name": "b"}}
    holds = {"a": [VFIO], "b": []}
    table = Ownership.of(entries, lambda uid, entry: holds[uid])
    assert table.held() == [GPU] and "bound to vfio-pci" in table.refusal("c", [MIG])
    table.release("a")
    assert table.held() == [] and table.refusal("c", [MIG]) is None


def test_a_refusal_names_the_device_and_the_claim_holding_it():
    table = Ownership()
    table.take("a", [Hold(GPU, "exclusive", "gpu-0000-18-00-0")], "ns/a")
    why = table.refusal("b", [Hold(GPU, "shared", "gpu-0000-18-00-0")])
    assert why.startswith("gpu-0000-18-00-0 (0000:18:00.0) is held by prepared claim ns/a (a) as a whole device")
    assert why.endswith("this claim needs it as a share")
    assert table.refusal("b", [Hold(GPU, "exclusive", "gpu-0000-18-00-0", admin=True)]) is None


def test_a_partition_refusal_names_the_partitions_and_their_modes():
    table = Ownership()
    table.take("a", [P0], "ns/a")
    # the function once: the partition's name is in what each claim holds
    assert table.refusal("b", [P1_DPX]) == ("0000:18:00.0 is held by prepared claim ns/a (a) partition p0 in "
                                            "CPX/NPS1; this claim needs it partition p1 in DPX/NPS1")


def _share(compute: int, admin: bool = False) -> Hold:
    return Hold(GPU, "shared", "gpu-0000-18-00-0", admin=admin, consumed=(("compute", Fraction(compute)),),
                capacity=(("compute", Fraction(100)), ("memory", Fraction(80 << 30))))


def test_shares_beyond_the_devices_capacity_are_refused():
    table = Ownership()
    table.take("a", [_share(60)], "ns/a")
    assert table.refusal("b", [_share(40)]) is None  # exactly full
    why = table.refusal("b", [_share(30), _share(11)])  # two shares of one claim count together
    assert why == ("gpu-0000-18-00-0 (0000:18:00.0): its shares would consume 101 of compute, more than its 100 "
                   "(shares held by ns/a (a))")
    assert table.refusal("b", [_share(41, admin=True)]) is None  # admin access consumes nothing
    table.take("c", [_share(90, admin=True)], "ns/c")
    assert table.refusal("b", [_share(40)]) is None
    assert "more than its 100" in table.refusal("a", [_share(101)])  # also alone


def test_admin_access_is_not_refused_where_the_shares_already_exceed_the_capacity():
    # the checkpoint's claims are taken at start unchecked: after the operator lowered a capacity
    # they may consume more than it; a claim with admin access consumes nothing and still goes
    table = Ownership()
    table.take("a", [_share(120)], "ns/a")
    assert table.refusal("b", [_share(10, admin=True)]) is None
    assert "consume 130 of compute" in table.refusal("b", [_share(10)])
