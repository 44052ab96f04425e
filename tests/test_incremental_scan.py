"""IncrementalScanner: after random changes to copies of every fixture node, an incremental
rescan naming the changed functions (as the watcher derives them from event paths) equals
a full scan of the same tree. Seeded, so every run does the same changes."""

from __future__ import annotations

import os
import random
import shutil

import pytest

from discovery.exclude import Exclusions
from discovery.inventory import IncrementalScanner, bdf_of_path, scan
from discovery.pci import BDF_RE
from tests.conftest import profile_root, profiles
from tests.simkernel import set_uevent_driver

BUS = "sys/bus/pci/devices"


def _function_files(root: str, bdf: str) -> list[str]:
    """Regular files of one function's own directory tree (not its child functions')."""
    top = os.path.realpath(os.path.join(root, BUS, bdf))
    out = []
    for dirpath, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if not BDF_RE.match(d)]
        out += [os.path.join(dirpath, f) for f in files if os.path.isfile(os.path.join(dirpath, f))
                and not os.path.islink(os.path.join(dirpath, f))]
    return sorted(out)


def _mutate(rng: random.Random, root: str, removed: dict[str, str]) -> str:
    """One random change; returns the changed path (what a file event would name)."""
    bus = os.path.join(root, BUS)
    bdfs = sorted(os.listdir(bus))
    what = rng.choice(["unlink", "unbind", "write", "write", "restore"])
    if what == "restore" and removed:
        bdf = rng.choice(sorted(removed))
        os.symlink(removed.pop(bdf), os.path.join(bus, bdf))
        return os.path.join(bus, bdf)
    bdf = rng.choice(bdfs)
    if what == "unlink":
        link = os.path.join(bus, bdf)
        removed[bdf] = os.readlink(link)
        os.unlink(link)
        return link
    real = os.path.realpath(os.path.join(bus, bdf))
    if what == "unbind" and os.path.islink(os.path.join(real, "driver")):
        os.unlink(os.path.join(real, "driver"))
        return os.path.join(real, "driver")
    files = _function_files(root, bdf)
    if not files:
        return real
    path = rng.choice(files)
    with open(path, "w") as f:
        f.write(rng.choice(["0\n", "1\n", "down\n", "up\n", "0x1234\n", "", "garbage \x01\n", "8.0 GT/s PCIe\n"]))
    return path


@pytest.mark.parametrize("profile", profiles())
def test_incremental_equals_full_after_random_changes(tmp_path, profile):
    root = str(tmp_path / "node")
    shutil.copytree(profile_root(profile), root, symlinks=True)
    rng = random.Random(f"incremental-{profile}")
    scanner = IncrementalScanner(root)
    assert scanner.full() == scan(root)
    removed: dict[str, str] = {}
    for _round in range(8):
        paths = [_mutate(rng, root, removed) for _ in range(rng.randint(1, 3))]
        changed = {bdf_of_path(os.path.relpath(p, root)) for p in paths}
        assert None not in changed
        assert scanner.update(changed) == scan(root), (profile, _round, paths)
    assert scanner.update(None) == scan(root)


def test_bdf_of_path():
    assert bdf_of_path("/devices/pci0000:00/0000:00:01.0/0000:01:00.0/net/eth0") == "0000:01:00.0"
    assert bdf_of_path("/sys/bus/pci/devices/0000:3b:00.1") == "0000:3b:00.1"
    assert bdf_of_path("/sys/devices/system/node/node0/cpulist") is None
    assert bdf_of_path("/sys/class/net/eth0") is None


def test_a_rescan_keeps_the_objects_of_what_reads_as_before(tmp_path):
    """The periodic resync reads everything again, an event's rescan some functions; an unchanged
    function's records are the previous scan's objects (the publisher's per-device cache hits on
    them), a changed one's are new."""
    root = str(tmp_path / "node")
    shutil.copytree(profile_root("server-2s-gpu-nic"), root, symlinks=True)
    scanner = IncrementalScanner(root)
    first = scanner.full()
    again = scanner.full()
    assert again == first and all(a is b for a, b in zip(again.devices, first.devices))
    nic = next(d for d in first.devices if d.kind == "nic" and d.nic and d.nic.interfaces)
    with open(os.path.join(root, BUS, nic.pci.bdf, "net", nic.nic.interfaces[0].name, "mtu"), "w") as f:
        f.write("4321\n")
    changed = scanner.full()
    assert changed == scan(root) and changed != first
    assert [d.name for d in changed.devices if all(d is not b for b in first.devices)] == [nic.name]
    # an incremental rescan of a function whose published records read the same keeps them too
    with open(os.path.join(root, BUS, nic.pci.bdf, "power_state"), "w") as f:
        f.write("D3hot\n")
    again = scanner.update({nic.pci.bdf})
    assert again == changed and all(a is b for a, b in zip(again.devices, changed.devices))



