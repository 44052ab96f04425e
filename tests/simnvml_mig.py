"""The simulated NVML (tests/simnvml.py) with MIG: MIG mode, the H200's real GPU-instance
profile table (the H200 facts sheet of the shared reference material: IDs, slices, memory, engines and
placements as NVML answered them), GPU and compute instances created and destroyed with the
refusals real NVML gives, and the driver's procfs side (``capabilities/gpu<N>/mig/gi<G>/ci<C>``).

State lives in a JSON file when ``state`` is given, so it is the node's "hardware": an agent
process killed with SIGKILL and started again sees the instances it made, and a test reads
them from outside. ``install_from_env`` puts the simulator under a real agent process
(``SYSDRA_SIMNVML=<state file>``; tests/faults/crashpoint.py calls it).

MIG mode as NVML's documentation of ``nvmlDeviceSetMigMode``/``nvmlDeviceGetMigMode`` (nvml.h,
cuda-python's nvml bindings) states it: a set changes the *pending* mode and the GPU is reset to
activate it; the call returns an activation status, and where the reset cannot happen (a
passthrough VM, where NVML says NVML_ERROR_RESET_REQUIRED, or a GPU not idle, NVML_ERROR_IN_USE)
the current mode stays until a GPU reset or reboot (``reset``, ``reboot``). ``SimGpu.mig_activation``
picks that status per GPU (0: activated at once, as on a bare-metal Hopper).

Assumptions, not measured (MIG mode was never enabled on the lent H200): the NVML profile
*index* of each row (the IDs are measured), the error a create gets while MIG is disabled
(NOT_SUPPORTED), GI IDs handed out lowest free first from 1, and a mode change refused with
IN_USE while a GPU instance exists (NVIDIA's own DRA driver disables MIG mode only once no MIG
device is left; the agent checks for instances first)."""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import json
import os
import threading
from contextlib import contextmanager
from types import SimpleNamespace

import pynvml  # its ctypes structures only: no library is loaded

from fixtures.generate import mig_minor
from tests.simnvml import NVMLError, SimGpu, SimNvmlEvents

INVALID_ARGUMENT, NOT_SUPPORTED, NOT_FOUND, RESET_REQUIRED, IN_USE, INSUFFICIENT_RESOURCES = 2, 3, 6, 16, 19, 23
# (NVML profile index, ID, name, slices, memory MB, SMs, CE, DEC, ENC, JPEG, OFA, instances, placements)
H200_PROFILES = [
    (0, 19, "MIG 1g.18gb", 1, 16384, 16, 1, 1, 0, 1, 0, 7, [(i, 1) for i in range(7)]),
    (7, 20, "MIG 1g.18gb+me", 1, 16384, 16, 1, 1, 0, 1, 1, 1, [(i, 1) for i in range(7)]),
    (9, 15, "MIG 1g.35gb", 1, 33280, 26, 1, 1, 0, 1, 0, 4, [(0, 2), (2, 2), (4, 2), (6, 2)]),
    (1, 14, "MIG 2g.35gb", 2, 33280, 32, 2, 2, 0, 2, 0, 3, [(0, 2), (2, 2), (4, 2)]),
    (2, 9, "MIG 3g.71gb", 3, 71424, 60, 3, 3, 0, 3, 0, 2, [(0, 4), (4, 4)]),
    (3, 5, "MIG 4g.71gb", 4, 71424, 64, 4, 4, 0, 4, 0, 1, [(0, 4)]),
    (4, 0, "MIG 7g.141gb", 7, 143360, 132, 8, 7, 0, 7, 1, 1, [(0, 8)]),
]
COMPUTE_SLICES, OFA = 7, 1
CI_SLICES = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7}  # NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE index -> slices
_BY_ID = {row[1]: row for row in H200_PROFILES}


