"""Property: every state of the store between two writes of a sync is one the scheduler may see,
and none of them is a pool it takes for complete with the wrong devices. After each write the
pool is gathered as the allocator gathers it (GatherPools, k8s.io/dynamic-resource-allocation
v0.37.2: the slices of the highest generation; complete when there are resourceSliceCount of
them): a complete pool holds each device once, its counters resolve (tests/pool_checks.py), and
its devices are exactly those of the pool before the sync or of the pool after it."""

from __future__ import annotations

import json
import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.publish import Reconciler
from agent.publish.dirstore import DirStore
from agent.publish.slices import build_pool
from agent.publish.store import StoreError
from discovery.models import Inventory, Sriov
from tests import inventory_factory as factory
from tests.pool_checks import pool_problems
from tests.test_publisher import DRIVER, NODE, run

TAINT = [{"key": "sysdra.io/unhealthy", "value": "xid-79", "effect": "NoSchedule"}]
GPUS = [factory.device(i) for i in range(150)]
PFS = [factory.device(200 + p, "nic", sriov=Sriov(total_vfs=64, num_vfs=30)) for p in range(3)]
VFS = [factory.device(300 + 64 * p + f, "nic", physfn=factory.bdf(200 + p)) for p in range(3) for f in range(30)]
UNIVERSE = GPUS + PFS + VFS


def gathered(slices: list[dict]) -> tuple[bool, list[dict]]:
    """(complete, the slices of the highest generation), as the allocator gathers a pool."""
    if not slices:
        return False, []
    top = max(s["spec"]["pool"]["generation"] for s in slices)
    current = [s for s in slices if s["spec"]["pool"]["generation"] == top]
    return len(current) == current[0]["spec"]["pool"]["resourceSliceCount"], current


def devices(slices) -> list[str]:
    """The pool's devices, each as its whole entry (attributes, taints, counters consumed)."""
    return sorted(json.dumps(d, sort_keys=True) for s in slices for d in (s.get("spec", s).get("devices") or ()))


class Checked:
    """The store, and after each write the pool as the scheduler would gather it."""

    def __init__(self, store: DirStore):
        self.store, self.full_names = store, store.full_names
        self.allowed: list[list[str] | None] = []
        self.fail_in: int | None = None  # the write (counted down) that fails, as a request the server never saw

    def check(self) -> None:
        complete, current = gathered(self.store._list())
        if complete:
            problems = pool_problems(current)
            assert not problems, problems
            assert devices(current) in self.allowed, "a complete pool that is neither the old one nor the new one"

    async def list_slices(self):
        return await self.store.list_slices()

    def _fault(self) -> None:
        if self.fail_in is not None:
            self.fail_in -= 1
            if self.fail_in < 0:
                self.fail_in = None
                raise StoreError("injected: the connection was reset")

    async def create(self, obj):
        self._fault()
        out = await self.store.create(obj)
        self.check()
        return out

    async def update(self, obj):
        self._fault()
        out = await self.store.update(obj)
        self.check()
        return out

    async def delete(self, name, uid, rv):
        self._fault()
        await self.store.delete(name, uid, rv)
        self.check()


@st.composite
def node_states(draw) -> list[tuple[Inventory, dict]]:
    """A node at its start (most of the universe present, some devices tainted), then a few
    changes, each a handful of devices coming or going and of taints raised or cleared."""
    rnd = draw(st.randoms(use_true_random=False))
    present = set(rnd.sample(range(len(UNIVERSE)), draw(st.integers(100, len(UNIVERSE)))))
    tainted = set(rnd.sample(sorted(present), draw(st.integers(0, 40))))
    states = []
    for step in range(draw(st.integers(2, 5))):
        if step:
            present ^= set(rnd.sample(range(len(UNIVERSE)), draw(st.integers(1, 12))))
            tainted ^= set(rnd.sample(sorted(present), min(len(present), draw(st.integers(0, 12)))))
        devices = tuple(UNIVERSE[i] for i in sorted(present, key=lambda i: UNIVERSE[i].name))
        states.append((Inventory(root="/", devices=devices), {UNIVERSE[i].name: TAINT for i in tainted & present}))
    return states


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(states=node_states(), exclusive=st.booleans(), faults=st.lists(st.tuples(st.none() | st.integers(0, 6), st.booleans()),
                                                                      min_size=5, max_size=5))
def test_no_write_of_a_sync_shows_a_complete_pool_that_is_neither_old_nor_new(tmp_path_factory, states, exclusive, faults):
    """Also when a write of the sync fails (the publisher syncs again) and when someone else
    deleted one of the slices before it."""
    store = Checked(DirStore(str(tmp_path_factory.mktemp("cluster")), node_name=NODE, driver_name=DRIVER))
    reconciler = Reconciler(store, node_name=NODE, driver_name=DRIVER)

    async def scenario():
        pool, cache = None, {}
        for (inv, taints), (fail_in, someone_deletes) in zip(states, faults):
            new = build_pool(inv, node_name=NODE, driver_name=DRIVER, pf_vf_exclusive=exclusive, taints=taints,
                             previous=pool, cache=cache)
            store.allowed = [devices(pool.slices) if pool else None, devices(new.slices)]
            if someone_deletes and (ours := store.store._list()):
                os.unlink(store.store.path(ours[(fail_in or 0) % len(ours)]["metadata"]["name"]))
            store.fail_in = fail_in
            try:
                await reconciler.sync(new)
            except StoreError:
                await reconciler.sync(new)  # the publisher's retry
            complete, current = gathered(store.store._list())
            assert complete and devices(current) == devices(new.slices)
            pool = new

    run(scenario())
