"""The whole agent under fault injection: a copied fixture node, the real ``python -m agent
run`` process, a KubeletClient over the real sockets, ResourceClaims in the offline store,
and the invariant checker run after every restart (tests/faults/*)."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

from agent.prepare.checkpoint import COMPLETED, Checkpoint
import grpc

from agent.kubeletplugin.kubelet_client import CALL_TIMEOUT, KNOWN, KubeletClient
from agent.prepare import cdifiles
from agent.prepare.metadata import layout as mdlayout
from agent.prepare.metadata.stream import KIND, VERSIONS, _objects
from agent.protos import pluginregistration_pb2, pluginregistration_pb2_grpc
from cdi.spec import minimum_version, validate
from tests.conftest import REPO, profile_root

DRIVER = "sysdra.io"
NODE = "node-1"
PROFILE = "server-2s-gpu-nic"
SEED = int(os.environ.get("SYSDRA_FAULT_SEED", "20240607"))
BOOT_ID = "proc/sys/kernel/random/boot_id"


def run(coro, timeout: float = 60.0):
    return asyncio.run(asyncio.wait_for(coro, timeout))


# gRPC shares subchannels (and their reconnect backoff) between channels of a process: a
# channel to the socket of a killed agent would wait out the backoff. Every call here gets
# its own subchannel, like a kubelet that restarted.
CHANNEL_OPTIONS = [("grpc.use_local_subchannel_pool", 1)]


class FreshKubeletClient(KubeletClient):
    """``KubeletClient`` with a private subchannel per call (see CHANNEL_OPTIONS)."""

    async def register(self, socket_path: str | None = None) -> None:
        if socket_path is None:
            from agent.kubeletplugin.kubelet_client import find_registration_sockets

            (socket_path,) = find_registration_sockets(self.registry_dir)
        async with grpc.aio.insecure_channel("unix:" + socket_path, options=CHANNEL_OPTIONS) as ch:
            stub = pluginregistration_pb2_grpc.RegistrationStub(ch)
            self.info = await stub.GetInfo(pluginregistration_pb2.InfoRequest(), timeout=5)
            self.service = self.prefer or next(v for v in self.info.supported_versions if v in KNOWN)
            await stub.NotifyRegistrationStatus(pluginregistration_pb2.RegistrationStatus(plugin_registered=True), timeout=5)

    async def _call(self, method: str, claims: list[tuple[str, str, str]], timeout: float = CALL_TIMEOUT):
        pb, pb_grpc = KNOWN[self.service]
        req_cls = pb.NodePrepareResourcesRequest if method == "NodePrepareResources" else pb.NodeUnprepareResourcesRequest
        req = req_cls(claims=[pb.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in claims])
        async with grpc.aio.insecure_channel("unix:" + self.info.endpoint, options=CHANNEL_OPTIONS) as ch:
            return await getattr(pb_grpc.DRAPluginStub(ch), method)(req, timeout=timeout)


def snapshot(top: str) -> dict[str, tuple]:
    """Every path under ``top`` -> (type, size, mtime_ns): to prove nothing else was written."""
    out = {}
    for dirpath, dirs, files in os.walk(top):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue
            out[p] = (st.st_mode >> 12, st.st_size if not os.path.isdir(p) else 0, st.st_mtime_ns if not os.path.isdir(p) else 0)
    return out


def snapshot_diff(before: dict, after: dict) -> list[str]:
    return sorted(p for p in set(before) | set(after) if before.get(p) != after.get(p))


class Node:
    """A copied fixture node plus the state dirs of one agent."""

    def __init__(self, tmp: str, profile: str = PROFILE, boot: str = "boot-1", cdi_dir: str | None = None,
                 kubelet_dir: str | None = None, copy_root: bool = True, node_name: str = NODE):
        self.tmp = str(tmp)
        self.name = node_name  # a Node of a shared API server needs a name of its own
        self.root = os.path.join(self.tmp, "root")
        if copy_root:
            shutil.copytree(profile_root(profile), self.root, symlinks=True)
            self.set_boot_id(boot)
        self.cluster = os.path.join(self.tmp, "cluster")
        self.kubelet_dir = kubelet_dir or os.path.join(self.tmp, "kubelet")
        self.cdi_dir = cdi_dir or os.path.join(self.tmp, "cdi")
        self.plugin_dir = os.path.join(self.kubelet_dir, "plugins", DRIVER)
        self.aside = os.path.join(self.tmp, "unplugged")
        self.proc: subprocess.Popen | None = None
        self.log_path = os.path.join(self.tmp, "agent.log")
        self.client: FreshKubeletClient | None = None
        self.starts = 0

    # --- the node ---------------------------------------------------------------------
    def set_boot_id(self, boot: str) -> None:
        path = os.path.join(self.root, BOOT_ID)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(boot + "\n")

    def devices(self) -> list[str]:
        from discovery.inventory import scan

        return [d.name for d in scan(self.root).devices]

    def _bdf(self, name: str) -> str:
        parts = name.split("-", 1)[1].rsplit("-", 1)
        return parts[0].replace("-", ":") + "." + parts[1]

    def unplug(self, name: str) -> None:
        """Surprise removal: the function's sysfs dir and its bus link disappear."""
        link = os.path.join(self.root, "sys/bus/pci/devices", self._bdf(name))
        real = os.path.realpath(link)
        os.makedirs(self.aside, exist_ok=True)
        with open(os.path.join(self.aside, name + ".where"), "w") as f:
            json.dump({"link": link, "target": os.readlink(link), "real": real}, f)
        os.unlink(link)
        os.rename(real, os.path.join(self.aside, name))

    def replug(self, name: str) -> None:
        with open(os.path.join(self.aside, name + ".where")) as f:
            where = json.load(f)
        os.rename(os.path.join(self.aside, name), where["real"])
        os.symlink(where["target"], where["link"])
        os.unlink(os.path.join(self.aside, name + ".where"))

    def unplugged(self) -> list[str]:
        return sorted(n[: -len(".where")] for n in os.listdir(self.aside) if n.endswith(".where")) if os.path.isdir(self.aside) else []

    # --- claims -------------------------------------------------------------------------
    def write_claim(self, name: str, results: list[tuple[str, str]], uid: str, namespace: str = "default",
                    pod_claim_name: str | None = None, driver: str = DRIVER, pool: str | None = None) -> dict:
        claim = {
            "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace, "uid": uid},
            "spec": {"devices": {"requests": [{"name": r.split("/")[0], "exactly": {"deviceClassName": "x"}} for r, _ in results]}},
            "status": {"allocation": {"devices": {"results": [
                {"request": r, "driver": driver, "pool": pool or self.name, "device": d} for r, d in results]}}},
        }
        if pod_claim_name:
            claim["metadata"]["annotations"] = {"resource.kubernetes.io/pod-claim-name": pod_claim_name}
        d = os.path.join(self.cluster, "resourceclaims", namespace)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, name + ".json"), "w") as f:
            json.dump(claim, f)
        return claim

    # --- the agent ------------------------------------------------------------------------
    def command(self, cluster: str | None = None) -> list[str]:
        return [sys.executable, "-m", "tests.faults.crashpoint", "run", "--root", self.root, "--node-name", self.name,
                "--cluster", cluster or f"dir:{self.cluster}", "--kubelet-dir", self.kubelet_dir,
                "--cdi-dir", self.cdi_dir, "--metrics-address", "", "--debounce", "0.05", "--resync-interval", "0"]

    def start(self, env: dict | None = None, cluster: str | None = None, wait: bool = True, timeout: float = 30.0):
        assert self.proc is None or self.proc.poll() is not None
        base = {k: v for k, v in os.environ.items() if not k.startswith("SYSDRA_")}
        base.update({"SYSDRA_CONFIG": os.devnull, "PYTHONPATH": REPO})
        base.update(env or {})
        self.starts += 1
        with open(self.log_path, "a") as log:
            log.write(f"\n===== start {self.starts} {json.dumps(env or {})}\n")
            log.flush()
            self.proc = subprocess.Popen(self.command(cluster), cwd=REPO, env=base, stdout=log, stderr=log)
        if wait:
            self.wait_ready(timeout)
        return self.proc

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Registered like the kubelet does it: the registration socket answers GetInfo.
        A stale socket from a killed agent refuses connections until the new one binds."""
        deadline = time.monotonic() + timeout
        err = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"agent exited {self.proc.returncode} during start-up:\n{self.log_tail()}")
            client = FreshKubeletClient(os.path.join(self.kubelet_dir, "plugins_registry"))
            try:
                run(client.register(), timeout=5)
                self.client = client
                return
            except Exception as e:  # not up yet
                err = e
                time.sleep(0.02)
        raise AssertionError(f"agent not ready after {timeout}s ({err}):\n{self.log_tail()}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def stop(self) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    async def prepare(self, *claims):
        return await self.client.prepare(*claims)

    async def unprepare(self, *claims):
        return await self.client.unprepare(*claims)

    # --- invariants -------------------------------------------------------------------------
    def temp_files(self) -> list[str]:
        found = []
        for top in (self.cdi_dir, self.kubelet_dir, self.cluster):
            for dirpath, _dirs, files in os.walk(top):
                found += [os.path.join(dirpath, n) for n in files if n.endswith(".tmp")]
        return found

    def assert_no_temps(self, settle: float = 5.0) -> None:
        """No temp file is left. The claim-status writer rewrites claim files and the publisher
        slice files in the background (after a pause in the kubelet's calls; after the rescans a
        GPU mode switch causes, which run beside the prepare), so their temps may exist for a
        moment: those get ``settle`` seconds to go; any other temp fails at once."""
        background = (os.path.join(self.cluster, "resourceclaims") + "/", os.path.join(self.cluster, "resourceslices") + "/")
        deadline = time.monotonic() + settle
        while True:
            left = self.temp_files()
            if not left:
                return
            if any(not p.startswith(background) for p in left) or time.monotonic() > deadline:
                raise AssertionError(f"temp files left: {left}")
            time.sleep(0.02)

    def check_state(self, generations: dict | None = None) -> Checkpoint:
        """After a (re)start: checkpoint, CDI dir and metadata files are consistent."""
        cp = Checkpoint.load(os.path.join(self.plugin_dir, "checkpoint.json"), move_corrupt=False)
        assert not glob.glob(os.path.join(self.plugin_dir, "checkpoint.json.corrupt-*")), "checkpoint was found corrupt"
        for uid, entry in cp.claims.items():
            assert entry["state"] == COMPLETED, f"claim {uid} still {entry['state']} after recovery"
        claim_specs = cdifiles.list_claim_specs(self.cdi_dir, DRIVER)
        meta_specs = mdlayout.list_specs(self.cdi_dir, DRIVER)
        owned = set(claim_specs.values()) | {p for ps in meta_specs.values() for p in ps}
        for name in os.listdir(self.cdi_dir) if os.path.isdir(self.cdi_dir) else ():
            path = os.path.join(self.cdi_dir, name)
            assert path in owned, f"unexpected file in the CDI dir: {name}"
            with open(path) as f:
                spec = json.load(f)
            validate(spec)
            assert spec["cdiVersion"] == minimum_version(spec), f"{name}: cdiVersion {spec['cdiVersion']} is not the minimum"
        for uid in claim_specs:
            assert uid in cp.claims, f"CDI spec of claim {uid} that is not prepared"
        for uid in meta_specs:
            assert uid in cp.claims, f"metadata spec of claim {uid} that is not prepared"
        for uid, entry in cp.claims.items():
            if entry.get("cdiSpec"):
                assert uid in claim_specs, f"prepared claim {uid} has no CDI spec"
                assert cdifiles.read_spec(claim_specs[uid]) is not None
        # metadata: complete JSON streams, every object of a known version, one generation
        mroot = mdlayout.host_root(self.plugin_dir)
        for path in glob.glob(os.path.join(mroot, "*", "*", mdlayout.FILE_NAME)):
            with open(path) as f:
                objs = list(_objects(f.read()))
            assert [o.get("apiVersion") for o in objs] == list(VERSIONS), f"{path}: incomplete stream"
            assert all(o.get("kind") == KIND for o in objs)
            gens = {o["metadata"]["generation"] for o in objs}
            uids = {o["metadata"]["uid"] for o in objs}
            assert len(gens) == 1 and len(uids) == 1, f"{path}: objects disagree"
            (uid,) = uids
            assert uid in cp.claims, f"metadata file {path} of claim {uid} that is not prepared"
            key = (uid, path)
            gen = gens.pop()
            if generations is not None:
                assert gen >= generations.get(key, 0), f"{path}: generation went back {generations[key]} -> {gen}"
                generations[key] = gen
        for uid, entry in cp.claims.items():
            for base in ((entry.get("metadata") or {}).get("requests") or {}):
                host = mdlayout.host_file(self.plugin_dir, entry["namespace"], entry["name"], base)
                assert os.path.exists(host), f"claim {uid}: metadata file {host} missing"
                assert mdlayout.spec_path(self.cdi_dir, DRIVER, uid, base) in meta_specs.get(uid, []), f"claim {uid}: metadata spec missing"
        self.assert_no_temps()
        return cp

    def check_clean(self) -> None:
        """Nothing of ours is left once every claim is unprepared."""
        cp = Checkpoint.load(os.path.join(self.plugin_dir, "checkpoint.json"), move_corrupt=False)
        assert cp.claims == {}, f"claims left in the checkpoint: {list(cp.claims)}"
        left = os.listdir(self.cdi_dir) if os.path.isdir(self.cdi_dir) else []
        assert left == [], f"CDI dir not empty: {left}"
        mroot = mdlayout.host_root(self.plugin_dir)
        assert not os.path.isdir(mroot) or os.listdir(mroot) == [], f"metadata left: {os.listdir(mroot)}"
        self.assert_no_temps()

    # --- slices -----------------------------------------------------------------------------
    def read_slices(self) -> list[dict] | None:
        out = []
        for path in sorted(glob.glob(os.path.join(self.cluster, "resourceslices", "*.json"))):
            with open(path) as f:
                out.append(json.load(f))
        return out

    def expected_devices(self) -> list[str]:
        from agent.publish.slices import build_pool
        from discovery.inventory import scan

        pool = build_pool(scan(self.root), node_name=self.name, driver_name=DRIVER)
        return sorted(d["name"] for s in pool.slices for d in s.get("devices", []))

    def wait_slices_converge(self, timeout: float = 10.0) -> list[dict]:
        """The dir store's slices validate strictly and list exactly the scanned devices."""
        import kubernetes_validate

        want = self.expected_devices()
        deadline = time.monotonic() + timeout
        while True:
            slices = self.read_slices()
            names = sorted(d["name"] for s in slices for d in s["spec"].get("devices", []))
            counts = {s["spec"]["pool"]["resourceSliceCount"] for s in slices}
            gens = {s["spec"]["pool"]["generation"] for s in slices}
            if names == want and counts == {len(slices)} and len(gens) == 1:
                for s in slices:
                    kubernetes_validate.validate(s, "1.37", strict=True)
                return slices
            if time.monotonic() > deadline:
                raise AssertionError(f"slices did not converge: have {names}, want {want}")
            time.sleep(0.02)
