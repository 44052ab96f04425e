"""A loader path of the NVIDIA driver's libraries alone, for its tools run by another system's
loader: the agent's image's (the DaemonSet's agent under ``/host``, the MPS daemons' pods). The
driver's library directory on the host is the host's system library directory too, libc among
them, and an image's loader with the host's libc fails (or worse) unless both are one glibc
version; NVIDIA's tools are built against an old glibc and run with the image's.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from typing import Callable

from agent.fsutil import make_dirs
from discovery.nvidia_driver import Library

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # a tool's PATH after the driver's bin
_LOCK = threading.Lock()  # the threads asking for a tool's environment at once write one directory


def link_libraries(directory: str, libraries: tuple[Library, ...], target: Callable[[str], str | None]) -> None:
    """``directory`` with a link per name each of the driver's libraries is loaded by
    (``libcuda.so.1`` ...) to the file where ``target`` (its host path) says it is (None: none
    there): a loader path of the driver's libraries alone. Links already right are kept, links
    of another driver version removed; a name from the host that is no plain file name is left out."""
    make_dirs(directory, 0o755)
    with _LOCK, _held(os.path.normpath(directory) + ".lock"):  # beside it: the directory holds links alone
        _link(directory, libraries, target)


@contextlib.contextmanager
def _held(path: str):
    """``path``'s flock, held: the two agents of a rolling update share the plugin dir's links."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _link(directory: str, libraries: tuple[Library, ...], target: Callable[[str], str | None]) -> None:
    wanted: dict[str, str] = {}
    for lib in libraries:
        dest = target(lib.host_path)
        for name in {lib.name, *lib.links} if dest else ():
            if "/" not in name and name not in ("", ".", ".."):
                wanted[name] = dest
    for name in set(os.listdir(directory)) - set(wanted):
        if os.path.islink(path := os.path.join(directory, name)):
            os.unlink(path)
    for name, dest in wanted.items():
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            if os.readlink(path) == dest:
                continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path + ".new")
        os.symlink(dest, path + ".new")
        os.replace(path + ".new", path)
