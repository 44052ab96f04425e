"""inotify(7) watches on directory trees, read on the event loop: the file events of fixture
roots (tests, demos) and of the offline cluster directory.

One path string per watched directory and no thread: the large benchmark node has ~10,500
directories, which watchdog held at ~550 bytes and several objects each (~6 MB of the idle
agent). Only changes are subscribed to (reads by a rescan would flood the queue otherwise).
A directory that appears is watched before it is listed, so nothing created in it is missed;
a queue overflow reports each watched root, i.e. "look at everything".
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
import struct
from typing import Callable

log = logging.getLogger("sysdra.watch")

IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = 0x2, 0x4, 0x8
IN_MOVED_FROM, IN_MOVED_TO, IN_CREATE, IN_DELETE = 0x40, 0x80, 0x100, 0x200
IN_DELETE_SELF, IN_MOVE_SELF, IN_Q_OVERFLOW, IN_IGNORED = 0x400, 0x800, 0x4000, 0x8000
IN_ONLYDIR, IN_DONT_FOLLOW, IN_ISDIR = 0x01000000, 0x02000000, 0x40000000
CHANGES = (IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
           | IN_DELETE_SELF | IN_MOVE_SELF)
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then the name)
_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.inotify_init1.argtypes = [ctypes.c_int]
        lib.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        lib.inotify_rm_watch.argtypes = [ctypes.c_int, ctypes.c_int]
        _libc = lib
    return _libc


class TreeWatch:
    """Calls ``callback(path)`` on the running event loop for every change in ``paths`` (and
    in every directory below them, present or new, when ``recursive``). ``complete`` turns
    False when a directory could not be watched (the user's inotify watch limit): its
    changes are then seen only by the periodic rescan."""

    def __init__(self, paths: list[str], callback: Callable[[str], None], recursive: bool = True):
        self.callback = callback
        self.recursive = recursive
        self.complete = True
        self._dirs: dict[int, str] = {}  # watch descriptor -> directory path
        fd = _lib().inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            raise OSError(ctypes.get_errno(), f"inotify_init1: {os.strerror(ctypes.get_errno())}")
        self._fd = fd
        self._roots = [p for p in paths if os.path.isdir(p)]
        for root in self._roots:
            self._add_tree(root)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(fd, self._readable)

    @property
    def watched(self) -> int:
        return len(self._dirs)

    def _add(self, path: str) -> bool:
        wd = _lib().inotify_add_watch(self._fd, os.fsencode(path), CHANGES | IN_ONLYDIR | IN_DONT_FOLLOW)
        if wd >= 0:
            self._dirs[wd] = path
            return True
        err = ctypes.get_errno()
        if err not in (errno.ENOENT, errno.ENOTDIR):  # (gone again, or not a directory: nothing to watch)
            self.complete = False
            log.warning("cannot watch %s: %s; changes there are seen by the periodic rescan", path, os.strerror(err))
        return False

    def _add_tree(self, top: str) -> list[str]:
        """Watch ``top`` and (recursive) every directory below it, each before it is listed;
        symlinks are not followed. Returns the directories now watched."""
        added, todo = [], [top]
        while todo:
            path = todo.pop()
            if not self._add(path):
                continue
            added.append(path)
            if not self.recursive:
                continue
            try:
                with os.scandir(path) as entries:
                    todo.extend(e.path for e in entries if e.is_dir(follow_symlinks=False))
            except OSError:
                continue
        return added

    def _forget(self, top: str) -> None:
        """A directory moved away: drop its watches and those below it (their paths are stale)."""
        below = top + "/"
        for wd, path in list(self._dirs.items()):
            if path == top or path.startswith(below):
                del self._dirs[wd]
                _lib().inotify_rm_watch(self._fd, wd)

    def _readable(self) -> None:
        try:
            data = os.read(self._fd, 1 << 16)
        except BlockingIOError:
            return
        except OSError as err:
            log.warning("file events: %s", err)
            return
        off = 0
        while off + _EVENT.size <= len(data):
            wd, mask, _cookie, length = _EVENT.unpack_from(data, off)
            name = data[off + _EVENT.size:off + _EVENT.size + length].split(b"\0", 1)[0]
            off += _EVENT.size + length
            self._event(wd, mask, os.fsdecode(name))

    def _event(self, wd: int, mask: int, name: str) -> None:
        if mask & IN_Q_OVERFLOW:  # events were lost
            for root in self._roots:
                self.callback(root)
            return
        directory = self._dirs.get(wd)
        if directory is None:
            return
        if mask & IN_IGNORED:  # the directory is gone (or its watch was removed)
            del self._dirs[wd]
            return
        path = os.path.join(directory, name) if name else directory
        if mask & IN_ISDIR and name and self.recursive:
            if mask & (IN_CREATE | IN_MOVED_TO):
                for below in self._add_tree(path)[1:]:  # it may have come with content already
                    self.callback(below)
            elif mask & IN_MOVED_FROM:
                self._forget(path)
        self.callback(path)

    def stop(self) -> None:
        if self._fd >= 0:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)  # removes every watch
            self._fd = -1
            self._dirs.clear()
