"""podman 4.3.1 (CDI library v0.5.x, which knows cdiVersion <= 0.5.0) against a claim spec with
``additionalGids``: the runtime this machine has shows why ``cdi_additional_gids`` is off by
default. With it on, the whole spec is rejected and the claim's devices do not resolve; off, the
same claim runs and opens the ``root:4242 0660`` node. Root, podman, busybox."""

from __future__ import annotations

import os
import stat

import pytest

from agent.prepare import cdifiles
from cdi.claim import build_claim_spec, cdi_id
from cdi.nodegroup import group_reader
from tests.conftest import require_podman
from tests.kubelet_standin import gpu
from tests.test_podman_cdi import Podman

pytestmark = [pytest.mark.slow, pytest.mark.root]
UID = "7a1f0c2e-0000-4000-8000-000000000042"


def test_podman_4_3_rejects_additional_gids_and_off_keeps_it_working(tmp_path):
    busybox = require_podman()
    host, cdi_dir = str(tmp_path / "host"), str(tmp_path / "cdi")
    node = os.path.join(host, "dev", "dri", "renderD128")
    os.makedirs(os.path.dirname(node))
    os.makedirs(cdi_dir)
    os.mknod(node, 0o660 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers: root:4242 0660
    os.chown(node, 0, 4242)
    os.chmod(node, 0o660)
    dev = gpu(0, root=host, major=1, minor=3)
    path = os.path.join(cdi_dir, f"k8s.sysdra.io-claim_{UID}.json")
    ids = [cdi_id("sysdra.io", UID, dev.name)]
    podman = Podman(str(tmp_path), cdi_dir)
    script = "/bin/busybox cat /dev/dri/renderD128 && echo OPENED"
    try:
        podman.import_busybox(busybox)
        spec = build_claim_spec("sysdra.io", UID, [dev], host, group_of=group_reader("on"))
        assert spec["devices"][0]["containerEdits"]["additionalGids"] == [4242]
        cdifiles.write_spec(path, spec)
        out = podman.run(ids, script)
        assert out.returncode != 0 and "unresolvable CDI devices" in out.stderr, (out.stdout, out.stderr)

        cdifiles.write_spec(path, build_claim_spec("sysdra.io", UID, [dev], host, group_of=group_reader("off")))
        out = podman.run(ids, script)
        assert out.returncode == 0 and "OPENED" in out.stdout, (out.stdout, out.stderr)
    finally:
        podman.cleanup()
