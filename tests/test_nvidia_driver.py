"""The NVIDIA user-space driver in a claim's CDI spec (discovery/nvidia_driver.py, cdi/nvidia.py,
agent/prepare/nvidia.py): fixture driver roots -> the exact spec; a version mismatch or no libcuda
fails the claim, marks the GPU unhealthy and is a doctor failure; NVIDIA's own CDI spec on request."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import stat

import pytest

from agent.health.checks import UNHEALTHY, Memory, check
from agent.prepare.driver import Driver
from agent.tools.doctor import check_nvidia_driver
from discovery.inventory import scan
from cdi.nvidia import driver_edits
from discovery.nvidia_driver import DriverFiles, DriverFilesCache, find_driver_files, resolve
from discovery.sysfs import HostFS
from tests.conftest import profile_root
from tests.kubelet_standin import settings_for

VER = "580.159.04"
LIBS = ["libcuda", "libnvidia-ptxjitcompiler", "libnvidia-ml", "libnvidia-nvvm", "libcudadebugger"]
NAMES = {"libcuda": ["libcuda.so.1", "libcuda.so"], "libnvidia-ptxjitcompiler": ["libnvidia-ptxjitcompiler.so.1"],
         "libnvidia-ml": ["libnvidia-ml.so.1"], "libnvidia-nvvm": ["libnvidia-nvvm.so.4"],
         "libcudadebugger": ["libcudadebugger.so.1"]}
VIDEO = {"libnvcuvid": ["libnvcuvid.so.1"], "libnvidia-encode": ["libnvidia-encode.so.1"],
         "libnvidia-opticalflow": ["libnvidia-opticalflow.so.1", "libnvidia-opticalflow.so"]}
TOOLS = ["nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control", "nvidia-cuda-mps-server"]


def copy_profile(tmp_path, profile: str) -> str:
    root = str(tmp_path / profile)
    shutil.copytree(profile_root(profile), root, symlinks=True)
    return root


def add_video_libraries(lib_dir: str, versions: dict[str, str] | None = None) -> None:
    """The video set in ``lib_dir`` as the installer leaves it (``libnvcuvid.so.1`` ->
    ``libnvcuvid.so.<ver>``); ``versions`` gives a library another version than the module's."""
    for lib in VIDEO:
        real = f"{lib}.so.{(versions or {}).get(lib, VER)}"
        with open(os.path.join(lib_dir, real), "w") as f:
            f.write(f"fixture: {real}\n")
        os.symlink(real, os.path.join(lib_dir, f"{lib}.so.1"))


def video_mounts(lib_dir: str, libs=tuple(VIDEO), prefix: str = "") -> list[dict]:
    ro = ["ro", "nosuid", "nodev", "bind"]
    return [{"hostPath": f"{prefix}{lib_dir}/{lib}.so.{VER}", "containerPath": f"/usr/local/nvidia/lib64/{name}", "options": ro}
            for lib in libs for name in [f"{lib}.so.{VER}", *VIDEO[lib]]]


