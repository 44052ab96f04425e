"""Full disk, run by test_full_disk.py as ``unshare -m --propagation private python -m
tests.faults.fulldisk_scenario TMP``: a private mount namespace, so the 96 KiB tmpfs
holding the CDI dir and the kubelet (state) dir disappears with the process whatever
happens. Prints one JSON line of results; exits non-zero with the reason on a failure."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import tempfile

from agent.prepare.checkpoint import COMPLETED, Checkpoint
from tests.faults.harness import Node, run

SIZE = "96k"  # room for two claims' files (a page each on tmpfs) once the filler is gone


def fill(path: str) -> int:
    """Write until ENOSPC; returns the bytes written."""
    n = 0
    with open(path, "ab", buffering=0) as f:
        while True:
            try:
                n += f.write(b"\0" * 1024)
            except OSError as err:
                if err.errno != errno.ENOSPC:
                    raise
                return n


def no_partial(node: Node, uid: str, name: str) -> None:
    """While running, after a failed prepare: no temp file, the checkpoint loads, and the
    claim's files exist only if the checkpoint records the claim (prepared or being prepared)."""
    assert not node.temp_files(), f"temp files left: {node.temp_files()}"
    cp = Checkpoint.load(os.path.join(node.plugin_dir, "checkpoint.json"), move_corrupt=False)
    if uid not in cp.claims:
        left = [n for n in os.listdir(node.cdi_dir) if uid in n]
        assert not left, f"files of the failed claim left: {left}"
        mdir = os.path.join(node.plugin_dir, "dra-device-metadata", f"default_{name}")
        assert not os.path.exists(mdir), f"metadata dir of the failed claim left: {mdir}"


def main(tmp: str) -> int:
    small = tempfile.mkdtemp(prefix="sdfd-")  # short: socket paths are limited to 108 bytes
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SIZE},mode=0755", "tmpfs", small], check=True)
    try:
        return scenario(tmp, small)
    finally:
        subprocess.run(["umount", "-l", small], check=False)
        os.rmdir(small)


def scenario(tmp: str, small: str) -> int:
    node = Node(tmp, cdi_dir=os.path.join(small, "cdi"), kubelet_dir=os.path.join(small, "kubelet"))
    devs = node.devices()
    g = [d for d in devs if d.startswith("gpu-")]
    a = node.write_claim("a", [("gpu", g[0])], uid="0000000a-0000-4000-8000-0000000d15c0")
    b = node.write_claim("b", [("gpu", g[1]), ("gpu2", g[2])], uid="0000000b-0000-4000-8000-0000000d15c0",
                         pod_claim_name="two")
    ua, ub = a["metadata"]["uid"], b["metadata"]["uid"]
    out = {"steps": [], "errors": []}
    node.start()
    try:
        r = run(node.prepare(a))
        assert not r.claims[ua].error, r.claims[ua].error
        filler = os.path.join(small, "filler")
        fill(filler)
        # free one page at a time: the failure moves through every write of a prepare
        size = os.path.getsize(filler)
        ok = False
        while not ok:
            r = run(node.prepare(b))
            err = r.claims[ub].error
            out["steps"].append({"free": os.statvfs(small).f_bavail * os.statvfs(small).f_frsize, "error": err})
            if err:
                assert "disk full" in err, f"prepare error does not name the cause: {err}"
                out["errors"].append(err)
                no_partial(node, ub, "b")
                if size == 0:
                    raise AssertionError("prepare still fails with the disk empty")
                size = max(0, size - 4096)
                os.truncate(filler, size)
            else:
                ok = True
        on_disk = Checkpoint.load(os.path.join(node.plugin_dir, "checkpoint.json"), move_corrupt=False).claims
        out["recorded_completed"] = on_disk.get(ub, {}).get("state") == COMPLETED
        # the prepared claim survives a restart (see test_checkpoint_save_failure_then_retry: it may not)
        assert node.stop() == 0
        node.start()
        cp = node.check_state()
        assert ua in cp.claims, f"claim a lost across a restart: {list(cp.claims)}"
        out["survived_restart"] = ub in cp.claims
        # unprepare with the disk full: a clear error or success, never a half state
        fill(filler)
        r = run(node.unprepare(a))
        out["unprepare_full"] = r.claims[ua].error
        assert not r.claims[ua].error or "disk full" in r.claims[ua].error, r.claims[ua].error
        os.unlink(filler)  # space is back
        r = run(node.unprepare(a, b))
        assert not r.claims[ua].error and not r.claims[ub].error, r
        on_disk = Checkpoint.load(os.path.join(node.plugin_dir, "checkpoint.json"), move_corrupt=False).claims
        out["unprepare_retry_recorded"] = not on_disk  # see test_unprepare_checkpoint_save_failure_then_retry
        assert node.stop() == 0
        node.start()
        node.check_state()
        out["resurrected"] = sorted(Checkpoint.load(os.path.join(node.plugin_dir, "checkpoint.json")).claims)
        r = run(node.unprepare(a, b))
        assert not r.claims[ua].error and not r.claims[ub].error, r
        node.check_clean()
        r = run(node.prepare(a, b))
        assert not r.claims[ua].error and not r.claims[ub].error, r
        r = run(node.unprepare(a, b))
        node.check_clean()
        assert node.stop() == 0
    except BaseException as err:
        node.kill()
        out["failure"] = f"{type(err).__name__}: {err}"
        out["log"] = node.log_tail(30)
        print(json.dumps(out), flush=True)
        return 1
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
