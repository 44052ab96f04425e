"""One reading primitive for sysfs/procfs/dev under a configurable host root.

Every reader in ``discovery`` goes through :class:`HostFS`: it joins paths onto the
root, reads a bounded number of bytes once (broken drivers can return endless or
huge data), and turns the errors sysfs is known to produce into :class:`AttrError`
with a short reason, so a caller loses only that one attribute.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import KeysView

import msgspec

DEFAULT_ROOT = "/"
MAX_ATTR_BYTES = 4096  # sysfs attributes are one page at most
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_LISTED_FLAGS = _READ_FLAGS | os.O_NOFOLLOW  # a listed regular file: a symlink there now was swapped in
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC  # a real directory, no symlink
S_ISREG = stat.S_ISREG

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


def _read_regular(path: str, limit: int) -> bytes:
    """Open, one read, close: for a path already known to be a regular file."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as err:
        raise AttrError(path, os_reason(err)) from err
    try:
        data = os.read(fd, limit + 1)
    except OSError as err:
        raise AttrError(path, os_reason(err)) from err
    finally:
        os.close(fd)
    if len(data) > limit:
        raise AttrError(path, f"larger than {limit} bytes")
    return data


def _refused(data: bytes) -> str:
    """Why an attribute's bytes (within its size limit) are no value."""
    try:
        text = data.decode().strip()
    except UnicodeDecodeError:
        return "not UTF-8"
    return "contains NUL bytes" if text else "empty"


_NO_NAME = frozenset(("", ".", ".."))  # last components of a link target that name nothing


def _target_name(target: str) -> str | None:
    """The last component of a link's target (what it links to); None for none or a dot."""
    if (name := target.rpartition("/")[2]) in _NO_NAME:  # a trailing slash, or a dot
        name = target.rstrip("/").rpartition("/")[2]
    return None if name in _NO_NAME else name


def _attr_text(path: str, data: bytes) -> str:
    try:
        text = data.decode().strip()
    except UnicodeDecodeError:
        text = ""
    if text and "\x00" not in text:
        return text
    raise AttrError(path, _refused(data))


class Dir(msgspec.Struct, frozen=True, gc=False):
    """A directory listed once: its host path and its entries by name (``entries`` None: it
    could not be listed); ``names`` is a view of their names. Readers ask :meth:`has` before
    looking for an optional entry, so an absent one costs no system call. An entry's type is
    asked only of the entries read (:meth:`HostFS.attrs`: a file the listing shows as regular
    is opened without the ``stat`` that otherwise comes first), from the listing's d_type;
    asking all ~30 entries of a PCI function as they were listed was ~60 M instructions of a
    large node's scan. A listing made through a held directory (:meth:`HostFS.open_dir`) is
    asked while that directory is open: an entry without d_type is looked up relative to it."""

    path: str
    entries: dict[str, os.DirEntry] | None = None
    names: KeysView[str] | None = None  # entries.keys(), a field: read several times per function

    def has(self, name: str) -> bool:
        """False only when the listing shows that ``name`` is absent."""
        return self.names is None or name in self.names


