"""Claim configuration (agent/prepare/claimconfig.py): strict decoding of sysdra.io/v1alpha1
kinds and upstream's precedence (class configs, then claim configs, last match per request).
The configs reach the driver as the scheduler's allocator copies them into the allocation."""

from __future__ import annotations

import copy
import os

import pytest

from agent.prepare.allocation import ClaimFailed
from agent.prepare.claimconfig import GpuConfig, NicConfig, config_for, decode, env_of, opaque_configs
from tests.conftest import REPO
from tests.controlplane import allocate, load_yaml
from tests.test_allocator import NODE, claim, exactly, published

CLASSES = load_yaml(os.path.join(REPO, "deploy", "deviceclasses.yaml"))


def gpu_config(**kw) -> dict:
    return {"apiVersion": "sysdra.io/v1alpha1", "kind": "GpuConfig", **kw}


def opaque(parameters: dict, requests: list[str] | None = None, driver: str = "sysdra.io") -> dict:
    out: dict = {"opaque": {"driver": driver, "parameters": parameters}}
    if requests:
        out["requests"] = requests
    return out


def test_decode_defaults_and_strictness():
    c = decode(gpu_config())
    assert isinstance(c, GpuConfig) and c.sharing.mpsLimits is True and c.env == {}
    assert isinstance(decode({"apiVersion": "sysdra.io/v1alpha1", "kind": "NicConfig", "env": {"A": "1"}}), NicConfig)
    for bad, why in (
        (gpu_config(sharing={"mpsLimits": True, "mps": 1}), "sharing.mps"),  # unknown field
        (gpu_config(sharing={"mpsLimits": "yes"}), "sharing.mpsLimits"),  # strict: no coercion
        (gpu_config(colour="red"), "colour"),
        (gpu_config(env={"SYSDRA_SHARE_ID": "x"}), "env"),  # the driver's own names
        (gpu_config(env={"1BAD": "x"}), "env"),
        (gpu_config(env={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "100"}), "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: names starting"),
        (gpu_config(env={"A" * 129: "x"}), "env"),  # a name of at most 128
        (gpu_config(env={"A": "x" * 4097}), "env.A"),  # a value of at most 4096
        (gpu_config(env={f"V{i}": "x" for i in range(33)}), "env: .*at most 32"),
        ({"apiVersion": "sysdra.io/v1", "kind": "GpuConfig"}, "apiVersion"),
        ({"apiVersion": "sysdra.io/v1alpha1", "kind": "TpuConfig"}, "kind"),
        ("not an object", "object"),
    ):
        with pytest.raises(ValueError, match=why):
            decode(bad)
    assert decode(gpu_config(env={"A" * 128: "x" * 4096, **{f"V{i}": "x" for i in range(31)}})).env["A" * 128]
    with pytest.raises(ValueError) as err:  # what is wrong, field by field, a claim's value cut short
        decode(gpu_config(colour="x" * 5000, env={"1BAD": "x"}))
    assert "colour" in str(err.value) and "1BAD" in str(err.value)
    with pytest.raises(ValueError) as err:
        decode({"apiVersion": "v" * 5000, "kind": "GpuConfig"})
    assert str(err.value).startswith("apiVersion 'vvv") and len(str(err.value)) < 200


def _allocated(class_configs: list[dict], claim_configs: list[dict], *requests: dict) -> dict:
    classes = copy.deepcopy(CLASSES)
    gpu_class = next(c for c in classes if c["metadata"]["name"] == "gpu.sysdra.io")
    gpu_class["spec"]["config"] = class_configs
    c = claim("cfg", *requests)
    c["spec"]["devices"]["config"] = claim_configs
    (allocation,) = allocate(published("server-2s-gpu-nic"), classes, c, node=NODE)
    return {"metadata": {"uid": "u"}, "status": {"allocation": allocation}}


def test_class_then_claim_last_match_per_request_from_the_allocators_copy():
    got = _allocated(
        [opaque(gpu_config(env={"FROM": "class"}))],
        [opaque(gpu_config(env={"FROM": "claim-a"}), requests=["a"]),
         opaque({"apiVersion": "sysdra.io/v1alpha1", "kind": "NicConfig", "env": {"FROM": "nic"}}),
         opaque({"anything": "goes"}, driver="other.example.com")],  # another driver's: not ours to read
        exactly("a", "gpu.sysdra.io"), exactly("b", "gpu.sysdra.io"), exactly("n", "nic.sysdra.io"))
    configs = opaque_configs(got, "sysdra.io")
    assert [c.source for c in configs] == ["FromClass", "FromClaim", "FromClaim"]
    assert env_of(config_for(configs, "a", "gpu")) == ["FROM=claim-a"]  # claim beats class for its request
    assert env_of(config_for(configs, "b", "gpu")) == ["FROM=class"]  # the claim's NicConfig is not for GPUs
    assert env_of(config_for(configs, "n", "nic")) == ["FROM=nic"]
    assert config_for(configs, "a/sub", "gpu") is not None  # "a" covers its subrequests
    # in the CDI spec in one order, whatever order the claim lists them in
    assert env_of(decode(gpu_config(env={"B": "1", "A": "2"}))) == ["A=2", "B=1"]


