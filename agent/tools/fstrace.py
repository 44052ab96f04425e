"""The file operations one discovery scan makes, traced at the ``os`` functions it calls.

Two users: ``sysdra record`` learns from it what to copy into a fixture tree, and
``bench/bench_scan.py`` replays exactly these operations as the floor a scan is measured
against. So every operation discovery uses is traced under its own name: ``open``,
``scandir`` (a listing with entry types), ``listdir``, ``readlink``, ``stat``, ``lstat``.
A directory opened to work in it (``HostFS.list_dir`` lists a real directory through
its descriptor) is traced as ``opendir`` ... ``closedir``; the operations made relative to it
carry an ``@`` (``scandir@``). Every traced path is the whole host path.
"""

from __future__ import annotations

import os

TRACED = ("open", "scandir", "listdir", "readlink", "stat", "lstat", "close")
LISTINGS = ("scandir", "listdir", "scandir@")


def plain_op(op: str) -> str:
    """The operation whatever it was relative to: ``open@`` -> ``open``."""
    return op.rstrip("@")


def traced_scan(root: str) -> tuple[object, list[tuple[str, str]]]:
    """One discovery scan of ``root`` with its file operations: (inventory, [(op, path)])."""
    from discovery.inventory import scan

    return traced(scan, root)


def traced(fn, *args) -> tuple[object, list[tuple[str, str]]]:
    """``fn(*args)`` with the file operations it makes through ``os``: (its result, [(op, path)])."""
    ops: list[tuple[str, str]] = []
    real = {name: getattr(os, name) for name in TRACED}
    held: dict[int, str] = {}  # directory descriptors the call holds open -> their paths

    def wrap(name):
        call = real[name]

        def recorded(path, *a, **kw):
            if isinstance(path, int):  # close(fd), scandir(fd): only held directories are traced
                where = held.pop(path, None) if name == "close" else held.get(path)
                if where is not None:
                    ops.append(("closedir" if name == "close" else name + "@", where))
                return call(path, *a, **kw)
            if not isinstance(path, str):
                return call(path, *a, **kw)
            dir_fd = kw.get("dir_fd")
            if dir_fd is not None:
                ops.append((name + "@", f"{held[dir_fd]}/{path}"))
                return call(path, *a, **kw)
            if name == "open" and (a[0] if a else kw.get("flags", 0)) & os.O_DIRECTORY:
                ops.append(("opendir", path))
                fd = call(path, *a, **kw)
                held[fd] = path
                return fd
            ops.append((name, path))
            return call(path, *a, **kw)

        return recorded

    for name in real:
        setattr(os, name, wrap(name))
    try:
        result = fn(*args)
    finally:
        for name, original in real.items():
            setattr(os, name, original)
    return result, ops


def replay_plan(ops: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The traced operations as :func:`replay` makes them: relative ones by their last name."""
    return [(op, path.rpartition("/")[2] if op.endswith("@") and op != "scandir@" else path) for op, path in ops]


def replay(plan: list[tuple[str, str]]) -> None:
    """The same operations (:func:`replay_plan`) in a tight loop: no parsing, no records (the
    bench's floor). A listing is iterated to its end, each entry made, as discovery keeps them
    (it asks only the entries it reads for their type, which d_type answers without a system
    call); relative operations go through the directory held open, as discovery's do."""
    flags = os.O_RDONLY | os.O_NONBLOCK
    held = -1
    for op, path in plan:
        try:
            if op == "open":
                fd = os.open(path, flags)
                os.read(fd, 4097)
                os.close(fd)
            elif op == "open@":
                fd = os.open(path, flags, dir_fd=held)
                os.read(fd, 4097)
                os.close(fd)
            elif op == "readlink@":
                os.readlink(path, dir_fd=held)
            elif op == "opendir":
                held = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            elif op == "closedir":
                os.close(held)
                held = -1
            elif op == "scandir" or op == "scandir@":
                with os.scandir(path if op == "scandir" else held) as entries:
                    for _ in entries:
                        pass
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
