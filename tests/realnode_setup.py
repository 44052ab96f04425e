"""What the real node (tests/realnode.py) needs on disk before it starts: the fixture root with
real device nodes, containerd's and the kubelet's configuration, and the images.

No registry is reachable: the pause image and a busybox image are one-layer OCI images built
here from the static ``/bin/busybox`` (Debian's busybox-static) and imported with ``ctr``.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import shutil
import stat
import subprocess
import tarfile

import yaml

PAUSE = "registry.k8s.io/pause:3.10.2"  # containerd 2.4's pinned sandbox image, by name
BUSYBOX = "sysdra.test/busybox:1"
E2E_BUSYBOX = "registry.k8s.io/e2e-test-images/busybox:1.36.1-1"  # deploy/'s examples, the same image here
ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())


# --- the fixture root -----------------------------------------------------------------------
def real_device_nodes(root: str, mode: int = 0o640) -> list[str]:
    """Replace the fixture's placeholder files under ``root/dev`` by real character nodes with
    the numbers ``sysdra scan`` reports for them (runc creates those in the containers)."""
    from discovery.inventory import scan

    made = []
    for device in scan(root).devices:
        for node in device.device_nodes:
            path = os.path.join(root, node.path.lstrip("/"))
            if os.path.lexists(path) and stat.S_ISCHR(os.lstat(path).st_mode):
                continue
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if os.path.lexists(path):
                os.unlink(path)
            os.mknod(path, mode | stat.S_IFCHR, os.makedev(node.major, node.minor))
            os.chmod(path, mode)
            made.append(node.path)
    return made


# --- images ---------------------------------------------------------------------------------
def _blob(out: tarfile.TarFile, data: bytes, media_type: str) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    if f"blobs/sha256/{digest}" not in out.getnames():
        info = tarfile.TarInfo(f"blobs/sha256/{digest}")
        info.size = len(data)
        out.addfile(info, io.BytesIO(data))
    return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}


def _busybox_layer(busybox: str) -> bytes:
    applets = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout.split()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for d in ("bin", "dev", "proc", "sys", "etc", "tmp", "var", "var/run"):
            info = tarfile.TarInfo(d)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if d == "tmp" else 0o755
            t.addfile(info)
        with open(busybox, "rb") as f:
            data = f.read()
        info = tarfile.TarInfo("bin/busybox")
        info.size, info.mode = len(data), 0o755
        t.addfile(info, io.BytesIO(data))
        for name in applets:
            if name != "busybox":
                link = tarfile.TarInfo(f"bin/{name}")
                link.type, link.linkname = tarfile.SYMTYPE, "busybox"
                t.addfile(link)
    return buf.getvalue()


def write_images(path: str, busybox: str) -> list[str]:
    """One OCI archive holding the pause and the busybox image (one layer), the latter also
    under the name deploy/'s examples use."""
    layer = _busybox_layer(busybox)
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    images = {PAUSE: ["/bin/sleep", "2147483647"], BUSYBOX: ["/bin/sh"], E2E_BUSYBOX: ["/bin/sh"]}
    manifests = []
    with tarfile.open(path, "w") as out:
        layout = json.dumps({"imageLayoutVersion": "1.0.0"}).encode()
        info = tarfile.TarInfo("oci-layout")
        info.size = len(layout)
        out.addfile(info, io.BytesIO(layout))
        layer_desc = _blob(out, layer, "application/vnd.oci.image.layer.v1.tar")
        for name, cmd in images.items():
            config = {"architecture": ARCH, "os": "linux", "config": {"Cmd": cmd, "Env": ["PATH=/bin"]},
                      "rootfs": {"type": "layers", "diff_ids": [diff_id]}}  # fmt: skip
            config_desc = _blob(out, json.dumps(config).encode(), "application/vnd.oci.image.config.v1+json")
            manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                        "config": config_desc, "layers": [layer_desc]}  # fmt: skip
            desc = _blob(out, json.dumps(manifest).encode(), "application/vnd.oci.image.manifest.v1+json")
            desc["annotations"] = {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1]}
            desc["platform"] = {"architecture": ARCH, "os": "linux"}
            manifests.append(desc)
        index = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": manifests}).encode()
        info = tarfile.TarInfo("index.json")
        info.size = len(index)
        out.addfile(info, io.BytesIO(index))
    return list(images)


