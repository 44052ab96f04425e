"""Regression tests for the defects an adversarial review found (issue: hardening). Each runs
the real agent over its real sockets and fails on the code before the fix:

1. a claim's own metadata (name with ``../``) steering metadata writes and ``rmtree``;
2. one malformed claim (or malformed results) failing the whole NodePrepareResources;
3. a FIFO or garbage ``boot_id`` hanging or crashing the agent;
4. a swapped kubelet-dir symlink plus a crafted checkpoint deleting an arbitrary file.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from agent.prepare.checkpoint import COMPLETED, Checkpoint
from tests.conftest import REPO
from tests.faults.harness import BOOT_ID, DRIVER, Node, run, snapshot
from tests.faults.test_hostile import errors_of, outside_writes

pytestmark = pytest.mark.slow
UID = "00000000-0000-4000-8000-00000000a001"
UID2 = "00000000-0000-4000-8000-00000000a002"
UID3 = "00000000-0000-4000-8000-00000000a003"


def _gpus(node: Node) -> list[str]:
    return [d for d in node.devices() if d.startswith("gpu-")]


def _claim_file(node: Node, name: str, obj: object, namespace: str = "default") -> None:
    d = os.path.join(node.cluster, "resourceclaims", namespace)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name + ".json"), "w") as f:
        json.dump(obj, f)


def _victim(node: Node) -> str:
    victim = os.path.join(node.tmp, "victim")
    os.makedirs(victim, exist_ok=True)
    with open(os.path.join(victim, "keep.txt"), "w") as f:
        f.write("keep me\n")
    return victim


def test_claim_metadata_cannot_traverse(node, faults):
    """Defect 1: the fetched claim's name/namespace must equal the request's."""
    victim = _victim(node)
    g = _gpus(node)
    evil_name = "base/" + "../" * 30 + victim.lstrip("/")
    for i, (field, value) in enumerate((("name", evil_name), ("namespace", "../" * 30 + victim.lstrip("/")))):
        obj = node.write_claim("trav", [("gpu", g[i])], uid=UID)
        obj["metadata"][field] = value
        _claim_file(node, "trav", obj)
        before = snapshot(node.tmp)
        err = errors_of(run(node.prepare(("default", "trav", UID))))[UID]
        assert err and field in err and "trav" in err, err
        assert outside_writes(node, before) == []
        assert os.listdir(victim) == ["keep.txt"]
        faults.add("Hostile input", f"claim whose metadata.{field} holds ../ to a foreign dir", 1,
                   "per-claim error naming the mismatch; nothing written or removed")
    # another claim's identity: claim B's file says it is claim A (overwriting A's metadata)
    a = node.write_claim("a", [("gpu", g[0])], uid=UID2)
    assert not errors_of(run(node.prepare(a)))[UID2]
    b = node.write_claim("b", [("gpu", g[1])], uid=UID3)
    b["metadata"]["name"] = "a"
    _claim_file(node, "b", b)
    err = errors_of(run(node.prepare(("default", "b", UID3))))[UID3]
    assert err and "name" in err
    faults.add("Hostile input", "claim file naming another claim's namespace/name", 1, "per-claim error; the other claim's metadata untouched")
    assert not errors_of(run(node.unprepare(a)))[UID2]
    node.check_clean()


def test_bad_names_are_refused_not_trimmed(node, faults):
    g = _gpus(node)
    cases = {
        "request name a/b/c": ([("a/b/c", g[0])], None, "request"),
        "request name ../x": ([("../x", g[0])], None, "request"),
        "request name with upper case": ([("GPU", g[0])], None, "request"),
        "pod-claim-name annotation ../x": ([("gpu", g[0])], "../x", "pod-claim-name"),
    }
    for i, (what, (results, pcn, word)) in enumerate(cases.items()):
        uid = f"00000000-0000-4000-8000-0000000b{i:04d}"
        node.write_claim(f"n{i}", results, uid=uid, pod_claim_name=pcn)
        before = snapshot(node.tmp)
        err = errors_of(run(node.prepare(("default", f"n{i}", uid))))[uid]
        assert err and word in err, (what, err)
        assert outside_writes(node, before) == []
        faults.add("Hostile input", f"claim with {what}", 1, f"per-claim error ('{word}'), nothing recorded")
    cp = Checkpoint.load(os.path.join(node.plugin_dir, "checkpoint.json"), move_corrupt=False)
    assert cp.claims == {}


def test_malformed_claim_is_that_claims_error(node, faults):
    """Defect 2: a malformed claim or result never fails the call, and is checked before
    anything is recorded (a retry gets the same clear error, not a stuck claim)."""
    g = _gpus(node)
    good = node.write_claim("good", [("gpu", g[0])], uid=UID)
    shapes = {
        "metadata is a string": {"metadata": "str", "status": 5},
        "metadata is a list": {"metadata": ["a"], "status": {}},
        "status is a number": None,
        "results not a list": None,
        "shareID is an object": None,
        "the same device twice": None,
        "annotations is a list": None,
    }
    refs = []
    for i, what in enumerate(shapes):
        uid = f"00000000-0000-4000-8000-0000000c{i:04d}"
        name = f"bad{i}"
        obj = shapes[what]
        if obj is None:
            obj = node.write_claim(name, [("gpu", g[1]), ("gpu2", g[2])], uid=uid)
            alloc = obj["status"]["allocation"]["devices"]
            if what == "status is a number":
                obj["status"] = 5
            elif what == "results not a list":
                alloc["results"] = {"a": 1}
            elif what == "shareID is an object":
                alloc["results"][0]["shareID"] = {"x": 1}
            elif what == "the same device twice":
                alloc["results"][1]["device"] = alloc["results"][0]["device"]
            elif what == "annotations is a list":
                obj["metadata"]["annotations"] = ["x"]
        _claim_file(node, name, obj)
        refs.append(("default", name, uid))
    for attempt in range(2):  # the retry must answer the same way
        errs = errors_of(run(node.prepare(good, *refs)))
        assert errs[UID] == "", errs[UID]
        for (ns, name, uid), what in zip(refs, shapes):
            assert errs[uid], (what, "no error")
    cp = Checkpoint.load(os.path.join(node.plugin_dir, "checkpoint.json"), move_corrupt=False)
    assert set(cp.claims) == {UID} and cp.claims[UID]["state"] == COMPLETED
    for what in shapes:
        faults.add("Hostile input", f"claim in a batch with a valid one: {what}", 2,
                   "that claim's error (same on retry), the valid claim prepared, nothing recorded for the bad one")
    assert not errors_of(run(node.unprepare(good)))[UID]
    assert node.proc.poll() is None


@pytest.mark.parametrize("what", ["FIFO", "non-UTF-8 bytes", "1 MB of garbage"])
def test_odd_boot_id_gives_a_warning_not_a_hang(tmp_path, what, faults):
    """Defect 3: boot_id goes through the bounded, non-blocking reader."""
    node = Node(tmp_path)
    path = os.path.join(node.root, BOOT_ID)
    os.unlink(path)
    if what == "FIFO":
        os.mkfifo(path)
    else:
        with open(path, "wb") as f:
            f.write(b"\xff\xfe\x80boot\n" if what == "non-UTF-8 bytes" else os.urandom(1 << 20))
    node.start(timeout=30)
    g = _gpus(node)
    c = node.write_claim("c", [("gpu", g[0])], uid=UID)
    assert not errors_of(run(node.prepare(c)))[UID]
    t0 = time.monotonic()
    rc = node.stop()
    took = time.monotonic() - t0
    log = node.log_tail(200)
    assert rc == 0, (rc, took)  # a hang past stop()'s 15 s is killed: rc -9
    assert "Traceback" not in log
    assert "boot ID" in log and "unreadable" in log
    faults.add("Hostile input", f"boot_id is a {what}", 1, f"warning, documented fallback; SIGTERM exits in {took:.1f}s")


def test_sigterm_at_every_stage_of_start_up(tmp_path, faults):
    node = Node(tmp_path)
    delays = (0.0, 0.05, 0.15, 0.3, 0.5, 0.8, 1.2)
    for delay in delays:
        proc = node.start(wait=False)
        time.sleep(delay)
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"SIGTERM {delay}s into start-up was ignored:\n{node.log_tail()}")
        assert rc in (0, -signal.SIGTERM), (delay, rc, node.log_tail())
        assert "Traceback" not in node.log_tail(200), node.log_tail(200)
    faults.add("Hostile input", "SIGTERM during start-up (0 to 1.2 s in)", len(delays), "exits within 10 s, no traceback")


def _crafted_checkpoint(plugin_dir: str, entries: dict) -> None:
    os.makedirs(plugin_dir, exist_ok=True)
    cp = Checkpoint(os.path.join(plugin_dir, "checkpoint.json"))
    cp.claims = entries
    cp.save()


def _entry(cdi_path: str, namespace: str = "default", name: str = "x") -> dict:
    spec = {"cdiVersion": "0.5.0", "kind": "k8s.sysdra.io/claim", "devices": [{"name": "d", "containerEdits": {"env": ["A=1"]}}]}
    return {"state": COMPLETED, "namespace": namespace, "name": name, "bootID": "boot-0", "allocation": "",
            "devices": [], "cdiSpec": {"path": cdi_path, "spec": spec}, "metadata": None}


def test_swapped_kubelet_dir_symlink_cannot_delete_foreign_files(tmp_path, faults):
    """Defect 4: directories are resolved once at start; checkpoint paths are untrusted."""
    real_a = tmp_path / "kubelet-a"
    real_b = tmp_path / "kubelet-b"
    real_a.mkdir()
    link = tmp_path / "kubelet"
    link.symlink_to(real_a)
    node = Node(tmp_path, kubelet_dir=str(link))
    victim_file = tmp_path / "victim-file"
    victim_file.write_text("precious\n")
    node.start()
    try:
        g = _gpus(node)
        c = node.write_claim("c", [("gpu", g[0])], uid=UID)
        assert not errors_of(run(node.prepare(c)))[UID]
        # a checkpoint elsewhere names a foreign file as the claim's spec; swap the symlink to it
        _crafted_checkpoint(str(real_b / "plugins" / DRIVER), {UID2: _entry(str(victim_file))})
        link.unlink()
        link.symlink_to(real_b)
        before = snapshot(str(tmp_path))
        assert not errors_of(run(node.unprepare(("default", "x", UID2))))[UID2]
        assert victim_file.read_text() == "precious\n"
        # the agent still works in the directory it resolved at start
        assert not errors_of(run(node.unprepare(c)))[UID]
        assert not (real_a / "plugins" / DRIVER / "dra-device-metadata" / "default_c").exists()
        changed = [p for p in outside_writes(node, before) if not p.startswith(str(real_a) + "/")]
        assert changed == [], changed
    finally:
        node.stop()
    faults.add("Hostile input", "kubelet-dir symlink swapped to a dir with a crafted checkpoint", 1,
               "ignored: dirs resolved once at start; the foreign file is kept")


def test_checkpoint_paths_are_untrusted(tmp_path, faults):
    """A checkpoint written by someone else (or restored from elsewhere) names files outside
    our directories and another vendor's CDI spec: recovery and unprepare touch none of them."""
    node = Node(tmp_path)
    victim = _victim(node)
    victim_file = os.path.join(node.tmp, "victim-file")
    with open(victim_file, "w") as f:
        f.write("precious\n")
    os.makedirs(node.cdi_dir, exist_ok=True)
    other_vendor = os.path.join(node.cdi_dir, "nvidia.com-gpu.json")
    with open(other_vendor, "w") as f:
        f.write("{}\n")
    # well-formed entries whose recorded spec paths are not ours: loaded, paths not trusted
    _crafted_checkpoint(node.plugin_dir, {UID: _entry(victim_file), UID2: _entry(other_vendor)})
    before = snapshot(node.tmp)
    node.start()
    try:
        for uid in (UID, UID2):
            assert not errors_of(run(node.unprepare(("default", "x", uid))))[uid]
        assert outside_writes(node, before) == []
        assert open(victim_file).read() == "precious\n" and os.path.exists(other_vendor)
    finally:
        node.stop()
    # an entry whose namespace climbs out of the metadata dir: not ours, moved aside whole
    _crafted_checkpoint(node.plugin_dir, {
        UID3: _entry(os.path.join(victim, "spec.json"), namespace="../" * 10 + victim.lstrip("/"), name="keep.txt")})
    before = snapshot(node.tmp)
    node.start()
    try:
        assert "CHECKPOINT CORRUPT" in node.log_tail(200)
        assert not errors_of(run(node.unprepare(("default", "x", UID3))))[UID3]
        assert outside_writes(node, before) == []
        assert sorted(os.listdir(victim)) == ["keep.txt"] and os.path.exists(other_vendor)
    finally:
        node.stop()
    faults.add("Hostile input", "checkpoint naming a foreign file and another vendor's spec as a claim's spec", 2,
               "both kept; recovery writes and unprepare removes only our own files")
    faults.add("Hostile input", "checkpoint entry with ../ in its namespace", 1, "not a checkpoint we wrote: moved aside, loud log")


