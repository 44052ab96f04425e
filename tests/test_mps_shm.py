"""An MPS control daemon's shm (agent/prepare/mps.py): a tmpfs of the configured size at
``<plugin dir>/mps/<uuid>/shm``, mounted before the daemon starts and the daemon's /dev/shm (the
simulated daemon, tests/fake_mps_control.py, writes into its /dev/shm and the file is found in
the host's shm dir); a restart or an adopting agent never mounts it twice; stopping the daemon,
and the clean-up of an orphan, unmount it; a mount that fails is the claim's error and nothing
is left, as when the container runtime's mount namespace does not see the tmpfs. Each case runs
tests/mps_shm_scenario.py in a private mount namespace."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO, require_root, require_tool
from tests.test_mps import UUID, binary  # noqa: F401 - fixture

SIZE = 64 << 20  # the scenario's


def _scenario(tmp_path, binary_path: str, name: str, prefix: tuple[str, ...] = (), **env) -> dict:  # noqa: F811
    require_root()
    for tool in ("unshare", "findmnt", "setpriv"):
        require_tool(tool)
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", *prefix, sys.executable, "-m",
                          "tests.mps_shm_scenario", str(tmp_path / "plugin"), binary_path, UUID, name],
                         cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO, **env}, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_daemons_dev_shm_is_its_sized_tmpfs_mounted_once_and_unmounted_at_stop(tmp_path, binary):  # noqa: F811
    seen = _scenario(tmp_path, binary, "lifecycle")
    shm = str(tmp_path / "plugin" / "mps" / UUID / "shm")
    assert [(m["target"], m["fstype"], m["size"]) for m in seen["mounts"]] == [(shm, "tmpfs", SIZE)]
    assert {"nosuid", "nodev"} <= set(seen["mounts"][0]["options"].split(","))
    # written by the daemon to its /dev/shm, found in the host's shm dir: the same tmpfs
    assert seen["marks"] == [f"fake-mps-{seen['first']}"] and seen["mark_text"] == UUID
    assert seen["daemon_dev_shm"][-1][0] == "tmpfs" and f"size={SIZE >> 10}k" in seen["daemon_dev_shm"][-1][1]
    again = seen["after_restart"]
    assert again["mounts"] == 1  # started again on the same tmpfs (what the first daemon left is there)
    assert again["marks"] == sorted([f"fake-mps-{seen['first']}", f"fake-mps-{again['second']}"])
    assert seen["after_supervisor_restart"] == 1 and seen["after_adoption"] == 1
    assert seen["after_stop"] == {"mounts_below": [], "dir": False}


def test_an_orphans_tmpfs_is_unmounted_and_the_orphan_ended(tmp_path, binary):  # noqa: F811
    assert _scenario(tmp_path, binary, "orphan") == {"mounts_below": [], "dir": False, "orphan_runs": False}


def test_a_mount_that_fails_is_the_claims_error_and_leaves_nothing(tmp_path, binary):  # noqa: F811
    no_cap = _scenario(tmp_path, binary, "refused", ("setpriv", "--inh-caps=-sys_admin", "--bounding-set=-sys_admin"))
    assert "mounting a tmpfs at" in no_cap["error"] and "CAP_SYS_ADMIN" in no_cap["error"]
    assert {k: no_cap[k] for k in ("kept", "records", "dir", "mounts_below", "daemons")} == \
        {"kept": True, "records": [], "dir": False, "mounts_below": [], "daemons": []}
    other = _scenario(tmp_path, binary, "refused", OTHER_FS="1")  # another file system there
    assert "is a mount of ramfs, not the daemon's tmpfs" in other["error"]
    assert {k: other[k] for k in ("kept", "records", "dir", "mounts_below", "daemons")} == \
        {"kept": True, "records": [], "dir": False, "mounts_below": [], "daemons": []}
    # mounted in the agent's private namespace only: the runtime (here: this test) would not see it
    unseen = _scenario(tmp_path, binary, "refused", RUNTIME_PID=str(os.getpid()))
    assert f"is not in the mount namespace of PID {os.getpid()}, where the container runtime binds it" in unseen["error"]
    assert {k: unseen[k] for k in ("kept", "records", "dir", "mounts_below", "daemons")} == \
        {"kept": True, "records": [], "dir": False, "mounts_below": [], "daemons": []}
