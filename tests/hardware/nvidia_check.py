"""The real-GPU check (issue 38): what sysdra publishes for a real NVIDIA GPU, and a CUDA program
that runs from the claim's CDI spec alone. Not a test CI runs: a developer with a GPU machine runs
it once, as root, from the repository root (docs/nvidia.md, "Checked on a real GPU"):

    python3 -m tests.hardware.nvidia_check --driver-root /usr/local/nvidia --out DIR

Steps (each logged to DIR/check.log with its result; the files named below land in DIR):
1. ``sysdra scan`` (table, ``-o json`` -> scan.json, ``-o slices --share gpu`` -> slices.json)
   and what NVML says of the same GPU (nvml.json), side by side.
2. ``sysdra run`` offline on ``/`` (its own kubelet, CDI and cluster dirs in a temp dir), a claim for
   the first NVIDIA GPU prepared over the kubelet's gRPC protocol; the CDI spec -> spec.json.
3. A plain rootfs holding glibc and the CUDA program (``cuda_check.cu``, PTX only, so the driver
   JIT-compiles it); the spec's edits applied by ``cdirun.py`` in new namespaces; the program
   launches a kernel and checks its result. Then the same rootfs with the spec's device nodes but
   without its driver mounts, which must fail: the spec is what made CUDA work. Then MPS: the claim
   is a 20Gi share, a client of the MPS control daemon the agent started for it; 10 GiB allocate in
   the spec's rootfs, 30 GiB do not. (Without nvcc the program's runs are skipped and reported.)
4. Unprepare, the spec gone, the MPS daemon stopped, the agent stopped.
1b. (``mig_check.py``, read-only) the MIG profiles and placements NVML lists through discovery/mig.py
   against ``nvidia-smi mig -lgip``/``-lgipp`` and the simulator's table -> mig-profiles.json; the
   MIG mode is not changed (checked before and after) and no instance is created.
Leaves the GPU's settings alone; stops everything it started. ``--root`` (default ``/``) and a
simulated NVML/nvidia-smi rehearse the whole check on a fixture node where no GPU is
(tests/test_hardware_check.py), so the first run on a lent GPU is not also its first run.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import psutil

from discovery.nvidia import ADDRESSING_MODES

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
NODE, DRIVER = "gpu-check", "sysdra.io"
GLIBC = ("libc.so.6", "libm.so.6", "libdl.so.2", "libpthread.so.0", "librt.so.1")


class Log:
    def __init__(self, out: str):
        self.path = os.path.join(out, "check.log")
        self.failures: list[str] = []

    def __call__(self, text: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {text}"
        print(line, flush=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")

    def check(self, ok: bool, what: str) -> bool:
        self(("PASS " if ok else "FAIL ") + what)
        if not ok:
            self.failures.append(what)
        return ok


def sysdra(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "agent", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def write(out: str, name: str, data) -> None:
    with open(os.path.join(out, name), "w") as f:
        f.write(data if isinstance(data, str) else json.dumps(data, indent=2))


def nvidia_smi(driver_root: str) -> str | None:
    """``nvidia-smi`` on PATH, else the driver root's (a container's PATH may lack it)."""
    return shutil.which("nvidia-smi") or shutil.which("nvidia-smi", path=os.path.join(driver_root, "bin"))


def nvml_facts() -> list[dict]:
    import pynvml

    pynvml.nvmlInit()
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            out.append({
                "pciBusId": pynvml.nvmlDeviceGetPciInfo(h).busId, "name": pynvml.nvmlDeviceGetName(h),
                "uuid": pynvml.nvmlDeviceGetUUID(h), "memoryTotal": pynvml.nvmlDeviceGetMemoryInfo(h).total,
                "architecture": pynvml.nvmlDeviceGetArchitecture(h), "brand": pynvml.nvmlDeviceGetBrand(h),
                "cudaComputeCapability": list(pynvml.nvmlDeviceGetCudaComputeCapability(h)),
                "driverVersion": pynvml.nvmlSystemGetDriverVersion(),
                "cudaDriverVersion": pynvml.nvmlSystemGetCudaDriverVersion_v2(),
                "addressingMode": _optional(pynvml.nvmlDeviceGetAddressingMode, h),
            })
        return out
    finally:
        pynvml.nvmlShutdown()


def _optional(fn, *args):
    import pynvml

    try:
        return fn(*args)
    except pynvml.NVMLError:
        return None


def step_scan(log: Log, out: str, root: str, driver_root: str) -> dict | None:
    flags = ["--root", root, "--nvidia-driver-root", driver_root]
    table = sysdra("scan", *flags)
    log(f"sysdra scan (exit {table.returncode}):\n{table.stdout}{table.stderr[-2000:]}")
    res = sysdra("scan", "-o", "json", *flags)
    inv = json.loads(res.stdout)
    gpus = [d for d in inv["devices"] if d["kind"] == "gpu" and d["name"].startswith("gpu-")]
    write(out, "scan.json", {"gpus": gpus, "problems": inv.get("problems")})
    slices = sysdra("scan", "-o", "slices", "--share", "gpu", *flags)
    write(out, "slices.json", slices.stdout)
    facts = nvml_facts()
    write(out, "nvml.json", facts)
    if not log.check(bool(gpus), f"scan found {len(gpus)} GPU(s)"):
        return None
    gpu, nv = gpus[0], facts[0]
    attrs = {k: next(iter(v.values())) for k, v in gpu.get("attributes", {}).items()}
    log(f"published {gpu['name']}: " + json.dumps({k: attrs.get(k) for k in (
        "productName", "brand", "architecture", "cudaComputeCapability", "driverVersion", "cudaDriverVersion",
        "addressingMode", "uuid")}) + f" capacity {gpu.get('capacity')}")
    log(f"NVML: {json.dumps(nv)}")
    log.check(attrs.get("productName") == nv["name"], "productName equals NVML's name")
    log.check(attrs.get("uuid") == nv["uuid"], "uuid equals NVML's")
    log.check(attrs.get("addressingMode") == ADDRESSING_MODES.get(nv["addressingMode"]), "addressingMode names NVML's")
    log.check(gpu.get("capacity", {}).get("memory", {}).get("value") is not None, "memory capacity published")
    log.check(attrs.get("cudaComputeCapability") == "{}.{}.0".format(*nv["cudaComputeCapability"]),
              "cudaComputeCapability equals NVML's")
    shared = json.loads(slices.stdout)["items"] if slices.returncode == 0 else []
    caps = [d.get("capacity", {}) for s in shared for d in s["spec"].get("devices", []) if d["name"] == gpu["name"]]
    log(f"--share gpu capacity: {json.dumps(caps)}")
    log.check(bool(caps) and "memory" in caps[0] and "compute" in caps[0], "--share gpu offers memory and compute")
    return gpu


def start_agent(tmp: str, root: str, driver_root: str) -> subprocess.Popen:
    args = ["run", "--root", root, "--node-name", NODE, "--cluster", f"dir:{tmp}/cluster",
            "--kubelet-dir", f"{tmp}/kubelet", "--cdi-dir", f"{tmp}/cdi", "--metrics-address", "",
            "--nvidia-driver-root", driver_root, "--share", "gpu"]
    log_file = open(os.path.join(tmp, "agent.log"), "w")
    return subprocess.Popen([sys.executable, "-m", "agent", *args], cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT,
                            env=dict(os.environ, SYSDRA_CONFIG="/dev/null"), start_new_session=True)


def wait_for(predicate, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    return None


def store_claim(tmp: str, gpu: str, share: dict | None) -> dict:
    result = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": gpu}
    if share:
        result.update({"shareID": str(uuid.uuid4()), "consumedCapacity": share})
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
             "metadata": {"name": "cuda", "namespace": "check", "uid": str(uuid.uuid4())},
             "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu-share.sysdra.io" if share else "gpu.sysdra.io"}}]}},
             "status": {"allocation": {"devices": {"results": [result]}}}}
    d = os.path.join(tmp, "cluster", "resourceclaims", "check")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "cuda.json"), "w") as f:
        json.dump(claim, f)
    return claim


def build_rootfs(tmp: str, program: str) -> str:
    """A rootfs holding the program and the glibc it links: nothing of the NVIDIA driver."""
    rootfs = os.path.join(tmp, "rootfs")
    for d in ("dev", "proc", "sys", "tmp", "usr/bin"):
        os.makedirs(os.path.join(rootfs, d), exist_ok=True)
    shutil.copy(program, os.path.join(rootfs, "usr/bin/cuda_check"))
    ldd = subprocess.run(["ldd", program], capture_output=True, text=True, check=True).stdout
    paths = [next((p for p in line.split() if p.startswith("/")), None) for line in ldd.splitlines()]
    libc = next(p for p in paths if p and os.path.basename(p) == "libc.so.6")
    # the rest of glibc, which any image has and libcuda links (libdl, libpthread, librt)
    paths += [os.path.join(os.path.dirname(libc), n) for n in GLIBC]
    for path in paths:
        if path and os.path.exists(path):
            dest = os.path.join(rootfs, path.lstrip("/"))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            shutil.copy(os.path.realpath(path), dest)
    return rootfs


def run_in_spec(spec_path: str, device: str, rootfs: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, os.path.join(HERE, "cdirun.py"), "--spec", spec_path, "--device", device,
                           "--rootfs", rootfs, "--", "/usr/bin/cuda_check", *args], capture_output=True, text=True,
                          timeout=180)


def check_mps(log: Log, spec: dict, spec_path: str, device: str, rootfs: str | None) -> None:
    """The share's limits enforced by the MPS control daemon the agent started at prepare
    (agent/prepare/steps/mps.py): the claim asked for 20Gi, so 10 GiB is allocated, 30 GiB is not."""
    (dev,) = [d for d in spec["devices"] if d["name"] == device]
    env = dev["containerEdits"]["env"]
    log(f"share env: {[e for e in env if e.startswith('CUDA_MPS')]}, mounts {dev['containerEdits'].get('mounts')}")
    if not log.check("CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in env, "the share is a client of the agent's MPS daemon"):
        return
    from agent.prepare.mps_records import mounted_at

    shm = [m["hostPath"] for m in dev["containerEdits"].get("mounts", []) if m["containerPath"] == "/dev/shm"]
    log.check(len(shm) == 1 and (mounted_at(shm[0]) or ("",))[0] == "tmpfs", f"the share's /dev/shm is the daemon's shm tmpfs {shm}")
    if rootfs is None:
        log("SKIP the MPS clients' allocations: no CUDA program was built")
        return
    small, big = run_in_spec(spec_path, device, rootfs, "10"), run_in_spec(spec_path, device, rootfs, "30")
    log(f"MPS client of a 20Gi share: {small.stdout.strip()} / {big.stdout.strip()} {big.stderr[-300:]}")
    log.check(small.returncode == 0 and big.returncode == 2, "MPS enforces the share's memory limit (10 GiB ok, 30 GiB refused)")


def check_cuda(log: Log, tmp: str, spec: dict, spec_path: str, device: str, rootfs: str, program: str) -> None:
    """The program runs from the spec's edits alone, and fails without its driver mounts."""
    run = run_in_spec(spec_path, device, rootfs)
    log(f"cuda_check from the spec (exit {run.returncode}):\n{run.stdout}{run.stderr[-3000:]}")
    log.check(run.returncode == 0 and "OK kernel ran" in run.stdout, "a CUDA kernel ran from the claim's CDI spec alone")
    bare = dict(spec, containerEdits={k: v for k, v in spec["containerEdits"].items() if k not in ("mounts", "hooks")})
    bare_path = os.path.join(tmp, "bare-spec.json")
    with open(bare_path, "w") as f:
        json.dump(bare, f)
    run = run_in_spec(bare_path, device, build_rootfs(os.path.join(tmp, "bare"), program))
    log(f"cuda_check with the device nodes only (exit {run.returncode}):\n{run.stdout}{run.stderr[-1000:]}")
    log.check(run.returncode != 0, "without the spec's driver mounts the same program fails")


