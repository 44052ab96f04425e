"""VFIO passthrough of a function in use on the host (docs/vfio.md, "In use on the host"), on a
simulated kernel (tests/simkernel.py) with real processes holding device files open.

Why the device numbers are borrowed: a process can only hold a character device open that a
driver of this machine serves, and it has no NVIDIA GPU, RDMA NIC or vfio group. So the
function's node is given the numbers of ``/dev/full`` (1:7) — in its sysfs ``dev`` file, or
for an NVIDIA GPU through the ``nvidia-frontend`` major in ``/proc/devices`` and the minor in
the driver's ``information`` file — and a real process (``sleep``) holds a node with those
numbers, made with mknod. The root's ``proc`` shows the test's own processes only (links to
``/proc/<pid>``): what the agent scans is real procfs, and no other process of this machine
can be taken for a holder. Beside it, the other refusals that must come before any write: vfio-pci
not loaded, and a PF whose VFs the host enabled at boot when a prepared claim's re-bind comes."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time

import pytest

from agent.kubeletplugin.service import SerializeLock
from agent.kubeletplugin.types import ClaimRef
from agent.prepare import devusers, vfio_kernel
from agent.prepare.checkpoint import Checkpoint
from agent.prepare.driver import Driver
from discovery.inventory import scan
from tests.kubelet_standin import claim, settings_for
from tests.simkernel import SimPciKernel
from tests.test_vfio import node_root, rebooted, vfio_claim

GPU, GPU_BDF = "gpu-0000-3b-00-0", "0000:3b:00.0"  # NVIDIA minor 1, alone in IOMMU group 37
NIC, NIC_BDF = "nic-0000-3c-00-0", "0000:3c:00.0"  # mlx5 with /dev/infiniband/uverbs0, group 39
OTHER = "nic-0000-1a-00-0"
FULL = (1, 7)  # /dev/full's numbers: a device every Linux machine serves
UID, UID2, UID3 = (f"00000000-0000-4000-8000-0000000f02{i:02d}" for i in range(1, 4))


@pytest.fixture
def node(tmp_path):
    root = node_root(tmp_path, "server-2s-gpu-nic")
    sim = SimPciKernel(root, real_nodes=True).start()
    s = settings_for(str(tmp_path), root=root)
    children: list[subprocess.Popen] = []

    def driver(wait: float = 3.0) -> Driver:
        d = Driver(s, lambda: scan(root))
        d.kernel.wait = wait
        return d

    yield s, sim, driver, children
    for child in children:
        child.kill()
        child.wait()
    sim.close()
    vfio_kernel._IN_FLIGHT.clear()  # this root's writes: gone with it


def hold(root: str, children: list, node: str, numbers: tuple[int, int], name: str = "sleep") -> subprocess.Popen:
    """A real process named ``name`` holding ``node`` (made with ``numbers``) open, seen in the
    root's procfs."""
    path = os.path.join(root, node.lstrip("/"))
    if not (os.path.exists(path) and os.stat(path).st_rdev == os.makedev(*numbers)):
        if os.path.lexists(path):
            os.unlink(path)  # the fixture's placeholder file
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.mknod(path, 0o600 | 0o020000, os.makedev(*numbers))
    exe = os.path.join(os.path.dirname(root), name)
    if not os.path.exists(exe):
        os.symlink(shutil.which("sleep"), exe)  # its comm is the name it was started by
    with open(path, "rb") as f:
        child = subprocess.Popen([exe, "600"], stdin=f, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children.append(child)
    see(root, child.pid)
    return child


def see(root: str, pid: int) -> None:
    os.makedirs(os.path.join(root, "proc"), exist_ok=True)
    os.symlink(f"/proc/{pid}", os.path.join(root, "proc", str(pid)))


def gpu_as_full(root: str) -> str:
    """The GPU's /dev/nvidia<minor> as /dev/full's numbers (the driver's major and minor)."""
    devices = os.path.join(root, "proc/devices")
    text = open(devices).read().replace("195 nvidia-frontend", f"{FULL[0]} nvidia-frontend")
    open(devices, "w").write(text)
    info = os.path.join(root, "proc/driver/nvidia/gpus", GPU_BDF, "information")
    text = re.sub(r"Device Minor:.*", f"Device Minor: \t {FULL[1]}", open(info).read())
    open(info, "w").write(text)
    return f"/dev/nvidia{FULL[1]}"


def nic_as_full(root: str) -> str:
    """The NIC's uverbs class device (sysfs ``dev``) as /dev/full's numbers."""
    with open(os.path.join(root, "sys/bus/pci/devices", NIC_BDF, "infiniband_verbs/uverbs0/dev"), "w") as f:
        f.write(f"{FULL[0]}:{FULL[1]}\n")
    return "/dev/infiniband/uverbs0"


@pytest.mark.parametrize("device, bdf, driver_name, setup, holder, words", [
    (GPU, GPU_BDF, "nvidia", gpu_as_full, "nvidia-persistenced",
     "until they close it. nvidia-persistenced keeps the GPU open: the persistence daemon must release it first "
     "(stop it, or restart it without this GPU); `nvidia-smi -i <id> -pm 0` is the GPU's persistence-mode setting"),
    (NIC, NIC_BDF, "mlx5_core", nic_as_full, "ib_send_bw", "; its driver would not let go of it until they close it"),
])
def test_a_function_whose_device_files_are_open_is_refused_and_nothing_written(node, device, bdf, driver_name, setup,
                                                                              holder, words):
    s, sim, driver, children = node
    path = setup(s.root)
    child = hold(s.root, children, path, FULL, holder)
    override = os.path.join(s.root, "sys/bus/pci/devices", bdf, "driver_override")
    before = os.stat(override).st_mtime_ns
    d = driver()
    err = d.prepare_claims([vfio_claim("vm", [device], UID)])[UID].error
    held = os.path.join(s.root, path.lstrip("/"))  # the path the process opened
    assert err.startswith(f"{bdf} is in use on the host: {held} is open by pid {child.pid} ({holder[:15]})"), err
    assert err.endswith(words), err
    assert sim.driver(bdf) == driver_name and sim.override(bdf) is None
    assert os.stat(override).st_mtime_ns == before and sim.log == []  # not a write: refused while planning
    assert UID not in Checkpoint.load(d.checkpoint_path, move_corrupt=False).claims
    child.kill()
    child.wait()  # gone: its procfs entry vanishes (the link into /proc stays dangling, as a race leaves it)
    assert d.prepare_claims([vfio_claim("vm", [device], UID)])[UID].error is None
    assert sim.driver(bdf) == "vfio-pci"
    assert d.unprepare_claims([ClaimRef("default", "vm", UID)]) == {UID: None}
    assert sim.driver(bdf) == driver_name


def test_giving_back_waits_for_the_vfio_user(node):
    """Unbinding from vfio-pci waits for the process that has the group open (a VM that did not
    stop): unprepare says who, the claim keeps the function, and the retry gives it back."""
    s, sim, driver, children = node
    d = driver()
    assert d.prepare_claims([vfio_claim("vm", [NIC], UID)])[UID].error is None
    group = sim.group(NIC_BDF)
    child = hold(s.root, children, f"/dev/vfio/{group}", (1, 3), "qemu-system-x86")  # the sim's real group node
    err = d.unprepare_claims([ClaimRef("default", "vm", UID)])[UID]
    assert f"{s.root}/dev/vfio/{group} is open by pid {child.pid} (qemu-system-x86)" in err, err
    assert sim.driver(NIC_BDF) == "vfio-pci" and UID in d.checkpoint.claims
    child.kill()
    child.wait()
    assert d.unprepare_claims([ClaimRef("default", "vm", UID)]) == {UID: None}
    assert sim.driver(NIC_BDF) == "mlx5_core"


def wait_until(predicate, what: str, timeout: float = 30.0) -> None:
    """Poll ``predicate`` until true; a test failure naming ``what`` if it never is."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            pytest.fail(f"still {what}")
        time.sleep(0.01)


def _in_thread(fn, *args) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    t.start()
    return t, out


def test_an_unbind_that_does_not_return_lets_go_of_the_node(node):
    """The unbind write blocks (someone opened the device after the check): the claim fails
    after the deadline, the serialize lock is free (another claim's prepare completes while the
    write is still in the kernel), the claim keeps the function with a record that says a
    write is pending, and nothing races the kernel: retries say so until the write returns;
    then the retry gives the function back and binds it again."""
    s, sim, driver, children = node
    sim.hang("mlx5_core")
    lock = SerializeLock(os.path.join(os.path.dirname(s.root), "serialize.lock"))  # the kubelet plugin's lock
    d = driver(wait=1.0)
    t, out = _in_thread(lock.run, d.prepare_claims, [vfio_claim("vm", [NIC], UID)])
    t.join(30)
    assert not t.is_alive(), "the prepare did not come back: the unbind write held it"
    err = out[0][UID].error
    assert f"{NIC_BDF}: the kernel has not finished unbinding it from mlx5_core after 1s" in err, err
    assert "the claim's record keeps the function" in err
    entry = Checkpoint.load(d.checkpoint_path, move_corrupt=False).claims[UID]  # saved durably
    assert entry["state"] == "PrepareStarted" and entry["vfio"][0]["pending"] is True
    # the node goes on: another claim (a plain one) is prepared while the write is in the kernel
    t2, out2 = _in_thread(lock.run, d.prepare_claims, [claim("net", [("net", OTHER)], uid=UID2)])
    t2.join(30)
    assert not t2.is_alive() and out2[0][UID2].error is None
    # the function stays the failed claim's; retries are answered at once, nothing written
    assert "in use by another prepared claim" in d.prepare_claims([vfio_claim("vm2", [NIC], UID3)])[UID3].error
    again = d.prepare_claims([vfio_claim("vm", [NIC], UID)])[UID].error
    assert "unbind from mlx5_core: written" in again and "the kernel has not finished it" in again, again
    assert "the kernel has not finished it" in d.unprepare_claims([ClaimRef("default", "vm", UID)])[UID]
    assert sim.driver(NIC_BDF) == "mlx5_core" and sim.log == []
    sim.release("mlx5_core")  # the holder let go: the kernel finishes the unbind
    wait_until(lambda: sim.driver(NIC_BDF) is None, f"bound, the unbind of {NIC_BDF} not landed")
    assert d.prepare_claims([vfio_claim("vm", [NIC], UID)])[UID].error is None  # given back, then bound again
    assert sim.driver(NIC_BDF) == "vfio-pci" and "pending" not in d.checkpoint.claims[UID]["vfio"][0]
    assert sim.log[-2:] == [f"unbind {NIC_BDF} mlx5_core", f"bind {NIC_BDF} vfio-pci"]
    assert d.unprepare_claims([ClaimRef("default", "vm", UID)]) == {UID: None}
    assert sim.driver(NIC_BDF) == "mlx5_core"


def test_a_pending_write_of_another_instance_holds_back_the_give_back(node):
    """A start (or the other instance of a rolling update) finds a claim whose unbind did not
    return: while some process still has the driver's unbind file open, a write may land at any
    moment, so the function is not given back; once none has, it is. The old instance is a
    real process blocked in its write (``sh``); this process's own hung thread is not in the
    root's procfs, as a new instance's registry is empty."""
    s, sim, driver, children = node
    sim.hang("mlx5_core")
    t, out = _in_thread(driver(wait=1.0).prepare_claims, [vfio_claim("vm", [NIC], UID)])
    t.join(30)
    assert "has not finished unbinding" in out[0][UID].error
    unbind = os.path.join(s.root, "sys/bus/pci/drivers/mlx5_core/unbind")
    old = subprocess.Popen(["sh", "-c", f"echo {NIC_BDF} > {unbind}"])
    children.append(old)
    see(s.root, old.pid)
    vfio_kernel._IN_FLIGHT.clear()  # a new instance knows nothing of the old one's threads
    # sh has opened it and waits in write()
    wait_until(lambda: driver().kernel.writers(NIC_BDF, ["mlx5_core"]), "no process blocked in its write")
    report = driver().recover()
    assert UID not in report.rolled_back and UID in Checkpoint.load(driver().checkpoint_path, move_corrupt=False).claims
    assert sim.driver(NIC_BDF) == "mlx5_core" and sim.override(NIC_BDF) == "vfio-pci" and sim.log == []  # nothing written
    sim.release("mlx5_core")  # the writes land, the old instance's returns
    assert old.wait(30) == 0
    t.join(30)
    # a kernel's write returns once the unbind is done; the simulated kernel handles it at its next step
    wait_until(lambda: sim.driver(NIC_BDF) is None, f"bound, the unbind of {NIC_BDF} not landed")
    report = driver().recover()
    assert UID in report.rolled_back
    assert sim.driver(NIC_BDF) == "mlx5_core" and sim.override(NIC_BDF) is None
    assert sim.log == [f"unbind {NIC_BDF} mlx5_core", f"bind {NIC_BDF} mlx5_core"]


@pytest.mark.parametrize("where", ["start", "re-prepare"])
def test_a_rebind_after_a_reboot_that_does_not_return_is_written_down(node, where):
    """A prepared claim's function is moved to vfio-pci again after a reboot (at the agent's
    start, or at the kubelet's re-prepare), and the unbind does not return: the claim's entry
    on disk says the write is pending, so an agent started later does not give the function
    back under a write still in the kernel; once it returns, the claim is served again."""
    s, sim, driver, children = node
    d = driver(wait=1.0)
    assert d.prepare_claims([vfio_claim("vm", [NIC], UID)])[UID].error is None
    rebooted(s.root, sim, NIC_BDF, "mlx5_core")
    sim.hang("mlx5_core")
    if where == "start":
        d = driver(wait=1.0)
        d.recover()
    else:  # the function left vfio-pci under this running agent (its start is done): the kubelet prepares again
        err = d.prepare_claims([vfio_claim("vm", [NIC], UID)])[UID].error
        assert f"{NIC_BDF}: the kernel has not finished unbinding it from mlx5_core after 1s" in err, err
    (rec,) = Checkpoint.load(d.checkpoint_path, move_corrupt=False).claims[UID]["vfio"]
    assert rec["pending"] is True and rec["driver"] == "mlx5_core"
    sim.release("mlx5_core")
    wait_until(lambda: sim.driver(NIC_BDF) is None, f"bound, the unbind of {NIC_BDF} not landed")
    assert d.prepare_claims([vfio_claim("vm", [NIC], UID)])[UID].error is None
    assert sim.driver(NIC_BDF) == "vfio-pci"
    assert d.unprepare_claims([ClaimRef("default", "vm", UID)]) == {UID: None}
    assert sim.driver(NIC_BDF) == "mlx5_core" and sim.override(NIC_BDF) is None


def test_a_give_back_whose_unbind_does_not_return_is_written_down_as_pending(node):
    """docs/vfio.md, "Crash safety": at unprepare the VM's group is closed, but the unbind from
    vfio-pci does not return (its remove waits for a user no file shows). The claim keeps its
    entry, saved with its record ``pending`` and the function as the bind left it (the override
    not yet written back), so a new instance (the old one's write, a real ``sh``, still in the
    kernel) looks for that writer and writes nothing for the function under it."""
    s, sim, driver, children = node
    d = driver(wait=1.0)
    assert d.prepare_claims([vfio_claim("vm", [NIC], UID)])[UID].error is None
    sim.hang("vfio-pci")
    err = d.unprepare_claims([ClaimRef("default", "vm", UID)])[UID]
    assert f"{NIC_BDF}: the kernel has not finished unbinding it from vfio-pci after 1s" in err, err
    (rec,) = Checkpoint.load(d.checkpoint_path, move_corrupt=False).claims[UID]["vfio"]
    assert rec["pending"] is True and sim.override(NIC_BDF) == "vfio-pci"
    unbind = os.path.join(s.root, "sys/bus/pci/drivers/vfio-pci/unbind")
    old = subprocess.Popen(["sh", "-c", f"echo {NIC_BDF} > {unbind}"], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # no /dev/null: the sim's group node numbers
    children.append(old)
    see(s.root, old.pid)
    vfio_kernel._IN_FLIGHT.clear()  # a new instance knows nothing of the old one's threads
    wait_until(lambda: driver().kernel.writers(NIC_BDF, ["vfio-pci"]), "no process blocked in its write")
    again = driver().unprepare_claims([ClaimRef("default", "vm", UID)])[UID]
    assert "a write for it is still in the kernel" in again and "(sh)" in again, again
    assert sim.override(NIC_BDF) == "vfio-pci" and sim.log == [f"unbind {NIC_BDF} mlx5_core", f"bind {NIC_BDF} vfio-pci"]


def test_vfio_pci_not_loaded_is_refused_before_anything_is_written(node):
    """docs/vfio.md, "What is refused (nothing is written)": without vfio-pci the NIC would be
    unbound from its driver (its link down) for a bind that cannot be done. ``rmmod`` removes the
    driver's directory."""
    s, sim, driver, children = node
    shutil.rmtree(os.path.join(s.root, "sys/bus/pci/drivers/vfio-pci"))
    err = driver().prepare_claims([vfio_claim("vm", [NIC], UID)])[UID].error
    assert err and "vfio-pci is not loaded (modprobe vfio-pci)" in err, err
    assert sim.driver(NIC_BDF) == "mlx5_core" and sim.override(NIC_BDF) is None and sim.log == []


def test_a_rebind_after_a_reboot_runs_the_checks_of_a_prepare(node):
    """A claim passed the NIC's PF through while it had no SR-IOV VFs; the node reboots and the
    host's SR-IOV setup enables VFs on it before the agent starts. The re-bind (at start, and at
    the kubelet's re-prepare) is refused as a prepare would be: unbinding the PF would destroy them."""
    s, sim, driver, children = node
    numvfs = os.path.join(s.root, "sys/bus/pci/devices", NIC_BDF, "sriov_numvfs")
    open(numvfs, "w").write("0\n")
    assert driver().prepare_claims([vfio_claim("vm", [NIC], UID)])[UID].error is None
    rebooted(s.root, sim, NIC_BDF, "mlx5_core")
    open(numvfs, "w").write("8\n")  # enabled at boot
    log, d = len(sim.log), driver()
    d.recover()
    err = d.prepare_claims([vfio_claim("vm", [NIC], UID)])[UID].error
    assert err and f"{NIC_BDF} has 8 SR-IOV VFs enabled" in err, err
    assert sim.log[log:] == [] and sim.driver(NIC_BDF) == "mlx5_core" and sim.override(NIC_BDF) is None


# --- the scan on its own: procfs as untrusted, changing input ------------------------------------
def _fake_pid(proc: str, pid: str, comm: bytes, fds: dict[str, str]) -> None:
    os.makedirs(os.path.join(proc, pid, "fd"))
    with open(os.path.join(proc, pid, "comm"), "wb") as f:
        f.write(comm)
    for fd, target in fds.items():
        os.symlink(target, os.path.join(proc, pid, "fd", fd))


def test_the_scan_skips_what_vanishes_and_says_names_safely(tmp_path):
    root = str(tmp_path)
    dev = os.path.join(root, "dev")
    os.makedirs(dev)
    os.mknod(os.path.join(dev, "held"), 0o600 | 0o020000, os.makedev(*FULL))
    proc = os.path.join(root, "proc")
    _fake_pid(proc, "10", b"evil\x1b[31m\n", {"0": os.path.join(dev, "held"), "1": "/nonexistent/closed-meanwhile",
                                              "2": os.path.join(proc, "10", "fd", "2")})  # a loop: ELOOP, skipped too
    _fake_pid(proc, "11", b"other\n", {"4": "/dev/null"})
    os.makedirs(os.path.join(proc, "12"))  # ended between the listing and the read: no fd dir
    os.symlink("/proc/999999999", os.path.join(proc, "13"))  # a process that is gone
    os.makedirs(os.path.join(proc, "self-not-a-pid", "fd"))
    os.makedirs(os.path.join(proc, "\u00b2", "fd"))  # a digit to str.isdigit(), not to int()
    found = devusers.holders(root, {os.makedev(*FULL)})
    assert found.holders == [devusers.Holder(10, "evil?[31m", os.path.join(dev, "held"))]
    assert found.incomplete == "" and found.unreadable == 0
    assert devusers.describe(found.holders) == f"{dev}/held is open by pid 10 (evil?[31m)"
    assert devusers.advice(found.holders) == ""


def test_the_scan_is_capped(tmp_path, monkeypatch):
    root = str(tmp_path)
    for pid in range(1, 6):
        _fake_pid(os.path.join(root, "proc"), str(pid), b"x\n", {str(fd): "/dev/null" for fd in range(4)})
    everyone = devusers.holders(root, {os.stat("/dev/null").st_rdev})
    assert devusers.describe(everyone.holders) == "/dev/null is open by pid 1 (x), pid 2 (x), pid 3 (x) and 2 more"
    monkeypatch.setattr(devusers, "MAX_FDS", 8)
    found = devusers.holders(root, {os.stat("/dev/null").st_rdev})
    assert len(found.holders) == 2 and found.incomplete.startswith("stopped after 8 open files")


def test_a_functions_nodes_are_its_class_devices_and_nvidia_minor(node):
    s, sim, driver, children = node
    fs = driver().kernel.fs
    nic = devusers.function_nodes(fs, fs.path("sys/bus/pci/devices", NIC_BDF), NIC_BDF)
    assert nic == {os.makedev(231, 192)}  # infiniband_verbs/uverbs0; net/ and infiniband/ have no node
    gpu = devusers.function_nodes(fs, fs.path("sys/bus/pci/devices", GPU_BDF), GPU_BDF)
    assert gpu == {os.makedev(195, 1)}  # /dev/nvidia1: the driver's minor; nvidiactl is every GPU's, not its
    card = os.path.join(fs.path("sys/bus/pci/devices", GPU_BDF), "drm", "card3")
    os.makedirs(os.path.join(card, "card3-DP-1"))
    open(os.path.join(card, "dev"), "w").write("226:3\n")
    assert devusers.function_nodes(fs, fs.path("sys/bus/pci/devices", GPU_BDF), GPU_BDF) == gpu | {os.makedev(226, 3)}
    os.makedirs(os.path.join(card, "..", "renderD128"))
    open(os.path.join(card, "..", "renderD128", "dev"), "w").write("99999999999:1\n")  # no such number: skipped
    assert devusers.function_nodes(fs, fs.path("sys/bus/pci/devices", GPU_BDF), GPU_BDF) == gpu | {os.makedev(226, 3)}
