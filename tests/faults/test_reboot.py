"""Reboot: the CDI dir (tmpfs) is emptied and the boot ID changes between two runs of the agent;
prepared claims come back intact: same CDI IDs, specs rebuilt, metadata generation higher."""

from __future__ import annotations

import glob
import os

import pytest

from agent.prepare.metadata.stream import generation_of
from tests.faults.harness import Node, run

pytestmark = pytest.mark.slow
REBOOTS = 3


def test_reboot_brings_prepared_claims_back(tmp_path, faults):
    node = Node(tmp_path, boot="boot-0")
    g = [d for d in node.devices() if d.startswith("gpu-")]
    n = [d for d in node.devices() if d.startswith("nic-")]
    claims = [node.write_claim("a", [("gpu", g[0]), ("nic", n[0])], uid="0000000a-0000-4000-8000-0000000b0070", pod_claim_name="acc"),
              node.write_claim("b", [("x", g[1]), ("y/sub", g[2])], uid="0000000b-0000-4000-8000-0000000b0070")]
    node.start()
    first = run(node.prepare(*claims))
    answer = {u: [(d.device_name, tuple(d.cdi_device_ids)) for d in r.devices] for u, r in first.claims.items()}
    assert all(not r.error for r in first.claims.values())
    gens = {p: generation_of(p) for p in glob.glob(os.path.join(node.plugin_dir, "dra-device-metadata", "*", "*", "metadata.json"))}
    assert len(gens) == 4
    for boot in range(1, REBOOTS + 1):
        node.kill() if boot % 2 else node.stop()  # a crash-reboot and a clean one
        for name in os.listdir(node.cdi_dir):
            os.unlink(os.path.join(node.cdi_dir, name))
        node.set_boot_id(f"boot-{boot}")
        node.start()
        cp = node.check_state()
        assert sorted(cp.claims) == sorted(answer) and {e["bootID"] for e in cp.claims.values()} == {f"boot-{boot}"}
        for p, gen in gens.items():
            assert generation_of(p) > gen, f"reboot {boot}: {p} generation {generation_of(p)} <= {gen}"
            gens[p] = generation_of(p)
        again = run(node.prepare(*claims))
        assert {u: [(d.device_name, tuple(d.cdi_device_ids)) for d in r.devices] for u, r in again.claims.items()} == answer
        node.wait_slices_converge()
    run(node.unprepare(*claims))
    node.check_clean()
    assert node.stop() == 0
    faults.add("Reboot", "CDI dir emptied + new boot ID (alternating SIGKILL and SIGTERM before)", REBOOTS,
               "2 claims (4 devices, 4 metadata files) back with the same CDI IDs, specs rebuilt, metadata generation +1")
