"""A claim's netdevs as a step (docs/networking.md): a whole NIC's or a VF's netdev is the
claim's from prepare to unprepare, and goes into the claim's pod while the pod's sandbox runs.

Record (``netdevs``): one ``NetdevMove`` per netdev (prepare/records.py): its host name, its name
in the pod (the ``NicConfig``'s ``interfaceName``, else the request's), the ``NicConfig``'s MTU,
addresses and routes, the RDMA device that moves with it in exclusive RDMA netns mode, and where
it is. Prepare plans and saves it (state ``planned``) and changes nothing on the host: the pod's
network namespace does not exist yet. The NRI plugin (agent/nri/netdev.py) moves it at
RunPodSandbox and back at Stop/RemovePodSandbox, saving the record in the claim's entry before
and after each kernel change. ``undo`` (unprepare, a failed or interrupted prepare) brings back
whatever a record says may be away, before the claim leaves the checkpoint; the runtime's
Synchronize after a crash or restart finishes or undoes what records say is under way, and
``recover`` gives back a netdev whose namespace is gone (a reboot, a runtime that forgot its pods).
A netdev the host uses (an address, a bond or bridge port: prepare/hostuse.py) is refused at
prepare unless the node and the claim's ``NicConfig`` allow it (``moves``: the NRI plugin is on;
without it nothing moves and nothing is refused); the record keeps the claim's say, and every
move from the host checks again (the host may have taken the netdev since, agent/nri/netdev.py).
"""

from __future__ import annotations

import logging
from typing import Callable

from agent.prepare import hostuse, netmove, rdma, rtnl
from agent.prepare.allocation import ClaimFailed
from agent.prepare.claimconfig import NicConfig, VfioConfig, config_for
from agent.prepare.ipam import Ipam, IpamError
from agent.prepare.netdevs import IFNAME_ROOM, group_consumers, valid_name
from agent.prepare.ownership import Hold, Ownership
from agent.prepare.records import NetdevMove
from agent.prepare.steps import Planned, RecordsOf, Undone
from discovery.models import Device
from discovery.nic import hides_netdevs
from discovery.pci import PciError, read_function
from discovery.sysfs import HostFS
from discovery.vfio import is_vfio_driver

log = logging.getLogger(__name__)
Record = tuple[NetdevMove, ...]