def write_hook(path: str, compat: bool = True) -> None:
    """A stand-in for nvidia-cdi-hook's Go binary, its subcommand names among its bytes;
    ``compat``: a toolkit of v1.17.5 or later, which has enable-cuda-compat."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"\x7fELF\x02\x01\x01\x00" + b"\x00" * 64 + b"update-ldcache\x00create-symlinks\x00"
                + (b"enable-cuda-compat\x00" if compat else b"") + b"chmod\x00")


def expected_mounts(lib_dir: str, bin_dir: str, fw_dir: str, prefix: str = "") -> list[dict]:
    ro = ["ro", "nosuid", "nodev", "bind"]
    out = [{"hostPath": f"{prefix}{lib_dir}/{lib}.so.{VER}", "containerPath": f"/usr/local/nvidia/lib64/{name}", "options": ro}
           for lib in LIBS for name in [f"{lib}.so.{VER}", *NAMES[lib]]]
    out += [{"hostPath": f"{prefix}{bin_dir}/{t}", "containerPath": f"/usr/bin/{t}", "options": ro} for t in TOOLS]
    out += [{"hostPath": f"{prefix}{fw_dir}/{VER}/{fw}", "containerPath": f"/lib/firmware/nvidia/{VER}/{fw}",
             "options": ro + ["noexec"]} for fw in ("gsp_ga10x.bin", "gsp_tu10x.bin")]
    return out


def prepare_gpu(tmp_path, root: str, gpu: str, **settings) -> tuple[object, dict | None, object]:
    s = settings_for(str(tmp_path / "agent"), root=root, node_name="node-a").replace(**settings)
    inv = scan(root)
    d = Driver(s, lambda: inv)
    uid = "0f0e0d0c-0b0a-4908-8706-050403020100"
    c = {"metadata": {"namespace": "ns", "name": "cuda", "uid": uid},
         "status": {"allocation": {"devices": {"results": [
             {"request": "gpu", "driver": "sysdra.io", "pool": "node-a", "device": gpu}]}}}}
    res = d.prepare_claims([c])[uid]
    spec = (d.checkpoint.claims.get(uid) or {}).get("cdiSpec")
    return res, spec["spec"] if spec else None, d


def test_a_distribution_layout_gives_the_exact_spec(tmp_path):
    res, spec, _ = prepare_gpu(tmp_path, profile_root("server-2s-gpu-nic"), "gpu-0000-18-00-0")
    assert res.error is None, res.error
    edits = spec["containerEdits"]
    assert edits["mounts"] == expected_mounts("/usr/lib/x86_64-linux-gnu", "/usr/bin", "/lib/firmware/nvidia")
    assert [e for e in edits["env"] if not e.startswith("SYSDRA_")] == [
        "NVIDIA_VISIBLE_DEVICES=void", "LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64"]
    assert "hooks" not in edits and "deviceNodes" not in edits  # no hook, no nvidia-modeset on this node
    nodes = spec["devices"][0]["containerEdits"]["deviceNodes"]
    assert [n["path"] for n in nodes] == ["/dev/nvidia2", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]


def test_the_usr_local_nvidia_layout_of_the_h200_host(tmp_path):
    root = profile_root("h200-vm")
    res, spec, _ = prepare_gpu(tmp_path, root, "gpu-0000-00-06-0", nvidia_driver_root="/usr/local/nvidia")
    assert res.error is None, res.error
    assert spec["containerEdits"]["mounts"] == expected_mounts(
        "/usr/local/nvidia/lib64", "/usr/local/nvidia/bin", "/usr/local/nvidia/firmware/nvidia")
    # the same files where a runtime sees the tree itself (tests, demos)
    res, spec, _ = prepare_gpu(tmp_path / "2", root, "gpu-0000-00-06-0", nvidia_driver_root="/usr/local/nvidia",
                               cdi_host_root=root)
    assert spec["containerEdits"]["mounts"] == expected_mounts(
        "/usr/local/nvidia/lib64", "/usr/local/nvidia/bin", "/usr/local/nvidia/firmware/nvidia", prefix=root)
    for m in spec["containerEdits"]["mounts"]:
        assert os.path.isfile(m["hostPath"]), m


def test_the_wrong_driver_root_fails_the_claim_with_how_to_fix_it(tmp_path):
    res, spec, _ = prepare_gpu(tmp_path, profile_root("h200-vm"), "gpu-0000-00-06-0")  # driver root /
    assert spec is None and "has no libcuda.so.580.159.04" in res.error and "nvidia-driver-root" in res.error


def _mismatched(tmp_path) -> str:
    root = copy_profile(tmp_path, "server-2s-gpu-nic")
    with open(os.path.join(root, "sys/module/nvidia/version"), "w") as f:
        f.write("590.48.01\n")
    return root


def test_a_version_mismatch_fails_the_claim_marks_the_gpu_and_fails_doctor(tmp_path):
    root = _mismatched(tmp_path)
    res, spec, d = prepare_gpu(tmp_path, root, "gpu-0000-18-00-0")
    assert spec is None
    assert res.error == ("NVIDIA user-space driver: driver root / has libcuda 580.159.04, the kernel module is "
                         "590.48.01: the user-space driver does not match the running driver")
    dev = scan(root).by_name()["gpu-0000-18-00-0"]
    verdict = check(HostFS(root), dev, Memory(), nvidia_files=DriverFilesCache(root).get)
    assert verdict.health == UNHEALTHY and verdict.reason == "nvidia-userspace-driver" and "590.48.01" in verdict.message
    found = check_nvidia_driver(root, "/")
    assert found[0].level == "fail" and "does not match" in found[0].message and "ok" not in [f.level for f in found]


def test_a_good_driver_is_a_positive_health_signal_and_doctor_ok(tmp_path):
    root = profile_root("server-2s-gpu-nic")
    dev = scan(root).by_name()["gpu-0000-18-00-0"]
    verdict = check(HostFS(root), dev, Memory(), nvidia_files=DriverFilesCache(root).get)
    assert "NVIDIA user-space driver 580.159.04 matches" in verdict.message
    assert [f.level for f in check_nvidia_driver(root, "/")] == ["ok"]


def test_a_missing_ptxjitcompiler_is_a_warning_and_left_out(tmp_path, caplog):
    root = copy_profile(tmp_path, "server-2s-gpu-nic")
    lib = os.path.join(root, "usr/lib/x86_64-linux-gnu")
    for name in os.listdir(lib):
        if name.startswith("libnvidia-ptxjitcompiler"):
            os.remove(os.path.join(lib, name))
    caplog.set_level(logging.WARNING)
    res, spec, _ = prepare_gpu(tmp_path, root, "gpu-0000-18-00-0")
    assert res.error is None
    assert not any("ptxjit" in m["containerPath"] for m in spec["containerEdits"]["mounts"])
    assert "has no libnvidia-ptxjitcompiler.so.580.159.04" in caplog.text
    assert [f.level for f in check_nvidia_driver(root, "/")] == ["warn", "ok"]


def test_the_video_libraries_are_mounted_after_the_compute_ones(tmp_path):
    """NVENC, NVDEC and optical flow (the toolkit's "video" set) at their sonames, and
    libnvidia-opticalflow.so, which the toolkit adds too; the fixture's own layout has none, and
    that is no warning (test_a_distribution_layout_gives_the_exact_spec, ..._doctor_ok)."""
    root = copy_profile(tmp_path, "server-2s-gpu-nic")
    lib = "/usr/lib/x86_64-linux-gnu"
    add_video_libraries(root + lib)
    res, spec, _ = prepare_gpu(tmp_path, root, "gpu-0000-18-00-0")
    assert res.error is None, res.error
    mounts = spec["containerEdits"]["mounts"]
    compute, libs = expected_mounts(lib, "/usr/bin", "/lib/firmware/nvidia"), sum(1 + len(NAMES[n]) for n in LIBS)
    assert mounts == compute[:libs] + video_mounts(lib) + compute[libs:]
    assert [f.level for f in check_nvidia_driver(root, "/")] == ["ok"]


def test_a_video_library_of_another_version_is_left_out_as_a_compute_one_is(tmp_path, caplog):
    """Debian packages libnvcuvid1 and libnvidia-encode1 apart from the driver: one of another
    version would fail in the container, so it is not mounted; the claim is prepared, nothing warns."""
    root = copy_profile(tmp_path, "server-2s-gpu-nic")
    lib = "/usr/lib/x86_64-linux-gnu"
    add_video_libraries(root + lib, {"libnvidia-encode": "570.195.03"})
    caplog.set_level(logging.WARNING)
    res, spec, _ = prepare_gpu(tmp_path, root, "gpu-0000-18-00-0")
    assert res.error is None, res.error
    video = [m for m in spec["containerEdits"]["mounts"] if any(v in m["hostPath"] for v in VIDEO)]
    assert video == video_mounts(lib, ("libnvcuvid", "libnvidia-opticalflow"))
    assert "libnvidia-encode" not in caplog.text and [f.level for f in check_nvidia_driver(root, "/")] == ["ok"]


def test_claims_after_a_driver_change_get_the_files_found_then(tmp_path):
    """The driver's edits are built once per set of files found: a second claim gets the same
    mounts; after the files change (a library removed) the next claim's spec has what is there
    now, and the earlier claim's recorded spec stays as it was written."""
    root = copy_profile(tmp_path, "server-2s-gpu-nic")
    _, first, d = prepare_gpu(tmp_path, root, "gpu-0000-18-00-0")
    uid2 = "1f0e0d0c-0b0a-4908-8706-050403020100"

    def claim(uid: str, gpu: str) -> dict:
        return {"metadata": {"namespace": "ns", "name": f"cuda-{uid[:2]}", "uid": uid},
                "status": {"allocation": {"devices": {"results": [
                    {"request": "gpu", "driver": "sysdra.io", "pool": "node-a", "device": gpu}]}}}}

    assert d.prepare_claims([claim(uid2, "gpu-0000-19-00-0")])[uid2].error is None
    second = d.checkpoint.claims[uid2]["cdiSpec"]["spec"]
    assert second["containerEdits"]["mounts"] == first["containerEdits"]["mounts"]
    assert second["containerEdits"]["mounts"] is not first["containerEdits"]["mounts"]
    lib = os.path.join(root, "usr/lib/x86_64-linux-gnu")
    for name in os.listdir(lib):
        if name.startswith("libnvidia-ptxjitcompiler"):
            os.remove(os.path.join(lib, name))
    uid3 = "2f0e0d0c-0b0a-4908-8706-050403020100"
    assert d.prepare_claims([claim(uid3, "gpu-0000-3a-00-0")])[uid3].error is None
    third = d.checkpoint.claims[uid3]["cdiSpec"]["spec"]["containerEdits"]["mounts"]
    assert third == [m for m in first["containerEdits"]["mounts"] if "ptxjit" not in m["containerPath"]] != first["containerEdits"]["mounts"]
    assert d.checkpoint.claims[uid2]["cdiSpec"]["spec"] == second


def test_links_are_followed_as_the_host_would_and_stay_host_paths(tmp_path):
    root = copy_profile(tmp_path, "server-2s-gpu-nic")
    lib = os.path.join(root, "usr/lib/x86_64-linux-gnu")
    os.makedirs(os.path.join(root, "opt/nvidia"))
    os.rename(os.path.join(lib, f"libcuda.so.{VER}"), os.path.join(root, f"opt/nvidia/libcuda.so.{VER}"))
    os.symlink(f"/opt/nvidia/libcuda.so.{VER}", os.path.join(lib, f"libcuda.so.{VER}"))  # absolute: the host's /
    assert resolve(root, "/usr/lib/x86_64-linux-gnu/libcuda.so.1") == f"/opt/nvidia/libcuda.so.{VER}"
    files = find_driver_files(root)
    assert files.libraries[0].host_path == f"/opt/nvidia/libcuda.so.{VER}"
    os.symlink("loop", os.path.join(root, "loop"))
    assert resolve(root, "/loop") is None and resolve(root, "/../../usr/../usr/bin/nvidia-smi") == "/usr/bin/nvidia-smi"


@pytest.mark.root
def test_sockets_modeset_and_the_ldcache_hook(tmp_path):
    root = copy_profile(tmp_path, "server-2s-gpu-nic")
    for d in ("run/nvidia-persistenced", "run/nvidia-fabricmanager"):
        os.makedirs(os.path.join(root, d))
        here = os.getcwd()
        os.chdir(os.path.join(root, d))  # a unix socket path has at most 107 bytes
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.bind("socket")
        finally:
            os.chdir(here)
    os.mknod(os.path.join(root, "dev/nvidia-modeset"), stat.S_IFCHR | 0o666, os.makedev(195, 254))
    with open(os.path.join(root, "usr/bin/nvidia-cdi-hook"), "w") as f:
        f.write("fixture")
    res, spec, _ = prepare_gpu(tmp_path, root, "gpu-0000-18-00-0")
    edits = spec["containerEdits"]
    sockets = [m for m in edits["mounts"] if m["containerPath"].endswith("/socket")]
    assert [m["hostPath"] for m in sockets] == ["/run/nvidia-persistenced/socket", "/run/nvidia-fabricmanager/socket"]
    assert edits["deviceNodes"] == [{"path": "/dev/nvidia-modeset", "type": "c", "major": 195, "minor": 254}]
    assert edits["hooks"] == [{"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook",
                               "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", "/usr/local/nvidia/lib64"]}]
    assert [e for e in edits["env"] if not e.startswith("SYSDRA_")] == ["NVIDIA_VISIBLE_DEVICES=void"]  # the hook: no LD_LIBRARY_PATH


