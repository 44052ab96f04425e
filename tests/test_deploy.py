"""deploy/: every manifest validates against the Kubernetes 1.37 strict schemas."""

from __future__ import annotations

import glob
import os

import pytest
import yaml

from tests.conftest import REPO

kubernetes_validate = pytest.importorskip("kubernetes_validate")
MANIFESTS = sorted(glob.glob(os.path.join(REPO, "deploy", "*.yaml")))


def _docs(path):
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d]


@pytest.mark.parametrize("path", MANIFESTS, ids=os.path.basename)
def test_manifest_validates(path):
    docs = _docs(path)
    assert docs
    for obj in docs:
        kubernetes_validate.validate(obj, "1.37", strict=True)


def _by_kind(kind):
    return [d for p in MANIFESTS for d in _docs(p) if d["kind"] == kind]


def test_deviceclasses_cover_every_kind():
    """One class per kind, whole devices only where a kind has partitions or shares, functions on vfio-pci
    in vfio.sysdra.io only (tests/test_deviceclasses.py)."""
    from discovery.models import KINDS

    classes = {d["metadata"]["name"]: d for d in _by_kind("DeviceClass")}
    assert set(classes) == {f"{k}.sysdra.io" for k in KINDS} | {"gpu-partition.sysdra.io", "gpu-share.sysdra.io", "nic-share.sysdra.io", "vfio.sysdra.io"}
    for kind in KINDS:
        expr = classes[f"{kind}.sysdra.io"]["spec"]["selectors"][0]["cel"]["expression"]
        assert expr.startswith(f'device.driver == "sysdra.io" && device.attributes["sysdra.io"].type == "{kind}"')
        # a container gets nothing of its kind from /dev/vfio/<group>: vfio-pci and its variant drivers are left out
        assert ('!(device.attributes["sysdra.io"].?driver.orValue("").endsWith("vfio-pci") || '
                'device.attributes["sysdra.io"].?driver.orValue("").endsWith("vfio_pci"))') in expr


def test_rbac_matches_what_the_agent_calls():
    from agent.tools.doctor import API_PERMISSIONS

    (role,) = _by_kind("ClusterRole")
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    assert granted == {(g, r, v) for v, g, r in API_PERMISSIONS}  # no more, no less


def test_daemonset_mounts_and_downward_api():
    (ds,) = _by_kind("DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    paths = {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert {"/sys", "/dev", "/var/run/cdi", "/var/lib/kubelet/plugins", "/var/lib/kubelet/plugins_registry"} <= paths
    (c,) = pod["containers"]
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in c["env"]}
    assert env["NODE_NAME"] == "spec.nodeName" and env["POD_UID"] == "metadata.uid"
    assert "--rolling-update-uid=$(POD_UID)" in c["args"]
    assert ds["spec"]["updateStrategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    sys_mount = [m for m in c["volumeMounts"] if m["mountPath"] == "/host/sys"][0]
    assert sys_mount["readOnly"] is True
    # ready once registered (tests/test_readiness.py runs that probe); alive while the event loop answers (tests/test_liveness.py)
    assert c["readinessProbe"]["exec"]["command"] == ["sysdra", "status", "--socket=/tmp/status.sock", "--registered"]
    assert "status --socket=/tmp/status.sock --timeout=" in c["livenessProbe"]["exec"]["command"][2]