def test_unsafe_directories_and_a_second_agent_are_refused(tmp_path, faults):
    node = Node(tmp_path)
    node.start()
    try:
        # a second agent on the same plugin dir and socket names: refused, the first keeps serving
        second = subprocess.run(node.command(), cwd=REPO, env={**os.environ, "SYSDRA_CONFIG": os.devnull, "PYTHONPATH": REPO},
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 75, (second.returncode, second.stderr)
        assert "another sysdra agent" in second.stderr and "Traceback" not in second.stderr
        assert len(second.stderr.strip().splitlines()) == 1, second.stderr
        g = _gpus(node)
        c = node.write_claim("c", [("gpu", g[0])], uid=UID)
        assert not errors_of(run(node.prepare(c)))[UID]
        assert not errors_of(run(node.unprepare(c)))[UID]
    finally:
        node.stop()
    faults.add("Hostile input", "a second `sysdra run` on the same plugin dir", 1, "refused (exit 75, one line); the first keeps serving")
    # a kubelet dir anyone can write to: refused at start with one line
    os.chmod(node.kubelet_dir, 0o777)
    out = subprocess.run(node.command(), cwd=REPO, env={**os.environ, "SYSDRA_CONFIG": os.devnull, "PYTHONPATH": REPO},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 77, (out.returncode, out.stderr)
    assert "writable" in out.stderr and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    faults.add("Hostile input", "kubelet dir writable by others", 1, "refused at start (exit 77, one line)")
    # a cluster directory that cannot be made (here a file's path; under systemd a read-only one)
    os.chmod(node.kubelet_dir, 0o755)
    with open(tmp_path / "a-file", "w"):
        pass
    out = subprocess.run(node.command(cluster=f"dir:{tmp_path / 'a-file' / 'cluster'}"), cwd=REPO, capture_output=True,
                         text=True, env={**os.environ, "SYSDRA_CONFIG": os.devnull, "PYTHONPATH": REPO}, timeout=60)
    assert out.returncode == 73, (out.returncode, out.stderr)
    assert "cluster directory" in out.stderr and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    faults.add("Hostile input", "a cluster directory that cannot be made", 1, "refused at start (exit 73, one line)")


def test_modes_do_not_depend_on_the_umask(tmp_path, faults):
    node = Node(tmp_path)
    old = os.umask(0)  # the agent inherits it
    try:
        node.start()
    finally:
        os.umask(old)
    try:
        g = _gpus(node)
        c = node.write_claim("c", [("gpu", g[0])], uid=UID)
        assert not errors_of(run(node.prepare(c)))[UID]
        modes = {}
        for top in (node.kubelet_dir, node.cdi_dir):
            for d, dirs, files in os.walk(top):
                for n in dirs + files:
                    p = os.path.join(d, n)
                    st = os.lstat(p)
                    if os.path.islink(p):
                        continue
                    if stat.S_ISSOCK(st.st_mode):  # the kubelet's sockets: 0660 (root's group), status 0600
                        assert st.st_mode & 0o7777 in (0o660, 0o600), (p, oct(st.st_mode))
                        continue
                    modes[os.path.relpath(p, node.tmp)] = st.st_mode & 0o7777
        writable = {p: oct(m) for p, m in modes.items() if m & 0o022}
        assert writable == {}, writable
        assert modes[os.path.relpath(os.path.join(node.plugin_dir, "checkpoint.json"), node.tmp)] == 0o600
        assert modes[os.path.relpath(node.plugin_dir, node.tmp)] == 0o750
    finally:
        node.stop()
    faults.add("Hostile input", "agent started with umask 000", 1, "every directory and file has its documented mode")


def test_run_help_documents_every_flag():
    from agent.cli.main import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    run_parser = sub.choices["run"]
    undocumented = [a.option_strings for a in run_parser._actions if a.option_strings and not (a.help or "").strip()]
    assert undocumented == []
    out = subprocess.run([sys.executable, "-m", "agent", "run", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for a in run_parser._actions:
        for opt in a.option_strings:
            assert opt in out.stdout