COMPAT = {"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook",
          "args": ["nvidia-cdi-hook", "enable-cuda-compat", f"--host-driver-version={VER}"]}
LDCACHE = {"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook",
           "args": ["nvidia-cdi-hook", "update-ldcache", "--folder", "/usr/local/nvidia/lib64"]}


def test_a_hook_with_enable_cuda_compat_runs_it_before_update_ldcache(tmp_path):
    """NVIDIA's order: the compat entry in ld.so.conf.d is written before ldconfig reads it."""
    root = copy_profile(tmp_path, "server-2s-gpu-nic")
    write_hook(os.path.join(root, "usr/bin/nvidia-cdi-hook"))
    res, spec, _ = prepare_gpu(tmp_path, root, "gpu-0000-18-00-0")
    assert res.error is None, res.error
    assert spec["containerEdits"]["hooks"] == [COMPAT, LDCACHE]
    assert "LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64" not in spec["containerEdits"]["env"]
    (ok,) = check_nvidia_driver(root, "/")
    assert ok.message.endswith("ld-cache hook, CUDA forward compatibility"), ok.message


def test_an_older_hook_gets_update_ldcache_alone(tmp_path):
    """A hook without enable-cuda-compat (toolkit < v1.17.5) exits non-zero on it, and the runtime
    would then refuse to create the container; doctor says the compat libraries are not used."""
    root = copy_profile(tmp_path, "server-2s-gpu-nic")
    write_hook(os.path.join(root, "usr/bin/nvidia-cdi-hook"), compat=False)
    res, spec, _ = prepare_gpu(tmp_path, root, "gpu-0000-18-00-0")
    assert res.error is None and spec["containerEdits"]["hooks"] == [LDCACHE]
    (ok,) = check_nvidia_driver(root, "/")
    assert "no CUDA forward compatibility" in ok.message and "enable-cuda-compat" in ok.message


