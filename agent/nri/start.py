"""The agent's NRI side at start (agent/service/daemon.py, after the first publish): the plugin
that moves claimed NICs' netdevs into their pods (agent/nri/netdev.py), its periodic look for pod
namespaces gone unannounced, and one line saying what would keep netdevs on the host."""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from agent.nri.netdev import NetdevMover
from agent.nri.plugin import NriPlugin
from agent.prepare import netmove

log = logging.getLogger(__name__)


def crash_at(point: str):
    """The mover's fault hook for the real-node tests (``SYSDRA_TEST_CRASH_AT``): SIGKILL at ``point``."""
    return lambda at: os.kill(os.getpid(), signal.SIGKILL) if at == point else None


def follow_pod_sandboxes(settings, kubelet_plugin=None, board=None) -> list[asyncio.Task]:
    """The agent's NRI plugin as a task (none when ``nri_socket`` is empty): it moves the
    netdevs of the claims the driver prepared (their checkpoint) into their pods; the kubelet
    plugin's claim status writer (if any) gets the claims' networkData after a move; the status
    board (agent.service.status.StatusBoard, if any) the plugin's state at every change and the
    claims as the moves saved them."""
    if not settings.nri_socket:
        return []
    status = getattr(kubelet_plugin, "status", None)
    driver = getattr(kubelet_plugin, "driver", None)
    point = os.environ.get("SYSDRA_TEST_CRASH_AT", "")
    loop = asyncio.get_running_loop()
    mover = NetdevMover(settings.plugin_dir, netmove.host_netns(settings.root), settings=settings,
                        status=status.submit if status is not None else None,
                        fault=crash_at(point) if point else (lambda at: None),
                        saved=(lambda: getattr(driver, "saved", None)) if driver is not None else None,
                        repair=getattr(driver, "repair_checkpoint", None),
                        on_saved=(lambda claims: loop.call_soon_threadsafe(board.set_prepared_claims, claims))
                        if board is not None else None)  # (the mover's threads: the board is the loop's)
    on_state = board.set_nri if board is not None else None
    return [loop.create_task(NriPlugin(settings.nri_socket, mover, on_state=on_state).run(), name="nri"),
            loop.create_task(mover.watch(), name="nri-netdevs"),
            loop.create_task(asyncio.to_thread(_say_what_moves_lack, settings.root), name="nri-rights")]


def _say_what_moves_lack(root: str) -> None:
    """Logged once at start (procfs reads: a worker thread): what would keep claimed NICs on the host."""
    lacking = netmove.missing_move_capabilities()
    if lacking:
        log.warning("claimed NICs cannot move into their pods: the agent lacks %s (a move needs %s)",
                    ", ".join(lacking), netmove.MOVE_RIGHTS)
    problem = netmove.host_netns_problem(root)
    if problem:  # a systemd service is in the host's namespace (the unit has no PrivateNetwork=)
        level = logging.INFO if os.environ.get("INVOCATION_ID") else logging.WARNING
        log.log(level, "the host's network namespace: %s", problem)
