"""Who holds which hardware: one table, derived from the checkpoint's entries (so it is rebuilt
at every start), consulted by every prepare before anything is written, whatever order claims
come in.

A hold is on a PCI function (a GPU, a NIC, a VF, ...) and says how the claim holds it:

- ``exclusive``: a whole device; ``shared``: a share of a multi-allocatable device;
- ``partition``: one partition or MIG instance of the GPU (``unit``: the device name,
  ``mode``: the GPU mode it runs in, None for MIG);
- ``vfio``: the function is bound to vfio-pci and handed to a VM;
- ``netdev``: the function's netdev goes into the claim's pod (prepare/steps/netdev.py).

Two claims conflict on one function when either holds it bound to vfio-pci or its netdev (a
share's pod would lose the interface under it) (the VM's group
must not reach another container, and a GPU must not be unbound under another claim's
partition or MIG instance), when one holds a partition of a GPU the other holds whole or a
share of, when their partitions need different modes, or when both hold the same partition.
Whole devices and shares are the scheduler's to hand out once: two claims holding one device
whole (a stale allocation the kubelet still asks for) are left to it, as upstream drivers do."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Literal

How = Literal["exclusive", "shared", "partition", "vfio", "netdev"]


@dataclass(frozen=True)
class Hold:
    bdf: str
    how: How
    unit: str = ""  # the partition's device name
    mode: str | None = None  # the GPU mode a partition needs

    def describe(self) -> str:
        if self.how == "vfio":
            return "bound to vfio-pci"
        if self.how == "netdev":
            return "with its netdev in the claim's pod"
        if self.how == "partition":
            return f"partition {self.unit}" + (f" in {self.mode}" if self.mode else "")
        return {"exclusive": "as a whole device", "shared": "as a share"}[self.how]


def conflict(a: Hold, b: Hold) -> bool:
    """Two holds of different claims on the same function cannot go together."""
    if "vfio" in (a.how, b.how) or "netdev" in (a.how, b.how):
        return True
    if a.how == b.how == "partition":
        return a.unit == b.unit or (a.mode is not None and b.mode is not None and a.mode != b.mode)
    return "partition" in (a.how, b.how)  # a partition beside the whole device or a share of it


# a claim's holds from its checkpoint entry: (uid, entry) -> holds
Resolver = Callable[[str, dict], Iterable[Hold]]


class Ownership:
    def __init__(self) -> None:
        self._by_bdf: dict[str, dict[str, list[Hold]]] = {}  # bdf -> claim uid -> its holds there
        self.names: dict[str, str] = {}  # uid -> "namespace/name", for messages

    @classmethod
    def of(cls, claims: dict[str, dict], holds_of: Resolver) -> "Ownership":
        """The table of the checkpoint's ``claims`` (prepared and being prepared)."""
        table = cls()
        for uid, entry in claims.items():
            table.take(uid, holds_of(uid, entry), f"{entry.get('namespace')}/{entry.get('name')}")
        return table

    def take(self, uid: str, holds: Iterable[Hold], name: str = "") -> None:
        for h in holds:
            self._by_bdf.setdefault(h.bdf, {}).setdefault(uid, []).append(h)
        self.names.setdefault(uid, name)

    def release(self, uid: str) -> None:
        for owners in self._by_bdf.values():
            owners.pop(uid, None)
        self.names.pop(uid, None)

    def held(self) -> list[str]:
        """Every function some claim holds."""
        return [bdf for bdf, owners in self._by_bdf.items() if any(owners.values())]

    def holders(self, bdf: str, but: str = "") -> dict[str, list[Hold]]:
        """The claims (other than ``but``) holding the function, with their holds."""
        return {u: hs for u, hs in self._by_bdf.get(bdf, {}).items() if u != but and hs}

    def refusal(self, uid: str, holds: Iterable[Hold]) -> str | None:
        """Why ``uid`` cannot take ``holds`` (the first conflict), or None."""
        for h in holds:
            for other, theirs in self.holders(h.bdf, but=uid).items():
                for t in theirs:
                    if conflict(h, t):
                        return (f"{h.bdf} is held by prepared claim {self.names.get(other) or other} ({other}) "
                                f"{t.describe()}; this claim needs it {h.describe()}")
        return None
