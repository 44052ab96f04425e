"""Socket paths and safe socket files (reference kubelet-plugin-protocol.md §2.2, §4.1).

DRA socket: ``<kubelet-dir>/plugins/<driver>/dra.sock`` (``dra-<uid>.sock`` with a
rolling-update UID). Registration socket: ``<kubelet-dir>/plugins_registry/<driver>-reg.sock``;
with a rolling-update UID the first candidate whose full path fits 108 bytes:
``<driver>-<uid>-reg.sock``, ``<driver>-<h8>-reg.sock``, ``dra-<h16>-reg.sock`` where
``hN`` = unpadded base64url of the first N bytes of sha256 (of the UID; of
``driver + "\\0" + uid``). The last one is also the fallback.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import os
import stat

from agent.fsutil import make_dirs
from agent.settings import Settings

UNIX_PATH_MAX = 108  # the kubelet's (Go's) limit on sun_path


class SocketError(Exception):
    """A socket path or file we must not use; the message says what to fix."""


def short_hash(data: str, nbytes: int) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data.encode()).digest()[:nbytes]).rstrip(b"=").decode()


def rolling_update_registrar_name(registry_dir: str, driver: str, uid: str) -> str:
    candidates = (
        f"{driver}-{uid}-reg.sock",
        f"{driver}-{short_hash(uid, 8)}-reg.sock",
        f"dra-{short_hash(driver + chr(0) + uid, 16)}-reg.sock",
    )
    for name in candidates:
        if len((registry_dir + "/" + name).encode()) <= UNIX_PATH_MAX:
            return name
    return candidates[-1]


def dra_socket_path(settings: Settings) -> str:
    uid = settings.rolling_update_uid
    return os.path.join(settings.plugin_dir, f"dra-{uid}.sock" if uid else "dra.sock")


def registration_socket_path(settings: Settings) -> str:
    uid = settings.rolling_update_uid
    d = settings.registry_dir
    name = rolling_update_registrar_name(d, settings.driver_name, uid) if uid else f"{settings.driver_name}-reg.sock"
    return os.path.join(d, name)


def check_length(path: str) -> None:
    if len(path.encode()) > UNIX_PATH_MAX:
        raise SocketError(
            f"socket path {path} is {len(path.encode())} bytes, the unix socket limit is {UNIX_PATH_MAX}; "
            "use a shorter --kubelet-dir"
        )


def ensure_dir(path: str, owned: bool) -> None:
    """Create ``path`` (0750 if ours, 0755 for the kubelet's registry) and refuse world-writable dirs.

    A world-writable socket directory would let anyone replace our socket; our own
    directory is fixed, the kubelet's is reported.
    """
    make_dirs(path, 0o750 if owned else 0o755)
    mode = os.stat(path).st_mode
    if mode & stat.S_IWOTH:
        if not owned:
            raise SocketError(f"{path} is world-writable (mode {stat.S_IMODE(mode):o}); fix its permissions")
        os.chmod(path, stat.S_IMODE(mode) & ~stat.S_IWOTH)


def remove_stale(path: str) -> None:
    """Remove an old socket at ``path``; anything else there is refused, never deleted."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        what = "directory" if stat.S_ISDIR(st.st_mode) else "symlink" if stat.S_ISLNK(st.st_mode) else "file"
        raise SocketError(f"{path} exists and is a {what}, not a socket; refusing to replace it")
    os.unlink(path)


def bind_address(path: str, dir_fd: int | None) -> str:
    """gRPC's address for ``path``. gRPC allows 107 bytes, the kubelet 108: a longer path is
    bound through ``/proc/self/fd/<dir fd>/<name>`` (``dir_fd`` must stay open)."""
    if len(path.encode()) < UNIX_PATH_MAX or dir_fd is None:
        return "unix:" + path
    return f"unix:/proc/self/fd/{dir_fd}/{os.path.basename(path)}"


def file_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def remove_if_same(path: str, ident: tuple[int, int] | None) -> None:
    """Remove our socket on stop, unless it was replaced by another instance's meanwhile."""
    if ident is not None and file_id(path) == ident:
        os.unlink(path)


def _fd_id(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


class InstanceLocked(SocketError):
    """Another agent serves the same sockets (same plugin dir and rolling-update UID)."""


class InstanceLock:
    """``flock`` on ``<dra socket>.lock`` for the life of the process: a second agent with
    the same socket names refuses to start instead of replacing the first one's live
    sockets. Instances of a rolling update have their own socket names, so their own locks."""

    def __init__(self, socket_path: str):
        self.path = socket_path + ".lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                os.fchmod(fd, 0o600)
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise InstanceLocked(f"another sysdra agent (pid {holder}) serves {self.path[:-len('.lock')]}; "
                                     "stop it first, or give this one its own --rolling-update-uid") from None
            except OSError:
                os.close(fd)
                raise
            # the holder before us removed the file after we opened it (``release``): lock the one there now
            if file_id(self.path) == _fd_id(fd):
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Removes the file while it still holds the lock (an agent that opened it meanwhile sees it
        gone and opens the path again): each pod of a rolling update has its own, which no later pod
        would reuse, so a file kept would be one more in the plugin dir for every agent pod."""
        if self._fd is not None:
            try:
                if file_id(self.path) == _fd_id(self._fd):
                    os.unlink(self.path)
            except OSError:
                pass
            os.close(self._fd)  # closing drops the flock
            self._fd = None
