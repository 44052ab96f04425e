"""Crash-safe file writes: everything other programs read goes through here.

A reader (container runtime, kubelet, operator) sees either the old file or the new
one, never a prefix: temp file in the same directory, write, rename. That alone is safe
against a crash of the process (``kill -9``) at any instruction: the page cache survives it.

``durable=True`` (the default) also survives a power loss: fdatasync the file before the
rename and fsync the directory after it. Callers pass ``durable=False`` only for files that
recovery rebuilds after a reboot anyway (docs/kubelet-plugin.md, "Durability").
"""

from __future__ import annotations

import errno
import json
import os
import tempfile


class WriteError(OSError):
    """Raised with a message naming the file and the cause (ENOSPC reads "disk full")."""


def _describe(err: OSError) -> str:
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return "disk full"
    if err.errno == errno.EROFS:
        return "read-only file system"
    return err.strerror or str(err)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str, data: bytes | str, mode: int = 0o644, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically; on any error the old file is kept.

    The temp name starts with ``.`` and ends with ``.tmp`` so CDI watchers and the
    kubelet's plugin watcher ignore it.
    """
    if isinstance(data, str):
        data = data.encode()
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fchmod(fd, mode)
            if durable:
                os.fdatasync(fd)  # size and data; the other inode metadata does not matter here
        finally:
            os.close(fd)
        os.rename(tmp, path)
        if durable:
            fsync_dir(directory)
    except OSError as err:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise WriteError(err.errno, f"cannot write {path}: {_describe(err)}") from err


def atomic_write_json(path: str, obj: object, mode: int = 0o644, indent: int | None = None, durable: bool = True) -> None:
    """Compact by default: only ``indent=None`` uses json's C encoder (pretty output is ~10x slower)."""
    atomic_write(path, json.dumps(obj, indent=indent, sort_keys=False) + "\n", mode, durable=durable)


def remove_file(path: str) -> bool:
    """Remove a file if present; True if it existed."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def clean_stale_temps(directory: str, prefix: str = ".") -> int:
    """Delete temp files left by a crash between mkstemp and rename."""
    n = 0
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return 0
    for name in names:
        if name.startswith(prefix) and name.endswith(".tmp"):
            if remove_file(os.path.join(directory, name)):
                n += 1
    return n
