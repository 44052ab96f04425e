"""Settings (agent/settings.py): text from flags and SYSDRA_* converted to each field's type,
every constructor checked, and a bad value named in the error (exit 78 in the CLI)."""

from __future__ import annotations

import os

import pytest

from agent.settings import ConfigError, Settings, build_settings


def _build(**values) -> Settings:
    return build_settings(values, config_file=os.devnull, environ={})


@pytest.mark.parametrize("word,value", [("true", True), ("Yes", True), ("ON", True), ("1", True),
                                        ("false", False), ("no", False), ("Off", False), ("0", False)])
def test_boolean_words(word, value):
    assert _build(device_metadata=word).device_metadata is value
    assert build_settings({}, os.devnull, environ={"SYSDRA_CLAIM_STATUS": word}).claim_status is value


def test_text_becomes_the_fields_type():
    s = _build(debounce="0.5", resync_interval="0", share="gpu, nic", kubelet_dir="rel/kubelet",
               cluster="dir:rel/cluster", log_level="debug")
    assert (s.debounce, s.resync_interval, s.share, s.log_level) == (0.5, 0.0, ("gpu", "nic"), "debug")
    assert s.kubelet_dir == os.path.abspath("rel/kubelet") and s.cluster == "dir:" + os.path.abspath("rel/cluster")
    assert _build(debounce=1).debounce == 1.0  # a YAML integer for a float setting


@pytest.mark.parametrize("values,message", [
    ({"debounce": "soon"}, "invalid setting debounce: expected float, got str 'soon'"),
    ({"claim_status": "maybe"}, "invalid setting claim-status: expected bool, got str 'maybe'"),
    ({"log_level": "loud"}, "invalid setting log-level: invalid enum value 'loud'"),
    ({"share": "gpu,tpu"}, "invalid setting share: invalid enum value 'tpu'"),
    ({"share": "gpu,gpu"}, "invalid setting share: names a kind twice"),
    ({"health_interval": "30"}, "invalid setting health-interval: must be in (0, 10] seconds"),
    ({"rolling_update_uid": 12}, "invalid setting rolling-update-uid: expected str | null, got int"),
    ({"share_policies": []}, "invalid setting share-policies: expected object, got array"),
    ({"no_such": 1}, "invalid setting no-such: no such setting"),
    ({"skip_node_operations": "{a: [b"}, "invalid setting skip-node-operations: not a YAML mapping"),
    ({"driver_name": "3d.example.com"}, "invalid setting driver-name: '3d.example.com' starts with a digit"),
])
def test_a_bad_value_is_named(values, message):
    with pytest.raises(ConfigError) as err:
        Settings.of(values)
    assert str(err.value).startswith(message)


def test_every_constructor_checks():
    s = Settings(node_name="node-a")
    with pytest.raises(ValueError, match="debounce: must not be negative"):
        Settings(node_name="node-a", debounce=-1.0)
    with pytest.raises(ValueError, match="node-name: must be a lower-case DNS subdomain"):
        s.replace(node_name="Node_A")
    moved = s.replace(kubelet_dir="rel")
    assert moved.kubelet_dir == os.path.abspath("rel") and s.kubelet_dir == "/var/lib/kubelet"
    with pytest.raises(AttributeError):
        s.debounce = 1.0  # frozen


def test_a_digit_driver_name_is_refused_only_where_it_is_a_cdi_vendor():
    """Device metadata specs are of kind ``<driver>/metadata``: a CDI vendor starting with a digit
    is rejected by runtimes. Claim specs use ``k8s.<driver>``, so without metadata it serves."""
    assert Settings(node_name="node-a", driver_name="3d.example.com", device_metadata=False).driver_name == "3d.example.com"
    with pytest.raises(ConfigError, match="device-metadata: false"):
        _build(node_name="node-a", driver_name="3d.example.com")


@pytest.mark.parametrize("address", ["9478", ":9478", "localhost:http", "127.0.0.1:70000"])
def test_a_bad_metrics_address_is_a_bad_setting(address):
    """docs/operations.md: metrics_address is HOST:PORT ("" disables), and an invalid value stops the
    agent with exit 78 naming it; not a running agent that serves no metrics and says so in a warning."""
    with pytest.raises(ConfigError, match="invalid setting metrics-address: "):
        _build(node_name="node-a", metrics_address=address)


def test_good_metrics_addresses():
    for address in ("", "127.0.0.1:9478", "0.0.0.0:0", "[::1]:9478", "fd00::5:9478"):  # the last: the chart's $(POD_IP):PORT
        assert _build(node_name="node-a", metrics_address=address).metrics_address == address


def test_the_default_node_name_is_the_kubelets(monkeypatch):
    """docs/operations.md: node_name defaults to $NODE_NAME or the host name and "must equal the
    kubelet's node name"; the kubelet's default is the host name trimmed and lower-cased
    (k8s.io/component-helpers/node/util GetHostname), so a host named GPU-Node-01 is node gpu-node-01."""
    import socket

    monkeypatch.delenv("NODE_NAME", raising=False)
    monkeypatch.setattr(socket, "gethostname", lambda: "GPU-Node-01")
    assert build_settings({}, os.devnull, environ={}).node_name == "gpu-node-01"
    monkeypatch.setenv("NODE_NAME", "worker-1")  # the DaemonSet's spec.nodeName, as it is
    assert build_settings({}, os.devnull, environ={}).node_name == "worker-1"


def test_a_setting_given_twice_in_the_config_file_is_refused(tmp_path):
    """Two spellings of one setting (the chart's camelCase and an operator's snake_case): which
    was meant cannot be told, so neither wins unseen."""
    path = tmp_path / "config.yaml"
    path.write_text("log_level: debug\nlogLevel: info\n")
    with pytest.raises(ConfigError, match="log_level given twice"):
        build_settings({}, config_file=str(path), environ={})
    path.write_text("log_level: debug\nresyncInterval: 60\n")
    s = build_settings({}, config_file=str(path), environ={})
    assert (s.log_level, s.resync_interval) == ("debug", 60)
