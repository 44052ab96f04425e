"""The inventory records (discovery/models.py): frozen, no pydantic on the scan path, and
strict checks on attribute values from outside (``AttributeValue.from_api``)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from discovery import models
from discovery.inventory import scan
from discovery.models import AttributeValue, Device, Inventory
from tests.conftest import FIXTURES, REPO, profile_root

RECORDS = {obj for obj in vars(models).values()
           if isinstance(obj, type) and obj.__module__ == models.__name__ and obj is not models.Record}


def _records(obj, out: dict) -> None:
    """Every record reachable from ``obj``, one example per type."""
    if dataclasses.is_dataclass(obj):
        out.setdefault(type(obj), obj)
        for name in _field_names(obj):
            _records(getattr(obj, name), out)
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            _records(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            _records(item, out)


def _field_names(obj) -> list[str]:
    return [f.name for f in dataclasses.fields(obj)]


def test_every_record_is_frozen():
    found: dict = {}
    for name in sorted(os.listdir(FIXTURES)):
        _records(scan(profile_root(name), list_attributes=True), found)
    _records(models.Problem(what="numa_node", reason="unreadable"), found)  # no fixture has one
    from tests.simnvml import SimGpu, open_sim
    from tests.simnvml_mig import SimMigNvml

    h200 = profile_root("h200-vm")  # MIG profiles come from NVML only (a simulated one here)
    _records(scan(h200, nvml=open_sim(h200, SimMigNvml([SimGpu(mig_capable=True)]))), found)
    assert set(found) == RECORDS, f"no fixture has {RECORDS - set(found)}"
    for cls, obj in found.items():
        first = _field_names(obj)[0]
        with pytest.raises(AttributeError):  # dataclasses' FrozenInstanceError is one too
            setattr(obj, first, getattr(obj, first))
        with pytest.raises(AttributeError):
            delattr(obj, first)


def _fresh_python(code: str) -> subprocess.CompletedProcess:
    """``code`` in a new interpreter (nothing imported yet); it prints to stdout, and the
    pydantic modules it ended up with go to stderr's last line."""
    tail = "\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'pydantic'), file=sys.stderr)\n"
    out = subprocess.run([sys.executable, "-c", "import sys\n" + code + tail], cwd=REPO, capture_output=True,
                         text=True, timeout=120, env={k: v for k, v in os.environ.items() if not k.startswith("SYSDRA_")})
    assert out.returncode == 0, out.stderr
    return out


def test_a_scan_imports_no_pydantic():
    root = profile_root("server-2s-gpu-nic")
    out = _fresh_python(f"from discovery.inventory import IncrementalScanner, scan\n"
                        f"print(len(scan({root!r}).to_json()['devices']))\n"
                        f"IncrementalScanner({root!r}).full()")
    assert int(out.stdout) > 0
    assert out.stderr.splitlines()[-1] == "[]"


@pytest.mark.parametrize("output", ["json", "table"])
def test_sysdra_scan_imports_no_pydantic(output):
    root = profile_root("server-2s-gpu-nic")
    out = _fresh_python(f"from agent.cli.main import main\n"
                        f"rc = main(['scan', '--root', {root!r}, '-o', {output!r}])\n"
                        f"sys.stdout.flush()\nassert rc == 0, rc")
    if output == "json":
        assert json.loads(out.stdout)["devices"]
    else:
        assert "gpu-" in out.stdout
    assert out.stderr.splitlines()[-1] == "[]"


GOOD = [{"int": 3}, {"int": -(2**63)}, {"bool": False}, {"string": ""}, {"string": "x"}, {"version": "1.2.3"},
        {"ints": [1, 2]}, {"bools": [True]}, {"strings": ["a", "b"]}, {"versions": ["1.0.0"]}]


@pytest.mark.parametrize("data", GOOD, ids=lambda d: next(iter(d)))
def test_from_api_takes_what_to_api_gives(data):
    value = AttributeValue.from_api(data)
    assert value.to_api() == data
    assert AttributeValue.from_api({**data, "version" if "version" not in data else "int": None}) == value  # null: unset