def check_video_and_hooks(log: Log, root: str, driver_root: str, spec: dict, mounts: list[str]) -> None:
    """The driver root's video libraries (NVENC/NVDEC) are in the spec where the node has them, and
    the hooks the host's nvidia-cdi-hook can run (docs/nvidia.md); which ones, logged."""
    from discovery.nvidia_driver import LIB_DIRS

    found = sorted({os.path.basename(p).split(".so")[0] for d in LIB_DIRS
                    for p in glob.glob(os.path.join(root, driver_root.lstrip("/"), d, "lib*.so.*"))
                    if os.path.basename(p).startswith(("libnvcuvid.so", "libnvidia-encode.so", "libnvidia-opticalflow.so"))})
    mounted = sorted({os.path.basename(m).split(".so")[0] for m in mounts
                      if os.path.basename(m).startswith(("libnvcuvid.so", "libnvidia-encode.so", "libnvidia-opticalflow.so"))})
    log(f"video libraries: {found or 'none'} under {driver_root}, {mounted or 'none'} in the spec")
    if found:
        log.check(mounted == found, "the spec carries the driver root's video libraries")
    hooks = [h["args"][1] for h in spec.get("containerEdits", {}).get("hooks", []) if len(h.get("args", [])) > 1]
    log(f"createContainer hooks: {hooks or 'none (no nvidia-cdi-hook: LD_LIBRARY_PATH)'}")


