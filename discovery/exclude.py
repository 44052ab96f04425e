"""Devices the node's operator leaves out (``exclude_devices``, docs/operations.md): never in the
slices, nor in health, status or a claim's reach; ``sysdra scan`` lists them as not offered, with
the rule. Each rule is ``pci:<glob>`` (the function's PCI address, ``0000:3b:00.*``),
``interface:<glob>`` (a NIC's netdev name, ``ens1f*``: any of its netdevs) or ``kind:<kind>``
(``gpu``, ``nic``, ``fpga``, ``accelerator``). Globs are fnmatch's (``*``, ``?``, ``[...]``), case
sensitive. Pure: the scan applies them (discovery/inventory.py)."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from dataclasses import dataclass

from discovery.models import KINDS

_PCI_GLOB = re.compile(r"[0-9a-f:.*?\[\]!-]{1,32}")
_IF_GLOB = re.compile(r"[^/\s]{1,64}")
MAX_RULES = 256


@dataclass(frozen=True)
class Exclusions:
    rules: tuple[tuple[str, str], ...] = ()  # (what, pattern): what is pci, interface or kind

    @classmethod
    def parse(cls, entries: Iterable[str]) -> Exclusions:
        """Rules from their text; ValueError naming the first bad one."""
        rules = []
        for entry in entries:
            what, sep, pattern = str(entry).partition(":")
            what = what.strip().lower()
            pattern = pattern.strip()
            if not sep or what not in ("pci", "interface", "kind"):
                raise ValueError(f"{entry!r} is not pci:<glob>, interface:<glob> or kind:<kind>")
            if what == "pci" and not _PCI_GLOB.fullmatch(pattern := pattern.lower()):
                raise ValueError(f"{entry!r}: not a glob of PCI addresses (hex digits, ':', '.', '*', '?', '[...]')")
            if what == "interface" and not _IF_GLOB.fullmatch(pattern):
                raise ValueError(f"{entry!r}: not a glob of interface names (no '/' or blanks, at most 64 characters)")
            if what == "kind" and pattern not in KINDS:
                raise ValueError(f"{entry!r}: {pattern!r} is not a device kind ({', '.join(KINDS)})")
            rules.append((what, pattern))
        if len(rules) > MAX_RULES:
            raise ValueError(f"{len(rules)} rules, at most {MAX_RULES}")
        return cls(tuple(dict.fromkeys(rules)))

    def __bool__(self) -> bool:
        return bool(self.rules)

    def function(self, bdf: str, kind: str | None) -> str | None:
        """The rule that leaves out the function ``bdf`` (offered as ``kind``), or None."""
        for what, pattern in self.rules:
            if (what == "pci" and fnmatch.fnmatchcase(bdf, pattern)) or (what == "kind" and kind == pattern):
                return f"{what}:{pattern}"
        return None

    def interfaces(self, names: Iterable[str]) -> str | None:
        """The rule that leaves out a NIC with netdevs ``names``, or None."""
        names = list(names)
        for what, pattern in self.rules:
            if what == "interface" and any(fnmatch.fnmatchcase(name, pattern) for name in names):
                return f"{what}:{pattern}"
        return None
