"""SIGHUP: which changed settings a running agent applies, and which need a restart."""

from __future__ import annotations

from typing import Any

from agent.settings import FIELDS, Settings

# Settings a SIGHUP applies without a restart; the others need one (sockets, paths, identity).
LIVE_SETTINGS = frozenset({"log_level", "log_format", "resync_interval", "debounce", "health_interval",
                           "list_attributes", "pf_vf_exclusive", "taint_unhealthy", "taint_hold", "share", "share_policies",
                           "skip_node_operations"})
# Of those, the ones that change the slices' content: a SIGHUP that changes one republishes.
REPUBLISH_SETTINGS = frozenset({"list_attributes", "pf_vf_exclusive", "taint_unhealthy", "share", "share_policies",
                                "skip_node_operations"})


def changes(old: Settings, new: Settings) -> tuple[dict[str, Any], list[str]]:
    """(live, restart): the changed settings a running agent applies (name -> new value), and
    the names of the changed ones that need a restart."""
    changed = {k for k in FIELDS if getattr(old, k) != getattr(new, k)}
    return {k: getattr(new, k) for k in changed & LIVE_SETTINGS}, sorted(changed - LIVE_SETTINGS)
