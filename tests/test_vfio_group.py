"""A function already on vfio-pci claimed without a ``VfioConfig`` (vfio.sysdra.io, docs/vfio.md
"Which class"): its container gets ``/dev/vfio/<group>``, the whole IOMMU group. Another function
of that group must not reach a second claim (a group opens once: the second VM fails, or both share
it), whichever order they come in and after a restart. Simulated PCI kernel (tests/simkernel.py)."""

from __future__ import annotations

import pytest

from discovery.inventory import scan
from tests.kubelet_standin import claim
from tests.test_ownership_driver import HOST_VFIO, HOST_VFIO_BDF, _into_group, _prepare, _spec
from tests.test_vfio import UID, UID2, VF2, node, spec_nodes  # noqa: F401 - node is a fixture

VF2_BDF = "0000:06:00.3"


def _vf2_on_vfio_in_group_48(s, sim) -> None:
    """VF2 on vfio-pci by the host's choice, in IOMMU group 48 beside HOST_VFIO (no ACS split)."""
    sim.stop()
    _into_group(s.root, VF2_BDF, 48)
    sim.unbind("mlx5_core", VF2_BDF)
    sim.bind("vfio-pci", VF2_BDF)
    sim.start()


@pytest.mark.parametrize("first", [HOST_VFIO, VF2])
def test_plain_claims_of_two_functions_of_one_vfio_group_do_not_both_get_it(node, first):
    s, sim, state, driver = node
    _vf2_on_vfio_in_group_48(s, sim)
    state["inv"] = scan(s.root)
    d = driver()
    second = VF2 if first == HOST_VFIO else HOST_VFIO
    a, b = claim("a", [("vm", first)], uid=UID), claim("b", [("vm", second)], uid=UID2)
    assert _prepare(d, a) == {UID: None}
    assert spec_nodes(s, UID) == ["/dev/vfio/48", "/dev/vfio/vfio"]
    err = _prepare(d, b)[UID2]
    assert err and "IOMMU group 48" in err and f"default/a ({UID})" in err, err
    assert UID2 not in d.checkpoint.claims and not _spec(d, UID2)
    assert _prepare(driver(), b)[UID2] == err  # after a restart too: the table is rebuilt from the checkpoint


@pytest.mark.parametrize("admin_first", [True, False])
def test_admin_access_never_reaches_a_function_on_vfio_pci_held_by_a_plain_claim(node, admin_first):
    """docs/vfio.md: admin access never reaches a function bound to vfio-pci (the group is one VM's): a
    container with admin access would get the same /dev/vfio/48 as the claim's."""
    s, sim, state, driver = node
    d = driver()
    plain = claim("plain", [("vm", HOST_VFIO)], uid=UID)
    admin = claim("admin", [("r", HOST_VFIO)], uid=UID2)
    admin["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
    first, second = (admin, plain) if admin_first else (plain, admin)
    assert _prepare(d, first) == {first["metadata"]["uid"]: None}
    err = _prepare(d, second)[second["metadata"]["uid"]]
    assert err and f"{HOST_VFIO} ({HOST_VFIO_BDF}) is held by prepared claim default/{first['metadata']['name']}" in err, err
    assert second["metadata"]["uid"] not in d.checkpoint.claims


def test_the_scheduler_hands_two_functions_of_one_group_to_two_claims_and_prepare_refuses_the_second(node):
    """The scheduler's own allocator (tests/controlplane_allocator.py) with the chart's classes knows no IOMMU
    groups: two claims for vfio.sysdra.io get the two functions of group 48. The node is what keeps the second
    container from the group."""
    from agent.publish.slices import build_pool, render
    from tests.controlplane_allocator import allocate, with_allocation
    from tests.kubelet_standin import DRIVER, NODE
    from tests.test_allocator import CLASSES, claim as api_claim, exactly

    s, sim, state, driver = node
    _vf2_on_vfio_in_group_48(s, sim)
    state["inv"] = scan(s.root)
    slices = render(build_pool(state["inv"], node_name=NODE, driver_name=DRIVER), driver_name=DRIVER,
                    node_name=NODE, generation=1, full_name=True)
    in_48 = [{"cel": {"expression": f'device.attributes["{DRIVER}"].iommuGroup == 48'}}]
    claims = [api_claim(n, exactly("vm", "vfio.sysdra.io", selectors=in_48)) for n in ("a", "b")]
    allocations = allocate(slices, CLASSES, claims, node=NODE)
    assert sorted(r["device"] for a in allocations for r in a["devices"]["results"]) == sorted([HOST_VFIO, VF2])
    a, b = (with_allocation(c, al) for c, al in zip(claims, allocations))
    a["metadata"]["uid"], b["metadata"]["uid"] = UID, UID2
    d = driver()
    assert _prepare(d, a) == {UID: None}
    err = _prepare(d, b)[UID2]
    assert err and "IOMMU group 48" in err and f"default/a ({UID})" in err, err
