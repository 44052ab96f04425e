"""sysdra record: a recording replays to the same scan as its source."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat

import pytest

from agent.cli.main import main as cli_main
from agent.tools.record import Redactor, record
from discovery.inventory import scan
from tests.conftest import profile_root, profiles, require_root

MAC = re.compile(r"\b(?:[0-9a-f]{2}:){5}[0-9a-f]{2}\b")


def comparable(root: str) -> dict:
    """Everything a scan reports that does not depend on where the root is."""
    return scan(root).to_json()


def _walk(out: str):
    for dirpath, dirs, files in os.walk(out):
        for name in files + dirs:
            yield os.path.join(dirpath, name)


def _assert_safe(out: str) -> None:
    """Only symlinks, directories and small UTF-8 text files; no device nodes, no denied names."""
    for path in _walk(out):
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode) or stat.S_ISDIR(st.st_mode):
            continue
        assert stat.S_ISREG(st.st_mode), path
        assert st.st_size <= 4096, path
        data = open(path, "rb").read()
        data.decode("utf-8")
        assert b"\0" not in data, path
        if re.match(r"^(config|rom|resource\d*|vpd)$", os.path.basename(path)):
            assert st.st_size == 0, path


def test_record_live_sys(tmp_path):
    require_root()  # some attributes are root-only
    out = str(tmp_path / "node")
    rec = record(out, "/")
    assert comparable(out) == comparable("/")
    _assert_safe(out)
    for link in (p for p in _walk(out) if os.path.islink(p)):
        target = os.readlink(link)
        assert not os.path.isabs(target), link
        live = os.path.join("/", os.path.relpath(link, out))
        if os.path.islink(live) and not os.path.isabs(os.readlink(live)):
            assert target == os.readlink(live)  # relative targets verbatim
    assert os.path.isfile(os.path.join(out, ".sysdra-record", "devnodes.json"))
    assert rec.files > 0


@pytest.mark.parametrize("profile", profiles())
def test_record_fixture_profiles(tmp_path, profile):
    out = str(tmp_path / "rec")
    record(out, profile_root(profile))
    assert comparable(out) == comparable(profile_root(profile))
    _assert_safe(out)


def test_real_device_nodes_are_recorded(tmp_path):
    require_root()  # mknod
    src = str(tmp_path / "src")
    shutil.copytree(profile_root("server-2s-gpu-nic"), src, symlinks=True)
    before = comparable(src)
    made = 0
    for dev in before["devices"]:
        for node in dev["deviceNodes"]:
            host = os.path.join(src, node["path"].lstrip("/"))
            os.unlink(host)
            os.mknod(host, 0o600 | (stat.S_IFCHR if node["type"] == "c" else stat.S_IFBLK), os.makedev(node["major"], node["minor"]))
            made += 1
            # the kernel's /sys/dev/char/MAJ:MIN link; a real node has one
            sysdev = os.path.join(src, "sys/dev/char", f"{node['major']}:{node['minor']}")
            if not os.path.lexists(sysdev):
                os.makedirs(os.path.dirname(sysdev), exist_ok=True)
                d = os.path.join(src, "sys/devices/virtual/sysdra-test", f"{node['major']}-{node['minor']}")
                os.makedirs(d, exist_ok=True)
                with open(os.path.join(d, "dev"), "w") as f:
                    f.write(f"{node['major']}:{node['minor']}\n")
                os.symlink(os.path.relpath(d, os.path.dirname(sysdev)), sysdev)
    assert made > 0
    assert comparable(src) == before
    out = str(tmp_path / "rec")
    rec = record(out, src)
    assert comparable(out) == before
    _assert_safe(out)
    side = json.load(open(os.path.join(out, ".sysdra-record", "devnodes.json")))
    assert len(side) == len(rec.devnodes) > 0
    for dev in before["devices"]:
        for node in dev["deviceNodes"]:
            assert side[node["path"]] == {"type": node["type"], "major": node["major"], "minor": node["minor"]}


def test_redaction_is_consistent_and_complete(tmp_path):
    root = profile_root("server-2s-gpu-nic")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    key = b"fixed-key-for-the-test"
    record(a, root, redactor=Redactor(key))
    record(b, root, redactor=Redactor(key))
    plain, red = comparable(root), comparable(a)
    assert red == comparable(b)  # same input -> same fakes
    assert [d["name"] for d in red["devices"]] == [d["name"] for d in plain["devices"]]
    text = json.dumps(plain)
    secrets = {m for m in MAC.findall(text) if m not in ("00:00:00:00:00:00", "ff:ff:ff:ff:ff:ff")}
    secrets |= set(re.findall(r"GPU-[0-9a-f-]{36}", text))
    assert secrets
    recorded = "\n".join(open(p, errors="replace").read() for p in _walk(a) if os.path.isfile(p) and not os.path.islink(p))
    for secret in secrets:
        assert secret not in recorded and secret not in json.dumps(red)
    # one device's MAC is the same fake in address and in the scan's attribute
    r = Redactor(key)
    for mac in secrets:
        if MAC.fullmatch(mac):
            assert r.fake("mac", mac).startswith("02:") and r.fake("mac", mac) == r.fake("mac", mac)
            break


def test_redactor_formats():
    r = Redactor(b"k")
    assert r.text("address", "ff:ff:ff:ff:ff:ff\n") == "ff:ff:ff:ff:ff:ff\n"
    assert r.text("serial_number", "ABC123XYZ\n") != "ABC123XYZ\n" and r.text("serial_number", "ABC123XYZ\n").endswith("\n")
    info = "Model: X\nSerial Number:  1324019032843\nGPU UUID: GPU-2f6a0e31-9c1b-4d7e-8a53-0b1c2d3e4f52\n"
    out = r.text("information", info)
    assert "1324019032843" not in out and "2f6a0e31" not in out and out.startswith("Model: X\nSerial Number:  ")
    guid = r.text("node_guid", "b8ce:f603:00d5:9a6c\n")
    assert re.fullmatch(r"[0-9a-f]{4}(:[0-9a-f]{4}){3}\n", guid) and guid != "b8ce:f603:00d5:9a6c\n"


def test_cli(tmp_path, capsys):
    out = str(tmp_path / "rec")
    assert cli_main(["record", out, "--root", profile_root("alveo"), "--redact"]) == 0
    assert "sysdra scan --root" in capsys.readouterr().out
    assert cli_main(["record", out, "--root", profile_root("alveo")]) == 2  # not empty
    assert "not empty" in capsys.readouterr().err


def test_out_beside_sys_is_not_refused(tmp_path):
    """Only OUT inside the recorded /sys or /proc is refused: /sysdump or /process-rec is not in them."""
    root = tmp_path / "root"
    shutil.copytree(profile_root("alveo"), root, symlinks=True)
    for name in ("sysdump", "process-rec"):
        out = str(root / name)
        record(out, str(root))
        assert comparable(out) == comparable(str(root))
    with pytest.raises(ValueError, match="inside the recorded"):
        record(str(root / "sys" / "rec"), str(root))
