"""The primitives that keep untrusted input inside: name formats, path confinement, the
directory checks at start, the boot ID reader and the allocation-result checks."""

from __future__ import annotations

import os

import pytest

from agent import names
from agent.apilimits import MAX_ATTRIBUTES_AND_CAPACITIES
from agent.fsutil import UnsafePath, inside, make_dirs
from agent.prepare.allocation import ClaimFailed, our_results
from agent.bootid import read_boot_id
from agent.prepare.metadata import layout
from agent.service.startup import unsafe_reason


@pytest.mark.parametrize("value,ok", [("gpu", True), ("a-b", True), ("a" * 63, True), ("a" * 64, False), ("A", False),
                                      ("-a", False), ("a/b", False), ("..", False), ("", False), (None, False), (3, False)])
def test_labels(value, ok):
    assert names.is_label(value) is ok


def test_request_names_are_one_or_two_labels_never_trimmed():
    assert names.check_request("gpu") == "gpu"
    assert names.check_request("gpu/big") == "gpu/big"
    for bad in ("a/b/c", "../x", "a/", "/a", "GPU", "", None, ["a"]):
        with pytest.raises(names.InvalidName, match="request name"):
            names.check_request(bad)


def test_inside_refuses_every_escape(tmp_path):
    base = str(tmp_path)
    assert inside(base, "a_b", "r", "m.json") == os.path.join(base, "a_b", "r", "m.json")
    for parts in (("..",), ("a", "..", ".."), ("/etc/passwd",), ("",), (".",), ("a\x00b",)):
        with pytest.raises(UnsafePath):
            inside(base, *parts)


def test_metadata_layout_checks_names_before_building_paths(tmp_path):
    plugin = str(tmp_path)
    with pytest.raises(names.InvalidName):
        layout.claim_dir(plugin, "default", "base/../../../tmp/victim")
    with pytest.raises(names.InvalidName):
        layout.host_file(plugin, "default", "c", "../r")
    with pytest.raises(names.InvalidName):
        layout.container_path("sysdra.io", "c", "r", "../x")
    with pytest.raises(names.InvalidName):
        layout.spec_path(plugin, "sysdra.io", "../uid", "r")


def test_make_dirs_ignores_the_umask(tmp_path):
    old = os.umask(0)
    try:
        make_dirs(str(tmp_path / "a" / "b"), 0o750)
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "a").st_mode & 0o777 == 0o750
    assert os.stat(tmp_path / "a" / "b").st_mode & 0o777 == 0o750


def test_unsafe_reason_walks_every_parent(tmp_path):
    d = tmp_path / "a" / "b"
    d.mkdir(parents=True)
    os.chmod(tmp_path, 0o755)
    assert unsafe_reason(str(d)) is None
    os.chmod(tmp_path / "a", 0o777)
    assert "writable by others" in unsafe_reason(str(d))
    os.chmod(tmp_path / "a", 0o1777)  # sticky, like /tmp: others cannot replace our entries
    assert unsafe_reason(str(d)) is None


def _claim(*results):
    return {"status": {"allocation": {"devices": {"results": list(results)}}}}


def test_allocation_results_are_checked_before_use():
    r = {"request": "gpu", "driver": "sysdra.io", "pool": "n", "device": "gpu-1"}
    raw, checked = our_results(_claim(r, dict(r, driver="other.io", device="x")), "sysdra.io")
    assert raw == [r] and checked[0].device == "gpu-1" and checked[0].share_id is None
    share = "3f2a9a56-7c1e-4d1b-9a4e-2f0c1d2e3f40"
    _, two = our_results(_claim(dict(r, shareID=share), dict(r, shareID=share.replace("0", "1"))), "sysdra.io")
    assert [c.share_id for c in two] == [share, share.replace("0", "1")]  # two shares of one device: fine
    for bad, word in ((dict(r, shareID={"x": 1}), "shareID"), (dict(r, request="a/b/c"), "request name"),
                      (dict(r, device="../x"), "device"), (dict(r, pool=5), "pool"), (5, "not an object")):
        with pytest.raises(ClaimFailed, match=word):
            our_results(_claim(bad), "sysdra.io")
    with pytest.raises(ClaimFailed, match="allocated twice"):
        our_results(_claim(r, dict(r)), "sysdra.io")
    with pytest.raises(ClaimFailed, match="not a list"):
        our_results({"status": {"allocation": {"devices": {"results": {"a": 1}}}}}, "sysdra.io")
    assert our_results({"status": {"allocation": {}}}, "sysdra.io") == ([], [])  # no devices: nothing of ours


def test_consumed_capacity_and_pool_are_held_to_the_apis_formats():
    # a capacity's name becomes part of the share's variable names (prepare/shares.py)
    r = {"request": "gpu", "driver": "sysdra.io", "pool": "n", "device": "gpu-1",
         "shareID": "3f2a9a56-7c1e-4d1b-9a4e-2f0c1d2e3f40"}
    _, (ok,) = our_results(_claim(dict(r, consumedCapacity={"memory": "1Gi", f"{'d' * 63}/{'C' * 32}": "1"})), "sysdra.io")
    assert [name for name, _ in ok.consumed] == [f"{'d' * 63}/{'C' * 32}", "memory"]  # by name
    for bad in ({"C" * 33: "1"}, {f"{'d' * 64}/c": "1"}, {"mem ory": "1"}, {"a/b/c": "1"},
                {f"c{i}": "1" for i in range(MAX_ATTRIBUTES_AND_CAPACITIES + 1)}):
        with pytest.raises(ClaimFailed, match="consumedCapacity"):
            our_results(_claim(dict(r, consumedCapacity=bad)), "sysdra.io")
    pool = "/".join(["p" * 63] * 4)  # each part a subdomain, 255 characters in all
    with pytest.raises(ClaimFailed, match="at most 253 characters"):
        our_results(_claim(dict(r, pool=pool)), "sysdra.io")
    # a device is its pool's: one name in two pools is two devices
    _, two = our_results(_claim(dict(r, pool="a"), dict(r, pool="b")), "sysdra.io")
    assert [c.pool for c in two] == ["a", "b"]


def test_boot_id_fallbacks(tmp_path, caplog):
    boot = tmp_path / "proc/sys/kernel/random/boot_id"
    boot.parent.mkdir(parents=True)
    boot.write_text("9e1f0b5e-8a43-4f4e-9d5b-0b3f1c2d3e4f\n")
    assert read_boot_id(str(tmp_path)) == "9e1f0b5e-8a43-4f4e-9d5b-0b3f1c2d3e4f"
    host = read_boot_id("/")
    boot.unlink()
    os.mkfifo(boot)
    with caplog.at_level("WARNING"):
        assert read_boot_id(str(tmp_path)) == host  # this system's, with a warning naming the FIFO
    assert "unreadable" in caplog.text and "boot_id" in caplog.text
    boot.unlink()
    boot.write_bytes(b"\xff\xfe garbage")
    assert read_boot_id(str(tmp_path)) == host
