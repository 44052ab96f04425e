"""The ownership table's rules (agent/prepare/ownership.py), as a table: which holds of two
claims on one PCI function go together; the real agent's cases are tests/faults/test_ownership.py."""

from __future__ import annotations

import pytest

from agent.prepare.ownership import Hold, Ownership

GPU = "0000:18:00.0"
WHOLE, SHARE, VFIO = Hold(GPU, "exclusive"), Hold(GPU, "shared"), Hold(GPU, "vfio")
P0, P1 = Hold(GPU, "partition", "p0", "CPX/NPS1"), Hold(GPU, "partition", "p1", "CPX/NPS1")
P1_DPX, MIG = Hold(GPU, "partition", "p1", "DPX/NPS1"), Hold(GPU, "partition", "mig-gi1-ci0")
NETDEV = Hold(GPU, "netdev")  # a NIC's function in truth; the rules do not look at kinds


@pytest.mark.parametrize("first, second, refused", [
    (VFIO, WHOLE, True), (VFIO, SHARE, True), (VFIO, P0, True), (VFIO, MIG, True),
    (P0, VFIO, True), (MIG, VFIO, True), (SHARE, VFIO, True),
    (P0, WHOLE, True), (SHARE, MIG, True), (P0, P0, True), (P0, P1_DPX, True),
    (P0, P1, False), (MIG, Hold(GPU, "partition", "mig-gi2-ci0"), False), (SHARE, SHARE, False),
    (WHOLE, WHOLE, False),  # the scheduler's to hand out once (docs/kubelet-plugin.md)
    (VFIO, Hold("0000:3a:00.0", "exclusive"), False),  # another function
    (NETDEV, SHARE, True), (SHARE, NETDEV, True), (NETDEV, WHOLE, True), (NETDEV, NETDEV, True),
    (NETDEV, Hold("0000:3a:00.0", "shared"), False),
])
def test_two_claims_on_one_function(first, second, refused):
    table = Ownership()
    table.take("a", [first], "ns/a")
    why = table.refusal("b", [second])
    assert (why is not None) is refused, why
    if refused:
        assert "ns/a (a)" in why and second.bdf in why
    assert table.refusal("a", [second]) is None  # a claim never conflicts with itself


def test_built_from_entries_and_released():
    entries = {"a": {"namespace": "ns", "name": "a"}, "b": {"namespace": "ns", "name": "b"}}
    holds = {"a": [VFIO], "b": []}
    table = Ownership.of(entries, lambda uid, entry: holds[uid])
    assert table.held() == [GPU] and "bound to vfio-pci" in table.refusal("c", [MIG])
    table.release("a")
    assert table.held() == [] and table.refusal("c", [MIG]) is None
