"""The NVIDIA user-space driver a container needs to run CUDA, found read-only on the host.

A container given an NVIDIA GPU needs the host's driver libraries of the *running kernel
module's* version (libcuda alone allocates memory but cannot launch a kernel without
libnvidia-ptxjitcompiler; NVENC/NVDEC need the video libraries), the driver's tools, its GSP
firmware and the sockets of its daemons.
They are looked up under a configurable **driver root** (``/``, ``/run/nvidia/driver`` as the GPU
operator mounts its driver container, ``/usr/local/nvidia``), itself under the agent's ``--root``.
Every path recorded here is the **host's** path (without ``--root``), symlinks resolved, because
the container runtime, not the agent, opens them.

A version mismatch between the module and the libraries, or no libcuda at all, is an error: the
spec would be silently useless. Nothing is guessed.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
from dataclasses import dataclass

from discovery.nvidia import kernel_module_version
from discovery.sysfs import HostFS

# Where a driver root keeps its libraries: a distribution's layout, a driver container's, a
# flat driver mount (/usr/local/nvidia/lib64).
LIB_DIRS = ("usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "usr/lib64", "lib64", "lib",
            "usr/lib", "lib/x86_64-linux-gnu", "lib/aarch64-linux-gnu")
BIN_DIRS = ("usr/bin", "bin", "usr/sbin", "sbin")
FIRMWARE_DIRS = ("lib/firmware/nvidia", "usr/lib/firmware/nvidia", "firmware/nvidia")
# The compute set (no graphics) and the names a program loads each by: its soname (and
# libcuda's development name, which some frameworks dlopen).
COMPUTE_LIBRARIES = {
    "libcuda": ("libcuda.so.1", "libcuda.so"),
    "libnvidia-ptxjitcompiler": ("libnvidia-ptxjitcompiler.so.1",),
    "libnvidia-ml": ("libnvidia-ml.so.1",),
    "libnvidia-nvvm": ("libnvidia-nvvm.so.4",),
    "libcudadebugger": ("libcudadebugger.so.1",),
    "libnvidia-cfg": ("libnvidia-cfg.so.1",),
    "libnvidia-opencl": ("libnvidia-opencl.so.1",),
    "libnvidia-gpucomp": (),
    "libnvidia-allocator": ("libnvidia-allocator.so.1",),
}
# The video set: NVDEC, NVENC, the optical flow engine. libnvidia-container's "video" capability
# (src/nvc_info.c, video_libs) also has libvdpau_nvidia, left out: libvdpau loads it from its own
# module directory, and a VDPAU device is only created on an X11 display (graphics, not mounted).
# libnvidia-opticalflow.so too, as the toolkit adds it (internal/discover/symlinks.go). Optional:
# Debian and Ubuntu package them apart from the driver.
VIDEO_LIBRARIES = {
    "libnvcuvid": ("libnvcuvid.so.1",),
    "libnvidia-encode": ("libnvidia-encode.so.1",),
    "libnvidia-opticalflow": ("libnvidia-opticalflow.so.1", "libnvidia-opticalflow.so"),
}
LIBRARIES = {**COMPUTE_LIBRARIES, **VIDEO_LIBRARIES}
REQUIRED = "libcuda"
# Without it a CUDA program allocates memory but fails its first kernel launch (PTX JIT).
EXPECTED = ("libnvidia-ptxjitcompiler", "libnvidia-ml")
BINARIES = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nvidia-cuda-mps-control",
            "nvidia-cuda-mps-server")
SOCKETS = ("/run/nvidia-persistenced/socket", "/run/nvidia-fabricmanager/socket")
MODESET = "/dev/nvidia-modeset"
# NVIDIA's container toolkit hook that refreshes a container's ld cache; where the GPU operator
# and the distribution packages install it.
HOOK = "nvidia-cdi-hook"
HOOK_DIRS = ("usr/bin", "usr/local/nvidia/toolkit", "usr/local/bin")
MAX_HOOK_BYTES = 256 << 20  # the hook's Go binary is ~5 MiB: a sparse file of gigabytes is not searched
# Its CUDA forward-compatibility subcommand, from toolkit v1.17.5: an older hook exits non-zero on
# it (v1.17.4: 3, "No help topic") and the runtime then refuses to create the container. The GPU
# operator's toolkit before v1.20.0 installs the binary as nvidia-cdi-hook.real beside a shell
# wrapper named nvidia-cdi-hook: the subcommand is looked for in either.
COMPAT_SUBCOMMAND = b"enable-cuda-compat"
_MAX_LINKS = 40


@dataclass(frozen=True)
class Library:
    name: str  # libcuda.so.580.159.04
    host_path: str  # the real file on the host
    links: tuple[str, ...]  # the names it is loaded by: libcuda.so.1, libcuda.so


@dataclass(frozen=True)
class Node:
    path: str
    major: int
    minor: int


@dataclass(frozen=True)
class DriverFiles:
    driver_root: str
    version: str | None  # the kernel module's, "580.159.04"
    libraries: tuple[Library, ...] = ()
    binaries: tuple[str, ...] = ()  # host paths (symlinks resolved: another name than the tool's is possible)
    binary_names: tuple[str, ...] = ()  # the tool each of ``binaries`` is (nvidia-smi), in the same order
    firmware: tuple[str, ...] = ()  # host paths of the version's GSP firmware files
    sockets: tuple[str, ...] = ()  # host paths (also the container paths)
    modeset: Node | None = None
    cdi_hook: str | None = None  # host path of nvidia-cdi-hook, when the host has one
    cuda_compat: bool = False  # that hook has enable-cuda-compat
    errors: tuple[str, ...] = ()  # a spec built from these files would not run CUDA
    warnings: tuple[str, ...] = ()  # it would run CUDA, with something missing

    def tools(self) -> list[tuple[str, str]]:
        """(tool name, host path) of each of ``binaries``: the name it is run by, not its target's."""
        names = self.binary_names or tuple(os.path.basename(b) for b in self.binaries)
        return list(zip(names, self.binaries))


