"""The running agent's heap: freed memory handed back to the OS.

A full scan and the pool built from it leave most of their objects as garbage once the next
inventory replaces them; glibc keeps that memory in its arenas, so an idle agent would hold
its peak for good.
"""

from __future__ import annotations

import ctypes
import gc


def freeze_startup() -> None:
    """Take what exists now (modules, classes, the settings: the start-up's objects, alive as long
    as the process) out of the cyclic collector's walks. A full scan makes objects fast enough to
    trigger full collections, and each would walk all of these again for nothing. Only in a
    process of its own (``sysdra``): a caller's objects are not ours to pin."""
    gc.freeze()


def trim() -> None:
    """Collect, then hand freed heap back to the OS (glibc keeps it in its arenas otherwise)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
