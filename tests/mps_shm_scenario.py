"""Run by tests/test_mps_shm.py inside ``unshare --mount --propagation private`` (the host's
mount table is never touched): MPS control daemons (agent/prepare/mps.py) on the simulated
binary, their shm tmpfs and the daemon's /dev/shm. Prints one JSON object of what it saw.

    python -m tests.mps_shm_scenario PLUGIN_DIR BINARY UUID SCENARIO

``lifecycle``: start, kill and start again, adopt from a new agent, stop; ``orphan``: the records
lost while a daemon ran, then an agent that starts with no share; ``refused``: a start whose
mount fails (run without CAP_SYS_ADMIN), finds another file system at the shm dir, or whose tmpfs
the runtime's namespace (``RUNTIME_PID``'s) does not see; its directories kept while the GPU is
wanted, gone once it is not.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import psutil

from agent.prepare import mps_records
from agent.prepare.mps import MpsDaemons

SIZE = 64 << 20


def _mounts(path: str) -> list[dict]:
    """findmnt's view (not the agent's own parser) of every mount at ``path``."""
    out = subprocess.run(["findmnt", "--json", "--mountpoint", path, "--output", "TARGET,FSTYPE,OPTIONS,SIZE",
                          "--bytes"], capture_output=True, text=True)
    return json.loads(out.stdout)["filesystems"] if out.stdout.strip() else []


def _marks(shm: str) -> list[str]:
    return sorted(n for n in os.listdir(shm) if n.startswith("fake-mps-")) if os.path.isdir(shm) else []


def _kill(d: MpsDaemons, uuid: str) -> int:
    pid = d.state.daemons[uuid].pid
    os.kill(pid, signal.SIGKILL)
    psutil.Process(pid).wait(5)
    return pid


def lifecycle(plugin: str, binary: str, uuid: str) -> dict:
    d = MpsDaemons(plugin, binary, boot_id="boot", shm_size=SIZE)
    d.runtime_pid = os.getpid()  # the runtime shares the agent's namespace: the tmpfs is seen there
    shm, seen = d.dirs(uuid)["shm"], {}
    assert d.reconcile({uuid}) == {}
    first = d.state.daemons[uuid].pid
    seen["mounts"] = _mounts(shm)
    seen["marks"] = _marks(shm)
    seen["first"] = first
    with open(os.path.join(shm, f"fake-mps-{first}")) as f:
        seen["mark_text"] = f.read()
    with open(f"/proc/{first}/mountinfo") as f:  # the daemon's own namespace: /dev/shm is a tmpfs of that size
        seen["daemon_dev_shm"] = [ln.split(" - ")[1].split()[0::2] for ln in f if ln.split()[4] == "/dev/shm"]
    _kill(d, uuid)
    assert d.reconcile({uuid}) == {}  # started again: the tmpfs is kept, not mounted twice
    second = d.state.daemons[uuid].pid
    seen["after_restart"] = {"mounts": len(_mounts(shm)), "marks": _marks(shm), "second": second}
    _kill(d, uuid)
    assert d.restart(uuid) is not None  # the supervisor's restart: the same
    seen["after_supervisor_restart"] = len(_mounts(shm))
    adopting = MpsDaemons(plugin, binary, boot_id="boot", shm_size=SIZE)  # the agent restarted
    assert adopting.reconcile({uuid}) == {} and adopting.state.daemons[uuid] == d.state.daemons[uuid]
    seen["after_adoption"] = len(_mounts(shm))
    adopting.reconcile(set())
    seen["after_stop"] = {"mounts_below": mps_records.mounts_below(adopting.base),
                          "dir": os.path.exists(os.path.join(adopting.base, uuid))}
    return seen


def orphan(plugin: str, binary: str, uuid: str) -> dict:
    d = MpsDaemons(plugin, binary, boot_id="boot", shm_size=SIZE)
    assert d.reconcile({uuid}) == {}
    pid = d.state.daemons[uuid].pid
    os.remove(d.path)  # records lost (moved aside, a wiped file): the dirs name the GPU only
    later = MpsDaemons(plugin, binary, boot_id="boot", shm_size=SIZE)
    assert later.reconcile(set()) == {}
    d.alive(d.state.daemons[uuid])  # reap it if it ended
    return {"mounts_below": mps_records.mounts_below(later.base), "dir": os.path.exists(os.path.join(later.base, uuid)),
            "orphan_runs": psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE}


def refused(plugin: str, binary: str, uuid: str) -> dict:
    d = MpsDaemons(plugin, binary, boot_id="boot", shm_size=SIZE)
    if os.environ.get("OTHER_FS"):  # another file system at the shm dir (and the right to mount)
        os.makedirs(d.dirs(uuid)["shm"])
        subprocess.run(["mount", "-t", "ramfs", "ramfs", d.dirs(uuid)["shm"]], check=True)
    if os.environ.get("RUNTIME_PID"):  # the runtime's namespace is another (the test's)
        d.runtime_pid = int(os.environ["RUNTIME_PID"])
    error = d.reconcile({uuid}).get(uuid)
    kept = os.path.exists(os.path.join(d.base, uuid))  # while a share may need them (still wanted)
    d.reconcile(set())  # what the failed claim's step does next: no other share needs the GPU
    seen = {"error": error, "kept": kept, "records": list(d.state.daemons),
            "dir": os.path.exists(os.path.join(d.base, uuid)), "mounts_below": mps_records.mounts_below(d.base)}
    seen["daemons"] = [p.pid for p in psutil.process_iter(["cmdline"]) if (p.info["cmdline"] or [])[-1:] == ["-f"]
                       and binary in (p.info["cmdline"] or [])]
    return seen


if __name__ == "__main__":
    plugin_dir, binary_path, gpu, scenario = sys.argv[1:5]
    print(json.dumps({"lifecycle": lifecycle, "orphan": orphan, "refused": refused}[scenario](plugin_dir, binary_path, gpu)))
