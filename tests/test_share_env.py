"""No variable twice in what a CDI device of a claim brings to a container, nor to two values
by two CDI devices of the claim (one container may get them all), for every
combination of device, share capacities and claim config (agent/prepare/shares.py,
cdi/claim.py): capacities whose short names clash get their whole name, and only names no
device can publish (``share_plan`` refuses them at start) are the claim's error."""

from __future__ import annotations

import itertools
import re
from collections import Counter

import pytest

from agent.prepare.allocation import ClaimFailed, Result
from agent.prepare.claimconfig import GpuConfig, GpuSharing, NicConfig, VfioConfig
from agent.prepare.shares import claim_device, claim_devices, recorded
from agent.publish.sharing import share_plan
from cdi.claim import build_claim_spec, capacity_keys
from discovery.inventory import scan
from tests.conftest import profile_root

UID = "00000000-0000-4000-8000-000000000001"
SHARES = ("11111111-2222-4333-8444-000000000001", "11111111-2222-4333-8444-000000000002")
CAPACITIES = ("memory", "example.com/memory", "compute", "example.org/compute", "bandwidth", "slots",
              "Memory", "example.com/MEMORY", "memory_value", "id", "device", "share")


def _devices() -> list:
    by_kind = {}
    for d in scan(profile_root("server-2s-gpu-nic")).devices:
        by_kind.setdefault(d.kind, d)
    nvidia, nic = by_kind["gpu"], by_kind["nic"]
    amd = nvidia.replace(name="gpu-amd", pci=nvidia.pci.replace(vendor_id="1002"))
    return [nvidia, amd, nic]


CONFIGS = [None, GpuConfig(apiVersion="sysdra.io/v1alpha1", kind="GpuConfig", env={"APP": "1", "MEMORY": "x"}),
           GpuConfig(apiVersion="sysdra.io/v1alpha1", kind="GpuConfig", sharing=GpuSharing(mpsLimits=False)),
           NicConfig(apiVersion="sysdra.io/v1alpha1", kind="NicConfig", env={"SHARE": "y"}),
           VfioConfig(apiVersion="sysdra.io/v1alpha1", kind="VfioConfig", env={"APP": "2"})]
COMBINATIONS = [c for n in range(4) for c in itertools.combinations(CAPACITIES, n)]


def _env_names(spec: dict) -> list[list[str]]:
    common = [e.split("=", 1)[0] for e in spec["containerEdits"]["env"]]
    return [common + [e.split("=", 1)[0] for e in d["containerEdits"]["env"]] for d in spec["devices"]]


def _whole_names_clash(names: tuple[str, ...]) -> bool:
    """Whether even the capacities' whole names set one variable twice (the only refusal)."""
    whole = [re.sub(r"[^A-Z0-9]", "_", n.upper()) for n in names]
    share = Counter(["ID", "DEVICE"] + [v for w in whole for v in (w, w + "_VALUE")])
    device = Counter(["SHARE", *whole])
    return max(share.values()) > 1 or max(device.values()) > 1


def _clashing(names: tuple[str, ...]) -> bool:
    try:
        capacity_keys(names)
    except ValueError:
        return True
    return False


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{type(c).__name__}{'-nompslimits' if isinstance(c, GpuConfig) and not c.sharing.mpsLimits else ''}")
def test_no_variable_twice_for_any_share_and_config(config):
    devices = _devices()
    built = refused = 0
    for dev, names in itertools.product(devices, COMBINATIONS):
        consumed = tuple((n, f"{i + 1}Gi") for i, n in enumerate(sorted(names)))
        other = devices[1] if dev is devices[0] else devices[0]
        # two shares of the device and a whole second device in the claim
        results = [(other, Result("r", "node-1", other.name, None), config)]
        results += [(dev, Result("r", "node-1", dev.name, s, consumed), config) for s in SHARES]
        try:
            entries = claim_devices(results)
        except ClaimFailed as err:
            assert _clashing(names) and _whole_names_clash(names), (dev.name, names, err)
            refused += 1
            continue
        spec = build_claim_spec("sysdra.io", UID, entries)
        for env in _env_names(spec):
            assert [n for n, c in Counter(env).items() if c > 1] == [], (dev.name, names, config, env)
        values = {}
        for d in spec["devices"]:
            for name, value in (e.split("=", 1) for e in d["containerEdits"]["env"]):
                assert values.setdefault(name, value) == value, (dev.name, names, config, name)
        built += 1
    assert built > 0 and refused > 0  # both outcomes were exercised


def test_clashing_short_names_get_their_whole_name():
    assert capacity_keys(["memory", "example.com/memory", "compute"]) == {
        "memory": "MEMORY", "example.com/memory": "EXAMPLE_COM_MEMORY", "compute": "COMPUTE"}
    assert capacity_keys(["example.com/rate"]) == {"example.com/rate": "RATE"}
    (dev, *_) = _devices()
    consumed = (("example.com/memory", "40Gi"), ("memory", "20Gi"))
    env = dict(e.split("=", 1) for e in claim_device(dev, Result("r", "node-1", dev.name, SHARES[0], consumed), None).env)
    assert env["SYSDRA_SHARE_MEMORY"] == "20Gi" and env["SYSDRA_SHARE_MEMORY_VALUE"] == str(20 * 2**30)
    assert env["SYSDRA_SHARE_EXAMPLE_COM_MEMORY"] == "40Gi" and env["SYSDRA_SHARE_EXAMPLE_COM_MEMORY_VALUE"] == str(40 * 2**30)
    # the MPS limit reads the capacity named memory, whatever else the share consumes
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={20 * 1024}M"


@pytest.mark.parametrize("name", ["id", "device", "share", "memory_value", "Memory"])
def test_a_policy_whose_variables_would_clash_stops_the_agent_at_start(name):
    policy = {"value": "1", "default": "1", "validRange": {"min": "1"}}
    with pytest.raises(ValueError, match="share-policies.gpu: capacities .* same environment variable"):
        share_plan(("gpu",), {"gpu": {name: policy}})



def _mps_env(dev, **consumed) -> dict:
    share = Result("r", "node-1", dev.name, SHARES[0], tuple(sorted(consumed.items())))
    return dict(e.split("=", 1) for e in claim_device(dev, share, None).env if e.startswith("CUDA_MPS_"))


def test_mps_limits_stay_within_what_cuda_takes_and_only_on_nvidia_gpus():
    nvidia, amd, _ = _devices()
    # a thread percentage of 1 to 100 (compute is a plain number the policy allows beyond 100)
    assert _mps_env(nvidia, compute="250")["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"
    assert _mps_env(nvidia, compute="0")["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "1"
    # under 1 MiB of memory sets no limit: 0M would leave the client no device memory
    assert _mps_env(nvidia, memory="512Ki") == {} and _mps_env(nvidia, memory="1Mi") == {
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1M"}
    assert _mps_env(amd, compute="25", memory="1Gi") == {}  # no CUDA MPS beside an AMD GPU


def test_a_variable_recorded_twice_by_an_older_agent_keeps_its_first_value():
    nvidia, *_ = _devices()
    dev = recorded(nvidia, {"shareID": SHARES[0], "cdiEnv": ["A=1", "B=2", "A=3"]})
    assert dev.env == ("A=1", "B=2") and dev.key == f"{nvidia.name}-{SHARES[0]}"
