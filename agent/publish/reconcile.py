"""Desired pool vs. slices in the store, reconciled like the upstream ResourceSlice
controller (protocol reference §4.2): delete obsolete slices first (with UID and
resourceVersion preconditions), then update changed ones, then create missing ones.

Generation: current = highest generation in the store; slices below it are obsolete.
It stays when nothing is created and at most one slice changes; otherwise it becomes
max(current, last we published) + 1 and every kept slice is rewritten. So it never goes
backwards, neither across restarts (the store still holds newer slices) nor after a wipe.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from agent.publish import metrics
from agent.publish.dropped import Dropped
from agent.publish.listattrs import refusal
from agent.publish.slices import PoolContent, parse_index, render_slice, stored_pool
from agent.publish.store import Invalid, NotFound, SliceStore, StoreError
from agent.publish.validation import parse_quantity

log = logging.getLogger("sysdra.publish")
# seconds between dry runs offering a field the server dropped again (its gate may be on by now)
RECHECK_DROPPED = 600.0


@dataclass
class SyncStats:
    created: int = 0
    updated: int = 0
    deleted: int = 0
    generation: int = 0

    @property
    def writes(self) -> int:
        return self.created + self.updated + self.deleted


def _quantity(text):
    try:
        return ("quantity", parse_quantity(text))
    except (ValueError, TypeError):
        return text


def _policy(policy):
    """A capacity's requestPolicy by value: every leaf is a quantity the server may respell (1000 -> 1k)."""
    if isinstance(policy, dict):
        return {k: _policy(v) for k, v in policy.items() if v not in (None, [], {})}
    if isinstance(policy, list):
        return [_policy(v) for v in policy]
    return _quantity(policy)


def _canonical(value):
    """Compare as the API server stores: quantities by value, absent lists/maps as empty."""
    if isinstance(value, dict):
        if set(value) == {"value"} and isinstance(value["value"], str):
            return _quantity(value["value"])
        if isinstance(value.get("requestPolicy"), dict):  # a shared capacity: its value, its policy
            value = {**value, "value": _quantity(value.get("value")), "requestPolicy": _policy(value["requestPolicy"])}
        return {k: _canonical(v) for k, v in value.items() if v not in (None, [], {})}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


_SPEC_FIELDS = ("driver", "pool", "nodeName", "nodeSelector", "allNodes", "devices", "sharedCounters", "perDeviceNodeSelection",
                "skipNodeOperations", "partitionTypeAttribute")


def _owner_key(obj: dict) -> list[tuple]:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return [(r.get("kind"), r.get("name"), r.get("uid"), bool(r.get("controller"))) for r in refs]


def _as_sent(devices):
    """Devices without the taints' ``timeAdded``: the agent sends none for a new taint and the
    server stamps the time of the write on it, so a slice read back would always differ. An empty
    ``value`` is no value: the server does not keep it (``omitempty``)."""
    if not isinstance(devices, list):
        return devices
    return [{**d, "taints": [{k: v for k, v in t.items() if k != "timeAdded" and not (k == "value" and v == "")}
                             if isinstance(t, dict) else t for t in d["taints"]]}
            if isinstance(d, dict) and isinstance(d.get("taints"), list) else d for d in devices]  # fmt: skip


def _taint_key(device: dict, taint: dict) -> tuple:
    return device.get("name"), taint.get("key"), taint.get("value") or "", taint.get("effect")


def _field(spec: dict, name: str):
    """A spec field as the server keeps it: an empty list or map is no field (omitempty; an
    empty pool's ``devices: []`` reads back absent)."""
    value = spec.get(name)
    return None if value in ([], {}) else value


def same_slice(existing: dict, desired: dict) -> bool:
    a, b = existing.get("spec", {}), desired.get("spec", {})
    # plain equality first (what we wrote reads back equal); canonical form only if it differs
    if any(_field(a, f) != _field(b, f) and _canonical(a.get(f)) != _canonical(b.get(f)) for f in _SPEC_FIELDS if f != "devices"):
        return False
    devices, wanted = _field(a, "devices"), _field(b, "devices")
    if devices != wanted and _canonical(_as_sent(devices)) != _canonical(_as_sent(wanted)):
        return False
    return not _owner_key(desired) or _owner_key(existing) == _owner_key(desired)


def _taint_times(slices: list[dict]) -> dict[tuple, str]:
    """(device, key, value, effect) -> the ``timeAdded`` the server stamped on that taint (a
    file of the offline directory may hold anything there: only well-formed taints count)."""
    out = {}
    for s in slices:
        devices = s.get("spec", {}).get("devices")
        for d in devices if isinstance(devices, list) else ():
            taints = d.get("taints") if isinstance(d, dict) else None
            for t in taints if isinstance(taints, list) else ():
                key = _taint_key(d, t) if isinstance(t, dict) else ()
                if key and all(isinstance(k, str) for k in key) and isinstance(t.get("timeAdded"), str) and t["timeAdded"]:
                    out[key] = t["timeAdded"]
    return out


