"""PCI functions the agent itself moves between drivers (VFIO's bind to vfio-pci and its
give-back, agent/prepare/vfio.py), so the health monitor does not take its own rebinds for
faults (docs/health.md, "Rules"): from the move's start until a rescan shows the function on
the driver the move left it on, the monitor keeps the function's verdict of before.

Process-wide, keyed by the function's ``sys/bus/pci/devices/<bdf>`` path under the root (as
vfio_kernel's writes in flight are): the prepare driver and the monitor of one agent share
the root, and agents of other roots (tests) never meet. A move that ends with no driver bound
(a bind and its give-back both failed) covers nothing: that function is unusable, a fault."""

from __future__ import annotations

import contextlib
import os
import threading

_LOCK = threading.Lock()
_UNDER_WAY = object()
_MOVES: dict[str, object] = {}  # function's path -> _UNDER_WAY, or the driver the move left it on


@contextlib.contextmanager
def moving(path: str):
    """Around the agent's writes that move the function at ``path`` to another driver."""
    with _LOCK:
        _MOVES[path] = _UNDER_WAY
    try:
        yield
    finally:
        driver = _driver(path)
        with _LOCK:
            if driver is None:
                _MOVES.pop(path, None)
            else:
                _MOVES[path] = driver


def _driver(path: str) -> str | None:
    try:
        return os.path.basename(os.readlink(os.path.join(path, "driver")))
    except OSError:
        return None


def by_agent(path: str, scanned: str | None) -> bool:
    """Whether the function at ``path`` (on ``scanned``, its driver in the monitor's inventory)
    is being moved by the agent, or is on the driver the agent's move left it on while the
    inventory does not show that yet. A rescan that does forgets the move."""
    with _LOCK:
        moved = _MOVES.get(path)
    if moved is None:
        return False
    if moved is _UNDER_WAY:
        return True
    if moved == scanned:  # the rescan caught up: the rules apply again
        with _LOCK:
            if _MOVES.get(path) == moved:
                del _MOVES[path]
        return False
    return _driver(path) == moved  # else moved again since, not by us
