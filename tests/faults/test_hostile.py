"""Hostile input against the running agent: malformed gRPC requests, corrupt checkpoints,
corrupt claim files in the offline store, adversarial sysfs trees. No crash, a clear error
for each, and no write outside our directories (the whole tmp tree is snapshotted)."""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.faults.harness import Node, run, snapshot, snapshot_diff

pytestmark = pytest.mark.slow
UID = "00000000-0000-4000-8000-0000000ba5e0"


def ours(node: Node) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Where the agent may write -> (directory prefixes, exact paths): its CDI files, its plugin
    and kubelet dirs, slices, the claims' status (offline mode writes it into the claim files), its log."""
    prefixes = (node.cdi_dir + "/", node.plugin_dir + "/", node.kubelet_dir + "/",
                os.path.join(node.cluster, "resourceslices"), os.path.join(node.cluster, "resourceclaims") + "/")
    return prefixes, (node.plugin_dir, node.log_path, node.kubelet_dir, node.cdi_dir, node.cluster)


def _outside(path: str, node: Node) -> bool:
    prefixes, exact = ours(node)
    return not (path.startswith(prefixes) or path in exact)


def outside_writes(node: Node, before: dict) -> list[str]:
    return [p for p in snapshot_diff(before, snapshot(node.tmp)) if _outside(p, node)]


def errors_of(resp) -> dict[str, str]:
    return {uid: c.error for uid, c in resp.claims.items()}


def test_malformed_grpc_requests(node, faults):
    g = [d for d in node.devices() if d.startswith("gpu-")]
    node.write_claim("unknown", [("r", "gpu-ffff-ff-1f-7")], uid="00000000-0000-4000-8000-00000000000a")
    node.write_claim("foreign", [("r", g[0])], uid="00000000-0000-4000-8000-00000000000b", driver="other.example.com")
    node.write_claim("otherpool", [("r", g[0])], uid="00000000-0000-4000-8000-00000000000c", pool="node-2")
    node.write_claim("replaced", [("r", g[0])], uid="00000000-0000-4000-8000-0000000000ff")
    before = snapshot(node.tmp)
    cases = {  # name -> (claim refs, expected words in every error)
        "empty uid": ([("default", "c", "")], "empty"),
        "huge uid (1 MB)": ([("default", "c", "u" * (1 << 20))], "characters long"),
        "../ in namespace": ([("../..", "c", UID)], "path separator"),
        "../ in name": ([("default", "../../etc/passwd", UID)], "path separator"),
        "/ in name": ([("default", "a/b", UID)], "path separator"),
        "../ in uid": ([("default", "c", "../" + UID)], "path separator"),
        "NUL in name": ([("default", "a\x00b", UID)], "path separator"),
        "10,000 claims": ([("default", f"c{i}", f"{i:08d}-0000-4000-8000-000000000000") for i in range(10_000)], "at most"),
        "unknown device": ([("default", "unknown", "00000000-0000-4000-8000-00000000000a")], "not on this node"),
        "device of another node's pool": ([("default", "otherpool", "00000000-0000-4000-8000-00000000000c")], "pool"),
        "claim replaced (UID mismatch)": ([("default", "replaced", UID)], "replaced"),
        "missing claim": ([("default", "nothere", UID)], "not found"),
    }
    for name, (refs, words) in cases.items():
        for call in (node.prepare, node.unprepare):
            if call == node.unprepare and name in ("unknown device", "device of another node's pool", "claim replaced (UID mismatch)", "missing claim"):
                continue  # unprepare by UID of a claim we never prepared is a no-op success
            errs = errors_of(run(call(*refs), timeout=120))
            assert errs and all(words in (e or "") for e in errs.values()), (name, call.__name__, list(errs.values())[:2])
        faults.add("Hostile input", f"gRPC: {name}", 1 if name != "10,000 claims" else 10_000,
                   f"per-claim error ('{words}')")
    # a claim with only another driver's devices: nothing of ours to prepare, no files
    r = errors_of(run(node.prepare(("default", "foreign", "00000000-0000-4000-8000-00000000000b"))))
    assert r == {"00000000-0000-4000-8000-00000000000b": ""}
    faults.add("Hostile input", "gRPC: claim allocating only another driver's devices", 1, "answered with no devices; no files written")
    run(node.unprepare(("default", "foreign", "00000000-0000-4000-8000-00000000000b")))
    assert outside_writes(node, before) == []
    assert not [n for n in os.listdir(node.cdi_dir)] if os.path.isdir(node.cdi_dir) else True
    assert node.proc.poll() is None


CORRUPT_CHECKPOINTS = {
    "not JSON": b"{not json",
    "empty": b"",
    "truncated": None,  # the real file cut in half
    "checksum mismatch": json.dumps({"version": 1, "checksum": "sha256:00", "claims": {}}).encode(),
    "claims is a list": json.dumps({"version": 1, "checksum": "x", "claims": []}).encode(),
    "binary": bytes(range(256)) * 64,
}


