"""One reading primitive for sysfs/procfs/dev under a configurable host root.

Every reader in ``discovery`` goes through :class:`HostFS`: it joins paths onto the
root, reads a bounded number of bytes (broken drivers can return endless or huge data),
and turns the errors sysfs is known to produce into :class:`AttrError` with a short
reason, so a caller loses only that one attribute.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from dataclasses import dataclass, field

DEFAULT_ROOT = "/"
SYSFS_MAGIC = 0x62656572  # statfs(2)'s f_type of sysfs
MAX_ATTR_BYTES = 4096  # sysfs attributes are one page at most
# O_NONBLOCK: a FIFO swapped in never blocks the scan; O_NOCTTY: a tty never becomes ours
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_LISTED_FLAGS = _READ_FLAGS | os.O_NOFOLLOW  # a listed regular file: a symlink there now was swapped in
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC  # a real directory, no symlink

_REASONS = {
    errno.ENOENT: "missing",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EIO: "I/O error",
    errno.EINVAL: "invalid (EINVAL)",
    errno.ENODEV: "no device (ENODEV)",
    errno.ENXIO: "no device (ENXIO)",
    errno.EOPNOTSUPP: "not supported (EOPNOTSUPP)",
    errno.ENODATA: "no data (ENODATA)",
    errno.EAGAIN: "busy (EAGAIN)",
    errno.ELOOP: "symlink loop",
    errno.ENOTDIR: "not a directory",
    errno.EISDIR: "is a directory",
}


class AttrError(Exception):
    """An attribute could not be read or parsed; ``reason`` is short and human."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def os_reason(err: OSError) -> str:
    return _REASONS.get(err.errno or 0, err.strerror or type(err).__name__)


def _read_file(path: str, limit: int) -> bytes:
    """Open, read to EOF, close; more than ``limit`` bytes is an error, not a truncated value.
    procfs seq_files hand out about a page per read(), so one read of a longer one
    (``/proc/net/ipv6_route``) is cut short."""
    try:
        fd = os.open(path, _READ_FLAGS)
        try:
            data = os.read(fd, limit + 1)
            while data and len(data) <= limit:
                if not (more := os.read(fd, limit + 1 - len(data))):
                    break
                data += more
        finally:
            os.close(fd)
    except OSError as err:
        raise AttrError(path, os_reason(err)) from err
    if len(data) > limit:
        raise AttrError(path, f"larger than {limit} bytes")
    return data


def _read_value(path: str, limit: int = MAX_ATTR_BYTES, flags: int = _READ_FLAGS) -> str:
    """One value, stripped: a sysfs attribute (one show() call) comes whole in the first read,
    so one read, no second to see EOF. More than ``limit`` bytes is an error, not a truncated
    value; empty, NUL bytes or not UTF-8 is no value. Open to text in one function: a scan
    reads ~12,000 values."""
    try:
        fd = os.open(path, flags)
        try:
            data = os.read(fd, limit + 1)
        finally:
            os.close(fd)
    except OSError as err:
        raise AttrError(path, os_reason(err)) from err
    if len(data) > limit:
        raise AttrError(path, f"larger than {limit} bytes")
    try:
        text = data.decode().strip()
    except UnicodeDecodeError:
        raise AttrError(path, "not UTF-8") from None
    if not text:
        raise AttrError(path, "empty")
    if "\x00" in text:
        raise AttrError(path, "contains NUL bytes")
    return text


