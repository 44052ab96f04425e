"""What an NVIDIA GPU's CDI spec adds so a container can run CUDA: the host's user-space driver.

Applied once per claim (spec-level edits), whatever number of NVIDIA devices it holds:
- the compute and video libraries of the kernel module's version, each mounted read-only under
  ``/usr/local/nvidia/lib64`` by its versioned name and by the names programs load it by
  (``libcuda.so.1``, ``libcuda.so``), so no symlink has to be made inside the container;
- the loader finds them through NVIDIA's ``nvidia-cdi-hook update-ldcache`` when the host has
  that hook, run after its ``enable-cuda-compat`` where it has that (CUDA forward compatibility);
  otherwise through ``LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64``,
  the value NVIDIA's CUDA images already set (an image that sets its own is overridden: use the
  hook there, or NVIDIA's own CDI spec, docs/nvidia.md);
- ``nvidia-smi`` and the other tools at ``/usr/bin``, GSP firmware at ``/lib/firmware/nvidia/<ver>``,
  the persistenced and fabricmanager sockets at their own paths, ``/dev/nvidia-modeset``;
- ``NVIDIA_VISIBLE_DEVICES=void`` (``VISIBLE_VOID``, as NVIDIA's own CDI specs set it): where
  nvidia-container-runtime is the runtime's default, its legacy hook would otherwise give a
  container of an image that sets ``NVIDIA_VISIBLE_DEVICES=all`` (CUDA's) every GPU of the node.
Every ``hostPath`` is the host's path: the runtime opens them, not the agent. Spec-level, as in
NVIDIA's own specs: on each GPU's device they would be copied once per GPU into the spec and the
checkpoint (an 8-GPU claim's spec eight times the driver's mounts); a container given only the
claim's other devices (its NIC) gets them too.
"""

from __future__ import annotations

import os

from discovery.nvidia_driver import DriverFiles

LIB_DIR = "/usr/local/nvidia/lib64"
LD_LIBRARY_PATH = "LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64"
BIN_DIR = "/usr/bin"
VISIBLE_VOID = "NVIDIA_VISIBLE_DEVICES=void"
_RO = ["ro", "nosuid", "nodev", "bind"]


def _hook_args(files: DriverFiles) -> list[list[str]]:
    """nvidia-cdi-hook's commands, in the order of NVIDIA's own specs (NVIDIA/nvidia-container-toolkit
    v1.20.0, pkg/nvcdi/driver-nvml.go, NewDriverLibraryDiscoverer): enable-cuda-compat writes an
    /etc/ld.so.conf.d entry for the image's /usr/local/cuda/compat when its libcuda is newer than the
    host's driver (cmd/nvidia-cdi-hook/cudacompat), which update-ldcache's ldconfig then reads."""
    out = []
    if files.cuda_compat and files.version:
        out.append(["nvidia-cdi-hook", "enable-cuda-compat", f"--host-driver-version={files.version}"])
    return out + [["nvidia-cdi-hook", "update-ldcache", "--folder", LIB_DIR]]


def driver_edits(files: DriverFiles, host_root: str = "/") -> dict:
    """The containerEdits for ``files`` (which must have no ``errors``). ``host_root``: the host's
    ``/`` as the runtime sees it (a fixture tree in tests)."""
    if files.errors:
        raise ValueError("; ".join(files.errors))

    def _mount(host_path: str, container_path: str, options: list[str] = _RO) -> dict:
        return {"hostPath": os.path.join(host_root, host_path.lstrip("/")), "containerPath": container_path,
                "options": list(options)}

    mounts = [_mount(lib.host_path, f"{LIB_DIR}/{name}") for lib in files.libraries for name in (lib.name, *lib.links)]
    mounts += [_mount(path, f"{BIN_DIR}/{name}") for name, path in files.tools()]
    mounts += [_mount(path, f"/lib/firmware/nvidia/{files.version}/{os.path.basename(path)}", _RO + ["noexec"])
               for path in files.firmware]
    mounts += [_mount(path, path, _RO + ["noexec"]) for path in files.sockets]
    edits: dict = {"mounts": mounts}
    if files.cdi_hook:
        path = os.path.join(host_root, files.cdi_hook.lstrip("/"))
        edits["hooks"] = [{"hookName": "createContainer", "path": path, "args": args} for args in _hook_args(files)]
    edits["env"] = [VISIBLE_VOID] if files.cdi_hook else [VISIBLE_VOID, LD_LIBRARY_PATH]
    if files.modeset is not None:
        m = files.modeset
        edits["deviceNodes"] = [{"path": m.path, "type": "c", "major": m.major, "minor": m.minor}]
    return edits
