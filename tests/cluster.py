"""``make cluster``: the real node of the tests (tests/realnode.py) for people. A single-node
Kubernetes v1.37.2 cluster with the sysdra agent on a fixture root, until Ctrl-C.

    make cluster                     # PROFILE=server-2s-gpu-nic, state in .state/cluster
    export KUBECONFIG=.state/cluster/kubeconfig
    kubectl apply -f .state/cluster/example-pod.yaml

Pods get a network namespace on a bridge of the node's own (a pod on the host's network cannot be
given a claimed NIC's netdev: the NRI plugin refuses it, docs/networking.md). The images are local: busybox as ``sysdra.test/busybox:1`` and under the
name deploy/'s examples use; nothing is pulled.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time

import yaml

from tests.controlplane import REPO, load_yaml
from tests.realnode import RealNode


def example_pod(path: str, image: str) -> str:
    """deploy/example-claim.yaml's template and pod, the pod in a network namespace of its own
    (the node's CNI bridge): its NIC's netdev goes into it (docs/networking.md)."""
    docs = load_yaml(os.path.join(REPO, "deploy", "example-claim.yaml"))
    for doc in docs:
        if doc["kind"] == "Pod":
            doc["spec"]["automountServiceAccountToken"] = False
            for c in doc["spec"]["containers"]:
                c["image"], c["imagePullPolicy"] = image, "Never"
    with open(path, "w") as f:
        yaml.safe_dump_all(docs, f, sort_keys=False)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make cluster", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", default=os.path.join(REPO, ".state", "cluster"))
    p.add_argument("--profile", default="server-2s-gpu-nic")
    p.add_argument("agent_args", nargs="*", help="more `sysdra run` flags (after --)")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("make cluster: needs root (mount namespace, runc, cgroups)", file=sys.stderr)
        return 1
    shutil.rmtree(args.dir, ignore_errors=True)  # a node of an earlier run left nothing running
    node = RealNode(args.dir, profile=args.profile, agent_args=list(args.agent_args))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background
    t0 = time.monotonic()
    try:
        node.start()
        kubeconfig = os.path.join(args.dir, "kubeconfig")
        shutil.copy(node.plane.kubeconfig, kubeconfig)
        example = example_pod(os.path.join(args.dir, "example-pod.yaml"), node.image)
        print(f"""
sysdra real node {node.name!r} up in {time.monotonic() - t0:.0f} s: kube-apiserver {node.plane.url}
  export KUBECONFIG={kubeconfig}
  kubectl get resourceslices
  kubectl apply -f {example}      # deploy/example-claim.yaml on this node
  kubectl logs gpu-nic-demo
logs: {args.dir}/*.log, {args.dir}/controlplane/*.log    Ctrl-C stops the node and removes what it ran.
""", flush=True)  # fmt: skip
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    finally:
        node.stop()


if __name__ == "__main__":
    sys.exit(main())