def test_the_gpu_operators_wrapper_is_looked_through(tmp_path):
    """Its toolkit before v1.20.0: nvidia-cdi-hook a shell script that runs nvidia-cdi-hook.real."""
    root = copy_profile(tmp_path, "server-2s-gpu-nic")
    toolkit = os.path.join(root, "usr/local/nvidia/toolkit")
    write_hook(os.path.join(toolkit, "nvidia-cdi-hook.real"))
    with open(os.path.join(toolkit, "nvidia-cdi-hook"), "w") as f:
        f.write('#! /bin/sh\n\t/usr/local/nvidia/toolkit/nvidia-cdi-hook.real \\\n\t\t"$@"\n')
    hooks = driver_edits(find_driver_files(root))["hooks"]
    assert [h["path"] for h in hooks] == ["/usr/local/nvidia/toolkit/nvidia-cdi-hook"] * 2
    assert [h["args"][1] for h in hooks] == ["enable-cuda-compat", "update-ldcache"]


def test_no_compat_hook_without_the_drivers_version():
    files = DriverFiles(driver_root="/", version=None, cdi_hook="/usr/bin/nvidia-cdi-hook", cuda_compat=True)
    assert driver_edits(files)["hooks"] == [LDCACHE]


def test_a_toolkit_upgrade_is_seen_without_a_restart(tmp_path):
    """The cache looks at the hook's directories too: a package upgrade replaces the binary there."""
    root = copy_profile(tmp_path, "h200-vm")
    toolkit = os.path.join(root, "usr/local/nvidia/toolkit")
    write_hook(os.path.join(toolkit, "nvidia-cdi-hook"), compat=False)
    cache = DriverFilesCache(root, "/usr/local/nvidia")
    assert cache.get().cdi_hook == "/usr/local/nvidia/toolkit/nvidia-cdi-hook" and not cache.get().cuda_compat
    write_hook(os.path.join(toolkit, "nvidia-cdi-hook.new"))
    os.replace(os.path.join(toolkit, "nvidia-cdi-hook.new"), os.path.join(toolkit, "nvidia-cdi-hook"))
    st = os.stat(toolkit)  # the replace's own mtime may fall in the same clock tick as the first write
    os.utime(toolkit, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert cache.get().cuda_compat


def test_a_vfio_bound_or_amd_gpu_gets_no_driver(tmp_path):
    res, spec, _ = prepare_gpu(tmp_path, profile_root("mi300x-partitions"), "gpu-0000-05-00-0")
    assert res.error is None and "mounts" not in spec["containerEdits"]
    assert not any(e.startswith("NVIDIA_") for e in spec["containerEdits"].get("env", []))


def test_nvidias_own_cdi_spec_on_request(tmp_path):
    root = copy_profile(tmp_path, "server-2s-gpu-nic")
    os.makedirs(os.path.join(root, "etc/cdi"))
    uuid = scan(root).by_name()["gpu-0000-18-00-0"].gpu.nvidia_uuid
    nvidia_spec = {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": [
        {"name": "0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}},
        {"name": uuid, "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia2"}]}}],
        "containerEdits": {"mounts": [{"hostPath": "/usr/lib/libcuda.so.1", "containerPath": "/usr/lib/libcuda.so.1"}]}}
    with open(os.path.join(root, "etc/cdi/nvidia.json"), "w") as f:
        json.dump(nvidia_spec, f)
    res, spec, _ = prepare_gpu(tmp_path, root, "gpu-0000-18-00-0", nvidia_cdi_spec=True)
    assert res.error is None
    (dev,) = res.devices
    assert dev.cdi_ids[1] == f"nvidia.com/gpu={uuid}" and dev.cdi_ids[0].startswith("k8s.sysdra.io/claim=")
    # NVIDIA's spec brings the driver; ours still keeps the legacy hook from adding the node's GPUs
    assert "mounts" not in spec["containerEdits"] and spec["containerEdits"]["env"].count("NVIDIA_VISIBLE_DEVICES=void") == 1
    res, _, _ = prepare_gpu(tmp_path / "b", root, "gpu-0000-19-00-0", nvidia_cdi_spec=True)
    assert "no nvidia.com/gpu device for GPU" in res.error and "nvidia-ctk cdi generate" in res.error


