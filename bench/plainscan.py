"""The plainest Python scan of a node, the measuring stick ``bench_scan`` holds the scan's
ratio goal against: what ``discovery.scan`` reads of each PCI function (its ``uevent``, its
value files and links, through its directory held open and listed once), of each netdev
and of each VFIO group, parsed into one tuple per function, with no checks, no problems,
no records and no attributes. ``bench_scan`` replays its file operations as it replays the
scan's, so its ratio to that replay is what Python itself costs above the system calls of
such a scan on this machine.

It reads a tree of the shape the generated large node has and nothing else: GPU, FPGA and
RDMA details (~1 % of that node's operations) are left out, and any error ends it.

``python bench/plainscan.py ROOT`` prints the functions as indented JSON, as ``sysdra scan
-o json`` prints its devices: ``bench_cli`` times that process beside lspci."""

from __future__ import annotations

import os
import stat
import sys

_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
VALUE_FILES = ("uevent", "numa_node", "max_link_speed", "max_link_width", "sriov_totalvfs", "sriov_numvfs")
NETDEV_FILES = ("address", "mtu", "phys_port_name", "speed")


def _text(path: str, dir_fd: int | None = None) -> str:
    fd = os.open(path, _FLAGS, dir_fd=dir_fd)
    try:
        return os.read(fd, 4097).decode().strip()
    finally:
        os.close(fd)


def _netdev(path: str, name: str) -> tuple:
    values = {}
    for attr in NETDEV_FILES:
        try:
            values[attr] = _text(f"{path}/{attr}")
        except FileNotFoundError:
            pass
    mtu, speed = values.get("mtu"), values.get("speed")
    return (name, values.get("address"), mtu and int(mtu), values.get("phys_port_name"), speed and int(speed))


def _vfio_node(root: str, group: int) -> tuple[int, int]:
    """major:minor of the group's node: the device node's own, else its sysfs ``dev`` file's."""
    try:
        node = os.stat(f"{root}/dev/vfio/{group}")
        if stat.S_ISCHR(node.st_mode):
            return os.major(node.st_rdev), os.minor(node.st_rdev)
    except FileNotFoundError:
        pass
    major, minor = _text(f"{root}/sys/class/vfio/{group}/dev").split(":")
    return int(major), int(minor)


def plain_scan(root: str) -> list[tuple]:
    """(address, sysfs path, vendor, device, class, driver, NUMA node, IOMMU group, link speed,
    link width, PF address, netdevs, VFIO node) of each PCI function under ``root``."""
    bus, sys_dir = f"{root}/sys/bus/pci/devices", f"{root}/sys/"
    functions = []
    for bdf in sorted(os.listdir(bus)):
        real = sys_dir + os.readlink(f"{bus}/{bdf}").removeprefix("../../../")
        fd = os.open(real, _DIR_FLAGS)
        try:
            with os.scandir(fd) as listing:
                names = {entry.name for entry in listing}
            values = {name: _text(name, dir_fd=fd) for name in VALUE_FILES if name in names}
            uevent = dict(line.split("=", 1) for line in values["uevent"].splitlines())
            driver = uevent.get("DRIVER")
            if driver is None and "driver" in names:
                driver = os.readlink("driver", dir_fd=fd).rpartition("/")[2]
            physfn = os.readlink("physfn", dir_fd=fd).rpartition("/")[2] if "physfn" in names else None
            group = int(os.readlink("iommu_group", dir_fd=fd).rpartition("/")[2]) if "iommu_group" in names else None
        finally:
            os.close(fd)
        netdevs = ()
        if "net" in names and driver != "vfio-pci":
            netdevs = tuple(_netdev(f"{real}/net/{name}", name) for name in sorted(os.listdir(f"{real}/net")))
        vendor, device = uevent["PCI_ID"].lower().split(":")
        numa, width = values.get("numa_node"), values.get("max_link_width")
        functions.append((
            bdf, real, vendor, device, int(uevent["PCI_CLASS"], 16), driver, numa and int(numa), group,
            values.get("max_link_speed"), width and int(width), physfn, netdevs,
            _vfio_node(root, group) if driver == "vfio-pci" and group is not None else None,
        ))  # fmt: skip
    return functions


def main(root: str) -> None:
    import orjson

    sys.stdout.buffer.write(orjson.dumps(plain_scan(root), option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE))


if __name__ == "__main__":
    main(sys.argv[1])
