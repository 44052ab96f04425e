"""Crash-safe file writes: everything other programs read goes through here; and the one
bounded reader of the files the agent reads back (``read_bounded``).

A reader (container runtime, kubelet, operator) sees either the old file or the new
one, never a prefix: temp file in the same directory, write, rename. That alone is safe
against a crash of the process (``kill -9``) at any instruction: the page cache survives it.

``durable=True`` (the default) also survives a power loss: fdatasync the file before the
rename and fsync the directory after it. Callers pass ``durable=False`` only for files that
recovery rebuilds after a reboot anyway (docs/kubelet-plugin.md, "Durability").
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import stat

import orjson


class WriteError(OSError):
    """Raised with a message naming the file and the cause (ENOSPC reads "disk full")."""


def describe_error(err: OSError) -> str:
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


_temp_counter = itertools.count()


class UnsafePath(ValueError):
    """A path built from input that would leave its base directory."""


def inside(base: str, *parts: str) -> str:
    """``base`` joined with ``parts``, refused (UnsafePath) unless it stays strictly below
    ``base`` after normalisation. ``base`` is a directory resolved once at start."""
    path = os.path.normpath(os.path.join(base, *parts))
    root = os.path.normpath(base)
    if not path.startswith(root.rstrip("/") + "/") or any(not p or "\x00" in p for p in parts):
        raise UnsafePath(f"{os.path.join(base, *parts)!r} would leave {base}")
    return path


def make_dirs(path: str, mode: int) -> None:
    """``os.makedirs`` with ``mode`` on every directory it creates, whatever the umask
    (makedirs alone gives ``mode & ~umask``). Existing directories are left as they are."""
    missing = []
    d = os.path.abspath(path)
    while not os.path.isdir(d):
        missing.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            if not os.path.isdir(d):
                raise
            continue
        os.chmod(d, mode)


def _create_temp(directory: str, base: str, dir_mode: int | None) -> tuple[int, str]:
    """A new temp file next to the target: pid + counter make the name unique to this
    process and call (cheaper than mkstemp's random names and retries). A leftover of
    the same name can only be from a dead process that had our pid: it is replaced."""
    for _ in range(3):
        tmp = os.path.join(directory, f".{base}.{os.getpid()}.{next(_temp_counter)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), tmp
        except FileExistsError:
            remove_file(tmp)
        except FileNotFoundError:
            if dir_mode is None:
                raise
            make_dirs(directory, dir_mode)
    raise FileExistsError(errno.EEXIST, "cannot create a temp file", directory)


def atomic_write(path: str, data: bytes | str, mode: int = 0o644, durable: bool = True,
                 dir_mode: int | None = None) -> None:
    """Replace ``path`` with ``data`` atomically; on any error the old file is kept.

    The temp name starts with ``.`` and ends with ``.tmp`` so CDI watchers and the
    kubelet's plugin watcher ignore it. ``dir_mode``: create missing parent directories
    with this mode (only when the first attempt finds them missing).
    """
    if isinstance(data, str):
        data = data.encode()
    directory = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        fd, tmp = _create_temp(directory, os.path.basename(path), dir_mode)
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
        if tmp is not None:
            remove_file(tmp)
        raise WriteError(err.errno, f"cannot write {path}: {describe_error(err)}") from err


def json_bytes(obj: object, sort_keys: bool = False) -> bytes:
    """Compact JSON (no spaces) as UTF-8, by orjson: ~10x faster than json's C encoder on
    the specs, metadata streams and checkpoint entries that prepare writes. Anything orjson
    does not take (non-string keys, integers past 64 bits) goes through json, same output."""
    try:
        return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS if sort_keys else 0)
    except TypeError:
        return json.dumps(obj, sort_keys=sort_keys, separators=(",", ":"), ensure_ascii=False).encode()


def atomic_write_json(path: str, obj: object, mode: int = 0o644, durable: bool = True,
                      dir_mode: int | None = None) -> None:
    """Compact JSON (``json_bytes``), one line: ``jq .`` shows it indented."""
    atomic_write(path, json_bytes(obj) + b"\n", mode, durable=durable, dir_mode=dir_mode)


def remove_file(path: str) -> bool:
    """Remove a file if present; True if it existed."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def clean_stale_temps(directory: str, prefix: str = ".") -> int:
    """Delete temp files left by a crash between creating them and the rename."""
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


# O_NONBLOCK: opening a FIFO put in a file's place returns at once (a blocking open waits for a
# writer for ever); O_NOCTTY: a tty never becomes ours
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_CHUNK = 1 << 16
_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


class FileRefused(OSError):
    """A file that is there but is not a regular file of at most its kind's size; ``str()`` is
    the reason alone (the callers name the file their own way)."""

    def __str__(self) -> str:
        return self.strerror


def read_bounded(path: str, limit: int) -> bytes:
    """The whole of the regular file at ``path``, at most ``limit`` bytes (/dev/null: empty).
    Never blocks and never reads without end: a FIFO, device or socket in the file's place is
    refused (FileRefused) before anything is read, a directory is IsADirectoryError as for
    ``open()``, and a file past ``limit`` (a sparse one of gigabytes) is refused, not read.
    Other OSErrors (FileNotFoundError ...) as ``os.open`` raises them."""
    fd = os.open(path, _READ_FLAGS)
    try:
        st = os.fstat(fd)
        _check_kind(path, st)
        if not stat.S_ISREG(st.st_mode):
            return b""  # /dev/null
        if st.st_size > limit:
            raise FileRefused(errno.EFBIG, f"{st.st_size} bytes, more than {limit}", path)
        parts, size = [], 0
        while size <= limit and (chunk := os.read(fd, min(limit + 1 - size, max(_CHUNK, st.st_size + 1)))):
            parts.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > limit:  # (it grew while read)
        raise FileRefused(errno.EFBIG, f"more than {limit} bytes", path)
    return b"".join(parts)


def _check_kind(path: str, st: os.stat_result) -> None:
    mode = st.st_mode
    if stat.S_ISREG(mode) or (stat.S_ISCHR(mode) and st.st_rdev == _devnull()):
        return
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    kind = next((name for test, name in _KINDS if test(mode)), "of an unknown type")
    raise FileRefused(errno.EINVAL, f"not a regular file: {kind}", path)


def _devnull() -> int:
    try:
        return os.stat(os.devnull).st_rdev
    except OSError:
        return -1