def _move_vfs(root: str, pf: str, vfs: dict[int, str], stash: str, away: bool) -> None:
    """The PF's VFs (index -> address) taken to ``stash`` or put back, as the kernel removes or
    makes them: the function (beside its PF), its bus link, the PF's ``virtfnN`` link; and the
    PF's ``sriov_numvfs``."""
    pf_dir = os.path.realpath(os.path.join(root, BUS, pf))
    for i, bdf in vfs.items():
        for here, there in ((os.path.join(os.path.dirname(pf_dir), bdf), bdf), (os.path.join(root, BUS, bdf), bdf + ".link"),
                            (os.path.join(pf_dir, f"virtfn{i}"), f"virtfn{i}")):
            os.rename(*((here, os.path.join(stash, there)) if away else (os.path.join(stash, there), here)))
    numvfs = len([n for n in os.listdir(pf_dir) if n.startswith("virtfn")])
    with open(os.path.join(pf_dir, "sriov_numvfs"), "w") as f:
        f.write(f"{numvfs}\n")


def test_a_new_vf_has_its_pf_read_again(tmp_path):
    """VFs created (``sriov_numvfs`` 6 -> 8): the rescan their events start names them alone, and
    their PF is read again with them, so its slice entry says 8 VFs at once, not after the next
    full resync."""
    root, stash = str(tmp_path / "node"), str(tmp_path / "stash")
    shutil.copytree(profile_root("sriov-nic"), root, symlinks=True)
    os.makedirs(stash)
    pf, vfs = "0000:06:00.1", {6: "0000:06:02.0", 7: "0000:06:02.1"}  # CX-6 Dx port 1, VFs on mlx5_core
    _move_vfs(root, pf, vfs, stash, away=True)
    scanner = IncrementalScanner(root)
    assert scanner.full().by_name()["nic-0000-06-00-1"].attributes["sriovNumVFs"].int_ == 6
    _move_vfs(root, pf, vfs, stash, away=False)
    inv = scanner.update(set(vfs.values()))
    assert inv.by_name()["nic-0000-06-00-1"].attributes["sriovNumVFs"].int_ == 8
    assert {"nic-0000-06-02-0", "nic-0000-06-02-1"} <= set(inv.by_name()) and inv == scan(root)


def test_vfs_without_a_driver_removed_have_their_pf_read_again(tmp_path):
    """VFs no driver took (``sriov_drivers_autoprobe`` 0, left for vfio-pci or DPDK) removed
    (``sriov_numvfs`` 16 -> 0): the kernel sends no event for the PF, only the VFs' removals, so
    the rescan they start reads their PF again from what it knew of them (skipped functions
    too), and the PF's slice entry says 0 VFs at once."""
    root, stash = str(tmp_path / "node"), str(tmp_path / "stash")
    shutil.copytree(profile_root("sriov-nic"), root, symlinks=True)
    os.makedirs(stash)
    pf, name = "0000:3b:00.0", "accelerator-0000-3b-00-0"  # QAT: alone in its slot, its 16 VFs in two others
    pf_dir = os.path.realpath(os.path.join(root, BUS, pf))
    vfs = {int(n[6:]): os.readlink(os.path.join(pf_dir, n))[3:] for n in os.listdir(pf_dir) if n.startswith("virtfn")}
    for bdf in vfs.values():  # none bound
        vf_dir = os.path.join(os.path.dirname(pf_dir), bdf)
        if os.path.islink(os.path.join(vf_dir, "driver")):
            os.unlink(os.path.join(vf_dir, "driver"))
        set_uevent_driver(vf_dir, None)
    scanner = IncrementalScanner(root)
    before = scanner.full()
    assert before.by_name()[name].attributes["sriovNumVFs"].int_ == 16
    assert set(vfs.values()) <= {s.bdf for s in before.skipped}
    _move_vfs(root, pf, vfs, stash, away=True)
    inv = scanner.update(set(vfs.values()))
    assert inv.by_name()[name].attributes["sriovNumVFs"].int_ == 0 and inv == scan(root)


