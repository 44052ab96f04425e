"""Dynamic MIG at prepare (docs/partitions.md, "Dynamic MIG"): the mechanics; the step is
prepare/steps/mig.py.

A MIG device is a GPU instance created with its placement and one compute instance spanning
it, through NVML (``discovery/nvml.py``: every call on NVML's own thread, so a hung driver
never blocks the event loop, and calls run in order). A create that fails once NVML may have
made the GPU instance (a timeout: the create still completes on NVML's thread; an error after
it) queues a destroy of that placement behind it, so the destroy finds the instance however late
the create ends; the claim's ownership of the placement makes it this claim's. A create NVML
refused destroys nothing (an instance there is someone else's). MIG mode is enabled only with
``nvidia_mig_enable``; otherwise a GPU not in MIG mode fails the claim, saying so.

The IDs NVML answers are input: out of the record's range, the claim fails and the instance goes.

Instances are found again by GPU, profile and placement, never by the IDs alone: placements
never overlap, IDs are reused. Their container nodes are ``/dev/nvidia-caps/nvidia-cap<N>``,
N from ``/proc/driver/nvidia-caps/mig-minors`` under the root.

The whole GPU of a GPU in MIG mode is no CUDA device (CUDA sees MIG devices only), so a claim
of it needs MIG mode off: ``turn_off`` (prepare/steps/migmode.py runs it as a step) with
``nvidia_mig_enable`` (the agent manages MIG mode both ways), never while a GPU instance
exists (NVML refuses; it is someone's), and ``turn_on`` gives the mode back. A mode NVML left
pending (a GPU that needs a reset to switch) fails the claim, as for enabling."""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Callable

from pydantic import ValidationError

from agent.prepare.allocation import ClaimFailed
from agent.prepare.records import MigDevice
from agent.prepare.steps import NotUndone
from discovery import mig
from discovery.devnodes import NodeResolver
from discovery.models import DeviceNode
from discovery.partitions import MIG_MINORS, parse_mig_minors
from discovery.sysfs import AttrError, HostFS

log = logging.getLogger(__name__)
# seconds one NVML change may take (enabling MIG mode, creating an instance): longer than a query;
# one that times out still runs on NVML's thread, before anything queued after it (an undo)
TIMEOUT = 60.0


def shared_nvml(root: str, driver_root: str) -> Callable[[], object]:
    """-> a function giving the process's NVML (opened on first use, in the caller's thread:
    the driver's worker, never the event loop), or None when the node has none."""
    def get():
        from discovery.nvml import Nvml

        return Nvml.shared(root, driver_root)

    return get


def _why(err: BaseException) -> str:
    if isinstance(err, TimeoutError):  # one refused while NVML hangs says on what
        return str(err) or "NVML did not answer in time"
    return str(err) or type(err).__name__


class NoAnswer(ClaimFailed):
    """NVML did not answer in time: the call may still run, later, on NVML's thread."""


