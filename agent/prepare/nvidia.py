"""What a claim's NVIDIA GPUs need beyond their device nodes (docs/nvidia.md).

By default the claim's own CDI spec carries the host's user-space driver (``cdi/nvidia.py``,
found by ``discovery/nvidia_driver.py`` under the configured driver root). With
``nvidia-cdi-spec`` the node's own NVIDIA CDI spec (``nvidia-ctk cdi generate`` output in a CDI
directory) is used instead: each GPU's CDI device ID there is returned beside ours, and our
spec leaves the driver out. Either way the claim's spec sets ``NVIDIA_VISIBLE_DEVICES=void``
(cdi/nvidia.py). A driver that does not match the kernel module fails the claim
with the reason: a spec that cannot run CUDA is never written.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import replace
from typing import Collection

from agent.fsutil import read_bounded
from agent.prepare.allocation import ClaimFailed
from agent.prepare.driverlinks import DEFAULT_PATH, link_libraries
from agent.prepare import cdifiles
from agent.prepare.mps import BINARY as MPS_BINARY
from agent.prepare.computemode import DaemonModes
from agent.prepare.mps import PIPE_IN_CONTAINER, SHM_SIZE, MpsDaemons
from agent.prepare.mps_records import GPU_UUID
from agent.prepare.mps_pods import PodLauncher
from agent.quantity import parse_quantity
from agent.settings import Settings
from agent.settings_mps import MpsPodSettings
from cdi.claim import ClaimDevice
from cdi.nvidia import VISIBLE_VOID, driver_edits
from cdi.spec import SpecError
from discovery.models import Device
from discovery.nvidia_driver import DriverFiles, DriverFilesCache, Library

log = logging.getLogger(__name__)

NVIDIA_KIND = "nvidia.com/gpu"
SPEC_DIRS = ("/etc/cdi", "/var/run/cdi")
MAX_SPEC_BYTES = 4 << 20

def needs_driver(dev: Device) -> bool:
    """A GPU (or MIG device) the nvidia driver serves; one bound to vfio-pci needs none."""
    return dev.kind == "gpu" and dev.gpu is not None and dev.gpu.vendor == "nvidia" and dev.pci.driver == "nvidia"


_PIPE = re.compile(r"^(/.+)/mps/" + GPU_UUID[1:-1] + r"/pipe$")


def mps_home(s: Settings) -> str:
    """The plugin dir whose MPS daemons serve the shares: this one, unless it has no daemon records while a
    claim spec's shares are clients of the daemons under another one, recorded there (``kubelet_dir`` changed
    while they ran: the claims are adopted from their specs, prepare/recovery.py). Those daemons stay in
    charge where they run (their pipe is bound in the running containers): the agent's MPS dir is theirs,
    new shares' too, until a start finds no spec of them (docs/operations.md)."""
    if os.path.lexists(os.path.join(s.plugin_dir, "mps", "daemons.json")):
        return s.plugin_dir
    for path in cdifiles.list_claim_specs(s.cdi_dir, s.driver_name).values():
        try:
            spec = cdifiles.read_spec(path)
        except SpecError:
            continue  # (recovery says it)
        mounts = [m for d in spec["devices"] for m in (d.get("containerEdits") or {}).get("mounts") or ()]
        for m in mounts:
            if isinstance(m, dict) and m.get("containerPath") == PIPE_IN_CONTAINER and (found := _PIPE.match(str(m.get("hostPath")))) \
                    and os.path.normpath(home := found[1]) == home != os.path.normpath(s.plugin_dir) \
                    and os.path.isfile(os.path.join(home, "mps", "daemons.json")):
                log.warning("MPS: the prepared shares' daemons are recorded under %s (kubelet_dir changed while they ran): "
                            "they stay in charge there, supervised and stopped with their last share", home)
                return home
    return s.plugin_dir


