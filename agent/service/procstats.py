"""The agent's own process as psutil sees it (resident and virtual memory, CPU time, threads,
open file descriptors and their limit, start time): shown by ``sysdra status`` and exported as
the standard ``process_*`` metrics. Read when asked, from ``/proc``, in well under a millisecond."""

from __future__ import annotations

import functools
import logging

log = logging.getLogger("sysdra.status")


@functools.cache
def _me():
    import psutil

    return psutil.Process()


def usage() -> dict | None:
    """This process's resource use; None where psutil cannot read it (no ``/proc``)."""
    import psutil

    try:
        p = _me()
        with p.oneshot():
            mem, cpu = p.memory_info(), p.cpu_times()
            return {"rssBytes": mem.rss, "virtualBytes": mem.vms, "cpuSeconds": round(cpu.user + cpu.system, 3),
                    "threads": p.num_threads(), "openFds": p.num_fds(), "maxFds": p.rlimit(psutil.RLIMIT_NOFILE)[0],
                    "startTime": p.create_time()}
    except (psutil.Error, OSError) as err:
        log.debug("process figures unavailable: %s", err)
        return None
