"""Dynamic MIG slices against the real kube-apiserver v1.37.2 (tests/controlplane.py): the H200's
26 placement devices, the whole GPU and their counter set pass the server's own validation and
come back as sent (no field dropped)."""

from __future__ import annotations

from agent.publish.slices import build_pool, render
from discovery.inventory import scan
from tests.controlplane import unique
from tests.mig_node import MigNode
from tests.test_apiserver_slices import DRIVER, without_server_fields


def test_mig_slices_are_accepted_and_stored_unchanged(apiserver, tmp_path):
    mig = MigNode(str(tmp_path))
    node = apiserver.create_node(unique("mig"))
    name = node["metadata"]["name"]
    pool = build_pool(scan(mig.root, list_attributes=True, nvml=mig.nvml), node_name=name, driver_name=DRIVER,
                      list_attributes=True, partitions=True)
    assert not pool.rejected, pool.rejected
    sent = render(pool, driver_name=DRIVER, node_name=name, generation=1, node_uid=node["metadata"]["uid"])
    assert sum(len(s["spec"].get("devices", [])) for s in sent) == 1 + 26  # the whole GPU and its placements (the NIC is the uplink)
    for want in sent:
        got = apiserver.create(want)
        assert without_server_fields(got["spec"]) == want["spec"]
    apiserver.delete("Node", name)
