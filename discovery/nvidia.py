"""NVIDIA GPU facts a scheduler selects on: memory, architecture, compute capability, versions.

Sources, best first: NVML (``discovery/nvml.py``, the vendor's own library, when the node has
it), then the kernel module's version (sysfs/procfs) and a table of data-center GPUs by PCI
device ID. A GPU in neither gets no memory and no architecture: never a made-up value.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from discovery.models import MigProfile, NvidiaFacts
from discovery.sysfs import AttrError, HostFS

# NVML's nvmlDeviceArchitecture_t -> the name NVIDIA's own DRA driver publishes.
ARCHITECTURES = {2: "Kepler", 3: "Maxwell", 4: "Pascal", 5: "Volta", 6: "Turing", 7: "Ampere",
                 8: "Ada Lovelace", 9: "Hopper", 10: "Blackwell"}
# NVML's nvmlBrandType_t -> its name (as go-nvlib spells them).
BRANDS = {0: "Unknown", 1: "Quadro", 2: "Tesla", 3: "NVS", 4: "Grid", 5: "GeForce", 6: "Titan",
          7: "NvidiaVApps", 8: "NvidiaVPC", 9: "NvidiaVCS", 10: "NvidiaVWS", 11: "NvidiaCloudGaming",
          12: "QuadroRTX", 13: "NvidiaRTX", 14: "Nvidia", 15: "GeForceRTX", 16: "TitanRTX"}
# NVML's nvmlDeviceAddressingModeType_t -> its name (as go-nvlib spells them): whether the GPU
# addresses the host's malloc'd memory, by mirrored page tables (HMM) or shared ones (ATS)
ADDRESSING_MODES = {0: "None", 1: "HMM", 2: "ATS"}

GB = 10**9


@dataclass(frozen=True)
class TableRow:
    """A data-center GPU by PCI device ID. ``memory`` is the datasheet's size in decimal GB
    (10^9 bytes): HBM/GDDR sizes are binary and the driver reserves less than the
    difference, so it never exceeds what the GPU reports."""

    product: str
    architecture: str
    compute_capability: str
    memory_gb: int
    source: str


_DS = "NVIDIA datasheet: "
# PCI device IDs from the PCI ID Repository (pci-ids.ucw.cz, vendor 10de); sizes, architecture
# and compute capability from NVIDIA's datasheets and the CUDA GPU list (developer.nvidia.com/cuda-gpus).
GPU_TABLE: dict[str, TableRow] = {
    "1db1": TableRow("Tesla V100-SXM2-16GB", "Volta", "7.0", 16, _DS + "Tesla V100"),
    "1db4": TableRow("Tesla V100-PCIE-16GB", "Volta", "7.0", 16, _DS + "Tesla V100"),
    "1db5": TableRow("Tesla V100-SXM2-32GB", "Volta", "7.0", 32, _DS + "Tesla V100"),
    "1db6": TableRow("Tesla V100-PCIE-32GB", "Volta", "7.0", 32, _DS + "Tesla V100"),
    "1eb8": TableRow("Tesla T4", "Turing", "7.5", 16, _DS + "T4 Tensor Core GPU"),
    "20b0": TableRow("A100-SXM4-40GB", "Ampere", "8.0", 40, _DS + "A100 Tensor Core GPU"),
    "20b2": TableRow("A100-SXM4-80GB", "Ampere", "8.0", 80, _DS + "A100 Tensor Core GPU"),
    "20b5": TableRow("A100 80GB PCIe", "Ampere", "8.0", 80, _DS + "A100 Tensor Core GPU"),
    "20f1": TableRow("A100-PCIE-40GB", "Ampere", "8.0", 40, _DS + "A100 Tensor Core GPU"),
    "20b7": TableRow("A30", "Ampere", "8.0", 24, _DS + "A30 Tensor Core GPU"),
    "2235": TableRow("A40", "Ampere", "8.6", 48, _DS + "A40"),
    "2236": TableRow("A10", "Ampere", "8.6", 24, _DS + "A10 Tensor Core GPU"),
    "26b5": TableRow("L40", "Ada Lovelace", "8.9", 48, _DS + "L40"),
    "26b9": TableRow("L40S", "Ada Lovelace", "8.9", 48, _DS + "L40S"),
    "27b8": TableRow("L4", "Ada Lovelace", "8.9", 24, _DS + "L4 Tensor Core GPU"),
    "2330": TableRow("H100 80GB HBM3 (SXM5)", "Hopper", "9.0", 80, _DS + "H100 Tensor Core GPU"),
    "2331": TableRow("H100 PCIe", "Hopper", "9.0", 80, _DS + "H100 Tensor Core GPU"),
    "2321": TableRow("H100 NVL", "Hopper", "9.0", 94, _DS + "H100 Tensor Core GPU (NVL: 94GB)"),
    "2329": TableRow("H20", "Hopper", "9.0", 96, _DS + "H20 (96GB HBM3)"),
    "2335": TableRow("H200 (SXM)", "Hopper", "9.0", 141, _DS + "H200 Tensor Core GPU (141GB HBM3e)"),
    "233b": TableRow("H200 NVL", "Hopper", "9.0", 141, _DS + "H200 Tensor Core GPU (141GB HBM3e)"),
    "2342": TableRow("GH200 (96GB HBM3)", "Hopper", "9.0", 96, _DS + "GH200 Grace Hopper Superchip"),
    "2901": TableRow("B200", "Blackwell", "10.0", 180, _DS + "DGX B200 (1,440GB for 8 GPUs)"),
    "2941": TableRow("GB200", "Blackwell", "10.0", 186, _DS + "GB200 NVL72 (13.4TB HBM3e for 72 GPUs)"),
}


@dataclass(frozen=True)
class NvmlDevice:
    """What NVML answered for one GPU (None: not answered)."""

    name: str | None = None
    uuid: str | None = None
    memory_bytes: int | None = None
    architecture: int | None = None
    compute_capability: tuple[int, int] | None = None
    brand: int | None = None
    addressing_mode: int | None = None
    mig_profiles: tuple[MigProfile, ...] = ()  # MIG GPU-instance profiles (discovery/mig.py); empty: no MIG


_VERSION = re.compile(r"\b(\d{1,6})\.(\d{1,6})(?:\.(\d{1,6}))?\b")


def semver(text: str | None) -> str | None:
    """``580.159.04`` -> ``580.159.4``, ``9.0`` -> ``9.0.0``: the semantic version the API takes
    (no leading zeros), as NVIDIA's driver publishes its versions; None if there is none."""
    if not text or not (m := _VERSION.fullmatch(text.strip())):
        return None
    return ".".join(str(int(p or 0)) for p in m.groups())