class NvidiaDriver:
    def __init__(self, root: str, driver_root: str = "/", use_nvidia_spec: bool = False, cdi_dir: str | None = None,
                 host_root: str = "/", mps_dir: str | None = None, boot_id: str = "", mps_shm_size: int = SHM_SIZE,
                 mps_pod: tuple[MpsPodSettings, str, str] | None = None, lib_dir: str | None = None,
                 mps_modes: DaemonModes | None = None, mps_shares: bool = True):
        self.root, self.host_root = root, host_root
        # under another root: links to the driver's libraries alone, the loader path of its tools (link_libraries)
        self.lib_dir = lib_dir
        self.files = DriverFilesCache(root, driver_root)
        self._edits: tuple[DriverFiles, dict] | None = None  # claim-wide edits of the files found last
        self.use_nvidia_spec = use_nvidia_spec
        # as the agent sees them: the host's CDI dirs under the root, and the agent's own CDI dir
        seen = [os.path.join(root, d.lstrip("/")) for d in SPEC_DIRS] + ([cdi_dir] if cdi_dir else [])
        self.spec_dirs = tuple(dict.fromkeys(os.path.normpath(d) for d in seen))
        # shares of NVIDIA GPUs are clients of one MPS control daemon per GPU (prepare/mps.py), the
        # agent's processes or, with ``mps_pod`` (its settings, the node's and the driver's name), pods
        self.mps = None
        # whether new shares become clients: ``mps`` may be there for the daemons of before (``of``) alone
        self.mps_shares = mps_shares and bool(mps_dir)
        if mps_dir:
            launcher = None
            if mps_pod is not None:
                launcher = PodLauncher(mps_pod[0], os.path.join(mps_dir, "mps"), mps_pod[1], mps_pod[2], boot_id,
                                       driver_root, self._mps_host_paths)
            self.mps = MpsDaemons(mps_dir, self._mps_binary, self._mps_env, boot_id, mps_shm_size, launcher, mps_modes)

    @classmethod
    def of(cls, s: Settings, boot_id: str, mps_modes: DaemonModes) -> NvidiaDriver:
        """As the settings ``s`` make it. With MPS off (``share`` without gpu, ``nvidia_mps: false``) while
        daemons are recorded (shares prepared before a restart), their daemons are kept, adopted and
        stopped as their shares go; no new share becomes a client."""
        on = "gpu" in s.share and s.nvidia_mps
        home = mps_home(s)
        recorded = os.path.exists(os.path.join(home, "mps", "daemons.json"))
        return cls(s.root, s.nvidia_driver_root, s.nvidia_cdi_spec, s.cdi_dir, s.cdi_host_root,
                   home if on or recorded else None, boot_id, int(parse_quantity(s.nvidia_mps_shm_size)),
                   (s.nvidia_mps_pod, s.node_name, s.driver_name) if s.nvidia_mps_pod else None,
                   os.path.join(s.plugin_dir, "nvidia-lib"), mps_modes, mps_shares=on)

    def _mps_binary(self) -> str | None:
        """``nvidia-cuda-mps-control`` of the driver root, as the agent runs it (under the root)."""
        return self.tool(MPS_BINARY)[0]

    def _host_tool(self, name: str) -> str | None:
        """A driver tool's host path; None when the driver root has none or the driver does not
        match the module."""
        files = self.files.get()
        found = [b for tool, b in files.tools() if tool == name]
        return found[0] if found and not files.errors else None

    def _mps_host_paths(self) -> tuple[str | None, tuple[Library, ...]]:
        """``nvidia-cuda-mps-control`` as a host path and the driver's libraries (a pod's view)."""
        binary = self._host_tool(MPS_BINARY)
        return (binary, self.files.get().libraries) if binary else (None, ())

    def tool(self, name: str) -> tuple[str | None, dict[str, str]]:
        """A driver tool (``nvidia-smi``) as the agent runs it, under the root, and its environment;
        (None, {}) when the driver root has none or the driver does not match the module."""
        host = self._host_tool(name)
        return (os.path.join(self.root, host.lstrip("/")), self._mps_env()) if host else (None, {})

    def _mps_env(self) -> dict[str, str]:
        """The environment of the driver's tools as the agent runs them: their directory first on
        PATH (``nvidia-cuda-mps-control`` starts ``nvidia-cuda-mps-server`` by name) and the
        driver's libraries on the loader path. On ``/`` the host's own loader runs them: the
        libraries' directories as they are. Under another root (the DaemonSet's ``/host``) the
        agent's image's loader does, and those directories hold the host's libc too: only links
        to the driver's libraries (``link_libraries``), never another system's libc."""
        files = self.files.get()
        under_root = sorted({os.path.dirname(os.path.join(self.root, b.lstrip("/"))) for b in files.binaries})
        env = {"PATH": ":".join([*under_root, os.environ.get("PATH") or DEFAULT_PATH])} if under_root else {}
        if self.root == "/" or self.lib_dir is None:
            libs = sorted({os.path.dirname(os.path.join(self.root, lib.host_path.lstrip("/"))) for lib in files.libraries})
        else:
            link_libraries(self.lib_dir, files.libraries, lambda host_path: os.path.join(self.root, host_path.lstrip("/")))
            libs = [self.lib_dir] if files.libraries else []
        if libs:
            env["LD_LIBRARY_PATH"] = ":".join(libs)
        return env

    def with_mps(self, cd: ClaimDevice, share_id: str | None, served: Collection[str] = ()) -> ClaimDevice:
        """A share of an NVIDIA GPU as a client of the GPU's MPS daemon (its pipe directory and
        ``CUDA_MPS_PIPE_DIRECTORY``); anything else as it is. ``served``: the GPUs whose daemon the
        claim's entry records (a spec rebuilt), its clients still with MPS turned off since."""
        uuid = cd.device.gpu.nvidia_uuid if cd.device.gpu else None
        if self.mps is None or not share_id or not needs_driver(cd.device) or not uuid:
            return cd
        if not self.mps_shares and uuid not in served:  # MPS off: only the shares of before are clients
            return cd
        edits = self.mps.container_edits(uuid)
        env = tuple(e for e in cd.env if not e.startswith("CUDA_MPS_PIPE_DIRECTORY="))
        return replace(cd, env=env + tuple(edits["env"]), mounts=tuple(edits["mounts"]))

    def claim_edits(self, devices: list[Device]) -> dict | None:
        """The claim-wide edits for ``devices`` (None: no NVIDIA GPU). With NVIDIA's spec only
        ``NVIDIA_VISIBLE_DEVICES=void``: an older spec may not set it, and the legacy hook must
        not add the node's other GPUs."""
        if not any(needs_driver(d) for d in devices):
            return None
        if self.use_nvidia_spec:
            return {"env": [VISIBLE_VOID]}
        files = self.files.get()
        if files.errors:
            raise ClaimFailed("NVIDIA user-space driver: " + "; ".join(files.errors))
        for warning in files.warnings:
            log.warning("NVIDIA user-space driver: %s", warning)
        if self._edits is None or self._edits[0] is not files:  # the cache gives the same object until the driver changes
            self._edits = (files, driver_edits(files, self.host_root))
        return self._edits[1]  # shared by the claims' specs: they copy the lists and never change a mount

    def cdi_ids(self, dev: Device) -> list[str]:
        """NVIDIA's own CDI device ID for ``dev`` when ``nvidia-cdi-spec`` is set."""
        if not self.use_nvidia_spec or not needs_driver(dev):
            return []
        name = _device_in_specs(self._specs(), dev)
        if name is None:
            raise ClaimFailed(f"{dev.name}: no {NVIDIA_KIND} device for GPU {dev.gpu.nvidia_uuid or dev.pci.bdf} "
                              f"in the NVIDIA CDI specs under {', '.join(self.spec_dirs)} (run nvidia-ctk cdi generate)")
        return [f"{NVIDIA_KIND}={name}"]

    def _specs(self) -> list[dict]:
        out = []
        for d in self.spec_dirs:
            try:
                names = sorted(os.listdir(d))
            except OSError:
                continue
            for name in names:
                if name.endswith((".yaml", ".yml", ".json")) and (spec := _load(os.path.join(d, name))):
                    out.append(spec)
        return out