def test_nvidias_spec_in_var_run_cdi_overrides_a_stale_one_in_etc_cdi(tmp_path):
    """The runtime takes a device name defined in /etc/cdi and in /var/run/cdi from /var/run/cdi
    (the higher priority dir): a stale /etc/cdi spec (generated before a GPU fell off the bus,
    index names shifted since) must not name the device the runtime then takes from the
    fresh spec, another GPU."""
    root = copy_profile(tmp_path, "server-2s-gpu-nic")

    def write(d: str, nodes: dict[str, str]) -> None:
        os.makedirs(os.path.join(root, d))
        spec = {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": [
            {"name": name, "containerEdits": {"deviceNodes": [{"path": node}]}} for name, node in nodes.items()]}
        with open(os.path.join(root, d, "nvidia.json"), "w") as f:
            json.dump(spec, f)

    write("etc/cdi", {"0": "/dev/nvidia0", "1": "/dev/nvidia1", "2": "/dev/nvidia2"})  # stale
    write("var/run/cdi", {"0": "/dev/nvidia0", "1": "/dev/nvidia2", "2": "/dev/nvidia3"})  # what the runtime uses
    res, _, _ = prepare_gpu(tmp_path, root, "gpu-0000-18-00-0", nvidia_cdi_spec=True)  # /dev/nvidia2
    assert res.error is None, res.error
    assert res.devices[0].cdi_ids[1] == "nvidia.com/gpu=1"


