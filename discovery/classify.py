"""Which PCI functions we offer, and as what kind: one table, first match wins.

Class code alone is not enough (AMD MI300X is 0x1200 but a GPU; DFL and Alveo FPGAs
are 0x1200 too; NVSwitch and GPU audio share NVIDIA's vendor id), so rules match on
class, vendor/device ids and the class views found below the function.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from functools import lru_cache

from discovery.models import PciFunction

DFL_IDS = frozenset(
    {
        ("8086", d)
        for d in ("09c4", "09c5", "0b2b", "0b2c", "0b30", "0b31", "bcce", "bccf", "bcbd", "bcbf", "bcc0", "bcc1")
    }
    | {("1c2c", "1000"), ("1c2c", "1001")}
)
# Xilinx/AMD Alveo: management PF -> user PF of the same card.
ALVEO_MGMT_TO_USER = {
    "5000": "5001", "5004": "5005", "500c": "500d", "5020": "5021",
    "505c": "505d", "5044": "5045", "d004": "d005",
}  # fmt: skip
ALVEO_IDS = frozenset(ALVEO_MGMT_TO_USER) | frozenset(ALVEO_MGMT_TO_USER.values())


@dataclass(frozen=True)
class Rule:
    """Matches when every given field matches. ``kind`` None means "not offered"."""

    what: str
    kind: str | None
    cls: tuple[int, int] | None = None  # (value, mask) applied to the 24-bit class code
    vendor: str | None = None
    ids: frozenset | None = None  # {(vendor, device)}
    device_in: frozenset | None = None  # device ids (with vendor)
    view: str | None = None  # a class view directory below the function

    def matches(self, class_code: int, vendor: str, device: str, views: frozenset[str]) -> bool:
        if self.cls is not None and (class_code & self.cls[1]) != self.cls[0]:
            return False
        if self.vendor is not None and vendor != self.vendor:
            return False
        if self.ids is not None and (vendor, device) not in self.ids:
            return False
        if self.device_in is not None and device not in self.device_in:
            return False
        if self.view is not None and self.view not in views:
            return False
        return True


_CLASS = 0xFF0000
_SUB = 0xFFFF00

RULES: tuple[Rule, ...] = (
    Rule("Intel DFL FPGA", "fpga", ids=DFL_IDS),
    Rule("Xilinx Alveo FPGA", "fpga", vendor="10ee", device_in=ALVEO_IDS),
    Rule("FPGA with a region", "fpga", view="fpga_region"),
    Rule("Xilinx management PF", "fpga", view="xrt_mgmt"),
    # the virtio device type is in the id, whatever class the function claims (N6001 .3)
    Rule("virtio-net", "nic", ids=frozenset({("1af4", "1000"), ("1af4", "1041")})),
    Rule("host bridge", None, cls=(0x060000, _SUB)),
    Rule("PCI bridge", None, cls=(0x060400, _SUB)),
    Rule("other bridge (ISA, NVSwitch, ...)", None, cls=(0x060000, _CLASS)),
    Rule("BMC display (ASPEED)", None, cls=(0x030000, _CLASS), vendor="1a03"),
    Rule("BMC display (Matrox)", None, cls=(0x030000, _CLASS), vendor="102b"),
    Rule("virtual display (virtio-gpu)", None, cls=(0x030000, _CLASS), vendor="1af4"),
    Rule("virtual display (QEMU VGA)", None, cls=(0x030000, _CLASS), ids=frozenset({("1234", "1111")})),
    Rule("virtual display (VMware SVGA)", None, cls=(0x030000, _CLASS), vendor="15ad"),
    Rule("virtual display (QXL)", None, cls=(0x030000, _CLASS), ids=frozenset({("1b36", "0100")})),
    Rule("audio function", None, cls=(0x040000, _CLASS)),
    Rule("AMD Instinct GPU", "gpu", cls=(0x120000, _CLASS), vendor="1002"),
    Rule("GPU (display controller)", "gpu", cls=(0x030000, _CLASS)),
    Rule("Ethernet NIC", "nic", cls=(0x020000, _SUB)),
    Rule("InfiniBand NIC", "nic", cls=(0x020700, _SUB)),
    Rule("fabric NIC", "nic", cls=(0x020800, _SUB)),
    Rule("other network controller (Wi-Fi)", None, cls=(0x020000, _CLASS)),
    Rule("processing accelerator", "accelerator", cls=(0x120000, _CLASS)),
    Rule("co-processor (e.g. QAT)", "accelerator", cls=(0x0B4000, _SUB)),
    Rule("storage controller", None, cls=(0x010000, _CLASS)),
)


_RULE_VIEWS = frozenset(r.view for r in RULES if r.view is not None)


def classify(fn: PciFunction, views: Collection[str]) -> tuple[str | None, str]:
    """-> (kind or None, why). ``views``: names of the entries below the function dir."""
    return _classify(fn.class_code, fn.vendor_id, fn.device_id, frozenset(views & _RULE_VIEWS))


@lru_cache(maxsize=1024)
def _classify(class_code: int, vendor: str, device: str, views: frozenset[str]) -> tuple[str | None, str]:
    """By what the rules look at only, so that a node's few distinct functions (the 2,048 VFs
    of a large node are four) go through the table once each."""
    for rule in RULES:
        if rule.matches(class_code, vendor, device, views):
            return rule.kind, rule.what
    return None, f"class 0x{class_code:06x} is not a device class we offer"