def _info(row) -> SimpleNamespace:
    keys = ("id", "name", "sliceCount", "memorySizeMB", "multiprocessorCount", "copyEngineCount", "decoderCount",
            "encoderCount", "jpegCount", "ofaCount", "instanceCount")
    return SimpleNamespace(**dict(zip(keys, row[1:12]), name=row[2].encode()), isP2pSupported=0)


def _code(h) -> int:
    return ctypes.cast(h, ctypes.c_void_p).value or 0


class SimMigNvml(SimNvmlEvents):
    """``gpus``' ``mig`` is (current, pending); ``gis`` {GI ID: {profile, start, size, cis: {CI ID: CI profile}}}.
    With the event API (XID/ECC), as a real NVML with MIG has."""

    c_nvmlGpuInstancePlacement_t = pynvml.c_nvmlGpuInstancePlacement_t
    c_nvmlGpuInstance_t, c_nvmlComputeInstance_t = pynvml.c_nvmlGpuInstance_t, pynvml.c_nvmlComputeInstance_t
    NVML_GPU_INSTANCE_PROFILE_COUNT, NVML_COMPUTE_INSTANCE_PROFILE_COUNT = 0x12, 0x9
    NVML_DEVICE_MIG_ENABLE, NVML_DEVICE_MIG_DISABLE = 1, 0

    def __init__(self, gpus: list[SimGpu] | None = None, state: str | None = None, root: str | None = None, **kw):
        super().__init__(gpus, **kw)
        self.state, self.root = state, root
        self.threads: set[str] = set()  # the threads that created or destroyed something (NVML's own, in the agent)
        for g in self.gpus.values():
            g.mig = list(getattr(g, "mig", None) or [0, 0])
            g.gis = dict(getattr(g, "gis", None) or {})
        if state and os.path.exists(state):
            self._load()
        elif state:
            self._save()

    # --- state -------------------------------------------------------------------------
    def _load(self) -> None:
        with open(self.state) as f:
            doc = json.load(f)
        self.root = doc.get("root", self.root)
        self.gpus = {}
        for bus, g in doc["gpus"].items():
            gpu = SimGpu(**{k: v for k, v in g.items() if k not in ("mig", "gis", "compute_capability", "unsupported")},
                         compute_capability=tuple(g["compute_capability"]), unsupported=set(g["unsupported"]))
            gpu.mig, gpu.gis = g["mig"], {int(k): dict(v, cis={int(c): p for c, p in v["cis"].items()}) for k, v in g["gis"].items()}
            self.gpus[bus] = gpu

    def _save(self) -> None:
        doc = {"root": self.root, "gpus": {b: dict(dataclasses.asdict(g), mig=g.mig, gis=g.gis, unsupported=sorted(g.unsupported))
                                           for b, g in self.gpus.items()}}
        tmp = self.state + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.rename(tmp, self.state)

    @contextmanager
    def _locked(self, write: bool):
        if not self.state:
            yield
            return
        with open(self.state + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self._load()
            yield
            if write:
                self._save()

    def _gpu(self, h) -> SimGpu:
        return self.gpus[h.bus_id]

    def _gi(self, h) -> tuple[SimGpu, int, dict]:
        code = _code(h)
        gpu = list(self.gpus.values())[(code >> 16) - 1]
        gi = gpu.gis.get((code >> 8) & 0xFF)
        if gi is None:
            raise NVMLError(NOT_FOUND)
        return gpu, (code >> 8) & 0xFF, gi

    def _handle(self, gpu: SimGpu, gi: int, ci: int = -1, kind=None):
        index = list(self.gpus).index(gpu.bus_id) + 1
        return ctypes.cast(ctypes.c_void_p(index << 16 | gi << 8 | (ci + 1)), kind or self.c_nvmlGpuInstance_t)

    # --- the driver's procfs side ---------------------------------------------------------
    def _cap(self, gpu: SimGpu, gi: int, ci: int | None, exists: bool) -> None:
        if not self.root:
            return
        rel = f"gi{gi}" + (f"/ci{ci}" if ci is not None else "")
        d = os.path.join(self.root, f"proc/driver/nvidia/capabilities/gpu{gpu.minor}/mig", rel)
        if exists:
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, "access"), "w") as f:
                f.write(f"DeviceFileMinor: {mig_minor(gpu.minor, gi, ci)}\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
        else:
            for name in ("access",):
                if os.path.exists(os.path.join(d, name)):
                    os.unlink(os.path.join(d, name))
            os.rmdir(d) if os.path.isdir(d) and not os.listdir(d) else None

    # --- MIG mode and profiles --------------------------------------------------------------
    def nvmlDeviceGetMigMode(self, h):
        with self._locked(False):
            gpu = self._gpu(h)
            if not gpu.mig_capable:
                raise NVMLError(NOT_SUPPORTED)
            return list(gpu.mig)

    def nvmlDeviceSetMigMode(self, h, mode: int):
        self.threads.add(threading.current_thread().name)
        with self._locked(True):
            gpu = self._gpu(h)
            if not gpu.mig_capable:
                raise NVMLError(NOT_SUPPORTED)
            if gpu.gis:
                raise NVMLError(IN_USE)
            gpu.mig[1] = mode  # pending: current once the GPU is reset, which here happens at once or not
            if not gpu.mig_activation:
                gpu.mig[0] = mode
            self.calls.append(f"set-mig-mode {gpu.bus_id} {mode}")
            return gpu.mig_activation

    def nvmlDeviceGetGpuInstanceProfileInfo(self, h, index: int, version: int = 2):
        if not self._gpu(h).mig_capable:
            raise NVMLError(NOT_SUPPORTED)
        row = next((r for r in H200_PROFILES if r[0] == index), None)
        if row is None:
            raise NVMLError(NOT_SUPPORTED)
        return _info(row)

    def nvmlDeviceGetGpuInstancePossiblePlacements(self, h, profile_id: int, arr, count_ref):
        row = _BY_ID.get(profile_id)
        if row is None or not self._gpu(h).mig_capable:
            raise NVMLError(INVALID_ARGUMENT)
        for i, (start, size) in enumerate(row[12]):
            arr[i].start, arr[i].size = start, size
        count_ref._obj.value = len(row[12])

    # --- GPU instances -------------------------------------------------------------------
    def _refusal(self, gpu: SimGpu, row, start: int, size: int) -> int | None:
        if (start, size) not in row[12]:
            return INVALID_ARGUMENT
        taken = [(g["start"], g["size"], _BY_ID[g["profile"]]) for g in gpu.gis.values()]
        overlap = any(s < start + size and start < s + n for s, n, _ in taken)
        slices = sum(r[3] for _, _, r in taken) + row[3] > COMPUTE_SLICES
        same = sum(1 for _, _, r in taken if r[1] == row[1]) >= row[11]
        ofa = row[10] and sum(r[10] for _, _, r in taken) + row[10] > OFA
        return INSUFFICIENT_RESOURCES if overlap or slices or same or ofa else None

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, h, profile_id: int, placement):
        self.threads.add(threading.current_thread().name)
        if not isinstance(getattr(placement, "_obj", None), self.c_nvmlGpuInstancePlacement_t):
            raise TypeError("nvmlDeviceCreateGpuInstanceWithPlacement takes a pointer to the placement (ctypes.byref)")
        placement = placement._obj
        with self._locked(True):
            gpu, row = self._gpu(h), _BY_ID.get(profile_id)
            if not gpu.mig_capable or gpu.mig[0] != 1:
                raise NVMLError(NOT_SUPPORTED)
            if row is None:
                raise NVMLError(INVALID_ARGUMENT)
            if (why := self._refusal(gpu, row, placement.start, placement.size)) is not None:
                raise NVMLError(why)
            gi = next(i for i in range(1, 15) if i not in gpu.gis)
            gpu.gis[gi] = {"profile": profile_id, "start": placement.start, "size": placement.size, "cis": {}}
            self._cap(gpu, gi, None, True)
            self.calls.append(f"create-gi {gpu.bus_id} {profile_id}@{placement.start} -> {gi}")
            return self._handle(gpu, gi)

    def nvmlDeviceGetGpuInstances(self, h, profile_id: int, arr, count_ref):
        with self._locked(False):
            gpu = self._gpu(h)
            if gpu.mig[0] != 1:
                raise NVMLError(NOT_SUPPORTED)
            mine = sorted(i for i, g in gpu.gis.items() if g["profile"] == profile_id)
            for n, gi in enumerate(mine):
                arr[n] = self._handle(gpu, gi)
            count_ref._obj.value = len(mine)

    def nvmlDeviceGetGpuInstanceById(self, h, gi: int):
        with self._locked(False):
            gpu = self._gpu(h)
            if gi not in gpu.gis:
                raise NVMLError(NOT_FOUND)
            return self._handle(gpu, gi)

    def nvmlGpuInstanceGetInfo(self, h):
        with self._locked(False):
            _, gid, gi = self._gi(h)
            return SimpleNamespace(id=gid, profileId=gi["profile"], placement=SimpleNamespace(start=gi["start"], size=gi["size"]))

    def nvmlGpuInstanceDestroy(self, h):
        self.threads.add(threading.current_thread().name)
        with self._locked(True):
            gpu, gid, gi = self._gi(h)
            if gi["cis"]:
                raise NVMLError(IN_USE)
            del gpu.gis[gid]
            self._cap(gpu, gid, None, False)
            self.calls.append(f"destroy-gi {gpu.bus_id} {gid}")

    # --- compute instances -----------------------------------------------------------------
    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, h, profile: int, eng_profile: int, version: int = 2):
        _, _, gi = self._gi(h)
        if CI_SLICES.get(profile, 99) > _BY_ID[gi["profile"]][3]:
            raise NVMLError(NOT_SUPPORTED)
        return SimpleNamespace(id=profile, sliceCount=CI_SLICES[profile])

    def nvmlGpuInstanceCreateComputeInstance(self, h, profile: int):
        self.threads.add(threading.current_thread().name)
        with self._locked(True):
            gpu, gid, gi = self._gi(h)
            if CI_SLICES.get(profile, 99) > _BY_ID[gi["profile"]][3]:
                raise NVMLError(INVALID_ARGUMENT)
            used = sum(CI_SLICES[p] for p in gi["cis"].values())
            if used + CI_SLICES[profile] > _BY_ID[gi["profile"]][3]:
                raise NVMLError(INSUFFICIENT_RESOURCES)
            ci = next(i for i in range(8) if i not in gi["cis"])
            gi["cis"][ci] = profile
            self._cap(gpu, gid, ci, True)
            self.calls.append(f"create-ci {gpu.bus_id} {gid}/{ci}")
            return self._handle(gpu, gid, ci, self.c_nvmlComputeInstance_t)

    def nvmlGpuInstanceGetComputeInstances(self, h, profile: int, arr, count_ref):
        with self._locked(False):
            gpu, gid, gi = self._gi(h)
            mine = sorted(c for c, p in gi["cis"].items() if p == profile)
            for n, ci in enumerate(mine):
                arr[n] = self._handle(gpu, gid, ci, self.c_nvmlComputeInstance_t)
            count_ref._obj.value = len(mine)

    def nvmlComputeInstanceGetInfo(self, h):
        code = _code(h)
        return SimpleNamespace(id=(code & 0xFF) - 1)

    def nvmlComputeInstanceDestroy(self, h):
        self.threads.add(threading.current_thread().name)
        with self._locked(True):
            gpu, gid, gi = self._gi(h)
            ci = (_code(h) & 0xFF) - 1
            if gi["cis"].pop(ci, None) is None:
                raise NVMLError(NOT_FOUND)
            self._cap(gpu, gid, ci, False)
            self.calls.append(f"destroy-ci {gpu.bus_id} {gid}/{ci}")

    # --- for tests ----------------------------------------------------------------------
    def instances(self, bus_id: str = "0000:00:06.0") -> dict[int, dict]:
        """GI ID -> {profile, start, size, cis}, as the 'hardware' holds them now."""
        with self._locked(False):
            return json.loads(json.dumps(self.gpus[bus_id].gis))

    # --- compute mode (prepare/computemode.py) ---------------------------------------------
    def nvmlDeviceGetComputeMode(self, h):
        with self._locked(False):
            return super().nvmlDeviceGetComputeMode(self._gpu(h))

    def nvmlDeviceSetComputeMode(self, h, mode: int):
        with self._locked(True):
            super().nvmlDeviceSetComputeMode(self._gpu(h), mode)

    def compute_mode(self, bus_id: str = "0000:00:06.0") -> int:
        with self._locked(False):
            return self.gpus[bus_id].compute_mode

    def reboot(self) -> None:
        """Every GPU and compute instance gone, as after a reboot (MIG mode stays; a pending one
        takes effect); compute modes back to Default (the driver does not keep them)."""
        with self._locked(True):
            for gpu in self.gpus.values():
                gpu.compute_mode = 0
                gpu.mig[0] = gpu.mig[1]
                for gid, gi in list(gpu.gis.items()):
                    for ci in gi["cis"]:
                        self._cap(gpu, gid, ci, False)
                    self._cap(gpu, gid, None, False)
                gpu.gis = {}

    def set_mig(self, bus_id: str, mode: int, pending: int | None = None) -> None:
        """MIG mode set by someone else (``nvidia-smi -mig``), as (current, pending)."""
        with self._locked(True):
            self.gpus[bus_id].mig = [mode, mode if pending is None else pending]

    def set_activation(self, bus_id: str, status: int) -> None:
        """What ``nvmlDeviceSetMigMode`` answers from now on (``SimGpu.mig_activation``)."""
        with self._locked(True):
            self.gpus[bus_id].mig_activation = status

    def reset(self, bus_id: str) -> None:
        """A GPU reset (``nvidia-smi -r``): the pending MIG mode becomes the current one."""
        with self._locked(True):
            gpu = self.gpus[bus_id]
            gpu.mig[0] = gpu.mig[1]


