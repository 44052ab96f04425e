"""The minimal Python reader ``bench_cli`` compares ``sysdra scan`` with: what ``lspci -vmm``
prints, read from sysfs in the plainest Python (no checks, no models), one line per function.

Usage: ``python bench/minreader.py ROOT``."""

import os
import sys

FILES = ("vendor", "device", "class", "revision", "subsystem_vendor", "subsystem_device", "numa_node")


def main(root: str) -> None:
    bus = os.path.join(root, "sys/bus/pci/devices")
    out = []
    for bdf in sorted(os.listdir(bus)):
        d = os.path.join(bus, bdf)
        values = [bdf]
        for name in FILES:
            try:
                with open(os.path.join(d, name), "rb") as f:
                    values.append(f.read().decode().strip())
            except OSError:
                values.append("-")
        try:
            values.append(os.path.basename(os.readlink(os.path.join(d, "driver"))))
        except OSError:
            values.append("-")
        out.append(" ".join(values))
    sys.stdout.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