def resolve(root: str, path: str) -> str | None:
    """``path`` (a host path) with every symlink followed as the host would: absolute targets
    from the host's ``/``, which is ``root`` here; None when it does not exist or loops."""
    parts = [p for p in path.split("/") if p]
    done: list[str] = []
    hops = 0
    while parts:
        part = parts.pop(0)
        if part == ".":
            continue
        if part == "..":
            if done:
                done.pop()
            continue
        here = os.path.join(root, *done, part)
        try:
            st = os.lstat(here)
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            hops += 1
            if hops > _MAX_LINKS:
                return None
            target = os.readlink(here)
            if target.startswith("/"):
                done = []
            parts = [p for p in target.split("/") if p] + parts
            continue
        done.append(part)
    return "/" + "/".join(done)


def _under(root: str, host_path: str) -> str:
    return os.path.join(root, host_path.lstrip("/"))


def _regular(root: str, host_path: str) -> str | None:
    real = resolve(root, host_path)
    if real is None:
        return None
    try:
        return real if stat.S_ISREG(os.stat(_under(root, real)).st_mode) else None
    except OSError:
        return None


def _listing(root: str, host_dir: str) -> list[str]:
    try:
        return sorted(os.listdir(_under(root, host_dir)))
    except OSError:
        return []


def _libraries(root: str, driver_root: str, version: str | None) -> tuple[list[Library], dict[str, set[str]]]:
    """The compute and video libraries of ``version`` (first lib dir holding each wins), and
    every version of each library found, for the mismatch message."""
    found: dict[str, Library] = {}
    versions: dict[str, set[str]] = {}
    pattern = re.compile(r"(lib[a-z0-9-]+)\.so\.(\d+\.\d+(?:\.\d+)?)")
    for d in LIB_DIRS:
        host_dir = os.path.join(driver_root, d)
        for name in _listing(root, host_dir):
            m = pattern.fullmatch(name)
            if not m or m.group(1) not in LIBRARIES:
                continue
            base, ver = m.groups()
            versions.setdefault(base, set()).add(ver)
            if ver != version or base in found:
                continue
            real = _regular(root, os.path.join(host_dir, name))
            if real is not None:
                found[base] = Library(name, real, LIBRARIES[base])
    return [found[b] for b in LIBRARIES if b in found], versions


def _first_files(root: str, dirs: list[str], names: tuple[str, ...]) -> dict[str, str]:
    """``{name: host path}`` of the first of ``dirs`` holding each name, in the order of ``names``."""
    out: dict[str, str] = {}
    for d in dirs:
        for name in names:
            if name not in out and (real := _regular(root, os.path.join(d, name))) is not None:
                out[name] = real
    return {n: out[n] for n in names if n in out}