def cuda_version(n: int | None) -> str | None:
    """NVML's CUDA driver version (``13000``) as ``13.0.0``."""
    if not isinstance(n, int) or isinstance(n, bool) or not 0 < n < 10**6:
        return None
    return f"{n // 1000}.{n % 1000 // 10}.0"


def kernel_module_version(fs: HostFS) -> str | None:
    """The loaded kernel module's version as the driver spells it (``580.159.04``): sysfs, else
    the first line of ``/proc/driver/nvidia/version``; None when no module is loaded."""
    for path, limit in (("sys/module/nvidia/version", 64), ("proc/driver/nvidia/version", 4096)):
        try:
            text = fs.read_text(fs.path(path), limit=limit)
        except AttrError:
            continue
        first = text.splitlines()[0] if text else ""
        if m := _VERSION.search(first):
            return m.group(0)
    return None


def facts(device_id: str, nvml: NvmlDevice | None, driver_version: str | None,
          cuda_driver: int | None) -> NvidiaFacts:
    """One GPU's facts: NVML's answers first, the table for what NVML did not say."""
    row = GPU_TABLE.get(device_id)
    nv = nvml or NvmlDevice()
    cc = nv.compute_capability
    return NvidiaFacts(
        product_name=_printable(nv.name),
        brand=BRANDS.get(nv.brand),
        architecture=ARCHITECTURES.get(nv.architecture) or (row.architecture if row else None),
        compute_capability=semver(f"{cc[0]}.{cc[1]}") if cc else (semver(row.compute_capability) if row else None),
        driver_version=semver(driver_version),
        cuda_driver_version=cuda_version(cuda_driver),
        memory_bytes=nv.memory_bytes if nv.memory_bytes else (row.memory_gb * GB if row else None),
        addressing_mode=ADDRESSING_MODES.get(nv.addressing_mode),
        source="nvml" if nvml is not None else "table",
    )


class NvidiaNode:
    """The node's NVIDIA driver as discovery sees it during one scan: NVML when it answers, the
    kernel module's version otherwise."""

    def __init__(self, fs: HostFS, nvml=None, static_mig: bool = False):
        self.nvml = nvml  # a discovery.nvml.NvmlSource, or None
        self.static_mig = static_mig  # MIG instances are the operator's (docs/partitions.md, "Static MIG")
        version, cuda = nvml.system() if nvml is not None else (None, None)
        self.driver_version = version if semver(version) else kernel_module_version(fs)
        self.cuda_driver = cuda

    def mig_profiles(self, bdf: str) -> tuple:
        """The GPU's MIG profiles from NVML (empty without NVML or MIG): dynamic MIG."""
        ask = getattr(self.nvml, "mig_profiles", None)
        return ask(bdf) if ask is not None else ()

    def mig_instances(self, bdf: str) -> list | None:
        """The GPU instances NVML lists now (discovery/mig.py ``GpuInstanceNow``), None without an answer."""
        ask = getattr(self.nvml, "mig_instances", None)
        return ask(bdf) if ask is not None else None

    def facts(self, bdf: str, device_id: str, uuid: str | None = None) -> NvidiaFacts:
        """``uuid``: the GPU's as the driver says (another GPU put at ``bdf`` has NVML asked anew)."""
        answer = self.nvml.device(bdf, uuid) if self.nvml is not None else None
        return facts(device_id, answer, self.driver_version, self.cuda_driver)


def _printable(text: str | None) -> str | None:
    return text if text and re.fullmatch(r"[\x20-\x7e]{1,64}", text) else None
