"""NodePrepareResources latency and prepare+unprepare throughput over the real DRA socket.

A real ``sysdra run`` serves the generated large node in offline mode (kubelet dir on the
disk, CDI dir on tmpfs as /run/cdi is in production). This process plays the kubelet:
it registers over the registration socket (GetInfo, NotifyRegistrationStatus) and keeps
one gRPC channel to the advertised DRA endpoint, as the kubelet does.

Floor: ``NodePrepareResources`` with zero claims on the same channel: the same gRPC path
and servicer, no claim read, no lock, no file. The figures' ratio is what one claim costs
on top of an RPC that does nothing. ``prepare_cpu`` is the agent's own CPU time (all its
threads, background work such as claim-status writes included) per prepare+unprepare,
against empty pairs: wall-time p50s move with the load of a shared machine, CPU time less."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid

from bench.agentproc import DRIVER, NODE, AgentProcess, large_node, tmpfs_dir
from bench.report import Figure, progress

NAMESPACE = "bench"


def _published_devices(cluster: str) -> list[str]:
    names = []
    for path in sorted(glob.glob(os.path.join(cluster, "resourceslices", "*.json"))):
        with open(path) as f:
            names += [d["name"] for d in json.load(f)["spec"].get("devices", [])]
    return names


def _store_claim(cluster: str, devices: list[str]) -> tuple[str, str, str]:
    """A ResourceClaim allocated ``devices`` for one request (an ExactCount request of n)."""
    uid = str(uuid.uuid4())
    name = "c-" + uid[:8]
    obj = {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NAMESPACE, "uid": uid}, "spec": {},
        "status": {"allocation": {"devices": {"results": [
            {"request": "devs", "driver": DRIVER, "pool": NODE, "device": d} for d in devices]}}},
    }
    d = os.path.join(cluster, "resourceclaims", NAMESPACE)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name + ".json"), "w") as f:
        json.dump(obj, f)
    return NAMESPACE, name, uid


def _cpu_seconds(pid: int) -> float:
    """User + system time of a process, all its threads (procfs; clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _measure(agent: AgentProcess, rounds: int) -> dict:
    import grpc

    from agent.kubeletplugin.kubelet_client import KubeletClient
    from agent.protos import dra_v1_pb2 as pb
    from agent.protos import dra_v1_pb2_grpc as pb_grpc

    kubelet = KubeletClient(agent.registry_dir, prefer="v1.DRAPlugin")
    await kubelet.register()
    devices = _published_devices(agent.cluster)
    gpus = [d for d in devices if d.startswith("gpu-")] or devices
    out: dict = {}
    async with grpc.aio.insecure_channel("unix:" + kubelet.info.endpoint) as ch:
        stub = pb_grpc.DRAPluginStub(ch)

        def req(cls, refs):
            return cls(claims=[pb.Claim(namespace=ns, name=n, uid=u) for ns, n, u in refs])

        async def prepare(refs):
            resp = await stub.NodePrepareResources(req(pb.NodePrepareResourcesRequest, refs), timeout=45)
            for uid, r in resp.claims.items():
                if r.error:
                    raise RuntimeError(f"prepare {uid}: {r.error}")
            return resp

        async def unprepare(refs):
            resp = await stub.NodeUnprepareResources(req(pb.NodeUnprepareResourcesRequest, refs), timeout=45)
            for uid, r in resp.claims.items():
                if r.error:
                    raise RuntimeError(f"unprepare {uid}: {r.error}")

        async def empty():
            await stub.NodePrepareResources(pb.NodePrepareResourcesRequest(), timeout=45)

        for _ in range(20):  # warm-up: channel, servicer, first checkpoint save
            await empty()
        ref = _store_claim(agent.cluster, gpus[:1])
        await prepare([ref])
        await unprepare([ref])

        empties = []
        for _ in range(rounds * 2):
            t0 = time.perf_counter()
            await empty()
            empties.append(time.perf_counter() - t0)
        out["empty"] = statistics.median(empties)

        for n, picks in ((1, gpus[:1]), (8, devices[:: max(1, len(devices) // 8)][:8])):
            lat = []
            for i in range(rounds):
                ref = _store_claim(agent.cluster, picks)
                t0 = time.perf_counter()
                await prepare([ref])
                lat.append(time.perf_counter() - t0)
                await unprepare([ref])
            out[f"p50_{n}"] = statistics.median(lat)
            progress(f"prepare {n} device(s): p50 {out[f'p50_{n}'] * 1000:.2f} ms over {rounds} claims")

        refs = [_store_claim(agent.cluster, gpus[:1]) for _ in range(rounds)]
        t0, c0 = time.perf_counter(), _cpu_seconds(agent.proc.pid)
        for ref in refs:
            await prepare([ref])
            await unprepare([ref])
        out["throughput"] = rounds / (time.perf_counter() - t0)
        out["cpu"] = (_cpu_seconds(agent.proc.pid) - c0) / rounds
        t0, c0 = time.perf_counter(), _cpu_seconds(agent.proc.pid)
        for _ in range(rounds):
            await empty()
            await stub.NodeUnprepareResources(pb.NodeUnprepareResourcesRequest(), timeout=45)
        out["throughput_floor"] = rounds / (time.perf_counter() - t0)
        out["cpu_floor"] = (_cpu_seconds(agent.proc.pid) - c0) / rounds
    return out


def run(rounds: int = 200) -> list[Figure]:
    root = large_node()
    work = tempfile.mkdtemp(prefix="sysdra-bench-prepare-")
    cdi = tmpfs_dir("sysdra-bench-cdi-")
    try:
        progress("prepare: starting sysdra run on the large node")
        with AgentProcess(root, work, cdi, "--resync-interval", "0") as agent:
            m = asyncio.run(_measure(agent, rounds))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(cdi, ignore_errors=True)
    empty_ms = m["empty"] * 1000
    figures = []
    for n in (1, 8):
        v = m[f"p50_{n}"] * 1000
        figures.append(Figure(f"prepare_{n}dev_p50", v, "ms", empty_ms, "ratio <= 5 (empty NodePrepareResources)", v <= 5 * empty_ms))
    tp, tpf = m["throughput"], m["throughput_floor"]
    figures.append(Figure("prepare_throughput", tp, "claims/s", tpf,
                          "ratio >= 0.2 (mirror of the p50 goal; floor: empty prepare+unprepare pairs/s)", tp >= 0.2 * tpf))
    figures.append(Figure("prepare_cpu", m["cpu"] * 1000, "ms", m["cpu_floor"] * 1000,
                          "informative (agent CPU per prepare+unprepare; floor: per empty pair)", True))
    return figures
