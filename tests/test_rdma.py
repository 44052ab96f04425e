"""RDMA devices: which uverbs node is whose (discovery/nic.py); network namespaces
(agent/prepare/rdma.py, the netdev step's RDMA decision).

This machine has no RDMA hardware and no ib_core: the RDMA netlink messages are checked byte for
byte against the kernel's uapi (include/uapi/rdma/rdma_netlink.h: RDMA_NL_NLDEV 5,
RDMA_NLDEV_CMD_SET 2, RDMA_NLDEV_ATTR_DEV_INDEX 1, RDMA_NLDEV_NET_NS_FD 68), the answer parser on
hand-made datagrams, and the mode decision on fixture trees carrying ib_core's ``netns_mode``.
The move itself is not run here.
"""

from __future__ import annotations

import os
import shutil
import struct

import pytest

from agent.prepare import rdma
from agent.prepare.driver import Driver
from agent.prepare.rtnl import LinkError
from agent.prepare import cdifiles
from discovery.inventory import scan
from tests.conftest import profile_root
from tests.kubelet_standin import claim, settings_for

NIC = "nic-0000-3c-00-0"  # server-2s-gpu-nic: enp60s0np0 with RDMA device mlx5_0 (uverbs0)
UID = "00000000-0000-4000-8000-00000000ab01"


@pytest.mark.parametrize("value, mode", [("Y", "shared"), ("1", "shared"), ("N", "exclusive"), ("0", "exclusive")])
def test_the_mode_is_ib_cores_netns_mode_under_the_root(tmp_path, value, mode):
    os.makedirs(tmp_path / os.path.dirname(rdma.NETNS_MODE))
    (tmp_path / rdma.NETNS_MODE).write_text(value + "\n")
    assert rdma.netns_mode(str(tmp_path)) == mode


def test_no_ib_core_is_no_mode(tmp_path):
    assert rdma.netns_mode(str(tmp_path)) is None


def test_the_set_netns_message_is_the_kernels_layout():
    msg = rdma.set_netns_message(index=3, netns_fd=17, seq=9)
    expect = bytes.fromhex(
        "20000000"  # length 32: a 16-byte header and two 8-byte attributes
        "0214"  # type (RDMA_NL_NLDEV << 10) + RDMA_NLDEV_CMD_SET = 0x1402
        "0500"  # NLM_F_REQUEST | NLM_F_ACK
        "09000000" "00000000"  # seq, port
        "0800" "0100" "03000000"  # RDMA_NLDEV_ATTR_DEV_INDEX = 3
        "0800" "4400" "11000000")  # RDMA_NLDEV_NET_NS_FD (68) = 17
    assert msg == expect
    assert rdma.get_dump_message(seq=2)[4:8] == bytes.fromhex("0114" "0103")  # CMD_GET, REQUEST | DUMP


def _device(index: int, name: str) -> bytes:
    attrs = struct.pack("=HHI", 8, rdma.RDMA_NLDEV_ATTR_DEV_INDEX, index)
    raw = name.encode() + b"\0"
    attrs += struct.pack("=HH", 4 + len(raw), rdma.RDMA_NLDEV_ATTR_DEV_NAME) + raw + b"\0" * (-(4 + len(raw)) % 4)
    attrs += struct.pack("=HHQ", 12, 4, 0)  # an attribute we do not read (capability flags)
    return struct.pack("=IHHII", 16 + len(attrs), rdma.nldev_type(rdma.RDMA_NLDEV_CMD_GET), 2, 1, 0) + attrs


def test_the_dump_answer_gives_devices_by_name():
    done = struct.pack("=IHHII", 20, rdma.NLMSG_DONE, 2, 1, 0) + b"\0" * 4
    assert rdma.parse_devices(_device(0, "mlx5_0") + _device(1, "mlx5_1")) == ({"mlx5_0": 0, "mlx5_1": 1}, False)
    assert rdma.parse_devices(_device(7, "rxe0") + done) == ({"rxe0": 7}, True)
    error = struct.pack("=IHHII", 36, rdma.NLMSG_ERROR, 0, 1, 0) + struct.pack("=i", -1) + b"\0" * 16
    with pytest.raises(LinkError, match="Operation not permitted"):
        rdma.parse_devices(error)


@pytest.fixture
def node(tmp_path):
    root = str(tmp_path / "root")
    shutil.copytree(profile_root("server-2s-gpu-nic"), root, symlinks=True)
    return root


