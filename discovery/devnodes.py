"""Device nodes (``/dev/...``) with type and major:minor.

Sources, in order of trust: the real node under ``ROOT/dev`` when it is a char or
block device; else the sysfs ``dev`` file of the class device (``226:128``); else a
major from ``/proc/devices`` plus a known minor. A node that none of these resolve is
reported as a problem, never guessed.
"""

from __future__ import annotations

import os
import re
import stat
from functools import cached_property

from discovery.models import DeviceNode, Problem
from discovery.sysfs import AttrError, HostFS

_DEV_RE = re.compile(r"^(\d+):(\d+)$")


def parse_dev(text: str) -> tuple[int, int]:
    """Contents of a sysfs ``dev`` file: ``"226:128"`` -> (226, 128)."""
    m = _DEV_RE.match(text.strip())
    if not m:
        raise ValueError(f"not MAJOR:MINOR: {text[:30]!r}")
    return int(m.group(1)), int(m.group(2))


def parse_proc_devices(text: str) -> dict[str, int]:
    """Character-device section of /proc/devices: name -> major (first wins)."""
    majors: dict[str, int] = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("Block devices"):
            break
        parts = line.split(None, 1)
        if len(parts) == 2 and parts[0].isascii() and parts[0].isdigit():
            majors.setdefault(parts[1].strip(), int(parts[0]))
    return majors


class NodeResolver:
    """Resolves device nodes for one scan (caches /proc/devices)."""

    def __init__(self, fs: HostFS):
        self.fs = fs
        self.problems: list[Problem] = []  # node-wide (unreadable /proc/devices)
        self.shared_nodes: dict[str, tuple[DeviceNode | None, tuple[Problem, ...]]] = {}

    def shared(self, key: str, problems: list[Problem], resolve) -> DeviceNode | None:
        """A node every device of a kind shares (``/dev/vfio/vfio``): ``resolve(problems)``
        once per scan run (the scanner clears ``shared_nodes``), its problems reported to
        every device that asks."""
        if key not in self.shared_nodes:
            found: list[Problem] = []
            self.shared_nodes[key] = (resolve(found), tuple(found))
        node, found = self.shared_nodes[key]
        problems.extend(found)
        return node

    @cached_property
    def char_majors(self) -> dict[str, int]:
        try:
            return parse_proc_devices(self.fs.read_text(self.fs.path("proc/devices"), limit=65536))
        except AttrError as err:
            self.problems.append(Problem(what="/proc/devices", reason=err.reason))
            return {}

    def _from_real_node(self, path: str) -> DeviceNode | None:
        host = self.fs.path(path)
        try:
            st = os.stat(host)
        except OSError:
            return None
        if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            return DeviceNode(
                path=path,
                host_path=host,
                type="c" if stat.S_ISCHR(st.st_mode) else "b",
                major=os.major(st.st_rdev),
                minor=os.minor(st.st_rdev),
                source="device node",
            )
        return None

    def resolve(
        self,
        path: str,
        problems: list[Problem],
        *,
        sysfs_dev: str | None = None,
        proc_name: str | None = None,
        major: int | None = None,
        minor: int | None = None,
    ) -> DeviceNode | None:
        """Resolve ``path`` (e.g. ``/dev/dri/renderD128``).

        ``sysfs_dev``: host path of the class device's ``dev`` file. ``proc_name``: the
        /proc/devices name for a dynamic major; ``major``: a fixed major; ``minor``: the
        minor when it is known from elsewhere (``Device Minor`` of nvidia).
        """
        node = self._from_real_node(path)
        if node is not None:
            return node
        host = self.fs.path(path)
        if sysfs_dev is not None:
            try:
                maj, mi = parse_dev(self.fs.read_attr(sysfs_dev))
                return DeviceNode(path=path, host_path=host, major=maj, minor=mi, source="sysfs dev file")
            except AttrError as err:
                problems.append(Problem(what=path, reason=f"{self.fs.rel(sysfs_dev)}: {err.reason}"))
            except ValueError as err:
                problems.append(Problem(what=path, reason=f"{self.fs.rel(sysfs_dev)}: {err}"))
        if minor is not None:
            maj = major
            if maj is None and proc_name is not None:
                maj = self.char_majors.get(proc_name)
            if maj is not None:
                return DeviceNode(path=path, host_path=host, major=maj, minor=minor, source="/proc/devices")
            if proc_name is not None:
                problems.append(Problem(what=path, reason=f"no {proc_name!r} major in /proc/devices"))
        if sysfs_dev is None and minor is None:
            problems.append(Problem(what=path, reason="no source for major:minor"))
        return None
