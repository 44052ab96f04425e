"""Cross-check the fake host trees in fixtures/sysfs with lspci, and make sure they are not stale.

* lspci (pciutils, linux-sysfs access method pointed at the fixture) must see every BDF named in
  fixtures/expected/<profile>.json, with the vendor/device/class of the tree's files;
* every PCI function in the tree must be accounted for in the expectations (devices, skipped or merged);
* regenerating from fixtures/specs into a temp dir must give byte-identical trees.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "fixtures")
sys.path.insert(0, FIX)

import generate  # noqa: E402

PROFILES = generate.profiles()
BDF_RE = re.compile(r"^([0-9a-f]{4,}):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$")


def _lspci() -> str:
    exe = shutil.which("lspci") or ("/usr/bin/lspci" if os.path.exists("/usr/bin/lspci") else None)
    if exe is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("lspci (pciutils) is required in CI")
        pytest.skip("lspci not installed (apt-get install -y pciutils)")
    return exe


def _expected(profile: str) -> dict:
    with open(os.path.join(FIX, "expected", f"{profile}.json"), encoding="utf-8") as fh:
        return json.load(fh)


def _bdf_of_name(name: str) -> str:
    # <kind>-<domain>-<bus>-<dev>-<fn>
    parts = name.split("-")
    dom, bus, dev, fn = parts[-4:]
    return f"{dom}:{bus}:{dev}.{fn}"


def _expected_bdfs(exp: dict) -> set[str]:
    out = {_bdf_of_name(d["name"]) for d in exp["devices"]}
    out |= set(exp["skipped"])
    out |= set(exp.get("merged", {}))
    return out


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as fh:
        return fh.read().strip()


def _parse_vmm(text: str) -> dict[str, dict[str, str]]:
    recs: dict[str, dict[str, str]] = {}
    for block in text.strip().split("\n\n"):
        rec = {}
        for line in block.splitlines():
            if ":\t" in line:
                k, v = line.split(":\t", 1)
                rec[k] = v
        if "Slot" in rec:
            recs[rec["Slot"]] = rec
    return recs


def _code(field: str) -> str:
    m = re.search(r"\[([0-9a-f]{4})\]$", field)
    assert m, field
    return m.group(1)


@pytest.mark.parametrize("profile", PROFILES)
def test_lspci_sees_expected_functions(profile: str) -> None:
    exe = _lspci()
    tree = os.path.join(FIX, "sysfs", profile)
    devdir = os.path.join(tree, "sys", "bus", "pci", "devices")
    res = subprocess.run(
        [exe, "-vmm", "-D", "-nn", "-A", "linux-sysfs", "-O", f"sysfs.path={tree}/sys/bus/pci"],
        capture_output=True, text=True, check=True,
        env={**os.environ, "LC_ALL": "C"},
    )
    recs = _parse_vmm(res.stdout)
    exp = _expected(profile)
    want = _expected_bdfs(exp)
    in_tree = {n for n in os.listdir(devdir) if BDF_RE.match(n)}

    missing = sorted(want - set(recs))
    assert not missing, f"lspci does not see {missing}"
    unaccounted = sorted(in_tree - want)
    assert not unaccounted, f"functions in the tree but not in expected/{profile}.json: {unaccounted}"
    extra = sorted(want - in_tree)
    assert not extra, f"expected/{profile}.json names functions not in the tree: {extra}"

    for bdf in sorted(want):
        rec = recs[bdf]
        d = os.path.join(devdir, bdf)
        assert _code(rec["Vendor"]) == _read(os.path.join(d, "vendor"))[2:], bdf
        assert _code(rec["Device"]) == _read(os.path.join(d, "device"))[2:], bdf
        cls = _read(os.path.join(d, "class"))
        assert _code(rec["Class"]) == cls[2:6], bdf
        assert rec.get("ProgIf", "00") == cls[6:8], bdf

    # every real PCI function directory below sys/devices is linked from sys/bus/pci/devices
    dirs = set()
    for dirpath, dirnames, _files in os.walk(os.path.join(tree, "sys", "devices")):
        for dn in dirnames:
            if BDF_RE.match(dn) and not os.path.islink(os.path.join(dirpath, dn)):
                dirs.add(dn)
    assert dirs == in_tree


@pytest.mark.parametrize("profile", PROFILES)
def test_device_names_and_nodes_are_consistent(profile: str) -> None:
    exp = _expected(profile)
    names = [d["name"] for d in exp["devices"]]
    assert names == sorted(names)
    assert exp["skipped"] == sorted(exp["skipped"])
    tree = os.path.join(FIX, "sysfs", profile)
    for d in exp["devices"]:
        bdf = _bdf_of_name(d["name"])
        assert d["pciBusID"] == (bdf if re.match(r"^[0-9a-f]{4}:", bdf) else None)
        for node in d["deviceNodes"]:
            p = os.path.join(tree, node["path"].lstrip("/"))
            assert os.path.isfile(p) and os.path.getsize(p) == 0, node["path"]


def _snapshot(root: str) -> dict[str, tuple[str, object]]:
    """Files and symlinks (directories are implied: git cannot store an empty one)."""
    out: dict[str, tuple[str, object]] = {}
    for dirpath, dirnames, files in os.walk(root):
        for name in dirnames + files:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, root)
            if os.path.islink(full):
                out[rel] = ("link", os.readlink(full))
            elif os.path.isdir(full):
                continue
            else:
                with open(full, "rb") as fh:
                    out[rel] = ("file", fh.read())
    return out


@pytest.mark.parametrize("profile", PROFILES)
def test_committed_tree_matches_generator(profile: str, tmp_path) -> None:
    generate.generate(profile, str(tmp_path))
    fresh = _snapshot(os.path.join(tmp_path, profile))
    committed = _snapshot(os.path.join(FIX, "sysfs", profile))
    assert sorted(fresh) == sorted(committed), "file lists differ: run python fixtures/generate.py"
    diff = [p for p in fresh if fresh[p] != committed[p]]
    assert not diff, f"stale entries (run python fixtures/generate.py): {diff[:10]}"


def test_large_node_spec_builds(tmp_path) -> None:
    # a scaled-down node: the full 2,000+ function build is exercised by `make bench`
    spec = generate.large_node_spec(n_pfs=4, vfs_per_pf=16, numa_nodes=4)
    generate.build_tree(spec, str(tmp_path / "large"))
    n = len(os.listdir(tmp_path / "large" / "sys" / "bus" / "pci" / "devices"))
    assert n >= 4 * 17
    nodes = [x for x in os.listdir(tmp_path / "large" / "sys" / "devices" / "system" / "node") if x.startswith("node")]
    assert len(nodes) == 4
