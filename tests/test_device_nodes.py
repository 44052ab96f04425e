"""Device nodes (discovery/devnodes.py): a real node under the root's /dev is the first source
of its type and numbers (a char or a block device, read as the kernel made it), ahead of sysfs
and /proc/devices; a node every device of a kind shares is resolved once a scan, and its
problems are every asking device's. Real nodes need root (mknod); the tests say so."""

from __future__ import annotations

import os
import shutil
import stat

import pytest

from discovery.devnodes import NodeResolver, parse_proc_devices
from discovery.inventory import scan
from discovery.models import Problem
from discovery.sysfs import HostFS
from tests.conftest import profile_root, require_root


def _mknod(path, kind: int, major: int, minor: int) -> None:
    if os.path.lexists(path):
        os.unlink(path)
    os.mknod(path, kind | 0o600, os.makedev(major, minor))


@pytest.mark.root
def test_a_real_node_under_the_root_is_read_as_the_kernel_made_it(tmp_path):
    require_root()
    root = tmp_path / "root"
    shutil.copytree(profile_root("h200-vm"), root, symlinks=True)
    _mknod(root / "dev/nvidia-uvm", stat.S_IFCHR, 510, 3)  # /proc/devices says 238 with minor 0
    nodes = {n.path: n for n in scan(str(root)).by_name()["gpu-0000-00-06-0"].device_nodes}
    uvm = nodes["/dev/nvidia-uvm"]
    assert (uvm.type, uvm.major, uvm.minor, uvm.source) == ("c", 510, 3, "device node")
    assert (nodes["/dev/nvidia-uvm-tools"].major, nodes["/dev/nvidia-uvm-tools"].minor) == (238, 1)  # no real node


@pytest.mark.root
def test_a_block_device_is_a_block_node(tmp_path):
    require_root()
    (tmp_path / "dev").mkdir()
    _mknod(tmp_path / "dev/sdz", stat.S_IFBLK, 8, 17)
    node = NodeResolver(HostFS(str(tmp_path))).resolve("/dev/sdz", [])
    assert (node.type, node.major, node.minor) == ("b", 8, 17)


def test_a_shared_node_is_resolved_once_and_its_problems_are_every_askers():
    calls = []

    def resolve(problems):
        calls.append(1)
        problems.append(Problem(what="/dev/vfio/vfio", reason="missing"))
        return None

    resolver = NodeResolver(HostFS("/nonexistent"))
    first, second = [], []
    assert resolver.shared("vfio", first, resolve) is None and resolver.shared("vfio", second, resolve) is None
    assert len(calls) == 1 and first == second == [Problem(what="/dev/vfio/vfio", reason="missing")]


def test_the_first_major_of_a_name_in_proc_devices_wins():
    assert parse_proc_devices("Character devices:\n 10 misc\n 11 misc\n") == {"misc": 10}


def test_a_dev_file_that_does_not_say_is_a_problem_not_a_guess(tmp_path):
    (tmp_path / "sys/class/drm/renderD128").mkdir(parents=True)
    (tmp_path / "sys/class/drm/renderD128/dev").write_text("226\n")
    fs = HostFS(str(tmp_path))
    problems: list[Problem] = []
    for name in ("renderD128", "renderD129"):
        assert NodeResolver(fs).resolve(f"/dev/dri/{name}", problems, sysfs_dev=fs.path(f"sys/class/drm/{name}/dev")) is None
    assert [(p.what, p.reason) for p in problems] == [
        ("/dev/dri/renderD128", "/sys/class/drm/renderD128/dev: not MAJOR:MINOR: '226'"),
        ("/dev/dri/renderD129", "/sys/class/drm/renderD129/dev: missing")]