def test_a_tool_that_is_a_link_keeps_its_name_in_the_container(tmp_path):
    """A tool the host has as a link to a file of another name (an alternatives link, a
    versioned file) is still ``/usr/bin/<tool>`` in the container, as a library is mounted by
    the names it is loaded by, not by its target's; and the agent still finds it to run."""
    root = copy_profile(tmp_path, "server-2s-gpu-nic")
    os.makedirs(os.path.join(root, "opt/nvidia/bin"))
    os.rename(os.path.join(root, "usr/bin/nvidia-smi"), os.path.join(root, f"opt/nvidia/bin/nvidia-smi.{VER}"))
    os.symlink(f"/opt/nvidia/bin/nvidia-smi.{VER}", os.path.join(root, "usr/bin/nvidia-smi"))
    res, spec, d = prepare_gpu(tmp_path, root, "gpu-0000-18-00-0")
    assert res.error is None, res.error
    smi = [m for m in spec["containerEdits"]["mounts"] if m["hostPath"] == f"/opt/nvidia/bin/nvidia-smi.{VER}"]
    assert [m["containerPath"] for m in smi] == ["/usr/bin/nvidia-smi"]
    assert d.nvidia.tool("nvidia-smi")[0] == os.path.join(root, f"opt/nvidia/bin/nvidia-smi.{VER}")