def placement(start: int, size: int):
    """A placement as NVML's create takes it: a pointer to the structure."""
    return ctypes.byref(pynvml.c_nvmlGpuInstancePlacement_t(start, size))


def write_mig_minors(root: str, gpus: int = 1) -> None:
    """``/proc/driver/nvidia-caps/mig-minors`` as the driver lists it (every possible GI/CI)."""
    lines = ["config 1", "monitor 2"]
    for g in range(gpus):
        for gi in range(15):
            lines.append(f"gpu{g}/gi{gi}/access {mig_minor(g, gi)}")
            lines += [f"gpu{g}/gi{gi}/ci{ci}/access {mig_minor(g, gi, ci)}" for ci in range(8)]
    os.makedirs(os.path.join(root, "proc/driver/nvidia-caps"), exist_ok=True)
    with open(os.path.join(root, "proc/driver/nvidia-caps/mig-minors"), "w") as f:
        f.write("\n".join(lines) + "\n")


def install_from_env() -> SimMigNvml | None:
    """Under a real agent process: NVML is this simulator over ``$SYSDRA_SIMNVML``'s state."""
    path = os.environ.get("SYSDRA_SIMNVML")
    if not path:
        return None
    from discovery.nvml import Nvml

    sim = SimMigNvml(state=path)
    real = Nvml._probe.__func__

    def probe_sim(cls, root, driver_root, timeout, pynvml, load):  # under open, probe and shared alike
        return real(cls, root, driver_root, timeout, sim, lambda p: None)

    Nvml._probe = classmethod(probe_sim)
    return sim
