"""``make demo``: the real agent doing its job on a bundled fixture node, end to end.

It copies a fixture node to ``.state/demo/root``, starts ``sysdra run`` on it in offline
mode, and then plays the kubelet and the scheduler against the real sockets and files:
registration, a ResourceClaim allocated from the published slices, NodePrepareResources
(CDI spec + device metadata on disk), two claims sharing one GPU (``--share gpu``: one share
each, with its own CDI device and environment), a GPU hot-unplug that the agent republishes,
and NodeUnprepareResources. Nothing outside ``.state/demo`` is touched.
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
import time
import uuid

from agent.kubeletplugin.kubelet_client import KubeletClient

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NODE = "demo-node"
DRIVER = "sysdra.io"


def say(title: str) -> None:
    print(f"\n\033[1m== {title}\033[0m", flush=True)


def show(text: str, limit: int = 60) -> None:
    lines = text.rstrip("\n").splitlines()
    for line in lines[:limit]:
        print("   " + line)
    if len(lines) > limit:
        print(f"   ... ({len(lines) - limit} more lines)")


def wait_for(predicate, what: str, timeout: float = 30.0, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"demo: the agent exited early ({proc.returncode}) while waiting for {what}")
        time.sleep(0.05)
    raise SystemExit(f"demo: timed out waiting for {what}")


def read_slices(cluster: str) -> list[dict]:
    """The pool as the scheduler takes it: the slices of its newest generation once all
    ``resourceSliceCount`` of them are there; [] while a publish is under way (the files of a
    pool are written one by one), so callers wait for it with :func:`wait_for`."""
    out = []
    for path in sorted(glob.glob(os.path.join(cluster, "resourceslices", "*.json"))):
        try:
            with open(path) as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            return []  # mid-rename: try again
    if not out:
        return []
    newest = max(s["spec"]["pool"]["generation"] for s in out)
    pool = [s for s in out if s["spec"]["pool"]["generation"] == newest]
    return pool if len(pool) == pool[0]["spec"]["pool"]["resourceSliceCount"] else []


def slice_summary(slices: list[dict]) -> tuple[int, int, list[str]]:
    gens = {s["spec"]["pool"]["generation"] for s in slices}
    devices = [d["name"] for s in slices for d in s["spec"].get("devices", [])]
    return max(gens) if gens else 0, len(slices), devices


def sysdra(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "agent", *args], cwd=REPO, capture_output=True, text=True)
    return out.stdout + out.stderr


def make_claim(cluster: str, gpu: str, nic: str) -> dict:
    claim = {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "train-job", "namespace": "demo", "uid": str(uuid.uuid4()),
                     "annotations": {"resource.kubernetes.io/pod-claim-name": "accel"}},
        "spec": {"devices": {"requests": [
            {"name": "gpu", "exactly": {"deviceClassName": "gpu.sysdra.io"}},
            {"name": "nic", "exactly": {"deviceClassName": "nic.sysdra.io"}},
        ]}},
        "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": gpu},
            {"request": "nic", "driver": DRIVER, "pool": NODE, "device": nic},
        ]}}},
    }  # fmt: skip
    d = os.path.join(cluster, "resourceclaims", "demo")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "train-job.json"), "w") as f:
        json.dump(claim, f, indent=2)
    return claim


# The two claims sharing one GPU: (name, capacity requests, what the scheduler's allocator
# consumes for them under the default policies; tests/test_allocator.py checks it does)
SHARE_CLAIMS = (("infer-a", {"memory": "20Gi", "compute": "30"}, {"compute": "30", "memory": "20Gi"}),
                ("infer-b", {"memory": "39.5Gi"}, {"compute": "10", "memory": "40Gi"}))


def make_share_claims(cluster: str, gpu: str) -> list[dict]:
    """Two ResourceClaims, each allocated one share of ``gpu`` (shareID, consumedCapacity)."""
    out = []
    for name, requests, consumed in SHARE_CLAIMS:
        claim = {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": "demo", "uid": str(uuid.uuid4())},
            "spec": {"devices": {"requests": [
                {"name": "gpu", "exactly": {"deviceClassName": "gpu-share.sysdra.io", "capacity": {"requests": requests}}}]}},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": gpu, "shareID": str(uuid.uuid4()),
                 "consumedCapacity": consumed}]}}},
        }  # fmt: skip
        d = os.path.join(cluster, "resourceclaims", "demo")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"{name}.json"), "w") as f:
            json.dump(claim, f, indent=2)
        out.append(claim)
    return out


async def share_session(kubelet, state: str, cluster: str, gpu: str) -> None:
    slices = wait_for(lambda: read_slices(cluster), "the ResourceSlices")
    shared = next(d for s in slices for d in s["spec"].get("devices", []) if d["name"] == gpu)
    say(f"sharing: {gpu} is published with allowMultipleAllocations (sysdra run --share gpu)")
    show(f"allowMultipleAllocations: {json.dumps(shared.get('allowMultipleAllocations'))}\n" + "\n".join(
        f"capacity {name}: {json.dumps(cap)}" for name, cap in (shared.get("capacity") or {}).items()))
    claims = make_share_claims(cluster, gpu)
    say(f"scheduler: two claims get one share of {gpu} each")
    for c in claims:
        r = c["status"]["allocation"]["devices"]["results"][0]
        show(f"{c['metadata']['name']}: shareID={r['shareID']} consumedCapacity={r['consumedCapacity']}")
    say("kubelet: NodePrepareResources for both: one Device per share, its own CDI device and environment")
    for c in claims:
        uid = c["metadata"]["uid"]
        result = (await kubelet.prepare(c)).claims[uid]
        if result.error:
            raise SystemExit(f"demo: prepare failed: {result.error}")
        (dev,) = result.devices
        with open(os.path.join(state, "cdi", f"k8s.{DRIVER}-claim_{uid}.json")) as f:
            spec = json.load(f)
        env = [e for d in spec["devices"] for e in d["containerEdits"]["env"] if e.startswith(("SYSDRA_SHARE_", "CUDA_MPS_"))]
        nodes = [n["path"] for d in spec["devices"] for n in d["containerEdits"].get("deviceNodes", [])]
        lines = [f"{c['metadata']['name']}: share_id={dev.share_id} cdi={list(dev.cdi_device_ids)}",
                 f"  device nodes {', '.join(nodes)}"] + [f"  {e}" for e in env]
        show("\n".join(lines))
    for c in claims:
        await kubelet.unprepare(c)
    show("both unprepared")


def unplug(root: str, device_name: str) -> str:
    """Remove a PCI function from the copied tree the way a surprise removal looks."""
    bdf_parts = device_name.split("-", 1)[1].rsplit("-", 1)
    bdf = bdf_parts[0].replace("-", ":") + "." + bdf_parts[1]
    link = os.path.join(root, "sys/bus/pci/devices", bdf)
    real = os.path.realpath(link)
    os.unlink(link)
    shutil.rmtree(real)
    return bdf


async def kubelet_session(state: str, cluster: str, root: str, proc: subprocess.Popen) -> None:
    kubelet = KubeletClient(os.path.join(state, "kubelet", "plugins_registry"))
    say("kubelet: registration (GetInfo over the registration socket)")
    await kubelet.register()
    info = kubelet.info
    show(f"type={info.type} name={info.name}\nendpoint={info.endpoint}\nsupported_versions={list(info.supported_versions)}\n"
         f"kubelet picks {kubelet.service}")

    gen, _, devices = slice_summary(wait_for(lambda: read_slices(cluster), "the ResourceSlices"))
    gpus = [d for d in devices if d.startswith("gpu-")]
    nics = [d for d in devices if d.startswith("nic-")]
    say(f"scheduler: allocate {gpus[0]} + {nics[0]} to ResourceClaim demo/train-job")
    claim = make_claim(cluster, gpus[0], nics[0])
    uid = claim["metadata"]["uid"]

    say("kubelet: NodePrepareResources")
    resp = await kubelet.prepare(claim)
    result = resp.claims[uid]
    if result.error:
        raise SystemExit(f"demo: prepare failed: {result.error}")
    for dev in result.devices:
        show(f"{dev.device_name}: requests={list(dev.request_names)} cdi={list(dev.cdi_device_ids)}")
    spec_path = os.path.join(state, "cdi", f"k8s.{DRIVER}-claim_{uid}.json")
    say(f"CDI spec the container runtime will read: {os.path.relpath(spec_path, REPO)}")
    with open(spec_path) as f:  # the file is compact JSON; shown indented
        show(json.dumps(json.load(f), indent=2), limit=45)
    meta = glob.glob(os.path.join(state, "kubelet", "plugins", DRIVER, "dra-device-metadata", "demo_train-job", "*", "metadata.json"))
    if meta:
        say("KEP-5304 device metadata (bind-mounted read-only into the container)")
        with open(sorted(meta)[0]) as f:
            show(f.read(), limit=25)

    await share_session(kubelet, state, cluster, gpus[1])

    victim = gpus[-1]
    say(f"hardware: surprise removal of {victim}")
    t0 = time.monotonic()
    unplug(root, victim)
    republished = wait_for(lambda: (pool := read_slices(cluster)) and victim not in slice_summary(pool)[2] and pool,
                           "the republished slices", proc=proc)  # fmt: skip
    new_gen, n_slices, after = slice_summary(republished)
    show(f"republished in {1000 * (time.monotonic() - t0):.0f} ms: {len(devices)} -> {len(after)} devices, "
         f"pool generation {gen} -> {new_gen}, {n_slices} slice(s)")

    say("sysdra status (asks the running agent over its status socket)")
    show(sysdra("status", "--kubelet-dir", os.path.join(state, "kubelet")))

    say("kubelet: NodeUnprepareResources")
    resp = await kubelet.unprepare(claim)
    show(f"error={resp.claims[uid].error!r}; CDI spec still there: {os.path.exists(spec_path)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="demo")
    parser.add_argument("--profile", default="server-2s-gpu-nic", help="fixture node under fixtures/sysfs")
    args = parser.parse_args(argv)
    state = os.path.join(REPO, ".state", "demo")
    shutil.rmtree(state, ignore_errors=True)
    root, cluster = os.path.join(state, "root"), os.path.join(state, "cluster")
    shutil.copytree(os.path.join(REPO, "fixtures", "sysfs", args.profile), root, symlinks=True)

    say(f"the node: fixture profile {args.profile} (sysdra scan -o tree)")
    show(tree := sysdra("scan", "--root", root, "-o", "tree"), limit=80)
    if "NVML:" in tree:
        print("   (the fixture's NVIDIA driver files are empty placeholders, there for the CDI spec's mounts:\n"
              "    NVML cannot load from them, so the GPUs' facts come from the PCI ID table, as on a node without NVML)")

    say("starting the agent: sysdra run --cluster dir:... (offline mode)")
    cmd = [sys.executable, "-m", "agent", "run", "--root", root, "--node-name", NODE, "--cluster", f"dir:{cluster}",
           "--kubelet-dir", os.path.join(state, "kubelet"), "--cdi-dir", os.path.join(state, "cdi"),
           "--metrics-address", "", "--debounce", "0.25", "--share", "gpu"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYSDRA_")}
    log_path = os.path.join(state, "agent.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env={**env, "SYSDRA_CONFIG": os.devnull}, stdout=log, stderr=log)
    try:
        slices = wait_for(lambda: read_slices(cluster), "the first ResourceSlices", proc=proc)
        gen, n, devices = slice_summary(slices)
        show(f"{n} ResourceSlice(s), pool {NODE} generation {gen}, {len(devices)} devices: " + ", ".join(devices))
        wait_for(lambda: glob.glob(os.path.join(state, "kubelet", "plugins_registry", "*.sock")), "the registration socket", proc=proc)
        asyncio.run(kubelet_session(state, cluster, root, proc))
    finally:
        say("stopping the agent (SIGTERM)")
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        show(f"exit code {proc.returncode}; sockets left: "
             f"{glob.glob(os.path.join(state, 'kubelet', '**', '*.sock'), recursive=True) or 'none'}")
        print(f"\n   agent log: {os.path.relpath(log_path, REPO)}")
    return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