async def step_prepare(log: Log, args, tmp: str, gpu: dict, program: str | None) -> None:
    """The claim prepared, its spec run (when the CUDA program was built), unprepared: the agent's
    side (spec, MPS daemon, cleanup) is checked even where no program could be built."""
    from agent.kubeletplugin.kubelet_client import KubeletClient

    kubelet = KubeletClient(os.path.join(tmp, "kubelet", "plugins_registry"))
    await kubelet.register()
    claim = store_claim(tmp, gpu["name"], {"memory": "20Gi", "compute": "30"})
    started = time.monotonic()
    result = (await kubelet.prepare(claim)).claims[claim["metadata"]["uid"]]
    log(f"NodePrepareResources: {(time.monotonic() - started) * 1000:.1f} ms, error {result.error!r}")
    if not log.check(not result.error, "the claim for the GPU prepared"):
        return
    from agent.prepare.cdifiles import claim_spec_path

    ids = [i for d in result.devices for i in d.cdi_device_ids if i.startswith(f"k8s.{DRIVER}/claim=")]
    spec_path = claim_spec_path(os.path.join(tmp, "cdi"), DRIVER, claim["metadata"]["uid"])
    with open(spec_path) as f:
        spec = json.load(f)
    write(args.out, "spec.json", spec)
    mounts = [m["containerPath"] for m in spec.get("containerEdits", {}).get("mounts", [])]
    log(f"CDI {ids}: {len(mounts)} driver mounts, spec env {spec['containerEdits'].get('env')}")
    check_video_and_hooks(log, args.root, args.driver_root, spec, mounts)
    device = ids[0].split("=", 1)[1]
    rootfs = build_rootfs(tmp, program) if program else None
    if rootfs is None:
        log("SKIP the CUDA program from the spec: none was built")
    else:
        check_cuda(log, tmp, spec, spec_path, device, rootfs, program)
    check_mps(log, spec, spec_path, device, rootfs)
    pids = [p.pid for p in psutil.process_iter(["cmdline"]) if "nvidia-cuda-mps-control" in " ".join(p.info["cmdline"] or [])]
    log(f"MPS control daemons running: {pids}")
    resp = await kubelet.unprepare(claim)
    log(f"NodeUnprepareResources: {resp}")
    log.check(not os.path.exists(spec_path), "the claim's CDI spec is gone after unprepare")
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if "nvidia-cuda-mps-control" in " ".join(p.info["cmdline"] or [])]
    log.check(not left, f"the MPS control daemon stopped with the last share {left or ''}")


