"""Deferred device metadata, written by the NRI plugin once a netdev is in its pod, inside the
same hold of the plugin's lock as the move's record: the request's metadata file is rewritten
(``generation`` + 1) with the interface's name in the pod, its MAC and its addresses, through the
update ``sysdra metadata update`` makes (agent/prepare/metadata/update.py); the claim's
``deviceStatus`` in the checkpoint follows, for ``status.devices[].networkData``.

A failure is logged, never the pod's error: the file then keeps what prepare wrote and
``sysdra metadata update`` can still be run.
"""

from __future__ import annotations

import logging

from agent.apilimits import MAX_IPS
from agent.kubeletplugin.types import base_request
from agent.prepare.metadata.update import NetworkData, UpdateError, update_entry, update_status
from agent.prepare.records import NetdevMove

log = logging.getLogger(__name__)


def network_data(move: NetdevMove) -> NetworkData:
    """The pod's view of ``move``: the config's addresses and the pool's lease (one that repeats an
    address once), the first ``MAX_IPS`` of them, as status and metadata take no more."""
    ips = list(dict.fromkeys([*move.addresses, *move.leased]))
    if len(ips) > MAX_IPS:
        log.warning("netdev %s: %d addresses in the pod, its metadata and claim status name the first %d",
                    move.host, len(ips), MAX_IPS)
    return NetworkData(interface_name=move.pod, hardware_address=move.mac, ips=ips[:MAX_IPS], all_ips=True)


def record(settings, uid: str, entry: dict, move: NetdevMove) -> bool:
    """``move``'s view from the pod into the claim's ``entry`` and its metadata file -> whether
    the entry changed (the caller saves it). Without device metadata only the ``deviceStatus``
    entries take it."""
    net = network_data(move)
    try:
        net.check()
        if not settings.device_metadata or not entry.get("metadata"):  # no metadata file: status.devices still follows
            return update_status(entry, move.device, net)
        generation = update_entry(settings, uid, entry, base_request(move.request), net, device=move.device,
                                  request=move.request)
    except (UpdateError, OSError, ValueError) as err:
        log.warning("claim %s: the device metadata and status keep the host's view of %s: %s", uid, move.host, err)
        return False
    log.info("device metadata of %s/%s request %s: %s is %s in the pod (generation %d)", entry.get("namespace"),
             entry.get("name"), move.request, move.host, move.pod, generation)
    return True
