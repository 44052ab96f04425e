"""The netdev records of a checkpoint as the NRI plugin reads and changes them under the
plugin's lock (agent/nri/netdev.py), and the tests on a record or an entry it makes."""

from __future__ import annotations

import os

from agent.nri.plugin import Pod
from agent.prepare import netmove
from agent.prepare.checkpoint import Checkpoint
from agent.prepare.checkpoint_format import COMPLETED
from agent.prepare.records import NetdevMove


class Claims:
    """The checkpoint as loaded under the lock, and the netdev records of its prepared claims."""

    def __init__(self, cp: Checkpoint):
        self.cp = cp
        self.changed: set[str] = set()
        self.saved = False

    def moves(self) -> list[tuple[str, int, NetdevMove]]:
        """(claim UID, index in its ``netdevs``, record) of every prepared claim."""
        out = []
        for uid, entry in self.cp.claims.items():
            if entry.get("state") == COMPLETED and uid not in self.cp.foreign:
                out += [(uid, i, NetdevMove.model_validate(r)) for i, r in enumerate(entry.get("netdevs") or ())]
        return out

    def put(self, uid: str, index: int, move: NetdevMove) -> None:
        entry = self.cp.claims[uid] = dict(self.cp.claims[uid])  # entries are replaced, never changed in place
        netdevs = list(entry["netdevs"])
        netdevs[index] = move.dump()
        entry["netdevs"] = netdevs
        self.changed.add(uid)

    def refusal(self, pod: Pod) -> str | None:
        """Why ``pod`` cannot have its claims' netdevs from these records whatever the kernel has,
        or None: a claim's entry that is not valid (never half-used), one whose records were lost,
        one a newer sysdra prepared (its netdevs that one's to move)."""
        for uid, (entry, why) in self.cp.rejected.items():
            if isinstance(entry, dict) and isinstance(entry.get("pods"), list) and pod.uid in entry["pods"]:
                return (f"claim {uid} of pod {pod.namespace}/{pod.name} has a checkpoint entry that is not valid "
                        f"({why}): its netdevs are not moved")
        for uid, entry in self.cp.claims.items():
            if lost_for(entry, pod):
                return (f"claim {uid} of pod {pod.namespace}/{pod.name} lost its netdev records ({entry['netdevsLost']}): "
                        "where its netdevs are cannot be told, so none is moved; the pod starts once the claim is "
                        "prepared anew (delete the pod)")
            if uid in self.cp.foreign and for_pod(entry, pod) and not all(
                    in_sandbox(NetdevMove.model_validate(m), pod.id) for m in entry.get("netdevs") or ()):
                return (f"claim {uid} of pod {pod.namespace}/{pod.name} was prepared by a newer sysdra (fields this one "
                        f"does not know: {self.cp.foreign[uid].fields}): that one moves its netdevs")
        return None

    def save(self) -> None:
        if self.changed:
            self.cp.save(changed=self.changed)
            self.changed, self.saved = set(), True


SEEN = ("sandbox", "netns", "podRef", "mac", "index", "parent", "hostMtu", "ipamConfig")  # of one stay in a pod: anew for the next


def for_pod(entry: dict, pod: Pod) -> bool:
    pods = entry.get("pods")
    return isinstance(pods, list) and pod.uid in pods


def in_sandbox(move: NetdevMove, sandbox: str) -> bool:
    return move.state == "in-pod" and move.sandbox == sandbox and netmove.in_pod(move)


def runs(move: NetdevMove, pods) -> bool:
    """``move``'s sandbox still runs: the runtime lists it (``pods``, by ID) and its network namespace
    is there. A stopped sandbox stays listed until it is removed, its namespace gone (containerd
    removes it at the stop, even one whose StopPodSandbox failed, and lists the sandbox without it)."""
    return move.sandbox in pods and move.netns is not None and os.path.exists(move.netns)


def lost_for(entry: dict, pod: Pod) -> bool:
    """An adopted claim of ``pod`` whose netdev records were lost with a damaged checkpoint."""
    return bool(entry.get("netdevsLost")) and for_pod(entry, pod)


def away(raw: dict) -> bool:
    """A record (as saved) says its netdev is in a pod's namespace, or on its way back."""
    return isinstance(raw, dict) and raw.get("state") in ("in-pod", "returning")


def away_in(raw: dict, sandbox: str) -> bool:
    """A record (as saved) says its netdev may be in ``sandbox``."""
    return isinstance(raw, dict) and raw.get("state", "planned") != "planned" and raw.get("sandbox") == sandbox


def not_in(raw: dict, sandbox: str) -> bool:
    """A record (as saved) does not say its netdev is in ``sandbox``: on the host, in another (maybe
    stopped) sandbox, or a move into it that began and did not end (a crash, then a Synchronize that
    could not finish it): the sandbox's containers wait for it."""
    return not (isinstance(raw, dict) and raw.get("state") == "in-pod" and raw.get("sandbox") == sandbox)
