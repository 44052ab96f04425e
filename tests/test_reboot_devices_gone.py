"""A device that did not come back after a reboot (fallen off the bus, its driver not bound yet)
under a prepared claim.

Device numbers are handed out at boot in probe order: with one GPU missing, the next GPU gets
the missing one's number (``/dev/nvidiaN``, ``renderD<N>``, an IOMMU group). So the numbers a claim's
spec recorded in the boot before name nothing, or another claim's device, in this one: the spec of
a claim whose device is gone is not written from them. Its pods cannot start (the kubelet's
re-prepare says why) until the device is back, when the re-prepare rebuilds the spec from it, or
until the claim is unprepared."""

from __future__ import annotations

import os

from agent.prepare import cdifiles
from agent.prepare.driver import Driver
from tests.kubelet_standin import claim, gpu, inventory
from tests.test_checkpoint import assert_consistent, make_env, ref

A, B = "gpu-0000-1b-00-0", "gpu-0000-1c-00-0"


def _reboot(s, state, boot: str, *devices) -> Driver:
    """The node rebooted with ``devices``: the CDI dir (tmpfs) empty, a new boot ID; the agent's start."""
    for p in cdifiles.list_claim_specs(s.cdi_dir, s.driver_name).values():
        os.unlink(p)
    with open(os.path.join(s.root, "proc/sys/kernel/random/boot_id"), "w") as f:
        f.write(boot + "\n")
    state["inv"] = inventory(*devices, root=s.root)
    d = Driver(s, lambda: state["inv"])
    d.recover()
    return d


def _nodes(s, uid: str) -> list[tuple[str, int]]:
    path = cdifiles.claim_spec_path(s.cdi_dir, s.driver_name, uid)
    spec = cdifiles.read_spec(path)
    return [(n["path"], n["minor"]) for d in spec["devices"] for n in d["containerEdits"].get("deviceNodes", ())]


def test_a_claims_gpu_gone_after_a_reboot_never_gets_the_number_another_gpu_took(tmp_path):
    s, state = make_env(tmp_path)
    state["inv"] = inventory(gpu(0, root=s.root), gpu(1, root=s.root), root=s.root)
    a, b = claim("a", [("g", A)]), claim("b", [("g", B)])
    d = Driver(s, lambda: state["inv"])
    ua, ub = a["metadata"]["uid"], b["metadata"]["uid"]
    assert [r.error for r in d.prepare_claims([a, b]).values()] == [None, None]
    assert _nodes(s, ua) == [("/dev/dri/renderD128", 128)]
    # GPU A is not there after the reboot: B was probed first and took render minor 128
    moved_b = gpu(1, root=s.root, minor=128)
    d = _reboot(s, state, "boot-2", moved_b)
    assert _nodes(s, ub) == [("/dev/dri/renderD129", 128)]
    assert not os.path.exists(cdifiles.claim_spec_path(s.cdi_dir, s.driver_name, ua)), \
        "claim a's spec names minor 128 of the boot before: GPU B's now"
    assert d.checkpoint.claims[ua]["state"] == "PrepareCompleted"  # still prepared: the kubelet unprepares it
    err = d.prepare_claims([a])[ua].error  # the kubelet's re-prepare, for the pod it restarts
    assert err and A in err and "not on this node" in err, err
    assert not os.path.exists(cdifiles.claim_spec_path(s.cdi_dir, s.driver_name, ua))
    assert not d.prepare_claims([b])[ub].error
    # an agent restarted in this boot knows claim a's spec is still of the boot before
    d = Driver(s, lambda: state["inv"])
    d.recover()
    assert not os.path.exists(cdifiles.claim_spec_path(s.cdi_dir, s.driver_name, ua))
    assert d.prepare_claims([a])[ua].error
    # its driver bound late: the GPU is back (probed last, minor 129), and the kubelet's retry rebuilds the spec
    state["inv"] = inventory(gpu(0, root=s.root, minor=129), moved_b, root=s.root)
    assert not d.prepare_claims([a])[ua].error
    assert _nodes(s, ua) == [("/dev/dri/renderD128", 129)]
    assert d.checkpoint.claims[ua]["bootID"] == "boot-2"
    assert_consistent(s, d)


def test_a_claim_whose_gpu_is_gone_after_a_reboot_is_unprepared(tmp_path):
    s, state = make_env(tmp_path)
    a = claim("a", [("g", A)])
    ua = a["metadata"]["uid"]
    assert not Driver(s, lambda: state["inv"]).prepare_claims([a])[ua].error
    d = _reboot(s, state, "boot-2", gpu(1, root=s.root, minor=128))
    assert d.unprepare_claims([ref(a)]) == {ua: None}
    assert d.checkpoint.claims == {} and cdifiles.list_claim_specs(s.cdi_dir, s.driver_name) == {}
    assert_consistent(s, d)


def test_an_admin_claim_beside_a_mig_device_follows_its_instance_made_again_after_a_reboot(tmp_path):
    """Admin access to a MIG device has no record of its own: it uses the instance the claim beside it
    made. After a reboot that instance is made again under another GPU instance ID, so its cap nodes
    differ: the admin claim's spec follows it, never the cap nodes of the boot before (another
    instance's, or none)."""
    from tests.mig_node import GPU, MigNode
    from tests.test_mig_prepare import _admin, driver_for, spec_of

    node = MigNode(str(tmp_path))
    d = driver_for(node)
    dev = f"{GPU}-mig-2g-35gb-2"
    first = claim("z", [("m", f"{GPU}-mig-1g-18gb-0")])  # takes the first GPU instance ID: a's is another
    a, adm = claim("a", [("m", dev)]), _admin("adm", dev)
    for c in (first, a, adm):
        assert not d.prepare_claims([c])[c["metadata"]["uid"]].error
    assert d.unprepare_claims([ref(first)]) == {first["metadata"]["uid"]: None}
    caps = {c["metadata"]["uid"]: [n for n in spec_of(d, c)[dev] if n[0].startswith("/dev/nvidia-caps/")] for c in (a, adm)}
    node.sim.reboot()
    for p in cdifiles.list_claim_specs(d.settings.cdi_dir, d.settings.driver_name).values():
        os.unlink(p)
    again = driver_for(node)
    again.boot_id = "another-boot"
    assert again.recover().not_rebuilt == []
    now = [n for n in spec_of(again, a)[dev] if n[0].startswith("/dev/nvidia-caps/")]
    assert now != caps[a["metadata"]["uid"]]  # made again under another ID
    assert [n for n in spec_of(again, adm)[dev] if n[0].startswith("/dev/nvidia-caps/")] == now
    assert not again.prepare_claims([adm])[adm["metadata"]["uid"]].error
