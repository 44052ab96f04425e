"""``list_attributes`` on a cluster whose API server refuses them (DRAListTypeAttributes off: the
agent cannot see the gate). The node's devices matter more than the lists: on the first refusal
the agent says so once, as an error, sets ``sysdra_list_attributes_refused`` to 1 and publishes
without list attributes (scanned as with ``list_attributes: false``), instead of retrying a pool
the server will never take while the node has no slices. A SIGHUP (or a restart) with
``list_attributes`` still on tries them again (docs/publishing.md)."""

from __future__ import annotations

import logging
from typing import Callable

from agent.publish import metrics as publish_metrics
from agent.publish.listattrs import ListAttributesRefused
from agent.settings import Settings

log = logging.getLogger("sysdra.daemon")


class ListFallback:
    def __init__(self, rescan: Callable[[], None]):
        self._rescan = rescan  # a full rescan and republish, soon (on the loop)
        self.active = False

    def refused(self, err: ListAttributesRefused) -> None:
        """The publisher's handler: from now on scan and publish without list attributes."""
        if not self.active:
            self.active = True
            publish_metrics.LIST_ATTRIBUTES_REFUSED.set(1)
            log.error("the API server refused the list-typed attributes %s (its DRAListTypeAttributes feature gate "
                      "is off: alpha, off by default in 1.37): publishing without list attributes, as with "
                      "list_attributes: false. Turn the gate on (kube-apiserver, kube-scheduler) and send SIGHUP, "
                      "or set list_attributes: false. The server said: %s", ", ".join(err.names), err)  # fmt: skip
        self._rescan()  # (again after a rescan that was under way with them: its pool was refused too)

    def applied(self, settings: Settings) -> Settings:
        """The settings to scan with: without list attributes while they are refused."""
        return settings.replace(list_attributes=False) if self.active and settings.list_attributes else settings

    def retry(self, new: Settings) -> bool:
        """SIGHUP: list attributes are tried again (True: rescan) when ``new`` still asks for them."""
        if not (self.active and new.list_attributes):
            return False
        self.active = False
        publish_metrics.LIST_ATTRIBUTES_REFUSED.set(0)
        log.info("SIGHUP: trying list-typed attributes again")
        return True