def _load(path: str) -> dict | None:
    """A CDI spec file of kind nvidia.com/gpu, or None (other kinds, unreadable, too large)."""
    try:
        data = read_bounded(path, MAX_SPEC_BYTES)
        if path.endswith(".json"):
            spec = json.loads(data)
        else:
            import yaml

            spec = yaml.safe_load(data)
    except (OSError, ValueError, ImportError) as err:
        log.warning("CDI spec %s: %s", path, err)
        return None
    except Exception as err:  # noqa: BLE001 - yaml.YAMLError and friends: another program's file
        log.warning("CDI spec %s: %s", path, err)
        return None
    if not isinstance(spec, dict) or spec.get("kind") != NVIDIA_KIND:
        return None
    if not isinstance(spec.get("devices"), list):  # the runtime refuses such a file: no device of it is resolved
        log.warning("CDI spec %s: devices is not a list: skipped", path)
        return None
    return spec


def _device_in_specs(specs: list[dict], dev: Device) -> str | None:
    """The spec device named by the GPU's UUID, else the one holding its ``/dev/nvidiaN``.
    ``specs`` in the order of their dirs' priority, lowest first: a name defined again in a
    later spec is that one's, as the runtime resolves it (/var/run/cdi overrides /etc/cdi), so
    a stale spec's device with the node is not the name given when a later spec defines it
    for another GPU."""
    uuid = dev.gpu.nvidia_uuid if dev.gpu else None
    node = f"/dev/nvidia{dev.gpu.nvidia_minor}" if dev.gpu and dev.gpu.nvidia_minor is not None else None
    effective: dict[str, dict] = {}  # name -> the device the runtime resolves it to (first seen order)
    for spec in specs:
        for d in spec["devices"]:  # a list (_load)
            if not isinstance(d, dict) or not isinstance(d.get("name"), str):
                continue
            if uuid and d["name"] == uuid:
                return uuid
            effective[d["name"]] = d
    for name, d in effective.items():
        nodes = d["containerEdits"].get("deviceNodes") if isinstance(d.get("containerEdits"), dict) else None
        nodes = nodes if isinstance(nodes, list) else []  # (another program's file: any JSON)
        if node and any(isinstance(n, dict) and n.get("path") == node for n in nodes):
            return name
    return None
