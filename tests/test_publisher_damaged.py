"""The offline publisher's own slice files read back damaged (agent/publish/dirstore.py): a
damaged file is that file's problem, repaired by the next syncs (as the publisher retries them),
never an exception other than the store's errors, never the node's slices stuck."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from agent.publish import Reconciler
from agent.publish.dirstore import DirStore
from agent.publish.store import StoreError
from tests.test_publisher import DRIVER, NODE, dir_slices, pool_of, run
from tests.test_records_damaged import damaged


async def _sync_until_done(rec: Reconciler, pool, tries: int = 3) -> None:
    """As the publisher does: a store error is retried (a conflict after a fresh listing)."""
    for _ in range(tries - 1):
        try:
            await rec.sync(pool)
            return
        except StoreError:
            continue
    await rec.sync(pool)


@pytest.mark.parametrize("damage", [
    lambda text: "z" + text[1:],  # does not parse: ignored by listings, the create conflicted for ever
    lambda text: text.replace('"driver":"sysdra.io"', '"driver":"rysdra.io"'),  # names another driver
    lambda text: text.replace('"name":"node-a"', '"name":"oode-a"'),  # another pool: the reconciler's not
    lambda text: text.replace('"metadata"', '"letadata"'),  # no metadata: the update raised KeyError
    lambda text: text.replace('"resourceVersion":"1"', '"resourceVersion":"q"'),  # the update raised ValueError
    lambda text: text.replace('"resourceVersion":"1"', '"resourceVersion":["1"]'),  # the update raised TypeError
])
def test_a_damaged_slice_file_is_replaced_and_kept_aside(tmp_path, damage):
    d = tmp_path / "resourceslices"

    async def scenario():
        await Reconciler(DirStore(str(tmp_path), node_name=NODE, driver_name=DRIVER), node_name=NODE,
                         driver_name=DRIVER).sync(pool_of(3))
        (path,) = d.glob("*.json")
        path.write_text(damage(path.read_text()))
        restarted = Reconciler(DirStore(str(tmp_path), node_name=NODE, driver_name=DRIVER), node_name=NODE, driver_name=DRIVER)
        await _sync_until_done(restarted, pool_of(4))
        return path.name

    name = run(scenario())
    (obj,) = dir_slices(tmp_path)
    assert len(obj["spec"]["devices"]) == 4 and obj["metadata"]["name"] + ".json" == name
    assert set(os.listdir(d)) <= {name} | {n for n in os.listdir(d) if n.startswith(name + ".damaged-")}


def test_a_foreign_file_nested_too_deep_is_left_alone(tmp_path):
    """Its RecursionError made every listing raise: the node's slices were never published."""
    d = tmp_path / "resourceslices"
    d.mkdir()
    (d / "deep.json").write_text("[" * 100000)

    async def scenario():
        return await Reconciler(DirStore(str(tmp_path), node_name=NODE, driver_name=DRIVER), node_name=NODE,
                                driver_name=DRIVER).sync(pool_of(3))

    assert run(scenario()).created == 1
    assert (d / "deep.json").read_text() == "[" * 100000


@settings(max_examples=150, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_damage_to_our_slice_file_is_repaired_by_the_next_syncs(tmp_path, data):
    d = tmp_path / "resourceslices"
    for p in d.glob("*") if d.exists() else ():
        p.unlink()

    async def scenario():
        store = DirStore(str(tmp_path), node_name=NODE, driver_name=DRIVER)
        await Reconciler(store, node_name=NODE, driver_name=DRIVER).sync(pool_of(3))
        (path,) = d.glob("*.json")
        path.write_bytes(data.draw(damaged(path.read_bytes())))
        restarted = Reconciler(DirStore(str(tmp_path), node_name=NODE, driver_name=DRIVER), node_name=NODE, driver_name=DRIVER)
        await _sync_until_done(restarted, pool_of(4))

    run(scenario())
    ours = [s for s in dir_slices_lenient(tmp_path) if s.get("spec", {}).get("driver") == DRIVER
            and s["spec"].get("nodeName") == NODE and len(s["spec"].get("devices") or []) == 4]
    assert len(ours) == 1, os.listdir(d)


def dir_slices_lenient(tmp_path) -> list[dict]:
    out = []
    for p in sorted((tmp_path / "resourceslices").glob("*.json")):
        try:
            obj = json.loads(p.read_bytes())
        except ValueError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get("spec"), dict):
            out.append(obj)
    return out


