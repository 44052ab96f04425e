"""inotify(7) watches on directory trees, read on the event loop: the file events of fixture
roots (tests, demos) and of the offline cluster directory. The system calls are
inotify_simple's (a literal ctypes wrapper); the tree walking is ours.

One path string per watched directory and no thread: the large benchmark node has ~10,500
directories, which watchdog held at ~550 bytes and several objects each (~6 MB of the idle
agent). Only changes are subscribed to (reads by a rescan would flood the queue otherwise).
A directory that appears is watched before it is listed, so nothing created in it is missed;
a queue overflow reports each watched root, i.e. "look at everything".
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from typing import Callable

from inotify_simple import INotify, flags, parse_events

log = logging.getLogger("sysdra.watch")

# plain ints: they are tested against every event's mask
IN_MODIFY, IN_ATTRIB, IN_CLOSE_WRITE = int(flags.MODIFY), int(flags.ATTRIB), int(flags.CLOSE_WRITE)
IN_MOVED_FROM, IN_MOVED_TO = int(flags.MOVED_FROM), int(flags.MOVED_TO)
IN_CREATE, IN_DELETE = int(flags.CREATE), int(flags.DELETE)
IN_DELETE_SELF, IN_MOVE_SELF = int(flags.DELETE_SELF), int(flags.MOVE_SELF)
IN_Q_OVERFLOW, IN_IGNORED, IN_ISDIR = int(flags.Q_OVERFLOW), int(flags.IGNORED), int(flags.ISDIR)
IN_ONLYDIR, IN_DONT_FOLLOW = int(flags.ONLYDIR), int(flags.DONT_FOLLOW)
CHANGES = (IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE | IN_DELETE
           | IN_DELETE_SELF | IN_MOVE_SELF)


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
        self._inotify = INotify(nonblocking=True)  # close-on-exec
        fd = self._fd = self._inotify.fileno()
        self._roots = [p for p in paths if os.path.isdir(p)]
        for root in self._roots:
            self._add_tree(root)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(fd, self._readable)

    @property
    def watched(self) -> int:
        return len(self._dirs)

    def _add(self, path: str) -> bool:
        try:
            wd = self._inotify.add_watch(path, CHANGES | IN_ONLYDIR | IN_DONT_FOLLOW)
        except OSError as err:
            if err.errno not in (errno.ENOENT, errno.ENOTDIR):  # (gone again, or not a directory: nothing to watch)
                self.complete = False
                log.warning("cannot watch %s: %s; changes there are seen by the periodic rescan", path, err.strerror)
            return False
        self._dirs[wd] = path
        return True

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
                try:
                    self._inotify.rm_watch(wd)
                except OSError:  # EINVAL: the kernel dropped it already
                    pass

    def _readable(self) -> None:
        try:
            data = os.read(self._fd, 1 << 16)
        except BlockingIOError:
            return
        except OSError as err:
            log.warning("file events: %s", err)
            return
        for event in parse_events(data):  # a read returns whole events only
            self._event(event.wd, event.mask, event.name)

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
            self._inotify.close()  # removes every watch
            self._fd = -1
            self._dirs.clear()
