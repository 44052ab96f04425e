"""The config file is untrusted: damaged in any way, ``sysdra run`` stops with exit 78 and one
clear line naming the file (never a traceback), and SIGHUP keeps the running configuration."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings

from agent.cli import main as cli
from agent.settings import EX_CONFIG, ConfigError, Settings, build_settings
from tests import damage

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the chart's own file (deploy/configmap.yaml's config.yaml), as the DaemonSet mounts it
VALID = b"""driverName: sysdra.io
claimStatus: true
deviceAttributes: []
healthInterval: 10
logLevel: info
nicIpam: {}
nvidiaMig: dynamic
resyncInterval: 300
share: [gpu]
skipNodeOperations: {}
taintEffects: {}
taintHold: 60
"""


def _load(tmp_path, data: bytes) -> Settings:
    path = tmp_path / "config.yaml"
    path.write_bytes(data)
    return build_settings({}, config_file=str(path), environ={})


@pytest.mark.parametrize("data,why", [
    (b"logLevel: \xff\xfedebug\n", "not UTF-8 text (byte 10)"),
    (b"deviceAttributes: " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested too deep"),
    (b"skipNodeOperations: " + b"{a: " * 3000 + b"1" + b"}" * 3000 + b"\n", "nested too deep"),
    (b"resyncInterval: " + b"9" * 5000 + b"\n", "a number of more digits than Python converts"),
    (b"debounce: 1\nlogLevel: info\ndebounce: 2\n", "key 'debounce' given twice"),
])
def test_a_damaged_file_is_a_config_error_naming_it(tmp_path, data, why):
    with pytest.raises(ConfigError, match="config file .*config.yaml: ") as err:
        _load(tmp_path, data)
    assert why in str(err.value)


@pytest.mark.parametrize("value", [".nan", ".NaN"])
def test_nan_seconds_are_a_bad_value(tmp_path, value):
    """A YAML .nan is a float but no number of seconds (every comparison with it is false: it
    passed the check for a negative one)."""
    for name in ("resyncInterval", "debounce", "taintHold"):
        with pytest.raises(ConfigError, match="must not be negative or NaN"):
            _load(tmp_path, f"{name}: {value}\n".encode())


def test_sysdra_run_exits_78_with_one_line(tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_bytes(VALID + b"logFormat: \xc3\x28\n")
    assert cli.main(["run", "--config", str(path)]) == EX_CONFIG
    err = capsys.readouterr().err
    assert err.startswith(f"sysdra: config file {path}: not UTF-8 text") and err.count("\n") == 1


def test_a_yaml_setting_from_the_environment_nested_too_deep_is_named():
    nested = "{a: " * 3000 + "1" + "}" * 3000
    with pytest.raises(ConfigError, match="invalid setting skip-node-operations: not a YAML mapping: nested too deep"):
        build_settings({}, config_file=os.devnull, environ={"SYSDRA_SKIP_NODE_OPERATIONS": nested})


NASTY = [b"\x00", b"\xff", b"\xc3", b"[" * 400, b"{" * 400, b"9" * 4400, b"\n" + VALID[:20], b": :", b"&a *a",
         b"!!binary x", b"!!python/object:os.system", b"\t", b".nan", b"\xef\xbb\xbf", b"? [a]\n: 1\n"]


def damaged():
    return damage.damaged(VALID, NASTY, ("flip", "cut", "insert", "repeat"))


@settings(max_examples=200, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=damaged())
def test_any_damage_to_a_valid_file_is_settings_or_a_config_error(tmp_path, data):
    try:
        _load(tmp_path, data)
    except ConfigError as err:
        assert str(err) and "Traceback" not in str(err)
