"""The running agent's heap: no cyclic collections while it starts, freed heap handed back.

Start-up builds the whole inventory and pool (~100,000 objects that all live on), so
Python's generational collector would traverse them again and again (~50 ms on the large
benchmark node before the first publish) and find almost nothing: the daemon pauses it
from the start until the first publish, then collects once and trims.
"""

from __future__ import annotations

import gc


def trim() -> None:
    """Collect, then hand freed heap back to the OS (glibc keeps it in its arenas otherwise)."""
    import ctypes  # here: the first trim comes after the first publish, ~3 ms of every start before it

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class StartupPause:
    """``pause()`` the cyclic collector, ``resume()`` it (idempotent, and only if this pause
    turned it off: a caller that had disabled it keeps it disabled)."""

    def __init__(self):
        self._paused = False

    def pause(self) -> None:
        if gc.isenabled():
            gc.disable()
            self._paused = True

    def resume(self) -> None:
        if self._paused:
            self._paused = False
            gc.enable()