class NetdevStep(RecordsOf):
    model = NetdevMove
    key = "netdevs"
    what = "netdev"  # the stage named in a claim error

    def __init__(self, settings, host_netns: Callable[[], str]):
        self.root = settings.root
        self.host_netns = host_netns  # the host's network namespace (a path), asked when needed
        self.moves, self.allow_host_in_use = bool(settings.nri_socket), settings.allow_host_in_use_nics
        self.ipam = Ipam.of(settings)  # the node's IPAM pools (a lease per pod sandbox, given back here too)

    def plan(self, planned: Planned, owners: Ownership) -> Record | None:
        mode = None
        out: list[NetdevMove] = []
        group = group_consumers(planned.claim) if self.moves else None
        for r in planned.results:
            dev = planned.names.get(r.device)
            nic = getattr(dev, "nic", None)
            if r.share_id or nic is None or not nic.interfaces or any(m.device == r.device for m in out):
                continue  # a share of a NIC cannot be in one pod
            cfg = config_for(planned.configs, r.request, dev.kind, dev.name)
            if isinstance(cfg, VfioConfig) or not valid_name(host := nic.interfaces[0].name):
                continue
            if group:  # before anything of the host's is read
                raise ClaimFailed(f"the claim is reserved for {group}, not for pods (DRAWorkloadResourceClaims): its NIC's "
                                  "netdev goes into one pod, and which pods a group has cannot be told at a pod's "
                                  "sandbox: give each pod a claim of its own (docs/networking.md)")
            cfg = cfg if isinstance(cfg, NicConfig) else None
            if nic.rdma and mode is None:
                mode = rdma.netns_mode(self.root)
            out.append(NetdevMove(device=r.device, request=r.request, bdf=dev.pci.bdf, host=host, pod=self._name(r.request, host, cfg, out),
                                  mtu=cfg.mtu if cfg else None, addresses=list(cfg.addresses) if cfg else [],
                                  routes=list(cfg.routes) if cfg else [],
                                  rdma=nic.rdma[0].name if nic.rdma and mode == "exclusive" else None,
                                  allowHostInUse=bool(cfg and cfg.allowHostInUse), ipamPool=cfg.ipamPool if cfg else None))
            if self.moves and cfg and cfg.ipamPool and (why := self.ipam.refusal(cfg.ipamPool)):
                raise ClaimFailed(f"request {r.request!r}: {why}")
            self._refuse_host_used(out[-1], cfg)
        return tuple(out) or None

    def _refuse_host_used(self, move: NetdevMove, cfg: NicConfig | None) -> None:
        """ClaimFailed for a netdev the host uses, unless the node and the claim allow it. Read in
        the namespace the move takes it from (``host_netns``: the init's, else the agent's own,
        which is the host's under systemd and with hostNetwork): a netdev not there cannot be
        moved (its sandbox fails), so the host cannot lose it to the move."""
        if self.moves and (why := hostuse.refusal(self.host_netns, {move.host: move.bdf}, self.allow_host_in_use,
                                                  bool(cfg and cfg.allowHostInUse), "moved into a pod", "NicConfig")):
            raise ClaimFailed(f"request {move.request!r}: {move.device}: {why}")

    @staticmethod
    def _name(request: str, host: str, cfg: NicConfig | None, taken: list[NetdevMove]) -> str:
        """The name in the pod: the config's (two netdevs under one name are the claim's error),
        else the request's (numbered from the second device of a request), else the host's."""
        names = {m.pod for m in taken}
        if cfg is not None and cfg.interfaceName:
            if cfg.interfaceName in names:
                raise ClaimFailed(f"request {request!r}: NicConfig interfaceName {cfg.interfaceName!r} is given to two "
                                  "netdevs of the claim (one name per request's device: give each request its own config)")
            return cfg.interfaceName
        base = request.rsplit("/", 1)[-1]
        name = base if valid_name(base) else host
        n = 1
        while name in names:
            name = f"{base[:IFNAME_ROOM]}{n}"
            n += 1
        return name

    def replanned(self, planned: Planned, pods: list[str]) -> dict:
        """An adopted claim's netdev fields (prepare/driver.py, its records lost with the checkpoint): the
        moves planned where its netdevs are on the host (its pod has not started), else its records marked
        lost: a netdev in a pod's namespace (the pod started before) cannot be told where, so its pods are
        refused (agent/nri/netdev.py) and nothing moves. With the NRI plugin off nothing ever moved."""
        record = self.plan(planned, Ownership()) or ()
        try:
            away = [m.host for m in record if self.moves and not rtnl.has_link(self.host_netns(), m.host)]
        except OSError as err:
            raise ClaimFailed(f"where its netdevs are cannot be read: {err}") from err
        away += [f"of {name}" for name in self._hidden(planned) if self.moves]
        if not away:
            return {self.key: self.write(record), "pods": pods} if record else {}
        why = (f"its netdev {', '.join(away)} is not on the host: in a pod's sandbox since before its records were "
               "lost with the checkpoint (the plugin dir wiped, or kubelet_dir changed)")
        log.error("claim %s: %s. Its pods (%s) are refused until it is unprepared; its netdevs are not moved",
                  planned.uid, why, ", ".join(pods) or "none known")
        return {"netdevsLost": why, "pods": pods}

    def _hidden(self, planned: Planned) -> list[str]:
        """The claim's NICs whose netdev directory in sysfs lists none: sysfs lists no netdev of another
        namespace (one the claim's pod has), so their netdevs are not where the host sees. A NIC with no
        such directory has no netdev at all (RDMA only, still probing): nothing of it is in a pod."""
        out = []
        for r in planned.results:
            dev = planned.names.get(r.device)
            if r.share_id or dev is None or dev.nic is None or dev.nic.interfaces or dev.pci is None \
                    or dev.pci.driver is None or is_vfio_driver(dev.pci.driver):
                continue
            if not isinstance(config_for(planned.configs, r.request, dev.kind, dev.name), VfioConfig) \
                    and self._netdev_dir_empty(dev.pci.bdf):
                out.append(r.device)
        return out

    def _netdev_dir_empty(self, bdf: str) -> bool:
        fs = HostFS(self.root)
        try:
            fn, _, d = read_function(fs, bdf)
        except PciError:
            return False  # gone from the node (or unreadable): no netdev of it to be in a pod
        return hides_netdevs(fs, fn, d)

    def holds(self, record: Record) -> list[Hold]:
        return [Hold(m.bdf, "netdev") for m in record if m.bdf]

    def apply(self, planned: Planned, record: Record) -> tuple[Record, dict[str, Device]]:
        return record, {}  # moved by the NRI plugin when the pod's sandbox exists

    def undo(self, record: Record, others: dict[str, dict]) -> Undone:
        problems, notes = [], []
        for move in record:
            if not move.away:
                continue
            try:
                netmove.move_out(move, self.host_netns(), self.root)
                notes.append(f"netdev {move.host} back on the host (from pod sandbox {move.sandbox})")
                if move.ipamPool and move.sandbox:  # the sandbox's lease, which no later event gives back
                    self.ipam.release(move.ipamPool, move.sandbox, move.netns, move.pod, move.ipamConfig, move.podRef)
            except (rtnl.LinkError, OSError, IpamError) as err:
                problems.append(f"netdev {move.host} ({move.pod} in pod sandbox {move.sandbox}): {err}")
        return Undone(problems=problems, notes=notes)

    def recover(self, record: Record) -> bool:
        for move in record:
            if move.away and move.netns and not netmove.in_pod(move):
                try:  # its namespace is gone (a reboot): the record is the NRI plugin's to finish
                    netmove.move_out(move, self.host_netns(), self.root)
                except (rtnl.LinkError, OSError) as err:
                    log.error("netdev %s of a gone pod sandbox %s: %s", move.host, move.sandbox, err)
        return False

    def devices_now(self, record: Record, devices: dict[str, Device]) -> dict[str, Device]:
        return {}