def test_a_driver_upgrade_reads_the_new_driver_version(tmp_path):
    """The NVIDIA driver upgraded while the agent runs (rmmod, modprobe of the new one): the kernel
    tells of it only by each GPU's unbind and bind (a module's own uevents name no PCI function),
    so the rescan those start re-reads the GPUs alone. They carry the module loaded now: the
    version the scanner read when it met its first GPU was published with them until the next
    full resync (5 minutes)."""
    root = str(tmp_path / "node")
    shutil.copytree(profile_root("server-2s-gpu-nic"), root, symlinks=True)
    scanner = IncrementalScanner(root)
    gpus = [d for d in scanner.full().devices if d.kind == "gpu" and d.pci.driver == "nvidia"]
    assert gpus and {d.attributes["driverVersion"].version for d in gpus} == {"580.159.4"}
    with open(os.path.join(root, "sys/module/nvidia/version"), "w") as f:
        f.write("590.48.01\n")
    with open(os.path.join(root, "proc/driver/nvidia/version"), "w") as f:
        f.write("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  590.48.01  Release Build\n")
    inv = scanner.update({d.pci.bdf for d in gpus})
    assert {inv.by_name()[d.name].attributes["driverVersion"].version for d in gpus} == {"590.48.1"}
    assert inv == scan(root)


def test_a_gpu_rebound_after_a_module_loaded_gets_its_device_nodes(tmp_path):
    """nvidia-uvm is loaded on first use (nvidia-modprobe -u), after the agent's first scan; a GPU
    bound to nvidia after that (from vfio-pci, say) is read again by the rescan its bind starts.
    It gets /dev/nvidia-uvm by the major /proc/devices gives now: the one of the first scan was
    none, and the GPU was published without those nodes until the next full resync."""
    root = str(tmp_path / "node")
    shutil.copytree(profile_root("server-2s-gpu-nic"), root, symlinks=True)
    devices = os.path.join(root, "proc/devices")
    with open(devices) as f:
        text = f.read()
    with open(devices, "w") as f:
        f.write(text.replace("510 nvidia-uvm\n", ""))
    scanner = IncrementalScanner(root)
    gpu = next(d for d in scanner.full().devices if d.kind == "gpu" and d.pci.driver == "nvidia")
    assert "/dev/nvidia-uvm" not in {n.path for n in gpu.device_nodes}
    with open(devices, "w") as f:
        f.write(text)
    inv = scanner.update({gpu.pci.bdf})
    assert inv.by_name()[gpu.name] == scan(root).by_name()[gpu.name]
    assert "/dev/nvidia-uvm" in {n.path for n in inv.by_name()[gpu.name].device_nodes}


def test_an_alveo_card_keeps_its_name_while_its_management_pf_is_unbound(tmp_path):
    """xclmgmt unloaded (an XRT upgrade, a shell being flashed): the user PF still serves and the
    card is still offered, under the name a claim holds it by. Named after its user PF instead,
    the card a claim held as fpga-0000-04-00-0 was offered as fpga-0000-04-00-1 to a second pod;
    with xclmgmt back, each claim held a name of the one card."""
    root = str(tmp_path / "node")
    shutil.copytree(profile_root("alveo"), root, symlinks=True)
    scanner = IncrementalScanner(root)
    assert sorted(d.name for d in scanner.full().devices if d.kind == "fpga") == ["fpga-0000-04-00-0", "fpga-0000-05-00-0"]
    mgmt = os.path.realpath(os.path.join(root, BUS, "0000:04:00.0"))
    os.unlink(os.path.join(mgmt, "driver"))
    set_uevent_driver(mgmt, None)
    inv = scanner.update({"0000:04:00.0"})
    assert sorted(d.name for d in inv.devices if d.kind == "fpga") == ["fpga-0000-04-00-0", "fpga-0000-05-00-0"]
    assert inv.by_name()["fpga-0000-04-00-0"].fpga.user_bdf == "0000:04:00.1" and inv == scan(root)
    # the operator's exclude_devices leaving the management PF out: the user PF alone names the card
    excluded = scan(root, exclude=Exclusions.parse(["pci:0000:04:00.0"]))
    assert "fpga-0000-04-00-1" in excluded.by_name() and "fpga-0000-04-00-0" not in excluded.by_name()
    os.unlink(os.path.join(root, BUS, "0000:04:00.0"))  # the function itself gone: a user PF alone (a VM's)
    assert "fpga-0000-04-00-1" in scanner.update({"0000:04:00.0"}).by_name()


def test_an_alveo_card_pulled_out_leaves_the_inventory(tmp_path):
    """Both PFs of an Alveo card gone (hot-unplugged, or removed through sysfs for a shell reload):
    the rescan their removals start has no function left in the card's slot to read, and the card
    stayed in the inventory, offered to pods, until the next full resync."""
    root = str(tmp_path / "node")
    shutil.copytree(profile_root("alveo"), root, symlinks=True)
    scanner = IncrementalScanner(root)
    assert "fpga-0000-04-00-0" in scanner.full().by_name()
    for bdf in ("0000:04:00.0", "0000:04:00.1"):
        os.unlink(os.path.join(root, BUS, bdf))
    inv = scanner.update({"0000:04:00.0", "0000:04:00.1"})
    assert [d.name for d in inv.devices if d.kind == "fpga"] == ["fpga-0000-05-00-0"] and inv == scan(root)