TAINT = {"gpu-0000-00-00-0": [{"key": "sysdra.io/unhealthy", "value": "xid-79", "effect": "NoSchedule",
                               "timeAdded": "2026-01-01T00:00:00Z"}]}


@pytest.mark.parametrize("damage", [
    lambda text: text.replace('"generation":1', '"generation":"x"'),  # every sync raised ValueError
    lambda text: text.replace('"generation":1', '"generation":[1]'),  # ... TypeError
    lambda text: text.replace('"taints":[{', '"taints":[5,{'),  # AttributeError
    lambda text: text.replace('"taints":[{', '"taints":5,"x":[{'),  # TypeError
    lambda text: text.replace('"value":"xid-79"', '"value":["xid-79"]'),  # unhashable
    lambda text: text.replace('"timeAdded":"2026-01-01T00:00:00Z"', '"timeAdded":["2026"]'),  # written on as it was
])
def test_a_damaged_generation_or_taint_in_our_slice_file_is_repaired(tmp_path, damage):
    d = tmp_path / "resourceslices"

    async def scenario():
        pool = pool_of(3, taints=TAINT)
        await Reconciler(DirStore(str(tmp_path), node_name=NODE, driver_name=DRIVER), node_name=NODE,
                         driver_name=DRIVER).sync(pool)
        (path,) = d.glob("*.json")
        text = path.read_text()
        assert damage(text) != text
        path.write_text(damage(text))
        restarted = Reconciler(DirStore(str(tmp_path), node_name=NODE, driver_name=DRIVER), node_name=NODE, driver_name=DRIVER)
        await _sync_until_done(restarted, pool_of(4, taints=TAINT))

    run(scenario())
    (obj,) = dir_slices(tmp_path)
    assert len(obj["spec"]["devices"]) == 4
    (taint,) = obj["spec"]["devices"][0]["taints"]
    assert isinstance(taint["timeAdded"], str) and taint["value"] == "xid-79"


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=6),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=6)


def _paths(obj, at=()):
    yield at
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield from _paths(v, at + (k,))


@settings(max_examples=150, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_value_of_our_slice_file_swapped_for_other_json_is_repaired(tmp_path, data):
    d = tmp_path / "resourceslices"
    for p in d.glob("*") if d.exists() else ():
        p.unlink()

    async def scenario():
        await Reconciler(DirStore(str(tmp_path), node_name=NODE, driver_name=DRIVER), node_name=NODE,
                         driver_name=DRIVER).sync(pool_of(3, taints=TAINT))
        (path,) = d.glob("*.json")
        obj = json.loads(path.read_text())
        at = data.draw(st.sampled_from(list(_paths(obj))[1:]))
        holder = obj
        for k in at[:-1]:
            holder = holder[k]
        holder[at[-1]] = data.draw(JSON)
        path.write_text(json.dumps(obj))
        restarted = Reconciler(DirStore(str(tmp_path), node_name=NODE, driver_name=DRIVER), node_name=NODE, driver_name=DRIVER)
        await _sync_until_done(restarted, pool_of(4, taints=TAINT))

    run(scenario())
    ours = [s for s in dir_slices_lenient(tmp_path) if s["spec"].get("driver") == DRIVER
            and s["spec"].get("nodeName") == NODE and len(s["spec"].get("devices") or []) == 4]
    assert len(ours) == 1, os.listdir(d)
