"""Which NIC functions' netdevs the agent's NRI plugin has in pods, for the scans, which keep those
netdevs' facts while sysfs no longer shows them (discovery/away.py): the checkpoint's netdev records
(prepare/records.py ``NetdevMove``) that are not ``planned`` — ``moving`` (saved before the kernel is
touched), ``in-pod``, ``returning`` (saved before it comes back) — each with what it knows of its
netdev on the host: its name, MAC and MTU.

Read through a ``CheckpointView`` (the driver's last save while the files are as it left them, else
the records appended since the last look), only once a checkpoint exists. Blocking (file reads): the
scan calls it, in its worker thread; scans never overlap, so the view has one user at a time.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

from discovery.models import NetInterface

log = logging.getLogger(__name__)


class InPodNetdevs:
    """``discovery.away.Away`` from the checkpoint under ``plugin_dir``; ``saved``: the in-process
    driver's last save (``Driver.saved``), or None."""

    def __init__(self, plugin_dir: str, saved: Callable[[], object] = lambda: None):
        self.path = os.path.join(plugin_dir, "checkpoint.json")
        self.saved = saved
        self._view = None
        self._last: dict[str, dict[str, NetInterface]] = {}

    def __call__(self) -> dict[str, dict[str, NetInterface]]:
        if self._view is None:
            if not os.path.exists(self.path):  # no claim prepared here yet (nothing loaded for it)
                return {}
            from agent.prepare.checkpoint_view import CheckpointView

            self._view = CheckpointView(self.path, self.saved)
        from agent.prepare.checkpoint_format import CheckpointError

        try:
            claims = self._view.claims()
        except (ValueError, OSError, CheckpointError) as err:  # damaged or unreadable: what was known stays
            log.debug("netdev records not read (%s): the last ones known are used", err)
            return self._last
        self._last = away(claims)
        return self._last


def away(claims: dict[str, dict]) -> dict[str, dict[str, NetInterface]]:
    """``{bdf: {host name: facts}}`` of the netdev records of ``claims`` (checkpoint entries, their
    records checked when loaded) that say their netdev may be away from the host."""
    from agent.prepare.records import NetdevMove

    out: dict[str, dict[str, NetInterface]] = {}
    for entry in claims.values():
        for raw in entry.get("netdevs") or ():
            try:
                move = NetdevMove.model_validate(raw)
            except ValueError:  # checked when loaded; a record that is none is no fact
                continue
            if move.away and move.bdf:
                out.setdefault(move.bdf, {})[move.host] = NetInterface(name=move.host, mac=move.mac, mtu=move.hostMtu)
    return out