def _firmware(root: str, driver_root: str, version: str | None) -> list[str]:
    if version is None:
        return []
    for d in FIRMWARE_DIRS:
        host_dir = os.path.join(driver_root, d, version)
        files = [real for name in _listing(root, host_dir) if name.endswith(".bin")
                 and (real := _regular(root, os.path.join(host_dir, name))) is not None]
        if files:
            return files
    return []


def _has(root: str, host_path: str, word: bytes) -> bool:
    """Whether the file has ``word`` in it: a Go program's subcommand names are in its binary."""
    try:  # O_NONBLOCK: a FIFO there is looked at (not regular: no word), never waited on
        fd = os.open(_under(root, host_path), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_HOOK_BYTES:
            return False
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as m:
            return m.find(word) != -1
    except (OSError, ValueError):  # ValueError: an empty file cannot be mapped
        return False
    finally:
        os.close(fd)


def _sockets(root: str) -> list[str]:
    out = []
    for path in SOCKETS:
        try:
            if stat.S_ISSOCK(os.stat(_under(root, path)).st_mode):
                out.append(path)
        except OSError:
            pass
    return out


def _modeset(root: str) -> Node | None:
    try:
        st = os.stat(_under(root, MODESET))
    except OSError:
        return None
    return Node(MODESET, os.major(st.st_rdev), os.minor(st.st_rdev)) if stat.S_ISCHR(st.st_mode) else None


def find_driver_files(root: str, driver_root: str = "/") -> DriverFiles:
    """What a container needs of the NVIDIA driver on the host under ``root``. Read-only."""
    version = kernel_module_version(HostFS(root))
    libraries, versions = _libraries(root, driver_root, version)
    errors, warnings = [], []
    have = {lib.name.split(".so.")[0] for lib in libraries}
    where = f"driver root {driver_root}"
    if version is None:
        errors.append("the nvidia kernel module's version is unknown (no /sys/module/nvidia/version)")
    elif REQUIRED not in have:
        others = sorted(versions.get(REQUIRED, ()))
        errors.append(f"{where} has libcuda {', '.join(others)}, the kernel module is {version}: "
                      "the user-space driver does not match the running driver" if others else
                      f"{where} has no libcuda.so.{version} (set nvidia-driver-root to where the driver is installed)")
    for base in EXPECTED:
        if version is not None and base not in have:
            others = sorted(versions.get(base, ()))
            warnings.append(f"{where} has no {base}.so.{version}" + (f" (only {', '.join(others)})" if others else ""))
    bin_dirs = [os.path.join(driver_root, d) for d in BIN_DIRS]
    hooks = list(_first_files(root, bin_dirs + [os.path.join("/", d) for d in HOOK_DIRS], (HOOK,)).values())
    tools = _first_files(root, bin_dirs, BINARIES)
    return DriverFiles(
        driver_root=driver_root, version=version, libraries=tuple(libraries),
        binaries=tuple(tools.values()), binary_names=tuple(tools), firmware=tuple(_firmware(root, driver_root, version)),
        sockets=tuple(_sockets(root)), modeset=_modeset(root), cdi_hook=hooks[0] if hooks else None,
        cuda_compat=bool(hooks) and any(_has(root, p, COMPAT_SUBCOMMAND) for p in (hooks[0], hooks[0] + ".real")),
        errors=tuple(errors), warnings=tuple(warnings),
    )


class DriverFilesCache:
    """``find_driver_files`` again only when the module's version or a library, tool, firmware or
    hook directory changed (a driver or toolkit upgrade), so prepare and the health checks pay a
    few ``stat``s."""

    def __init__(self, root: str, driver_root: str = "/"):
        self.root, self.driver_root = root, driver_root
        self._key: tuple | None = None
        self._files: DriverFiles | None = None
        dirs = [os.path.join(driver_root, d) for d in LIB_DIRS + BIN_DIRS + FIRMWARE_DIRS]
        dirs += [os.path.join("/", d) for d in HOOK_DIRS]
        # what _stamp looks at, joined once: every prepare of a GPU claim asks (21 paths)
        self._watched = tuple(_under(root, p) for p in
                              ("/sys/module/nvidia/version", "/run/nvidia-persistenced", "/run/nvidia-fabricmanager", *dirs))

    def _stamp(self) -> tuple:
        out = []
        for path in self._watched:
            try:
                st = os.stat(path)
                out.append((st.st_ino, st.st_mtime_ns))
            except OSError:
                out.append(None)
        return tuple(out)

    def get(self) -> DriverFiles:
        key = self._stamp()
        if self._files is None or key != self._key:
            self._files, self._key = find_driver_files(self.root, self.driver_root), key
        return self._files
