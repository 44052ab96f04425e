"""The host's boot identity, which tells recovery whether the node rebooted since a claim
was prepared (device numbers and tmpfs contents do not survive a reboot).

Read like every host file: through discovery's bounded, non-blocking reader, so a FIFO, a
huge file or garbage at ``<root>/proc/sys/kernel/random/boot_id`` cannot hang or crash the
agent. Fallback, in order: the boot_id under ``--root``, this system's own, then ``btime``
(boot time, seconds) from ``/proc/stat`` as ``btime-<n>``; if none is readable the ID is ""
and every recorded claim counts as prepared before a reboot: recovery rewrites their CDI
specs and metadata from the checkpoint, which is always safe, only slower."""

from __future__ import annotations

import logging
import re

from discovery.sysfs import AttrError, HostFS

log = logging.getLogger(__name__)

BOOT_ID = "proc/sys/kernel/random/boot_id"
# the kernel writes a UUID; anything printable and short is accepted (test trees use names)
_PLAUSIBLE = re.compile(r"[A-Za-z0-9][-A-Za-z0-9_.]{0,63}")


def _boot_id(fs: HostFS) -> str:
    text = fs.read_attr(fs.path(BOOT_ID), limit=128)
    if not _PLAUSIBLE.fullmatch(text):
        raise AttrError(fs.path(BOOT_ID), "not a boot ID")
    return text


def _btime(fs: HostFS) -> str:
    for line in fs.read_text(fs.path("proc/stat"), limit=1 << 20).splitlines():
        if line.startswith("btime "):
            value = line.split()[1]
            if value.isdigit():
                return f"btime-{value}"
    raise AttrError(fs.path("proc/stat"), "no btime line")


def read_boot_id(root: str = "/") -> str:
    """The boot ID under ``root``, else this system's; a warning names what was unreadable."""
    problems = []  # files that exist but are not a boot ID (a missing one under a fixture root is normal)
    for base in dict.fromkeys((root, "/")):
        try:
            boot = _boot_id(HostFS(base))
        except AttrError as err:
            if err.reason != "missing":
                problems.append(str(err))
            continue
        if problems:
            log.warning("boot ID unreadable (%s): using %s's", "; ".join(problems), base)
        return boot
    try:
        boot = _btime(HostFS("/"))
    except AttrError as err:
        problems.append(str(err))
        boot = ""
    problems = problems or ["missing"]
    log.warning("boot ID unreadable (%s): using %r; with no boot ID every prepared claim is treated as "
                "prepared before a reboot and its files are rewritten at start", "; ".join(problems), boot)
    return boot
