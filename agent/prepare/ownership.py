"""Who holds which hardware: one table, derived from the checkpoint's entries (so it is rebuilt
at every start), consulted by every prepare before anything is written, whatever order claims
come in.

A hold is on a PCI function (a GPU, a NIC, a VF, ...) and says how the claim holds it:

- ``exclusive``: a whole device; ``shared``: a share of a multi-allocatable device;
- ``partition``: one partition or MIG instance of the GPU (``unit``: the device name,
  ``mode``: the GPU mode it runs in, None for MIG);
- ``vfio``: the function is bound to vfio-pci and handed to a VM, or it is in the IOMMU group of
  one that is (``unit``: that group; the VM has the whole group);
- ``netdev``: the function's netdev goes into the claim's pod (prepare/steps/netdev.py);
- and ``admin`` marks any of the first three taken with DRA admin access (``adminAccess: true``).

Two claims conflict on one function when either holds it bound to vfio-pci (the VM's group
must not reach another container, and a GPU must not be unbound under another claim's
partition or MIG instance) or with its netdev in its pod (another claim's users, admin access
included, would lose the interface under them), when their partitions need different modes (a GPU runs in one),
and, unless one of them has admin access, when one holds it whole and the other in any way
(a stale allocation the kubelet still asks for must not hand a device to a second container),
when one holds a partition of a GPU the other holds whole or a share of, or when both hold
the same partition. Shares of one device go together as long as what they consume fits the
capacities the device is published with (a share of a device whose kind is not shared holds
it whole). Admin access is for monitoring and management beside the device's ordinary users
(upstream it "ignores all ordinary claims to the device with respect to access modes and any
resource allocations"), so it reaches a device whoever holds it and consumes nothing, but
never one bound to vfio-pci (the device nodes it would watch are gone and the group is the
VM's), nor does it let a GPU switch modes."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Iterable, Literal

from agent.quantity import plain

How = Literal["exclusive", "shared", "partition", "vfio", "netdev"]


@dataclass(frozen=True)
class Hold:
    bdf: str
    how: How
    unit: str = ""  # the device's name (a partition's: the partition's)
    mode: str | None = None  # the GPU mode a partition needs
    admin: bool = False  # taken with DRA admin access
    consumed: tuple[tuple[str, Fraction], ...] = ()  # a share's consumedCapacity
    capacity: tuple[tuple[str, Fraction], ...] = ()  # a shared device's capacities, as published

    def describe(self) -> str:
        if self.how == "vfio":  # the function itself, or a member of the group (``unit``) a VM has
            return f"with {self.unit} bound to vfio-pci" if self.unit else "bound to vfio-pci"
        if self.how == "netdev":
            return "with its netdev in the claim's pod"
        if self.how == "partition":
            what = f"partition {self.unit}" + (f" in {self.mode}" if self.mode else "")
        else:
            what = {"exclusive": "as a whole device", "shared": "as a share"}[self.how]
        return what + (" with admin access" if self.admin else "")


def conflict(a: Hold, b: Hold) -> bool:
    """Two holds of different claims on the same function cannot go together."""
    if "vfio" in (a.how, b.how) or "netdev" in (a.how, b.how):
        return True
    if a.how == b.how == "partition" and a.mode is not None and b.mode is not None and a.mode != b.mode:
        return True  # one GPU, one mode: admin access or not
    if a.admin or b.admin:
        return False
    if a.how == b.how == "partition":
        return a.unit == b.unit
    return not a.how == b.how == "shared"  # whole beside anything; a partition beside the whole GPU or a share


def entry_name(entry: dict) -> str:
    """``namespace/name`` of a checkpoint entry; empty for an adopted claim's before the kubelet's
    re-prepare fills it in (prepare/recovery.py: its CDI spec names no claim)."""
    return f"{entry.get('namespace')}/{entry.get('name')}" if entry.get("name") else ""


def named(uid: str, name: str) -> str:
    """A claim as messages name it: ``namespace/name (uid)``, an adopted one by its UID and as such."""
    return f"{name} ({uid})" if name else f"{uid} (adopted from its CDI spec, not prepared again by the kubelet yet)"


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
            table.take(uid, holds_of(uid, entry), entry_name(entry))
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
        holds = list(holds)
        for h in holds:
            for other, theirs in self.holders(h.bdf, but=uid).items():
                for t in theirs:
                    if conflict(h, t):
                        what = f"{h.unit} ({h.bdf})" if h.unit and h.how not in ("partition", "vfio") else h.bdf
                        return (f"{what} is held by prepared claim {self._name(other)} "
                                f"{t.describe()}; this claim needs it {h.describe()}")
        return self._beyond_capacity(uid, holds)

    def _name(self, uid: str) -> str:
        return named(uid, self.names.get(uid, ""))

    def _beyond_capacity(self, uid: str, holds: list[Hold]) -> str | None:
        """Why the shares ``uid`` takes would consume more of a device than it has, or None.
        Admin access consumes nothing (it ignores resource allocations upstream)."""

        def counted(hs: Iterable[Hold], bdf: str) -> list[Hold]:
            return [t for t in hs if t.bdf == bdf and t.how == "shared" and not t.admin]

        for h in holds:
            if h.how != "shared" or h.admin or not h.capacity:
                continue
            theirs = {u: counted(ts, h.bdf) for u, ts in self.holders(h.bdf, but=uid).items()}
            every = counted(holds, h.bdf) + [t for ts in theirs.values() for t in ts]
            for name, total in h.capacity:
                used = sum(dict(t.consumed).get(name, 0) for t in every)
                if used > total:
                    by = ", ".join(self._name(u) for u, ts in theirs.items() if ts) or "no other claim"
                    return (f"{h.unit} ({h.bdf}): its shares would consume {plain(used)} of {name}, more than its "
                            f"{plain(total)} (shares held by {by})")
        return None