def build_program(log: Log, tmp: str) -> str | None:
    """``cuda_check`` as PTX only (the driver JIT-compiles it); None where nvcc is missing or fails."""
    nvcc, program = shutil.which("nvcc"), os.path.join(tmp, "cuda_check")
    if not log.check(nvcc is not None, "nvcc on PATH (CUDA toolkit)"):
        return None
    build = subprocess.run([nvcc, "-O2", "-gencode", "arch=compute_90,code=compute_90", "-o", program,
                            os.path.join(HERE, "cuda_check.cu")], capture_output=True, text=True)
    return program if log.check(build.returncode == 0, f"nvcc built cuda_check (PTX only) {build.stderr[-500:]}") else None


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default="/", help="the host root the agent reads (/ on the GPU machine)")
    p.add_argument("--driver-root", default="/")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    log = Log(args.out)
    log(f"sysdra real-GPU check, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, root {args.root}, driver root {args.driver_root}")
    smi_path = nvidia_smi(args.driver_root)
    if not log.check(smi_path is not None, f"nvidia-smi on PATH or in {args.driver_root}/bin (no GPU driver here?)"):
        return 1
    smi = subprocess.run([smi_path, "--query-gpu=name,driver_version,memory.total,pci.bus_id", "--format=csv"],
                         capture_output=True, text=True)
    log(f"nvidia-smi: {smi.stdout.strip()}")
    try:
        gpu = step_scan(log, args.out, args.root, args.driver_root)
    except Exception as err:  # noqa: BLE001 - the later steps still run and report
        log.check(False, f"scan step: {type(err).__name__}: {err}")
        gpu = None
    if gpu:  # read-only: the MIG profiles NVML lists against nvidia-smi's, MIG mode left as it is
        from tests.hardware.mig_check import step_compute_mode, step_memory, step_mig

        bdf = gpu["attributes"]["pciAddress"]["string"]
        for what, step in (("MIG", lambda: step_mig(log, args.out, args.root, args.driver_root, bdf)),
                           ("row remapping", lambda: step_memory(log, args.root, args.driver_root, bdf)),
                           ("compute mode", lambda: step_compute_mode(log, args.root, args.driver_root,
                                                                      gpu["attributes"]["uuid"]["string"]))):
            try:
                step()
            except Exception as err:  # noqa: BLE001 - the later steps still run and report
                log.check(False, f"{what} step: {type(err).__name__}: {err}")
    tmp = tempfile.mkdtemp(prefix="sysdra-gpu-")
    program = build_program(log, tmp)
    agent = start_agent(tmp, args.root, args.driver_root)
    try:
        sock = wait_for(lambda: glob.glob(os.path.join(tmp, "kubelet", "plugins_registry", "*.sock")))
        if log.check(bool(sock), "the agent registered its socket") and gpu:
            try:
                asyncio.run(step_prepare(log, args, tmp, gpu, program))
            except Exception as err:  # noqa: BLE001
                log.check(False, f"prepare step: {type(err).__name__}: {err}")
    finally:
        os.killpg(agent.pid, signal.SIGTERM)
        code = agent.wait(timeout=30)
        with open(os.path.join(tmp, "agent.log")) as f:
            agent_log = f.read()
        write(args.out, "agent.log", agent_log[-200_000:])
        log.check("NVML XID/ECC events watched on" in agent_log, "the agent watches the GPU's XID/ECC events")
        log.check(code == 0, f"the agent stopped cleanly (exit {code})")
        subprocess.run(["umount", "-R", os.path.join(tmp, "rootfs")], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"done: {len(log.failures)} failure(s) {log.failures}")
    return 1 if log.failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