class MigDevices:
    def __init__(self, root: str, nvml: Callable[[], object], enable: bool, fault: Callable[[str], None] = lambda p: None):
        self.fs = HostFS(root)
        self.nvml = nvml  # -> discovery.nvml.Nvml, or None (no NVML on the node)
        self.enable = enable
        self.fault = fault

    def _run(self, what: str, fn):
        nvml = self.nvml()
        if nvml is None:
            raise ClaimFailed(f"{what}: the node has no NVML (dynamic MIG needs the driver's libnvidia-ml)")
        try:
            return nvml.run(what, fn, timeout=TIMEOUT)
        except ClaimFailed:
            raise
        except TimeoutError as err:
            raise NoAnswer(f"{what} failed: {_why(err)}") from None
        except Exception as err:  # noqa: BLE001 - NVMLError: this claim's error
            raise ClaimFailed(f"{what} failed: {_why(err)}") from None

    def _mig_mode(self, nv, h, bdf: str) -> None:
        """MIG mode on, or (``enable``) switched on; ClaimFailed when it is not."""
        mode = mig.mig_mode(nv, h)
        if mode is None:
            raise ClaimFailed(f"GPU {bdf} has no MIG mode (NVML)")
        if mode[0] == 1:
            return
        if not self.enable:
            raise ClaimFailed(f"GPU {bdf} is not in MIG mode (current {mode[0]}, pending {mode[1]}): enable it "
                              f"(nvidia-smi -i {bdf} -mig 1) or set nvidia_mig_enable to let the agent do it")
        nv.nvmlDeviceSetMigMode(h, nv.NVML_DEVICE_MIG_ENABLE)
        log.warning("GPU %s: MIG mode enabled (nvidia_mig_enable)", bdf)
        if (mode := mig.mig_mode(nv, h)) is None or mode[0] != 1:
            raise ClaimFailed(f"GPU {bdf}: MIG mode enabled but pending ({mode}): the GPU needs a reset")

    # --- MIG mode off, for a claim of the whole GPU ------------------------------------------
    def _may_turn_off(self, nv, h, bdf: str, mode: tuple[int, int]) -> None:
        """ClaimFailed when MIG mode is on and the agent may not, or cannot, turn it off."""
        if not self.enable:
            raise ClaimFailed(f"GPU {bdf} is in MIG mode (current {mode[0]}, pending {mode[1]}): CUDA sees no device on "
                              f"the whole GPU; turn MIG mode off (nvidia-smi -i {bdf} -mig 0) or set nvidia_mig_enable "
                              "to let the agent do it")
        if gis := mig.gpu_instances(nv, h, [p.id for p in mig.profiles(nv, h)]):
            listed = ", ".join(f"{g.gi} (profile {g.profile}, placement {g.start})" for g in gis[:4])
            raise ClaimFailed(f"GPU {bdf} is in MIG mode with GPU instances {listed}{', ...' if len(gis) > 4 else ''}, "
                              "not this claim's: NVML does not turn MIG mode off while they exist; destroy them "
                              f"(nvidia-smi mig -i {bdf} -dci, then -dgi)")

    def needs_off(self, mode: tuple[int, int] | None) -> bool:
        """Whether the agent turns MIG mode off for the whole GPU: on now, or (``enable``) pending
        on, which a GPU reset would make current under the claim."""
        return mode is not None and (mode[0] == 1 or (self.enable and mode[1] == 1))

    def check_off(self, bdf: str) -> tuple[int, int] | None:
        """The GPU's MIG mode (current, pending) now, None: no MIG; ClaimFailed when a claim of its
        whole GPU needs it off and the agent may not or cannot turn it off. Nothing changes."""
        def look(nv):
            h = nv.nvmlDeviceGetHandleByPciBusId(bdf)
            if self.needs_off(mode := mig.mig_mode(nv, h)):
                self._may_turn_off(nv, h, bdf, mode)
            return mode

        return self._run(f"reading the MIG mode of GPU {bdf}", look)

    def turn_off(self, bdf: str) -> bool:
        """MIG mode off, for a claim of the whole GPU -> whether it had to be changed. ClaimFailed
        when it may not or cannot be, or NVML leaves it on until a GPU reset (pending)."""
        def off(nv):
            h = nv.nvmlDeviceGetHandleByPciBusId(bdf)
            if not self.needs_off(mode := mig.mig_mode(nv, h)):
                return False
            self._may_turn_off(nv, h, bdf, mode)
            status = nv.nvmlDeviceSetMigMode(h, nv.NVML_DEVICE_MIG_DISABLE)  # the activation's status
            self.fault("migmode:off")
            if (now := mig.mig_mode(nv, h)) is None or now[0] != 0:
                raise ClaimFailed(f"GPU {bdf}: MIG mode turned off but still on until the GPU is reset (mode {now}"
                                  f"{_activation(nv, status)}): reset it once idle (nvidia-smi -r -i {bdf}) or reboot")
            log.warning("GPU %s: MIG mode turned off for a claim of the whole GPU (nvidia_mig_enable)", bdf)
            return True

        return self._run(f"turning MIG mode off on GPU {bdf}", off)

    def turn_on(self, bdf: str) -> bool:
        """MIG mode back on (current or pending: a GPU that needs a reset takes it then) -> whether
        it had to be changed; ClaimFailed when NVML does not take it."""
        if self.gone(bdf, "turning MIG mode back on"):
            return False
        def on(nv):
            h = nv.nvmlDeviceGetHandleByPciBusId(bdf)
            if (mode := mig.mig_mode(nv, h)) is None or mode[1] == 1:
                return False
            status = nv.nvmlDeviceSetMigMode(h, nv.NVML_DEVICE_MIG_ENABLE)
            self.fault("migmode:on")
            if (now := mig.mig_mode(nv, h)) is None or now[1] != 1:
                raise ClaimFailed(f"GPU {bdf}: MIG mode not back on (mode {now}{_activation(nv, status)})")
            if now[0] != 1:
                log.warning("GPU %s: MIG mode back on once the GPU is reset (pending)%s", bdf, _activation(nv, status))
            return True

        return self._run(f"turning MIG mode back on on GPU {bdf}", on)

    def create(self, rec: MigDevice) -> MigDevice:
        """The GPU instance at the record's placement, then its compute instance -> the record
        with their IDs. On failure nothing of this device is left (or, after a timeout, its
        destroy is queued behind the create) and ClaimFailed says why."""
        what = f"creating MIG device {rec.device} (profile {rec.profile}, placement {rec.start})"
        made: list[bool] = []  # set on NVML's thread once the GPU instance exists

        def gpu_instance(nv):
            h = nv.nvmlDeviceGetHandleByPciBusId(rec.gpu)
            self._mig_mode(nv, h, rec.gpu)
            where = nv.c_nvmlGpuInstancePlacement_t(rec.start, rec.size)  # NVML takes a pointer to it
            gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, rec.profile, ctypes.byref(where))
            made.append(True)
            return nv.nvmlGpuInstanceGetInfo(gi).id

        def compute_instance(nv):
            h = nv.nvmlDeviceGetHandleByPciBusId(rec.gpu)
            handle = nv.nvmlDeviceGetGpuInstanceById(h, gi)
            profile = _full_ci_profile(nv, handle)
            return nv.nvmlComputeInstanceGetInfo(nv.nvmlGpuInstanceCreateComputeInstance(handle, profile)).id

        try:
            gi = self._run(what, gpu_instance)
            self.fault("mig:gi-created")
            ci = self._run(what, compute_instance)
            self.fault("mig:ci-created")
            try:  # model_copy would not validate: an ID out of range would spoil the entry at its next load
                out = MigDevice.model_validate(dict(rec.model_dump(), gi=gi, ci=ci))
            except ValidationError:
                raise ClaimFailed(f"{what} failed: NVML answered GPU instance {gi!r:.20}, compute instance {ci!r:.20}: "
                                  "not IDs it hands out") from None
        except ClaimFailed as err:
            if problem := self._undo_create(rec, made, wait=not isinstance(err, NoAnswer)):
                raise NotUndone(err, [problem]) from None  # the instance is left: the claim keeps its entry
            raise
        log.info("GPU %s: MIG device %s created (GPU instance %d, compute instance %d)", rec.gpu, rec.device, gi, ci)
        return out

    def _undo_create(self, rec: MigDevice, made: list[bool], wait: bool) -> str | None:
        """The placement's instance destroyed if this create made it, queued behind the create on
        NVML's thread (so after it, however late it ends); waited for unless NVML stopped answering.
        -> why the instance this create made is left, when waited for and it could not be destroyed."""
        nvml = self.nvml()
        if nvml is None or (wait and not made):  # NVML answered, and refused the create
            return None
        what = f"destroying MIG device {rec.device} after its create failed"
        fut = nvml.after(what, lambda nv: bool(made) and _destroy_at(nv, rec, self.fault), timeout=TIMEOUT)

        def done(f) -> None:
            if (err := f.exception()) is not None:
                log.error("GPU %s: %s: %s (the start-up sweep destroys it)", rec.gpu, what, _why(err))
            elif f.result():
                log.info("GPU %s: MIG device %s destroyed (its create failed)", rec.gpu, rec.device)

        fut.add_done_callback(done)
        if wait:
            try:
                fut.result(timeout=TIMEOUT)
            except Exception as err:  # noqa: BLE001 - logged by ``done``; the claim's error is the create's
                return f"{what}: {_why(err)}"
        return None

    def find(self, rec: MigDevice) -> mig.GpuInstanceNow | None:
        """The record's instance as NVML shows it now (by profile and placement), or None."""
        def look(nv):
            h = nv.nvmlDeviceGetHandleByPciBusId(rec.gpu)
            return next((g for g in mig.gpu_instances(nv, h, [rec.profile]) if g.start == rec.start), None)

        return self._run(f"looking up MIG device {rec.device}", look)

    def gone(self, bdf: str, what: str) -> bool:
        """Whether the GPU has left the node (hot-unplugged, ``remove``: its sysfs directory went), and
        ``what`` was to be done on it with it: NVML would answer Not Found for as long as it is away,
        and an undo that fails keeps the claim's entry, its unprepare failing."""
        if os.path.isdir(self.fs.path("sys/bus/pci/devices", bdf)):
            return False
        log.warning("GPU %s has left the node (its sysfs directory is gone): %s went with it", bdf, what)
        return True

    def destroy(self, rec: MigDevice) -> bool:
        """The record's instance and its compute instances destroyed -> whether one existed."""
        if self.gone(rec.gpu, f"MIG device {rec.device}"):  # a GPU back on the bus has none of its instances
            return False
        done = self._run(f"destroying MIG device {rec.device}", lambda nv: _destroy_at(nv, rec, self.fault))
        if done:
            log.info("GPU %s: MIG device %s destroyed", rec.gpu, rec.device)
        return done

    def orphans(self, gpus: dict[str, tuple[int, ...]], known: set[tuple[str, int, int]],
                claimed: set[tuple[str, int]] = frozenset()) -> list[str]:
        """Destroy every GPU instance of ``gpus`` (PCI address -> GI profile IDs) no record
        knows (``known``: (GPU, profile, start)) nor a claim holds (``claimed``: (GPU, GI ID),
        the operator's instances of claims prepared with ``nvidia_mig: static``) -> what was destroyed."""
        out = []
        for bdf, profiles in gpus.items():
            def sweep(nv, bdf=bdf, profiles=profiles):
                h = nv.nvmlDeviceGetHandleByPciBusId(bdf)
                if (mig.mig_mode(nv, h) or (0, 0))[0] != 1:
                    return []
                done = []
                for g in mig.gpu_instances(nv, h, profiles):
                    if (bdf, g.profile, g.start) in known or (bdf, g.gi) in claimed:
                        continue
                    what = f"{bdf}: MIG GPU instance {g.gi} (profile {g.profile}, placement {g.start}) no claim knows"
                    try:  # one in use (a process on it) must not keep the others
                        _destroy(nv, h, g.gi)
                        done.append(what + ", destroyed")
                    except nv.NVMLError as err:
                        log.error("%s, not destroyed: %s", what, err)
                return done

            try:
                out += self._run(f"MIG devices of GPU {bdf}", sweep)
            except NoAnswer:  # NVML stopped answering: so it would for the next GPU
                raise
            except ClaimFailed as err:  # this GPU's answer: the others are swept still
                log.error("GPU %s: MIG devices no claim knows not swept: %s", bdf, err)
        for line in out:
            log.warning("%s", line)
        return out

    def cap_nodes(self, minor: int, gi: int, ci: int) -> tuple[DeviceNode, ...]:
        """The instance's ``/dev/nvidia-caps`` nodes (GI, then CI access)."""
        try:
            minors = parse_mig_minors(self.fs.read_text(self.fs.path(MIG_MINORS), limit=1 << 20))
        except AttrError as err:
            raise ClaimFailed(f"MIG: {MIG_MINORS}: {err.reason}") from None
        out, problems = [], []
        for key in (f"gpu{minor}/gi{gi}/access", f"gpu{minor}/gi{gi}/ci{ci}/access"):
            cap = minors.get(key)
            node = NodeResolver(self.fs).resolve(f"/dev/nvidia-caps/nvidia-cap{cap}", problems, proc_name="nvidia-caps",
                                                 minor=cap) if cap is not None else None
            if node is None:
                raise ClaimFailed(f"MIG: no nvidia-caps node for {key}" + (f" ({problems[-1].reason})" if problems else ""))
            out.append(node)
        return tuple(out)