def _keep_taint_times(obj: dict, times: dict[tuple, str]) -> dict:
    """A rewrite carries each unchanged taint's ``timeAdded`` over: sent without one, the server
    stamps the time of this write, and every taint would look new (tolerationSeconds restart)."""
    devices = obj["spec"].get("devices")
    if not times or not devices:
        return obj
    def kept(d):
        taints = [{**t, "timeAdded": times[k]} if (k := _taint_key(d, t)) in times
                  else t for t in d["taints"]]  # fmt: skip
        return {**d, "taints": taints}
    obj["spec"]["devices"] = [kept(d) if d.get("taints") else d for d in devices]  # (the pool's own dicts untouched)
    return obj


def _generation(obj: dict) -> int:
    """The slice's pool generation; 0 for one that is no number (a damaged file: then obsolete)."""
    pool = obj.get("spec", {}).get("pool")
    generation = pool.get("generation") if isinstance(pool, dict) else None
    return generation if type(generation) is int and generation >= 0 else 0


def _match(existing: list[dict], count: int, current: int) -> tuple[dict[int, dict], list[dict]]:
    """The stored slices that stay, by their index in a pool of ``count`` slices, and the obsolete
    ones: of an older generation, not named as ours for that count, or a second at an index."""
    matched: dict[int, dict] = {}
    obsolete: list[dict] = []
    for s in existing:
        index = parse_index(s["metadata"]["name"], count)
        if _generation(s) < current or index is None or index in matched:
            obsolete.append(s)
        else:
            matched[index] = s
    return matched, obsolete


