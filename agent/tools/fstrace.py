"""The file operations one discovery scan makes, traced at the ``os`` functions it calls.

Two users: ``sysdra record`` learns from it what to copy into a fixture tree, and
``bench/bench_scan.py`` replays exactly these operations as the floor a scan is measured
against. So every operation discovery uses is traced under its own name: ``open``,
``scandir`` (a listing with entry types), ``listdir``, ``readlink``, ``stat``, ``lstat``.
Paths are recorded as given: discovery passes absolute host paths, never ``dir_fd``.
"""

from __future__ import annotations

import os

TRACED = ("open", "scandir", "listdir", "readlink", "stat", "lstat")
LISTINGS = ("scandir", "listdir")


def traced_scan(root: str) -> tuple[object, list[tuple[str, str]]]:
    """One discovery scan of ``root`` with its file operations: (inventory, [(op, path)])."""
    from discovery.inventory import scan

    ops: list[tuple[str, str]] = []
    real = {name: getattr(os, name) for name in TRACED}

    def wrap(name):
        def traced(path, *a, **kw):
            if isinstance(path, str):
                ops.append((name, path))
            return real[name](path, *a, **kw)

        return traced

    for name in real:
        setattr(os, name, wrap(name))
    try:
        inventory = scan(root)
    finally:
        for name, fn in real.items():
            setattr(os, name, fn)
    return inventory, ops


def replay(ops: list[tuple[str, str]]) -> None:
    """The same operations in a tight loop: no parsing, no records (the bench's floor).
    A listing with types asks each entry's type, as discovery does (free with d_type)."""
    flags = os.O_RDONLY | os.O_NONBLOCK
    for op, path in ops:
        try:
            if op == "open":
                fd = os.open(path, flags)
                os.read(fd, 4097)
                os.close(fd)
            elif op == "scandir":
                with os.scandir(path) as entries:
                    for e in entries:
                        e.is_file(follow_symlinks=False) or e.is_dir(follow_symlinks=False)
            elif op == "listdir":
                os.listdir(path)
            elif op == "readlink":
                os.readlink(path)
            elif op == "stat":
                os.stat(path)
            else:
                os.lstat(path)
        except OSError:
            pass
