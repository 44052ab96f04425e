"""The bench's floor (tests/realnode_floor.py, the plugin in tests/peers/draplugin) on the real
node beside the agent: what it gives a container is what sysdra gave one for a GPU of the same
node, so `make bench` compares two drivers that do the same job. Root only, slow."""

from __future__ import annotations

import json
import os

import pytest

from tests import realnode_floor as floor
from tests.realnode import RealNode
from tests.realnode_leftovers import HostState
from tests.realnode_pods import METADATA, create_pod, delete_pod, module_node, namespace, running_log, wait

pytestmark = [pytest.mark.slow, pytest.mark.root]
SCRIPT = ("for n in $(ls /dev | grep nvidia); do stat -c '%n %F %t:%T %a' /dev/$n; done; env | grep ^SYSDRA_ | sort; "
          "ls /usr/local/nvidia/lib64 | wc -l; echo METADATA; cat {metadata}; echo")  # fmt: skip


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    yield from module_node(tmp_path_factory, "floor")


def claim(node: RealNode, ns: str, name: str, device_class: str) -> dict:
    request = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": device_class}}]}}
    return node.plane.create({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                              "metadata": {"name": name, "namespace": ns}, "spec": request})  # fmt: skip


def pod_lines(node: RealNode, ns: str, name: str, driver: str) -> list[str]:
    metadata = f"{METADATA}/resourceclaims/{name}/gpu/{driver}-metadata.json"
    create_pod(node, ns, name, SCRIPT.format(metadata=metadata), claims=[{"name": "gpu", "resourceClaimName": name}])
    return running_log(node, ns, name)


def test_the_floor_gives_a_container_what_sysdra_gives_it(node):
    ns = namespace(node)
    sysdra_uid = claim(node, ns, "sysdra", "gpu.sysdra.io")["metadata"]["uid"]
    sysdra_lines = pod_lines(node, ns, "sysdra", "sysdra.io")
    with open(os.path.join(node.cdi_dir, f"k8s.sysdra.io-claim_{sysdra_uid}.json")) as f:
        device = floor.device_file(json.load(f))
    floor.start(node, device)
    (published,) = floor.slices(node)
    assert [d["name"] for d in published["spec"]["devices"]] == ["gpu-0"]

    floor_uid = claim(node, ns, "floor", floor.DEVICE_CLASS)["metadata"]["uid"]
    floor_lines = pod_lines(node, ns, "floor", floor.DRIVER)
    got = node.plane.get("ResourceClaim", "floor", ns)["status"]["allocation"]["devices"]["results"]
    assert [(r["driver"], r["device"]) for r in got] == [(floor.DRIVER, "gpu-0")]
    # the same device nodes, environment and driver mounts; only the claim's UID differs
    split = sysdra_lines.index("METADATA")
    assert floor_lines[:split] == [line.replace(sysdra_uid, floor_uid) for line in sysdra_lines[:split]], (sysdra_lines, floor_lines)
    assert f"SYSDRA_CLAIM_UID={floor_uid}" in floor_lines
    assert any(line.startswith("/dev/nvidia") and "character special file" in line for line in floor_lines), floor_lines
    # written by the upstream helper: a stream of the same object in each version, newest first
    metadata = json.JSONDecoder().raw_decode("\n".join(floor_lines[split + 1: floor_lines.index("END")]))[0]
    assert metadata["metadata"]["uid"] == floor_uid
    assert [(d["driver"], d["name"]) for r in metadata["requests"] for d in r["devices"]] == [(floor.DRIVER, "gpu-0")]

    assert os.path.exists(floor.spec_path(node, floor_uid))
    delete_pod(node, ns, "floor")
    wait(lambda: not [f for f in os.listdir(node.cdi_dir) if floor_uid in f], "the floor's CDI specs removed by unprepare", node,
         log="floor")  # fmt: skip
    delete_pod(node, ns, "sysdra")


def test_zz_the_node_leaves_nothing_behind(node):
    node.stop()
    problems = node.before.compare(HostState.take(), node_dir=node.dir, cgroup_root=node.cgroup_root)
    assert not problems, "\n".join(problems)