def test_config_naming_a_request_of_another_kind_is_the_claims_error():
    got = _allocated([], [opaque(gpu_config(), requests=["n"])], exactly("g", "gpu.sysdra.io"), exactly("n", "nic.sysdra.io"))
    configs = opaque_configs(got, "sysdra.io")
    assert config_for(configs, "g", "gpu") is None
    with pytest.raises(ClaimFailed, match="GpuConfig names request 'n'"):
        config_for(configs, "n", "nic", "nic-0")
    # the allocator drops `requests` from a config that names every request: it then applies by kind
    (only,) = opaque_configs(_allocated([], [opaque(gpu_config(), requests=["n"])], exactly("n", "nic.sysdra.io")), "sysdra.io")
    assert only.requests == () and config_for([only], "n", "nic") is None


def test_unknown_field_fails_the_claim_even_where_no_result_uses_it():
    nic = {"apiVersion": "sysdra.io/v1alpha1", "kind": "NicConfig", "speed": 9000}  # no NIC in this claim
    got = _allocated([], [opaque(nic)], exactly("a", "gpu.sysdra.io"))
    with pytest.raises(ClaimFailed, match=r"config 0 \(FromClaim\) for sysdra.io: NicConfig: speed"):
        opaque_configs(got, "sysdra.io")


def test_vfio_config_is_a_known_kind_for_every_device_kind():
    from agent.prepare.claimconfig import VfioConfig

    got = _allocated([], [opaque({"apiVersion": "sysdra.io/v1alpha1", "kind": "VfioConfig"})], exactly("a", "gpu.sysdra.io"))
    (only,) = opaque_configs(got, "sysdra.io")
    assert isinstance(only.config, VfioConfig)
    for kind in ("gpu", "nic", "fpga", "accelerator"):
        assert isinstance(config_for([only], "a", kind), VfioConfig), kind


NIC = {"apiVersion": "sysdra.io/v1alpha1", "kind": "NicConfig"}


def test_nic_config_takes_the_pods_interface_name_mtu_addresses_and_routes():
    cfg = decode({**NIC, "interfaceName": "data0", "mtu": 9000, "addresses": ["192.0.2.5/24", "2001:db8::5/64"],
                  "routes": [{"destination": "default", "gateway": "192.0.2.1"},
                             {"destination": "198.51.100.0/24", "gateway": "192.0.2.254"},
                             {"destination": "2001:db8:1::/48"}]})
    assert isinstance(cfg, NicConfig) and cfg.interfaceName == "data0" and cfg.mtu == 9000
    assert cfg.addresses == ["192.0.2.5/24", "2001:db8::5/64"] and cfg.routes[0].gateway == "192.0.2.1"


@pytest.mark.parametrize("bad, why", [
    ({"interfaceName": "a/b"}, "interfaceName: .*not a netdev name"),
    ({"interfaceName": "x" * 16}, "interfaceName: .*not a netdev name"),
    ({"interfaceName": ".."}, "interfaceName: .*not a netdev name"),  # a path component in sysfs
    ({"interfaceName": "a\tb"}, "interfaceName: .*not a netdev name"),
    ({"interfaceName": "a\x00b"}, "interfaceName: .*not a netdev name"),
    ({"mtu": 67}, "mtu: .*greater than or equal to 68"),
    ({"mtu": "9000"}, "mtu: .*integer"),
    ({"mtu": 65536}, "mtu: .*less than or equal to 65535"),
    ({"mtu": 1000, "addresses": ["2001:db8::5/64"]}, "IPv6 addresses need at least 1280"),
    ({"addresses": ["192.0.2.5"]}, "not an address with its prefix"),
    ({"addresses": ["192.0.2.5/24", "192.0.2.5/24"]}, "listed twice"),
    ({"addresses": ["192.0.2.%d/24" % i for i in range(17)]}, "at most 16"),
    ({"routes": [{"destination": "default"}]}, "default route needs a gateway"),
    ({"routes": [{"destination": "198.51.100.1/24", "gateway": "192.0.2.1"}]}, "neither 'default' nor a network"),
    ({"routes": [{"destination": "198.51.100.0/24", "gateway": "2001:db8::1"}]}, "another IP family"),
    ({"routes": [{"destination": "default", "gateway": "192.0.2.1", "metric": 5}]}, "metric"),
])
def test_nic_config_refuses_bad_network_values(bad, why):
    with pytest.raises(ValueError, match=why):
        decode({**NIC, **bad})


@pytest.mark.parametrize("name", ["a\rb", "a\x0bb", "a\x0cb", "n\u00e0"])
def test_an_interface_name_the_kernel_refuses_fails_the_claim_config(name):
    """dev_valid_name refuses every isspace() byte: \\v, \\f and \\r as well as blanks, and 0xA0 (in
    UTF-8 'à' is C3 A0). A name it refuses would pass prepare and fail every sandbox of the pod
    (EINVAL from the rename that the move is)."""
    from agent.prepare.netdevs import valid_name

    assert not valid_name(name)
