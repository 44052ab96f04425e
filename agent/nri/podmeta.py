"""Deferred device metadata, written by the NRI plugin once a netdev is in its pod: the
request's metadata file is rewritten (``generation`` + 1) with the interface's name in the
pod and its MAC, through the same update as ``sysdra metadata update``
(agent/prepare/metadata/update.py), so the checkpoint's ``deviceStatus`` follows.

Best effort: the runtime waits for RunPodSandbox only a short while (containerd: 2 s), so the
plugin lock is waited for briefly and a failure is logged, never the pod's error; the file
then keeps what prepare wrote and ``sysdra metadata update`` can still be run.
"""

from __future__ import annotations

import logging

from agent.kubeletplugin.types import ClaimRef
from agent.nri import rtnl
from agent.prepare.checkpoint import Checkpoint
from agent.prepare.metadata.update import NetworkData, UpdateError, update_request
from agent.prepare.netdevs import NetdevPlan

log = logging.getLogger(__name__)
LOCK_TIMEOUT = 1.0  # seconds: within the runtime's request timeout


def updater(settings):
    """The ``moved`` callback of NetdevMover for these settings (none without device metadata)."""
    if not settings.device_metadata:
        return lambda claim, plan, netns: None

    def moved(claim: str, plan: NetdevPlan, netns: str) -> None:
        try:
            entry = Checkpoint.load(settings.plugin_dir + "/checkpoint.json", move_corrupt=False).claims.get(claim) or {}
            ref = ClaimRef(entry.get("namespace", ""), entry.get("name", ""), claim)
            net = NetworkData(interface_name=plan.pod, hardware_address=rtnl.hardware_address(netns, plan.pod))
            generation, path = update_request(settings, ref, plan.request, net, device=plan.device, lock_timeout=LOCK_TIMEOUT)
            log.info("device metadata %s: %s is %s in the pod (generation %d)", path, plan.host, plan.pod, generation)
        except (UpdateError, OSError, ValueError) as err:
            log.warning("claim %s: the device metadata keeps the host's view of %s: %s", claim, plan.host, err)

    return moved