def prepared(tmp_path, root: str, mode: str | None) -> tuple[dict, list[str]]:
    if mode is not None:
        os.makedirs(os.path.join(root, os.path.dirname(rdma.NETNS_MODE)), exist_ok=True)
        with open(os.path.join(root, rdma.NETNS_MODE), "w") as f:
            f.write(mode)
    s = settings_for(str(tmp_path / mode if mode else tmp_path / "none"), root=root)
    inv = scan(root)
    d = Driver(s, lambda: inv)
    assert d.prepare_claims([claim("nic", [("net1", NIC)], uid=UID)])[UID].error is None
    spec = cdifiles.read_spec(cdifiles.claim_spec_path(s.cdi_dir, s.driver_name, UID))
    nodes = [n["path"] for dev in spec["devices"] for n in dev["containerEdits"].get("deviceNodes", [])]
    return d.checkpoint.claims[UID]["netdevs"][0], nodes


def test_exclusive_mode_moves_the_rdma_device_with_the_netdev(tmp_path, node):
    move, nodes = prepared(tmp_path, node, "N")
    assert move["rdma"] == "mlx5_0"
    assert "/dev/infiniband/uverbs0" in nodes  # the pod opens it in its namespace, where the device is


@pytest.mark.parametrize("mode", ["Y", None])
def test_shared_mode_injects_only_the_char_devices(tmp_path, node, mode):
    move, nodes = prepared(tmp_path, node, mode)
    assert "rdma" not in move
    assert "/dev/infiniband/uverbs0" in nodes


def _second_rdma_device(root: str) -> None:
    """NIC's function gets a second RDMA device, mlx5_4, whose node is uverbs0; mlx5_0's is now
    uverbs7: neither the names' order nor the nodes' says which node is whose, ``ibdev`` does."""
    fn = os.path.realpath(os.path.join(root, "sys/bus/pci/devices/0000:3c:00.0"))
    shutil.copytree(os.path.join(fn, "infiniband/mlx5_0"), os.path.join(fn, "infiniband/mlx5_4"), symlinks=True)
    verbs = os.path.join(fn, "infiniband_verbs")
    shutil.copytree(os.path.join(verbs, "uverbs0"), os.path.join(verbs, "uverbs7"), symlinks=True)
    for name, text in (("uverbs0/ibdev", "mlx5_4"), ("uverbs7/ibdev", "mlx5_0"), ("uverbs7/dev", "231:199"),
                       ("uverbs7/uevent", "MAJOR=231\nMINOR=199\nDEVNAME=infiniband/uverbs7")):
        with open(os.path.join(verbs, name), "w") as f:
            f.write(text + "\n")
    open(os.path.join(root, "dev/infiniband/uverbs7"), "w").close()


def test_each_rdma_device_goes_with_its_own_uverbs_node(tmp_path, node):
    """Which ``/dev/infiniband/uverbsN`` is an RDMA device's is the kernel's
    ``infiniband_verbs/uverbsN/ibdev``, never an order (the fixture's mlx5_N/uverbsN are not in
    BDF order either); a claimed NIC's CDI spec has its own function's nodes and no other's."""
    _second_rdma_device(node)
    inv = scan(node)
    nics = {name: inv.by_name()[name] for name in (NIC, "nic-0000-1a-00-0")}
    assert {r.name: r.uverbs for r in nics[NIC].nic.rdma} == {"mlx5_0": "uverbs7", "mlx5_4": "uverbs0"}
    assert {r.name: r.uverbs for r in nics["nic-0000-1a-00-0"].nic.rdma} == {"mlx5_1": "uverbs1"}
    d = Driver(settings_for(str(tmp_path), root=node), lambda: inv)
    for i, (name, want) in enumerate({NIC: [(0, 192), (7, 199)], "nic-0000-1a-00-0": [(1, 193)]}.items()):
        uid = UID[:-1] + str(i)
        assert d.prepare_claims([claim(f"nic{i}", [("net1", name)], uid=uid)])[uid].error is None
        spec = cdifiles.read_spec(cdifiles.claim_spec_path(d.settings.cdi_dir, d.settings.driver_name, uid))
        nodes = [(n["path"], n["major"], n["minor"]) for dev in spec["devices"]
                 for n in dev["containerEdits"].get("deviceNodes", [])]
        assert nodes == [(f"/dev/infiniband/uverbs{n}", 231, minor) for n, minor in want], name