class Reconciler:
    """One pool of one driver on one node. ``sync`` is idempotent; a no-op sync writes nothing."""

    def __init__(self, store: SliceStore, *, node_name: str, driver_name: str):
        self.store = store
        self.node_name = node_name
        self.driver_name = driver_name
        self.generation_floor = 0  # highest generation we published in this process
        self.node_uid: str | None = None
        self._owner_logged = False
        self.dropped = Dropped()  # fields the server does not keep (a feature gate off): not compared
        self.clock = time.monotonic
        self._recheck_at = 0.0  # when the dropped fields are next offered again (a dry run)
        self._asked = False  # whether a dry run or a write told what the server keeps (_first_dry_run)

    def _ours(self, obj: dict, pool: PoolContent) -> bool:
        spec = obj.get("spec", {})
        pool_of = spec.get("pool")  # (a file of the offline directory may hold anything there)
        return (spec.get("driver") == self.driver_name and spec.get("nodeName") == self.node_name
                and isinstance(pool_of, dict) and pool_of.get("name") == pool.name)

    def _desired(self, pool: PoolContent, index: int, generation: int) -> dict:
        return render_slice(
            pool, index, driver_name=self.driver_name, node_name=self.node_name,
            generation=generation, node_uid=self.node_uid, full_name=self.store.full_names,
        )

    async def _resolve_owner(self, again: bool) -> None:
        """The Node's UID for the owner reference: read while unknown, and again when slices must be
        created: the garbage collector deleted them if the Node was re-created (a new UID), and slices
        owned by the old one would be deleted again and again."""
        lookup = getattr(self.store, "node_uid", None)
        if lookup is None or (self.node_uid and not again):
            return
        try:
            uid = await lookup()
        except StoreError as err:
            if isinstance(err, NotFound):
                self.node_uid = None  # owned by a Node that is gone, a slice would be collected at once
            if not self._owner_logged:
                log.warning("cannot read Node %s (%s): publishing slices without an owner reference", self.node_name, err)
                self._owner_logged = True
            return
        if self.node_uid and uid != self.node_uid:
            log.info("Node %s was re-created (UID %s, was %s): slices now owned by it", self.node_name, uid, self.node_uid)
        self.node_uid = uid

    @staticmethod
    async def _write(write, obj: dict) -> dict:
        """``write(obj)``; a 422 on the list attributes it carries raises ListAttributesRefused."""
        try:
            return await write(obj)
        except Invalid as err:
            refused = refusal(obj, err)
            if refused is None:
                raise
            raise refused from err

    async def sync(self, pool: PoolContent, placed=None) -> SyncStats:
        """Raises StoreError (Conflict included) on failure; the caller retries with backoff.
        ``placed(stored)`` (the publisher's first sync): the pool to publish, placed like the slices
        stored (``slices.stored_pool``), or None to publish ``pool``."""
        existing = sorted((s for s in await self.store.list_slices() if self._ours(s, pool)), key=lambda s: s["metadata"]["name"])
        if placed is not None:
            pool = placed(stored_pool(existing, pool.name)) or pool
        count = len(pool.slices)
        current = max((_generation(s) for s in existing), default=0)
        matched, obsolete = _match(existing, count, current)
        missing = [i for i in range(count) if i not in matched]
        await self._resolve_owner(again=bool(missing))
        await self._first_dry_run(pool, matched, current)
        await self._recheck_dropped(pool, matched, current)
        generation, to_update = self._next_generation(pool, matched, missing, current)
        stats = SyncStats(generation=generation)
        await self._delete(obsolete, stats)
        times = _taint_times(existing)
        await self._update(pool, {i: matched[i] for i in to_update}, generation, times, stats)
        await self._create(pool, missing, generation, times, stats)
        self.generation_floor = generation
        self._asked = self._asked or stats.created + stats.updated > 0  # (each write is learned from)
        metrics.POOL_GENERATION.set(generation)
        if stats.writes:
            log.info(
                "published pool %s generation %d: %d created, %d updated, %d deleted",
                pool.name, generation, stats.created, stats.updated, stats.deleted,
            )
        return stats

    async def _first_dry_run(self, pool: PoolContent, matched: dict[int, dict], current: int) -> None:
        """Before this process wrote a slice, the first stored one that differs from ours is sent in
        a dry run: what the server drops (a gate off) is learned before the pool is compared. Learned
        from the writes only, a restarted agent found every slice carrying such a field changed and
        rewrote the whole pool with a generation bump, at every restart (a rolling update)."""
        dry_run = getattr(self.store, "dry_run_update", None)
        if self._asked or dry_run is None:
            return
        for i, existing in matched.items():
            obj = self._desired(pool, i, current)
            if same_slice(existing, self.dropped.strip(obj)):
                continue
            self._asked, self._recheck_at = True, self.clock() + RECHECK_DROPPED  # (the recheck's dry run: later)
            await self._dry_run(dry_run, obj, existing)
            return

    async def _dry_run(self, dry_run, obj: dict, existing: dict) -> None:
        """``obj`` sent in place of ``existing`` with nothing written; what the server keeps learned."""
        old = existing["metadata"]
        obj["metadata"].pop("generateName", None)
        obj["metadata"].update(name=old["name"], uid=old.get("uid"), resourceVersion=old.get("resourceVersion"))
        try:
            self.dropped.learn(obj, await dry_run(obj))
        except StoreError as err:  # (learned from the writes then)
            log.debug("dry run of ResourceSlice %s: %s", old["name"], err)

    async def _recheck_dropped(self, pool: PoolContent, matched: dict[int, dict], current: int) -> None:
        """Now and then, a slice carrying a field the server dropped is sent again in a dry run: a gate
        turned on since (the server restarted with it) keeps it, and this sync then writes it. Compared
        without it, the pool never got it while the agent ran."""
        dry_run = getattr(self.store, "dry_run_update", None)
        if not self.dropped.paths or dry_run is None or self.clock() < self._recheck_at:
            return
        self._recheck_at = self.clock() + RECHECK_DROPPED
        for i, existing in matched.items():
            obj = self._desired(pool, i, current)
            if self.dropped.carried(obj):
                await self._dry_run(dry_run, obj, existing)  # (failed: offered again at the next recheck)
                return

    def _next_generation(self, pool: PoolContent, matched: dict[int, dict], missing: list[int],
                         current: int) -> tuple[int, list[int]]:
        """(the generation to publish, the slices to update): one changed slice is updated at the
        current generation; more changes, a slice missing or a floor above it bump the generation
        and every slice is written."""
        changed = [i for i, s in matched.items() if not same_slice(s, self.dropped.strip(self._desired(pool, i, current)))]
        base = max(current, self.generation_floor)
        if not missing and len(changed) <= 1 and base == current:
            return current, changed
        return base + 1, sorted(matched)

    async def _delete(self, obsolete: list[dict], stats: SyncStats) -> None:
        """The obsolete slices deleted; one someone else deleted first is counted as ours."""
        for s in obsolete:
            meta = s["metadata"]
            try:
                await self.store.delete(meta["name"], meta.get("uid", ""), meta.get("resourceVersion", ""))
            except NotFound:
                pass  # someone (the kubelet) was faster
            stats.deleted += 1
            metrics.SLICE_WRITES.labels("delete").inc()

    async def _update(self, pool: PoolContent, slices: dict[int, dict], generation: int, times: dict,
                      stats: SyncStats) -> None:
        """``slices``: index -> the slice in the store that becomes the pool's slice at that index."""
        for i, existing in slices.items():
            obj = _keep_taint_times(self._desired(pool, i, generation), times)
            old = existing["metadata"]
            obj["metadata"].pop("generateName", None)
            obj["metadata"].update(name=old["name"], uid=old.get("uid"), resourceVersion=old.get("resourceVersion"))
            self.dropped.learn(obj, await self._write(self.store.update, obj))
            stats.updated += 1
            metrics.SLICE_WRITES.labels("update").inc()

    async def _create(self, pool: PoolContent, missing: list[int], generation: int, times: dict, stats: SyncStats) -> None:
        for i in missing:  # (a device moved to a new slice keeps its taints' times too)
            obj = _keep_taint_times(self._desired(pool, i, generation), times)
            self.dropped.learn(obj, await self._write(self.store.create, obj))
            stats.created += 1
            metrics.SLICE_WRITES.labels("create").inc()