BAD = {
    "not an object": ([("int", 1)], "must be an object"),
    "no field": ({}, "exactly one value field"),
    "only nulls": ({"int": None}, "exactly one value field"),
    "two fields": ({"int": 1, "string": "x"}, "exactly one value field"),
    "unknown field": ({"float": 1.5}, "unknown attribute value field"),
    "python name": ({"int_": 1}, "unknown attribute value field"),
    "bool is not int": ({"int": True}, "int: expected int, got bool"),
    "int is not bool": ({"bool": 1}, "bool: expected bool, got int"),
    "float is not int": ({"int": 1.0}, "expected int, got float"),
    "bytes are not str": ({"string": b"x"}, "string: expected str, got bytes"),
    "number is not str": ({"version": 1}, "expected str, got int"),
    "scalar for a list": ({"ints": 1}, "ints: expected a list"),
    "str for a list": ({"strings": "abc"}, "strings: expected a list, got str"),
    "empty list": ({"strings": []}, "must not be empty"),
    "bool in ints": ({"ints": [1, True]}, "ints[1]: expected int, got bool"),
    "null in a list": ({"strings": ["a", None]}, "strings[1]: expected str, got NoneType"),
    "int in bools": ({"bools": [True, 0]}, "bools[1]: expected bool, got int"),
    "bytes in strings": ({"strings": ["a", b"b"]}, "strings[1]: expected str, got bytes"),
}


@pytest.mark.parametrize("data,message", BAD.values(), ids=BAD.keys())
def test_from_api_refuses_what_the_api_would_not_send(data, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        AttributeValue.from_api(data)


def test_from_api_lists_become_tuples():
    value = AttributeValue.from_api({"ints": [1, 2]})
    assert value.ints == (1, 2) and value.field == "ints"
    assert value == AttributeValue(ints=(1, 2)) and hash(value) == hash(AttributeValue(ints=(1, 2)))


def test_the_constructor_keeps_the_one_field_contract():
    assert AttributeValue(int_=1) == AttributeValue.from_api({"int": 1})
    assert AttributeValue(bool_=True).to_api() == {"bool": True}
    assert AttributeValue(int_=1) != AttributeValue(bool_=True)
    for kw, error in [({}, ValueError), ({"int_": 1, "string": "x"}, ValueError), ({"ints": ()}, ValueError),
                      ({"int": 1}, TypeError), ({"float": 1.0}, TypeError)]:  # fmt: skip
        with pytest.raises(error):
            AttributeValue(**kw)


def test_an_encoding_is_the_callers_to_change():
    value = AttributeValue(strings=("a",))
    assert value.strings == ("a",) and value.ints is None and value.field == "strings" and value.value == ("a",)
    encoded = value.to_api()
    encoded["strings"].append("b")
    assert value.to_api() == {"strings": ["a"]} and value == AttributeValue(strings=("a",))


def test_by_name_is_built_once_per_inventory():
    inv = scan(profile_root("server-2s-gpu-nic"))
    assert inv.by_name() is inv.by_name() and set(inv.by_name()) == {d.name for d in inv.devices}
    fewer = inv.replace(devices=inv.devices[:1])
    assert list(fewer.by_name()) == [inv.devices[0].name]
    assert fewer != inv and inv.replace() == inv


def test_records_take_keywords_only_and_no_unknown_ones():
    inv = scan(profile_root("server-2s-gpu-nic"))
    dev = inv.devices[0]
    with pytest.raises(TypeError):
        Device(dev.name, dev.kind, dev.pci)
    with pytest.raises(TypeError):
        Inventory(root="/", device=())


def test_device_entries_share_their_values_encodings():
    """Discovery shares equal values; a device's API entry holds each value's one encoding (a
    large node's pool: ~6,000 encodings for ~37,000 attribute entries), equal to a fresh one."""
    inv = scan(profile_root("server-2s-gpu-nic"))
    vendor = {}
    for dev in inv.devices:
        attrs = dev.to_api().get("attributes", {})
        assert attrs == {k: v.to_api() for k, v in dev.attributes.items()}
        assert all(attrs[k] is v.encoded for k, v in dev.attributes.items())
        vendor.setdefault(dev.attributes["vendorID"].value, set()).add(id(attrs["vendorID"]))
    assert len(inv.devices) > len(vendor) and all(len(ids) == 1 for ids in vendor.values())