class HostFS(msgspec.Struct, frozen=True):
    """A host root (``/`` on a node, ``fixtures/sysfs/<profile>`` in tests). A Struct, as
    ``Dir``: a dataclass decorator cost ~0.7 ms of every ``sysdra`` start."""

    root: str = DEFAULT_ROOT

    def path(self, *parts: str) -> str:
        rel = (parts[0] if len(parts) == 1 else os.path.join(*parts)).lstrip("/")  # join: an absolute part restarts
        root = self.root
        return (root if root.endswith("/") else root + "/") + rel

    def rel(self, host_path: str) -> str:
        """Host path under the root -> path as seen on the node (``/sys/...``)."""
        root = self.root.rstrip("/")
        tail = host_path[len(root):]
        if host_path.startswith(root + "/") and "/." not in tail and "//" not in tail:  # normalised, below root
            return tail.rstrip("/") or "/"
        r = os.path.relpath(host_path, self.root)
        return "/" + ("" if r == "." else r)

    # --- reading -----------------------------------------------------------------
    def read_bytes(self, path: str, limit: int = MAX_ATTR_BYTES) -> bytes:
        """Read at most ``limit`` bytes of a regular file in one go.

        FIFOs, sockets and devices are refused before opening (opening a FIFO blocks, opening
        a device can have side effects). Files of a listed :class:`Dir` are read with
        :meth:`attrs`, which knows their type from the listing and skips the ``stat``.
        """
        data = self.read_present(path, limit)
        if data is None:
            raise AttrError(path, "missing")
        return data

    def read_present(self, path: str, limit: int = MAX_ATTR_BYTES) -> bytes | None:
        """:meth:`read_bytes`, or None when the file is missing: no error is built, raised
        and caught for an optional file that is absent, the common case of a by-path read
        (a VF's netdev has no ``speed`` and no ``phys_port_name``: ~3,000 per large node)."""
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            return None
        except OSError as err:
            raise AttrError(path, os_reason(err)) from err
        if not S_ISREG(mode):
            raise AttrError(path, "directory" if stat.S_ISDIR(mode) else "not a regular file")
        return _read_regular(path, limit)

    def read_text(self, path: str, limit: int = MAX_ATTR_BYTES) -> str:
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
        return _attr_text(path, self.read_bytes(path, limit))

    def read_optional(self, path: str) -> str | None:
        """:meth:`read_attr` of an attribute that may be absent: None when it is missing."""
        data = self.read_present(path)
        return None if data is None else _attr_text(path, data)

    def attrs(self, d: Dir, names: list[str] | tuple[str, ...], errors: dict[str, AttrError],
              dir_fd: int | None = None) -> dict[str, str]:  # fmt: skip
        """Several attributes of a directory in one pass: name -> text as :meth:`read_attr`
        returns it; a name it would raise for goes into ``errors`` with that
        :class:`AttrError`, and absent ones are left out. Of a listed directory, names the
        listing lacks cost no system call, and a file the listing shows as regular is opened
        straight away (O_NOFOLLOW and O_NONBLOCK keep an entry swapped since the listing from
        being followed or blocking), relative to ``dir_fd`` when the caller holds the
        directory open (:meth:`open_dir`). Any other name (of an unlisted :class:`Dir`, or of
        no known type) is read by :meth:`read_present`: its type asked first. The scan's hot
        path (every PCI function), so written out; texts and errors apart, so that callers
        need not tell them apart again."""
        out: dict[str, str] = {}
        base, entries = d.path, d.entries
        _open, _read, _close = os.open, os.read, os.close  # per call: the tracer patches os
        cap = MAX_ATTR_BYTES + 1
        for name in names:
            entry = None
            if entries is not None and (entry := entries.get(name)) is None:
                continue  # the listing lacks it
            try:  # the path is put together only for a read by path or an error
                if entry is not None and entry.is_file(follow_symlinks=False):
                    fd = _open(name, _LISTED_FLAGS, dir_fd=dir_fd) if dir_fd is not None else _open(f"{base}/{name}", _LISTED_FLAGS)
                    try:
                        data = _read(fd, cap)
                    finally:
                        _close(fd)
                elif (data := self.read_present(f"{base}/{name}")) is None:  # not listed, or of no known type
                    continue
            except AttrError as err:
                errors[name] = err
                continue
            except OSError as err:
                errors[name] = AttrError(f"{base}/{name}", os_reason(err))
                continue
            if len(data) < cap:
                try:
                    text = data.decode().strip()
                except UnicodeDecodeError:
                    text = ""
                if text and "\x00" not in text:
                    out[name] = text
                    continue
            errors[name] = AttrError(f"{base}/{name}", f"larger than {MAX_ATTR_BYTES} bytes" if len(data) == cap
                                     else _refused(data))  # fmt: skip
        return out

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

    def link_names(self, d: Dir, names: tuple[str, ...], errors: dict[str, AttrError],
                   dir_fd: int | None = None) -> dict[str, str]:  # fmt: skip
        """:meth:`link_name` of several links of a directory in one pass, as :meth:`attrs`
        reads files: name -> target's last component, a failed one into ``errors``; absent
        links (not listed, or ENOENT) are left out. Read relative to ``dir_fd`` when the
        caller holds ``d`` open; the path is put together for a read by path or an error only."""
        out: dict[str, str] = {}
        base, listed = d.path, d.names
        _readlink = os.readlink  # per call: the tracer patches os
        for name in names:
            if listed is not None and name not in listed:
                continue
            try:
                target = _readlink(f"{base}/{name}") if dir_fd is None else _readlink(name, dir_fd=dir_fd)
            except FileNotFoundError:
                continue
            except OSError as err:
                errors[name] = AttrError(f"{base}/{name}", os_reason(err))
                continue
            if (last := _target_name(target)) is None:
                errors[name] = AttrError(f"{base}/{name}", f"odd link target {target!r}")
            else:
                out[name] = last
        return out

    def resolve_link(self, path: str) -> str:
        """Resolve one symlink (relative to its directory), lexically, no recursion."""
        try:
            target = os.readlink(path)
        except OSError as err:
            raise AttrError(path, os_reason(err)) from err
        return os.path.normpath(os.path.join(os.path.dirname(path), target))

    def follow(self, path: str) -> str:
        """Like :meth:`resolve_link`, but a path that is no symlink (or missing) is returned
        as it is: one ``readlink`` instead of checking first what the path is."""
        try:
            target = os.readlink(path)
        except OSError as err:
            if err.errno in (errno.EINVAL, errno.ENOENT):
                return path
            raise AttrError(path, os_reason(err)) from err
        return os.path.normpath(os.path.join(os.path.dirname(path), target))

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except OSError as err:
            raise AttrError(path, os_reason(err)) from err

    def open_dir(self, path: str) -> int:
        """A real directory (not a symlink to one) opened, for :meth:`list_dir`,
        :meth:`attrs` and :meth:`link_names` relative to it: each of those then looks one name
        up instead of walking the whole path again (a PCI function's directory is ~10
        components deep). The caller closes it."""
        try:
            return os.open(path, _DIR_FLAGS)
        except OSError as err:
            raise AttrError(path, os_reason(err)) from err

    def list_dir(self, path: str, dir_fd: int | None = None) -> Dir:
        """``path`` listed once, its entries kept with the types the listing gave them (d_type:
        no ``stat`` per entry); through ``dir_fd`` (:meth:`open_dir` of ``path``) when the
        caller holds it open."""
        try:
            with os.scandir(path if dir_fd is None else dir_fd) as listing:
                entries = {e.name: e for e in listing}
        except OSError as err:
            raise AttrError(path, os_reason(err)) from err
        return Dir(path, entries, entries.keys())

    def subdirs(self, path: str) -> list[str]:
        """Names of the real directories (not symlinks) in ``path``, sorted, from one listing
        (d_type; an entry without it is looked up by its path)."""
        out = []
        try:
            with os.scandir(path) as listing:
                for entry in listing:
                    try:
                        if entry.is_dir(follow_symlinks=False):
                            out.append(entry.name)
                    except OSError:  # no d_type, and the lstat failed: not known to be a directory
                        pass
        except OSError as err:
            raise AttrError(path, os_reason(err)) from err
        out.sort()
        return out

    def contains(self, host_path: str) -> bool:
        """True if a (normalised) host path lies under the root."""
        root = os.path.normpath(self.root)
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