def _regular(path: str) -> bool:
    """Whether the file at ``path`` is there (an absent optional file is common: a VF's netdev
    has no ``speed``); one that is not a regular file is an error: FIFOs, sockets and devices
    are refused before opening (opening a FIFO blocks, opening a device can have side effects)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return False
    except OSError as err:
        raise AttrError(path, os_reason(err)) from err
    if not stat.S_ISREG(mode):
        raise AttrError(path, "directory" if stat.S_ISDIR(mode) else "not a regular file")
    return True


def printable_name(name: str) -> bool:
    """Whether a name from a listing or a link (str via surrogateescape) is printable UTF-8:
    one that is not cannot be encoded into a value, a problem, JSON or a log line."""
    try:
        name.encode()
    except UnicodeEncodeError:
        return False
    return name.isprintable()


def _target_name(target: str) -> str | None:
    """The last component of a link's target (what it links to); None for none, a dot or
    a name that is not printable UTF-8."""
    name = target.rstrip("/").rpartition("/")[2]
    return None if name in ("", ".", "..") or not printable_name(name) else name


def is_sysfs(path: str) -> bool:
    """Whether ``path`` is the kernel's sysfs (a mount of it or a bind of one), not a tree of
    files that looks like it (a fixture): only a root whose ``sys`` is the kernel's has a kernel
    behind it (uevents; the init's network namespace under its procfs)."""
    buf = (ctypes.c_long * 32)()  # struct statfs (120 bytes on 64-bit Linux), f_type first
    if ctypes.CDLL(None, use_errno=True).statfs(os.fsencode(path), buf) != 0:
        return False
    return buf[0] == SYSFS_MAGIC


@dataclass(frozen=True, slots=True)
class Dir:
    """A directory listed once: its host path and its entries by name (``entries`` None: it
    could not be listed). Readers ask :meth:`has` before looking for an optional entry, so
    an absent one costs no system call, and the entries' types come from the listing."""

    path: str
    entries: dict[str, os.DirEntry] | None = None

    @property
    def names(self):
        """The entries' names (a set-like view), None when the directory could not be listed."""
        return None if self.entries is None else self.entries.keys()

    def has(self, name: str) -> bool:
        """False only when the listing shows that ``name`` is absent."""
        return self.entries is None or name in self.entries

    def is_file(self, name: str) -> bool:
        """True when the listing shows ``name`` as a regular file (not a symlink)."""
        entry = None if self.entries is None else self.entries.get(name)
        return entry is not None and _listed_file(entry)


def _listed_file(entry: os.DirEntry) -> bool:
    try:
        return entry.is_file(follow_symlinks=False)
    except OSError:  # no type in the listing, and looking it up failed
        return False


@dataclass(frozen=True, slots=True)
class HostFS:
    """A host root (``/`` on a node, ``fixtures/sysfs/<profile>`` in tests)."""

    root: str = DEFAULT_ROOT
    # the root's forms, made once (a scan makes thousands of paths under it and checks one per
    # PCI function): as every path under it begins (``join(root, "")``), and normalised
    _prefix: str = field(init=False, repr=False, compare=False)
    _normal: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # how a frozen dataclass sets derived fields
        object.__setattr__(self, "_prefix", os.path.join(self.root, ""))
        object.__setattr__(self, "_normal", os.path.normpath(self.root))

    def path(self, *parts: str) -> str:
        rel = os.path.join(*parts) if len(parts) > 1 else parts[0]  # join: an absolute part restarts
        return self._prefix + rel.lstrip("/")  # os.path.join(root, rel): rel is relative now

    def rel(self, host_path: str) -> str:
        """Host path under the root -> path as seen on the node (``/sys/...``)."""
        root = self.root.rstrip("/")
        if host_path.startswith(root + "/") and os.path.normpath(host_path) == host_path:
            return host_path[len(root):]
        r = os.path.relpath(host_path, self.root)
        return "/" + ("" if r == "." else r)

    def node_path(self, host_path: str) -> str | None:
        """:meth:`rel` of a host path that the root :meth:`contains`, None for one outside it:
        both with one normpath (a scan asks it of every PCI function's directory)."""
        p = os.path.normpath(host_path)
        root = self._normal
        if not (root == "/" or p == root or p.startswith(root + os.sep)):
            return None
        bare = self.root.rstrip("/")
        if p == host_path and host_path.startswith(bare + "/"):
            return host_path[len(bare):]
        return self.rel(host_path)

    # --- reading -----------------------------------------------------------------
    def read_bytes(self, path: str, limit: int = MAX_ATTR_BYTES) -> bytes:
        """A whole regular file of at most ``limit`` bytes, read to EOF (FIFOs, sockets and
        devices are refused before opening)."""
        if not _regular(path):
            raise AttrError(path, "missing")
        return _read_file(path, limit)

    def read_text(self, path: str, limit: int = MAX_ATTR_BYTES) -> str:
        """A whole text file (several lines: ``/proc/devices``, a GPU's ``information``)."""
        data = self.read_bytes(path, limit)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise AttrError(path, "not UTF-8") from err
        if "\x00" in text:
            raise AttrError(path, "contains NUL bytes")
        return text

    def read_attr(self, path: str, limit: int = MAX_ATTR_BYTES) -> str:
        """A one-value sysfs attribute, stripped; empty counts as an error."""
        if not _regular(path):
            raise AttrError(path, "missing")
        return _read_value(path, limit)

    def read_optional(self, path: str) -> str | None:
        """:meth:`read_attr` of an attribute that may be absent: None when it is missing."""
        return _read_value(path) if _regular(path) else None

    def read_attrs(self, d: Dir, names: tuple[str, ...]) -> tuple[dict[str, str], dict[str, AttrError]]:
        """Several attributes of a directory: (name -> text as :meth:`read_attr` returns it,
        name -> error of those present but unreadable); absent ones are in neither. Names the
        listing lacks cost nothing, and a file the listing shows as regular needs no ``stat``
        (O_NOFOLLOW and O_NONBLOCK keep an entry swapped since from being followed or
        blocking)."""
        values: dict[str, str] = {}
        errors: dict[str, AttrError] = {}
        entries = d.entries  # Dir.has() and Dir.is_file() inline: a scan asks ~17,000 names
        entry = None
        for name in names:
            if entries is not None and (entry := entries.get(name)) is None:
                continue
            path = f"{d.path}/{name}"
            try:
                if entry is not None and _listed_file(entry):
                    values[name] = _read_value(path, MAX_ATTR_BYTES, _LISTED_FLAGS)
                else:
                    values[name] = self.read_attr(path)
            except AttrError as err:
                if err.reason != "missing":
                    errors[name] = err
        return values, errors

    def read_int(self, path: str, base: int = 10) -> int:
        text = self.read_attr(path)
        try:
            return int(text, base)
        except ValueError as err:
            raise AttrError(path, f"not an integer: {text[:40]!r}") from err

    # --- links and listings ------------------------------------------------------
    def link_name(self, path: str) -> str:
        """Basename of a symlink's target (``driver``, ``iommu_group``, ``physfn``)."""
        try:
            target = os.readlink(path)
        except OSError as err:
            raise AttrError(path, os_reason(err)) from err
        if (name := _target_name(target)) is None:
            raise AttrError(path, f"odd link target {target!r}")
        return name

    def link_names(self, d: Dir, names: tuple[str, ...]) -> tuple[dict[str, str], dict[str, AttrError]]:
        """:meth:`link_name` of several links of a directory, as :meth:`read_attrs` reads
        files: (name -> target's last component, name -> error); absent links in neither."""
        found: dict[str, str] = {}
        errors: dict[str, AttrError] = {}
        entries = d.entries
        for name in names:
            if entries is not None and name not in entries:  # Dir.has() inline, as in read_attrs
                continue
            try:
                found[name] = self.link_name(f"{d.path}/{name}")
            except AttrError as err:
                if err.reason != "missing":
                    errors[name] = err
        return found, errors

    def resolve_link(self, path: str) -> str:
        """Resolve one symlink (relative to its directory), lexically, no recursion."""
        try:
            target = os.readlink(path)
        except OSError as err:
            raise AttrError(path, os_reason(err)) from err
        return _joined(path, target)

    def follow(self, path: str) -> str:
        """Like :meth:`resolve_link`, but a path that is no symlink (or missing) is returned
        as it is."""
        try:
            target = os.readlink(path)
        except OSError as err:
            if err.errno in (errno.EINVAL, errno.ENOENT):
                return path
            raise AttrError(path, os_reason(err)) from err
        return _joined(path, target)

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except OSError as err:
            raise AttrError(path, os_reason(err)) from err

    def list_dir(self, path: str) -> Dir:
        """A real directory (a symlink to one is refused: ``symlink loop``) listed once, its
        entries kept with the types the listing gave them (d_type: no ``stat`` per entry)."""
        try:
            fd = os.open(path, _DIR_FLAGS)
            try:
                with os.scandir(fd) as listing:
                    entries = {e.name: e for e in listing}
            finally:
                os.close(fd)
        except OSError as err:
            raise AttrError(path, os_reason(err)) from err
        return Dir(path, entries)

    def subdirs(self, path: str) -> list[str]:
        """Names of the real directories (not symlinks) in ``path``, sorted, from one listing."""
        try:
            with os.scandir(path) as listing:
                return sorted(entry.name for entry in listing if _is_real_dir(entry))
        except OSError as err:
            raise AttrError(path, os_reason(err)) from err

    def contains(self, host_path: str) -> bool:
        """True if a (normalised) host path lies under the root."""
        root = self._normal
        p = os.path.normpath(host_path)
        return root == "/" or p == root or p.startswith(root + os.sep)

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def is_dir(self, path: str) -> bool:
        """A real directory (symlinks to directories do not count)."""
        try:
            return stat.S_ISDIR(os.lstat(path).st_mode)
        except OSError:
            return False


def _is_real_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:  # no type in the listing, and looking it up failed
        return False


def _joined(link: str, target: str) -> str:
    """A link's target as a path, lexically (relative targets from the link's directory):
    ``normpath(join(dirname(link), target))``, without the two calls (one per PCI function),
    as normpath folds the slashes dirname would strip."""
    return os.path.normpath(target if target.startswith("/") else link[: link.rfind("/") + 1] + target)
