"""Bad sysfs content costs one attribute, never the scan; discovery never writes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from discovery.inventory import scan
from discovery.pci import split_sysfs_path
from tests.conftest import REPO, copy_profile, profile_root, profiles

PROFILE = "server-2s-gpu-nic" if "server-2s-gpu-nic" in profiles() else (profiles() or [None])[0]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    if PROFILE is None:
        pytest.fail("no fixture profiles")
    dest = tmp_path_factory.mktemp("pristine") / "root"
    shutil.copytree(profile_root(PROFILE), dest, symlinks=True)
    return str(dest)


def _files(root: str) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, "sys", "devices")):
        for f in filenames:
            out.append(os.path.join(dirpath, f))
    return sorted(out)


def _names(root: str) -> list[str]:
    """Names read from listings and links: netdevs, RDMA devices, driver links."""
    out = []
    for dirpath, dirnames, _ in os.walk(os.path.join(root, "sys", "devices")):
        if os.path.basename(dirpath) in ("net", "infiniband"):
            out += [os.path.join(dirpath, d) for d in dirnames]
        if os.path.islink(os.path.join(dirpath, "driver")):
            out.append(os.path.join(dirpath, "driver"))
    return sorted(out)


def _misname(path: str) -> None:
    """The entry (a link: its target) named neither UTF-8 nor printable."""
    if os.path.islink(path):
        target = os.readlink(os.fsencode(path))
        os.unlink(path)
        os.symlink(target + b"\xff\n", path)
    elif os.path.lexists(path):
        os.rename(path, os.fsencode(path) + b"\xff\n")


MUTATIONS = ("garbage", "empty", "huge", "binary", "delete", "fifo", "dir", "loop", "escape")


def _mutate(path: str, how: str, data: bytes) -> None:
    if os.path.lexists(path):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    if how == "garbage":
        open(path, "wb").write(data or b"zz")
    elif how == "empty":
        open(path, "wb").close()
    elif how == "huge":
        with open(path, "wb") as f:
            f.truncate(64 * 1024 * 1024)  # sparse: a "1 GB file" without the disk
    elif how == "binary":
        open(path, "wb").write(b"\xff\x00" * 600)
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "dir":
        os.mkdir(path)
    elif how == "loop":
        os.symlink(os.path.basename(path), path)
    elif how == "escape":
        os.symlink("../../../../../../../../../../../etc/passwd", path)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_corrupted_trees_never_raise(pristine, tmp_path_factory, data):
    root = str(tmp_path_factory.mktemp("mut") / "root")
    shutil.copytree(pristine, root, symlinks=True)
    files = _files(root)
    links = [os.path.join(root, "sys/bus/pci/devices", n) for n in os.listdir(os.path.join(root, "sys/bus/pci/devices"))]
    candidates = files + links + [os.path.join(root, "proc/devices")]
    picks = data.draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=12, unique=True))
    for p in picks:
        _mutate(p, data.draw(st.sampled_from(MUTATIONS)), data.draw(st.binary(max_size=64)))
    for p in data.draw(st.lists(st.sampled_from(_names(root)), max_size=3, unique=True)):
        _misname(p)
    inv = scan(root)
    json.dumps(inv.to_json())  # and everything it reports serialises
    for d in inv.devices:
        for n in d.device_nodes:
            assert 0 <= n.major and 0 <= n.minor


def test_broken_function_goes_to_skipped(pristine, tmp_path):
    root = str(tmp_path / "root")
    shutil.copytree(pristine, root, symlinks=True)
    inv0 = scan(root)
    victim = inv0.devices[0]
    d = os.path.join(root, victim.pci.sysfs_path.lstrip("/"))
    open(os.path.join(d, "vendor"), "w").write("garbage\n")
    uevent = open(os.path.join(d, "uevent")).read()
    assert scan(root).by_name()[victim.name] == victim  # the uevent still identifies it
    open(os.path.join(d, "uevent"), "w").write(uevent.replace("PCI_ID=", "PCI_ID=zz"))
    inv = scan(root)
    assert victim.name not in inv.by_name()
    reasons = {s.bdf: s.reason for s in inv.skipped}
    assert "vendor" in reasons[victim.pci.bdf]
    assert len(inv.devices) == len(inv0.devices) - 1


@pytest.mark.parametrize("class_file", ["0x1030200", "-0x030200"])
def test_a_class_code_past_24_bits_is_not_published(pristine, tmp_path, class_file):
    """A PCI class code is 24 bits (base class, subclass, programming interface). A ``class``
    file saying more (its uevent without PCI_CLASS, so the file answers) cannot be identified:
    the function is skipped with the value, not classified on its low bits (0x1030200 & the
    base-class mask reads as a display controller: a GPU published with pciClass "1030200")."""
    root = str(tmp_path / "root")
    shutil.copytree(pristine, root, symlinks=True)
    victim = next(d for d in scan(root).devices if d.kind == "gpu")
    d = os.path.join(root, victim.pci.sysfs_path.lstrip("/"))
    uevent = open(os.path.join(d, "uevent")).read()
    open(os.path.join(d, "uevent"), "w").write(re.sub(r"(?m)^PCI_CLASS=.*\n", "", uevent))
    open(os.path.join(d, "class"), "w").write(class_file + "\n")
    inv = scan(root)
    assert victim.name not in inv.by_name()
    reason = {s.bdf: s.reason for s in inv.skipped}[victim.pci.bdf]
    assert reason == f"cannot identify: class: out of range {int(class_file, 16):#x}"


@pytest.mark.parametrize("how", ["missing", "empty", "garbled", "not pci", "no driver line"])
def test_uevent_and_attribute_files_agree(pristine, tmp_path, how):
    """A function's uevent is read instead of five attribute files and the driver link; when
    it is missing or says less, the files answer, so the scan is the same either way (the
    kernel prints the same fields in both). Without a DRIVER line no driver is bound."""
    root = str(tmp_path / "root")
    shutil.copytree(pristine, root, symlinks=True)
    inv0 = scan(root)
    victim = inv0.devices[0]
    path = os.path.join(root, victim.pci.sysfs_path.lstrip("/"), "uevent")
    text = open(path).read()
    assert "PCI_ID=" in text and "DRIVER=" in text
    if how == "missing":
        os.unlink(path)
    else:
        new = {"empty": "", "garbled": text.replace("PCI_ID=", "PCI_ID=x").replace("PCI_CLASS=", "PCI_CLASS=y"),
               "not pci": "DRIVER=other\n", "no driver line": re.sub(r"(?m)^DRIVER=.*\n?", "", text)}[how]
        open(path, "w").write(new)
    inv = scan(root)
    if how == "no driver line":
        assert victim.name not in inv.by_name()
        assert "no driver bound" in {s.bdf: s.reason for s in inv.skipped}[victim.pci.bdf]
    else:
        assert inv.to_json() == inv0.to_json()


def test_bad_attribute_costs_only_that_attribute(pristine, tmp_path):
    root = str(tmp_path / "root")
    shutil.copytree(pristine, root, symlinks=True)
    victim = scan(root).devices[0]
    d = os.path.join(root, victim.pci.sysfs_path.lstrip("/"))
    os.unlink(os.path.join(d, "numa_node"))
    os.mkfifo(os.path.join(d, "numa_node"))
    dev = scan(root).by_name()[victim.name]
    assert "resource.kubernetes.io/numaNode" not in dev.attributes
    assert "resource.kubernetes.io/pciBusID" in dev.attributes
    assert any(p.what == "numa_node" and p.reason == "not a regular file" for p in dev.problems)


def test_link_escaping_root_is_refused(pristine, tmp_path):
    root = str(tmp_path / "root")
    shutil.copytree(pristine, root, symlinks=True)
    victim = scan(root).devices[0]
    link = os.path.join(root, "sys/bus/pci/devices", victim.pci.bdf)
    os.unlink(link)
    os.symlink("../../../../../../../../../../sys/devices", link)
    inv = scan(root)
    assert victim.name not in inv.by_name()
    assert "escapes the root" in {s.bdf: s.reason for s in inv.skipped}[victim.pci.bdf]


def test_scan_never_writes(pristine, monkeypatch):
    real_open = os.open
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def guarded(path, flags, *a, **kw):
        assert not flags & write_flags, f"discovery opened {path} for writing"
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", guarded)
    for forbidden in ("mkdir", "makedirs", "unlink", "remove", "rename", "replace", "symlink", "chmod", "mknod"):
        monkeypatch.setattr(os, forbidden, lambda *a, _n=forbidden, **k: pytest.fail(f"discovery called os.{_n}"))
    assert scan(pristine).devices


def test_never_reads_forbidden_files(pristine, monkeypatch):
    seen = []
    real_open = os.open

    def spy(path, flags, *a, **kw):
        seen.append(os.path.basename(str(path)))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", spy)
    scan(pristine)
    forbidden = {n for n in seen if n in ("config", "rom", "vpd") or n.startswith("resource")}
    assert not forbidden


def test_real_sys_scan_works():
    """This machine's real /sys: no crash, and the CLI prints all three formats."""
    inv = scan("/")
    if os.path.isdir("/sys/bus/pci/devices"):
        assert len(inv.devices) + len(inv.skipped) == len(os.listdir("/sys/bus/pci/devices"))
    for fmt in ("table", "tree", "json"):
        out = subprocess.run([sys.executable, "-m", "agent", "scan", "-o", fmt], cwd=REPO, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert set(data) >= {"devices", "skipped"}


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("how", ["symlink", "file", "unreadable", "unidentifiable"])
def test_a_function_directory_is_held_open_only_while_it_is_read(pristine, tmp_path, monkeypatch, how):
    """Discovery reads a function's files relative to its directory, held open: a directory
    that is a symlink (to a real one) or a file is skipped as before, one it may not list
    is read by path, and no descriptor outlives the scan, whatever the function's fate."""
    root = str(tmp_path / "root")
    shutil.copytree(pristine, root, symlinks=True)
    inv0 = scan(root)
    victim = inv0.devices[0]
    d = os.path.join(root, victim.pci.sysfs_path.lstrip("/"))
    if how == "symlink":
        os.rename(d, d + ".real")
        os.symlink(os.path.basename(d) + ".real", d)
    elif how == "file":
        shutil.rmtree(d)
        open(d, "w").close()
    elif how == "unreadable":  # EACCES on opening it (root may open any directory: stand-in for a 0311 one)
        real_open = os.open

        def refusing(path, flags, *a, **kw):
            if path == d and flags & os.O_DIRECTORY:
                raise PermissionError(13, "Permission denied", path)
            return real_open(path, flags, *a, **kw)

        monkeypatch.setattr(os, "open", refusing)
    else:
        open(os.path.join(d, "uevent"), "w").write("DRIVER=x\n")
        os.unlink(os.path.join(d, "vendor"))
    before = _open_fds()
    inv = scan(root)
    assert _open_fds() == before
    reasons = {s.bdf: s.reason for s in inv.skipped}
    if how in ("symlink", "file"):
        assert "device directory missing or not a directory" in reasons[victim.pci.bdf]
    elif how == "unreadable":
        assert inv.by_name()[victim.name].attributes == victim.attributes
    else:
        assert "vendor: missing" in reasons[victim.pci.bdf]


def test_the_traced_operations_replay_as_the_scan_made_them(pristine):
    """The bench's floor and ``sysdra record`` see the held directories: each ``opendir`` is
    closed, relative operations name files directly in it, and the plan replays cleanly."""
    from agent.tools.fstrace import replay, replay_plan, traced_scan

    _, ops = traced_scan(pristine)
    held = None
    relative = 0
    for op, path in ops:
        assert path.startswith(pristine), (op, path)
        if op == "opendir":
            assert held is None
            held = path
        elif op == "closedir":
            assert path == held
            held = None
        elif op.endswith("@"):
            relative += 1
            assert held is not None and (path == held if op == "scandir@" else os.path.dirname(path) == held)
    assert held is None and relative > 0
    before = _open_fds()
    replay(replay_plan(ops))
    assert _open_fds() == before


def test_netdevs_are_found_in_real_directories_only(tmp_path):
    """A virtio NIC's netdev is one level deeper (``virtioN/net``); neither that directory
    nor a netdev's own may be a symlink (one could point anywhere, outside the root too)."""
    root = str(tmp_path / "root")
    shutil.copytree(profile_root("vm-numa-none"), root, symlinks=True)
    fn_dir = os.path.join(root, "sys/devices/pci0000:00/0000:00:01.4/0000:05:00.0")
    nic = scan(root).by_name()["nic-0000-05-00-0"]
    assert [i.name for i in nic.nic.interfaces] == ["eth0"]

    elsewhere = str(tmp_path / "elsewhere")
    shutil.copytree(os.path.join(fn_dir, "virtio12/net/eth0"), os.path.join(elsewhere, "eth1"), symlinks=True)
    os.symlink(os.path.join(elsewhere, "eth1"), os.path.join(fn_dir, "virtio12/net/eth1"))
    assert [i.name for i in scan(root).by_name()[nic.name].nic.interfaces] == ["eth0"]

    os.rename(os.path.join(fn_dir, "virtio12"), os.path.join(elsewhere, "virtio12"))
    os.symlink(os.path.join(elsewhere, "virtio12"), os.path.join(fn_dir, "virtio12"))
    assert scan(root).by_name()[nic.name].nic.interfaces == ()


def test_odd_physfn_and_a_directory_not_named_by_its_address(tmp_path):
    """A VF's ``physfn`` that names no PCI address is a problem, not a PF (the check is
    remembered per target, so the VF after it is checked again); a function whose directory is
    not named by its address is split as any other path (no pcieRoot, as upstream)."""
    root = str(tmp_path / "root")
    shutil.copytree(profile_root("sriov-nic"), root, symlinks=True)
    before = scan(root)
    vfs = [d for d in before.devices if d.pci.physfn is not None][:2]
    assert len(vfs) == 2 and vfs[0].pci.physfn == vfs[1].pci.physfn
    for vf in vfs:
        link = os.path.join(root, vf.pci.sysfs_path.lstrip("/"), "physfn")
        os.unlink(link)
        os.symlink("../not-a-bdf", link)
    other = next(d for d in before.devices if d.pci.physfn is None and d.pci.pcie_root is not None)
    real = os.path.join(root, other.pci.sysfs_path.lstrip("/"))
    os.rename(real, real + "-moved")
    bus_link = os.path.join(root, "sys/bus/pci/devices", other.pci.bdf)
    os.unlink(bus_link)
    os.symlink(os.readlink(os.path.join(root, "sys/bus/pci/devices", vfs[0].pci.bdf)).rpartition("/")[0]
               + "/" + os.path.basename(real) + "-moved", bus_link)  # fmt: skip
    after = scan(root).by_name()
    for vf in vfs:
        dev = after[vf.name]
        assert dev.pci.physfn is None and "pfPciAddress" not in dev.attributes
        assert any(p.what == "physfn" and p.reason == "odd target 'not-a-bdf'" for p in dev.problems)
    moved = after[other.name]
    assert moved.pci.sysfs_path == other.pci.sysfs_path + "-moved"
    assert (moved.pci.pcie_root, moved.pci.bridges) == split_sysfs_path(moved.pci.sysfs_path)
    assert "resource.kubernetes.io/pcieRoot" not in moved.attributes
    assert moved.attributes["resource.kubernetes.io/pciBusID"] == other.attributes["resource.kubernetes.io/pciBusID"]