# --- containerd -----------------------------------------------------------------------------
def containerd_config(dir_: str, cdi_dir: str, socket: str, bridge: str, nri_request_timeout: str = "2s") -> str:
    """containerd 2.x (config version 3): everything under ``dir_``; no plugin that writes to
    fixed host paths (opt); NRI's socket under ``dir_`` (the agent's NRI plugin connects there,
    no plugins started by containerd, each request answered within ``nri_request_timeout``); CDI
    from the agent's CDI dir; the sandbox image pinned."""
    cni = os.path.join(dir_, "cni")
    os.makedirs(cni, exist_ok=True)
    with open(os.path.join(cni, "10-bridge.conflist"), "w") as f:
        # hostNetwork pods need no CNI; the others get a veth on a bridge of their own (no
        # gateway, no masquerading, addresses kept under dir_), as the NIC tests need a pod network namespace
        ipam = {"type": "host-local", "ranges": [[{"subnet": "10.251.7.0/24"}]], "dataDir": os.path.join(dir_, "cni-ipam")}
        json.dump({"cniVersion": "1.0.0", "name": "sysdra-test",
                   "plugins": [{"type": "bridge", "bridge": bridge, "isGateway": False, "ipMasq": False, "ipam": ipam}]}, f)
    runc = shutil.which("runc") or "runc"
    text = f"""version = 3
root = '{dir_}/root'
state = '{dir_}/state'
imports = []
disabled_plugins = ['io.containerd.internal.v1.opt', 'io.containerd.internal.v1.tracing']

[grpc]
  address = '{socket}'

[ttrpc]
  address = '{socket}.ttrpc'

[metrics]
  address = ''

[plugins.'io.containerd.nri.v1.nri']
  disable = false
  socket_path = '{dir_}/nri/nri.sock'
  plugin_path = '{dir_}/nri/plugins'
  plugin_config_path = '{dir_}/nri/conf.d'
  plugin_request_timeout = '{nri_request_timeout}'

# checks only what a pod's annotations ask (required-plugins.noderesource.dev), as docs/networking.md says
[plugins.'io.containerd.nri.v1.nri'.default_validator]
  enable = true

[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = '{PAUSE}'

[plugins.'io.containerd.cri.v1.runtime']
  enable_cdi = true
  cdi_spec_dirs = ['{cdi_dir}']
  # CAP_SYS_RESOURCE is missing from this VM kind's bounding set: runc cannot lower
  # oom_score_adj below the parent's, and every sandbox failed without this
  restrict_oom_score_adj = true

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  BinaryName = '{runc}'
  SystemdCgroup = false

[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dirs = ['/usr/lib/cni', '/opt/cni/bin']
  conf_dir = '{cni}'

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = '127.0.0.1'
  stream_server_port = '0'
"""
    path = os.path.join(dir_, "config.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


# --- kubelet ----------------------------------------------------------------------------------
def kubelet_config(path: str, *, socket: str, port: int, healthz: int, ca: str, serving: tuple[str, str],
                   cgroup_root: str, gates: dict[str, bool], volume_plugins: str) -> str:  # fmt: skip
    """KubeletConfiguration for this VM kind: cgroup v1 without systemd (cgroupfs, no QoS
    cgroups, nothing enforced), 127.0.0.1 only, x509 clients of the test CA, no eviction."""
    config = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "failCgroupV1": False, "cgroupDriver": "cgroupfs", "cgroupsPerQOS": False, "cgroupRoot": cgroup_root,
        "enforceNodeAllocatable": ["none"], "failSwapOn": False,
        "address": "127.0.0.1", "port": port, "readOnlyPort": 0, "healthzBindAddress": "127.0.0.1", "healthzPort": healthz,
        "tlsCertFile": serving[0], "tlsPrivateKeyFile": serving[1],
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False}, "x509": {"clientCAFile": ca}},
        "authorization": {"mode": "AlwaysAllow"},
        "containerRuntimeEndpoint": f"unix://{socket}", "imageServiceEndpoint": f"unix://{socket}",
        "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "featureGates": dict(gates), "serializeImagePulls": False, "localStorageCapacityIsolation": False,
        "syncFrequency": "10s", "nodeStatusUpdateFrequency": "5s", "shutdownGracePeriod": "0s",
        "podPidsLimit": -1, "volumePluginDir": volume_plugins, "resolvConf": "", "staticPodPath": "",
    }  # fmt: skip
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    return path
