"""``cdi_additional_gids`` on the real kubelet v1.37.2 + containerd v2.4.2 (tests/realnode.py):
a pod running as uid 1000 (restricted PodSecurity's non-root) given a GPU node that the host
has ``root:4242 0660`` (as ROCm's ``/dev/kfd`` is ``root:render 0660``) joins group 4242 when
the claim's CDI spec adds it (``additionalGids``, cdiVersion 0.7.0, which containerd accepts).

What this found: without the field the pod opens the node too, on this runtime: containerd
2.4.2's CDI library makes an injected node whose spec names no owner the process's uid:gid. The
group matters where the node is not chowned so (docs/kubelet-plugin.md, "Non-root containers").
The fixture's GPU nodes are char 1:3 (``/dev/null``'s numbers): opening one needs no driver.
Root only.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess

import pytest

from tests.conftest import REPO
from tests.realnode import PROFILE, RealNode
from tests.realnode_pods import GPU_REQUEST, allocated, module_node, namespace, running_log, wait
from tests.realnode_setup import real_device_nodes

pytestmark = [pytest.mark.slow, pytest.mark.root]
GROUP = 4242
GPU_NODES = [f"/dev/nvidia{i}" for i in range(8)]  # the profile's GPUs' own nodes


def group_owned_nodes(root: str) -> None:
    """The fixture's GPU nodes as ``root:4242 0660`` char 1:3, before the node starts (the
    node's /dev copies them: the namespace's copies get the owner in ``chown_in_node``)."""
    if not os.path.isdir(root):
        shutil.copytree(os.path.join(REPO, "fixtures", "sysfs", PROFILE), root, symlinks=True)
    for path in GPU_NODES:
        host = os.path.join(root, path.lstrip("/"))
        if os.path.lexists(host):
            os.unlink(host)
        os.mknod(host, 0o660 | stat.S_IFCHR, os.makedev(1, 3))
        os.chown(host, 0, GROUP)
        os.chmod(host, 0o660)
    real_device_nodes(root)


@pytest.fixture(scope="module")
def gidnode(tmp_path_factory, monkeypatch_module):
    yield from module_node(tmp_path_factory, "gidnode")


@pytest.fixture(scope="module")
def monkeypatch_module():
    # RealNode.start copies the fixture only when its root is missing: ours is made first
    start = RealNode.start

    def start_with_group_nodes(self, *args, **kwargs):
        group_owned_nodes(self.root)
        return start(self, *args, **kwargs)

    RealNode.start = start_with_group_nodes
    yield
    RealNode.start = start


def chown_in_node(node: RealNode) -> None:
    """The runtime's /dev (the node's namespace) gets the same owner and mode."""
    for path in GPU_NODES:
        subprocess.run([*node.enter, "sh", "-c", f"chown 0:{GROUP} {path} && chmod 0660 {path}"], check=True)


def run_nonroot_pod(node: RealNode, ns: str) -> tuple[dict, list[str]]:
    claim = node.plane.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                               "metadata": {"name": "gpu", "namespace": ns}, "spec": GPU_REQUEST})  # fmt: skip
    script = ("id; for n in $(ls /dev | grep -E '^nvidia[0-9]$'); do stat -c '%n %u:%g %a' /dev/$n; "
              "cat /dev/$n && echo OPENED /dev/$n; done")
    container = {"name": "app", "image": node.image, "imagePullPolicy": "Never",
                 "command": ["sh", "-c", f"{script} 2>&1; echo END; exec sleep 3600"],
                 "resources": {"claims": [{"name": "gpu"}]},
                 "securityContext": {"runAsUser": 1000, "runAsGroup": 1000, "runAsNonRoot": True,
                                     "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}}  # fmt: skip
    node.plane.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "app", "namespace": ns},
                       "spec": {"automountServiceAccountToken": False, "hostNetwork": True, "terminationGracePeriodSeconds": 1,
                                "resourceClaims": [{"name": "gpu", "resourceClaimName": "gpu"}], "containers": [container]}})  # fmt: skip
    lines = running_log(node, ns, "app")
    claim = wait(lambda: (c := node.plane.get("ResourceClaim", "gpu", ns))["status"].get("allocation") and c,
                 "the claim's allocation", node)  # fmt: skip
    return claim, lines


def claim_spec(node: RealNode, uid: str) -> dict:
    (name,) = [f for f in os.listdir(node.cdi_dir) if uid in f and "metadata" not in f]
    with open(os.path.join(node.cdi_dir, name)) as f:
        return json.load(f)


def test_a_nonroot_pod_joins_the_group_of_a_group_owned_node_with_additional_gids(gidnode):
    chown_in_node(gidnode)
    # off (the default): no field; containerd 2.4.2's CDI library makes an injected node that the
    # spec gives no owner the container process's (1000:1000), so it opens even so (docs/kubelet-plugin.md)
    ns = namespace(gidnode)
    claim, lines = run_nonroot_pod(gidnode, ns)
    spec = claim_spec(gidnode, claim["metadata"]["uid"])
    assert "additionalGids" not in json.dumps(spec) and spec["cdiVersion"] in ("0.3.0", "0.5.0"), spec  # a UID starting with a digit needs 0.5.0
    assert "uid=1000 gid=1000 groups=1000" in lines, lines
    assert any(line.endswith(" 1000:1000 660") for line in lines), lines

    # on: the device's edits add group 4242; containerd accepts the 0.7.0 spec and the process joins it
    gidnode.stop_process("agent")
    gidnode.start_agent("--cdi-additional-gids", "on")
    ns = namespace(gidnode)
    claim, lines = run_nonroot_pod(gidnode, ns)
    (device,) = allocated(claim)
    spec = claim_spec(gidnode, claim["metadata"]["uid"])
    assert spec["cdiVersion"] == "0.7.0", spec
    (dev,) = [d for d in spec["devices"] if d["name"].endswith(device)]
    assert dev["containerEdits"]["additionalGids"] == [GROUP], spec
    assert f"uid=1000 gid=1000 groups=1000,{GROUP}" in lines, lines
    assert [line for line in lines if line.startswith("OPENED")], lines