def test_corrupt_checkpoints(node, faults):
    g = [d for d in node.devices() if d.startswith("gpu-")]
    c = node.write_claim("c", [("r", g[0])], uid=UID)
    path = os.path.join(node.plugin_dir, "checkpoint.json")
    for name, garbage in CORRUPT_CHECKPOINTS.items():
        assert not errors_of(run(node.prepare(c)))[UID]
        node.kill()
        if garbage is None:
            with open(path, "rb") as f:
                garbage = f.read()[: os.path.getsize(path) // 2]
        with open(path, "wb") as f:
            f.write(garbage)
        before = snapshot(node.tmp)
        node.start()
        assert "CHECKPOINT CORRUPT" in node.log_tail(200), name
        # the claim was adopted from its CDI spec; the kubelet's re-prepare and unprepare work
        assert not errors_of(run(node.prepare(c)))[UID], name
        assert outside_writes(node, before) == [], name
        assert not errors_of(run(node.unprepare(c)))[UID]
        faults.add("Hostile input", f"corrupt checkpoint: {name}", 1, "moved aside, logged CHECKPOINT CORRUPT, claim adopted from its spec")
    node.kill()
    with open(path, "w") as f:
        json.dump({"version": 99, "claims": {}}, f)
    node.start(wait=False)
    assert node.proc.wait(timeout=30) != 0 and "newer sysdra" in node.log_tail(50)
    os.unlink(path)
    node.start()
    faults.add("Hostile input", "checkpoint of a newer version", 1, "agent refuses to start, names the file, keeps it")


def test_corrupt_claim_files(node, faults):
    d = os.path.join(node.cluster, "resourceclaims", "default")
    os.makedirs(d, exist_ok=True)
    cases = {
        "not-json": b"{nope", "empty": b"", "a-list": b"[1,2]", "binary": b"\xff\xfe\x00",
        "bad-results": json.dumps({"metadata": {"uid": UID, "name": "bad-results", "namespace": "default"},
                                   "status": {"allocation": {"devices": {"results": "x"}}}}).encode(),
        "results-not-dicts": json.dumps({"metadata": {"uid": UID}, "status": {"allocation": {"devices": {"results": [1, "a", None]}}}}).encode(),
        "no-metadata": json.dumps({"status": {"allocation": {}}}).encode(),
        "deeply-nested": b"[" * 100_000,
    }
    for name, data in cases.items():
        with open(os.path.join(d, name + ".json"), "wb") as f:
            f.write(data)
    os.mkdir(os.path.join(d, "a-directory.json"))
    os.mkfifo(os.path.join(d, "a-fifo.json"))
    with open(os.path.join(d, "huge-sparse.json"), "wb") as f:
        f.truncate(1 << 30)
    os.symlink("/etc/passwd", os.path.join(d, "a-symlink.json"))
    before = snapshot(node.tmp)
    for name in [*cases, "a-directory", "a-fifo", "huge-sparse", "a-symlink"]:
        t0 = time.monotonic()
        errs = errors_of(run(node.prepare(("default", name, UID)), timeout=60))
        took = time.monotonic() - t0
        err = errs[UID]
        assert err and "default/" + name in err, (name, err)
        faults.add("Hostile input", f"claim file: {name.replace('-', ' ')}", 1, f"per-claim error in {took * 1000:.0f} ms")
    run(node.unprepare(("default", "bad-results", UID)))
    assert outside_writes(node, before) == []
    assert node.proc.poll() is None


def test_deeply_nested_checkpoint(node, faults):
    path = os.path.join(node.plugin_dir, "checkpoint.json")
    node.kill()
    with open(path, "wb") as f:
        f.write(b"[" * 100_000)
    node.start()
    assert "CHECKPOINT CORRUPT" in node.log_tail(200)
    faults.add("Hostile input", "corrupt checkpoint: 100,000 nested brackets", 1,
               "moved aside, loud log, the agent starts")


def _adversarial(node: Node, what: str) -> str:
    """Damage the copied tree; returns the device whose sysfs dir was changed."""
    devdir = os.path.join(node.root, "sys/bus/pci/devices")
    bdfs = sorted(os.listdir(devdir))
    real = os.path.realpath(os.path.join(devdir, bdfs[0]))
    if what == "symlink loop":
        os.symlink("loop-b", os.path.join(devdir, "loop-a"))
        os.symlink("loop-a", os.path.join(devdir, "loop-b"))
        os.symlink(".", os.path.join(real, "subsystem_loop"))
    elif what == "1 GB sparse attribute file":
        os.unlink(os.path.join(real, "vendor"))
        with open(os.path.join(real, "vendor"), "wb") as f:
            f.truncate(1 << 30)
    elif what == "FIFO as an attribute file":
        os.unlink(os.path.join(real, "class"))
        os.mkfifo(os.path.join(real, "class"))
    return bdfs[0]


@pytest.mark.parametrize("what", ["symlink loop", "1 GB sparse attribute file", "FIFO as an attribute file"])
def test_adversarial_sysfs(tmp_path, what, faults):
    node = Node(tmp_path)
    _adversarial(node, what)
    before = snapshot(node.tmp)
    t0 = time.monotonic()
    node.start(timeout=20)
    try:
        node.wait_slices_converge(timeout=20)
        took = time.monotonic() - t0
        g = [d for d in node.expected_devices() if d.startswith("gpu-")]
        c = node.write_claim("c", [("r", g[-1])], uid=UID)
        assert not errors_of(run(node.prepare(c)))[UID]
        assert not errors_of(run(node.unprepare(c)))[UID]
        assert [p for p in outside_writes(node, before) if "resourceclaims" not in p] == []
    finally:
        rc = node.stop()
    assert rc == 0
    faults.add("Hostile input", f"sysfs: {what}", 1, f"agent up and slices valid in {took:.1f}s; prepare works; no foreign writes")
