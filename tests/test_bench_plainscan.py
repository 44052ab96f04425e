"""The plain scan ``make bench`` measures the scan's Python against reads what the scan reads
and finds what it finds, on a node of the large node's shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from agent.tools.fstrace import plain_op, replay, replay_plan, traced, traced_scan
from bench.plainscan import plain_scan
from discovery.inventory import scan
from tests.conftest import REPO

sys.path.insert(0, os.path.join(REPO, "fixtures"))
from generate import build_tree, large_node_spec  # noqa: E402


@pytest.fixture(scope="module")
def small_node(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("node"))
    build_tree(large_node_spec(n_pfs=4, vfs_per_pf=4, numa_nodes=2), root)
    return root


def test_the_plain_scan_finds_what_the_scan_finds(small_node):
    functions = {f[0]: f for f in plain_scan(small_node)}
    inventory = scan(small_node)
    assert set(functions) == {d.pci.bdf for d in inventory.devices} | {s.bdf for s in inventory.skipped}
    kinds = set()
    for dev in inventory.devices:
        bdf, real, vendor, device, cls, driver, numa, group, speed, width, physfn, netdevs, vfio = functions[dev.pci.bdf]
        fn = dev.pci
        assert (real, vendor, device, cls, driver, numa, group) == (
            small_node + fn.sysfs_path, fn.vendor_id, fn.device_id, fn.class_code, fn.driver, fn.numa_node, fn.iommu_group)  # fmt: skip
        assert (speed, width, physfn) == (fn.link.max_speed, fn.link.max_width, fn.physfn)
        if dev.nic is not None:
            assert netdevs == tuple((i.name, i.mac, i.mtu, i.phys_port_name, i.speed_mbps) for i in dev.nic.interfaces)
            kinds.add("netdev" if netdevs else "no netdev")
        if driver == "vfio-pci":
            node = next(n for n in dev.device_nodes if n.path == f"/dev/vfio/{group}")
            assert vfio == (node.major, node.minor)
            kinds.add("vfio")
        kinds.add("vf" if physfn else "pf")
    assert {"netdev", "vfio", "vf", "pf"} <= kinds


def test_the_plain_scan_reads_the_files_the_scan_reads(small_node):
    """Its operations are the scan's but for the ones it leaves out (type checks first, GPU
    and RDMA details) and the listings it makes without entry types."""
    result, ops = traced(plain_scan, small_node)
    assert result == plain_scan(small_node)
    opened = {path for op, path in ops if plain_op(op) == "open" and os.path.exists(path)}  # not the absent ones it tried
    scan_opened = {path for op, path in traced_scan(small_node)[1] if plain_op(op) == "open"}
    assert opened <= scan_opened
    assert len(opened) > 0.9 * len(scan_opened)
    replay(replay_plan(ops))


def test_the_plain_scan_prints_what_it_finds(small_node):
    """``bench_cli`` times it as a process, printing indented JSON as ``sysdra scan -o json`` does."""
    script = os.path.join(REPO, "bench", "plainscan.py")
    out = subprocess.run([sys.executable, script, small_node], check=True, capture_output=True, text=True).stdout
    assert json.loads(out) == json.loads(json.dumps(plain_scan(small_node)))