def _activation(nv, status) -> str:
    """``nvmlDeviceSetMigMode``'s activation status, said (NVML_ERROR_RESET_REQUIRED, IN_USE, ...)."""
    if not isinstance(status, int) or isinstance(status, bool) or status == 0:
        return ""
    try:
        return f"; NVML: {nv.NVMLError(status)}"
    except Exception:  # noqa: BLE001 - its text is only for the message
        return f"; NVML activation status {status}"


def _full_ci_profile(nv, gi) -> int:
    """The compute-instance profile spanning the whole GPU instance (the largest it takes)."""
    best = None
    for index in range(getattr(nv, "NVML_COMPUTE_INSTANCE_PROFILE_COUNT", 9)):
        try:
            info = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, index, 0)
        except nv.NVMLError:
            continue
        if best is None or info.sliceCount > best[1]:
            best = (info.id, info.sliceCount)
    if best is None:
        raise ClaimFailed("the GPU instance offers no compute-instance profile")
    return best[0]


def _destroy(nv, h, gi: int, fault: Callable[[str], None] = lambda p: None) -> None:
    """Compute instances first (NVML refuses a GPU instance that has any), then the GI."""
    handle = nv.nvmlDeviceGetGpuInstanceById(h, gi)
    for ci in mig.compute_instances(nv, handle):
        nv.nvmlComputeInstanceDestroy(ci)
    fault("mig:ci-destroyed")
    nv.nvmlGpuInstanceDestroy(handle)
    fault("mig:gi-destroyed")


def _destroy_at(nv, rec: MigDevice, fault: Callable[[str], None]) -> bool:
    """The instance at the record's placement destroyed -> whether one existed."""
    h = nv.nvmlDeviceGetHandleByPciBusId(rec.gpu)
    now = next((g for g in mig.gpu_instances(nv, h, [rec.profile]) if g.start == rec.start), None)
    if now is None:
        return False
    _destroy(nv, h, now.gi, fault)
    return True
