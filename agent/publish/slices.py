"""Inventory -> ResourceSlice objects (resource.k8s.io/v1). Pure: no I/O, no clock.

One pool per node, named after the node. The pool's content (which device goes into
which slice) is built here; names, generation and resourceSliceCount are applied by
``render`` so the publisher can pick the generation (§4.2 of the protocol reference).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from itertools import chain

from agent.apilimits import MAX_COUNTER_SETS, MAX_DEVICES, MAX_DEVICES_ADVANCED
from agent.publish import partitions as gpu_partitions
from agent.publish import partitiontype
from agent.publish.sharing import SharePlan, share_plan, shared_entry
from agent.publish.nodeops import grouped_slices
from agent.publish.validation import device_problems, fitted
from discovery.gpuways import instances_beside, whole_unusable

API_VERSION = "resource.k8s.io/v1"
KIND = "ResourceSlice"
_SCALAR_FIELDS = frozenset(("string", "int", "bool", "version"))  # any other value field is a list
# generateName: the apiserver keeps 58 characters of the prefix and appends 5 random ones
MAX_GENERATE_PREFIX = 58
_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
# Driver-local attribute added to a VF when discovery gives no attribute holding its PF's BDF
PF_ATTRIBUTE = "pfPciAddress"  # same name discovery uses (docs/attributes.md)
PF_COUNTER = "functions"


@dataclass(frozen=True)
class PoolContent:
    """The desired pool before naming: each entry is one slice's ``devices`` or ``sharedCounters``."""

    name: str
    slices: tuple[dict, ...]
    rejected: tuple[tuple[str, str], ...] = field(default=())  # (device name, reason)


def is_advanced(device: dict) -> bool:
    if device.get("taints") or device.get("consumesCounters"):
        return True
    # each attribute value is a one-field dict ({"string": ...}): its fields, chained, all scalar?
    return not _SCALAR_FIELDS.issuperset(chain.from_iterable((device.get("attributes") or {}).values()))


def _limit(advanced: bool) -> int:
    return MAX_DEVICES_ADVANCED if advanced else MAX_DEVICES


def chunk_devices(devices: list[dict], previous: list[list[dict]] | None = None) -> list[list[dict]]:
    """Greedy split keeping order: 128 per slice, 64 once the slice holds an advanced device.

    ``previous`` (the device lists of the slices published before): sticky placement. A
    device stays in the slice it was in while that slice stays within its limit; new
    devices go to the first slice with room, else to a new slice at the end. So adding,
    removing or changing one device changes one slice, not every later one (a change in
    more than one slice makes the publisher bump the pool generation and rewrite all).
    When holes make the pool much larger than a fresh split, it is split afresh."""
    greedy = _greedy(devices)
    if not previous:
        return greedy
    order = {d["name"]: i for i, d in enumerate(devices)}
    buckets, advanced, new = _keep_places(devices, previous)
    _place_new(sorted(new, key=lambda d: order[d["name"]]), buckets, advanced)
    while len(buckets) > 1 and not buckets[-1]:
        buckets.pop()
    if len(buckets) > max(2 * len(greedy), len(greedy) + 2):
        return greedy  # too fragmented: compact (one generation bump)
    for bucket in buckets:
        bucket.sort(key=lambda d: order[d["name"]])
    return buckets


def _keep_places(devices: list[dict], previous: list[list[dict]]) -> tuple[list[list[dict]], list[bool], list[dict]]:
    """Each device that was published back in its slice while that slice has room: (the slices,
    whether each is an advanced one, the devices left to place: new ones and those moved out)."""
    where = {d["name"]: i for i, chunk in enumerate(previous) for d in chunk}
    buckets: list[list[dict]] = [[] for _ in previous]
    advanced = [False] * len(previous)
    new: list[dict] = []
    for device in devices:
        i = where.get(device["name"])
        if i is None:
            new.append(device)
            continue
        adv = advanced[i] or is_advanced(device)
        if len(buckets[i]) + 1 > _limit(adv):
            new.append(device)  # its slice became an advanced one and is full: it moves
            continue
        buckets[i].append(device)
        advanced[i] = adv
    return buckets, advanced, new


def _place_new(new: list[dict], buckets: list[list[dict]], advanced: list[bool]) -> None:
    """Each device in ``new`` into the first slice with room, else a new slice at the end."""
    for device in new:
        adv_dev = is_advanced(device)
        for i, bucket in enumerate(buckets):
            adv = advanced[i] or adv_dev
            if len(bucket) + 1 <= _limit(adv):
                bucket.append(device)
                advanced[i] = adv
                break
        else:
            buckets.append([device])
            advanced.append(adv_dev)


def _greedy(devices: list[dict]) -> list[list[dict]]:
    chunks: list[list[dict]] = []
    current: list[dict] = []
    advanced = False
    for device in devices:
        adv = advanced or is_advanced(device)
        if current and len(current) + 1 > _limit(adv):
            chunks.append(current)
            current, adv = [], is_advanced(device)
        current.append(device)
        advanced = adv
    if current or not chunks:
        chunks.append(current)  # an empty pool still gets one (empty) slice
    return chunks


def _with_pf_attribute(entry: dict, pf_bdf: str) -> dict:
    attributes = entry.get("attributes") or {}
    pf_value = {"string": pf_bdf}
    # discovery's own name is one lookup; any other name holding the PF's address, a scan in C
    if attributes.get(PF_ATTRIBUTE) == pf_value or pf_value in attributes.values():
        return entry
    attributes = dict(attributes, **{PF_ATTRIBUTE: pf_value})
    return dict(entry, attributes=dict(sorted(attributes.items())))


def counter_set_name(pf_bdf: str) -> str:
    return "pf-" + pf_bdf.replace(":", "-").replace(".", "-")


def _pf_vf_counters(entries: list[dict], pf_of: dict[str, str | None], bdf_of: dict[str, str]) -> tuple[list[dict], list[dict]]:
    """Shared counter per PF: the PF consumes all of it, each VF one unit, so a PF and any
    of its VFs never fit together while VFs still combine freely."""
    present = {bdf_of[e["name"]]: e["name"] for e in entries}
    vfs_by_pf: dict[str, int] = {}
    for e in entries:
        pf = pf_of.get(e["name"])
        if pf in present:
            vfs_by_pf[pf] = vfs_by_pf.get(pf, 0) + 1
    counter_sets = [
        {"name": counter_set_name(pf), "counters": {PF_COUNTER: {"value": str(n)}}} for pf, n in sorted(vfs_by_pf.items())
    ]
    out = []
    for e in entries:
        bdf, pf = bdf_of[e["name"]], pf_of.get(e["name"])
        if bdf in vfs_by_pf:
            e = dict(e, consumesCounters=[{"counterSet": counter_set_name(bdf), "counters": {PF_COUNTER: {"value": str(vfs_by_pf[bdf])}}}])
        elif pf in vfs_by_pf:
            e = dict(e, consumesCounters=[{"counterSet": counter_set_name(pf), "counters": {PF_COUNTER: {"value": "1"}}}])
        out.append(e)
    return out, counter_sets


def _entry(device, driver_name: str, list_attributes: bool, taints, cache: dict | None,
           share: SharePlan | None = None) -> tuple[dict, list[str]]:
    """The device's API entry and validation problems; ``cache`` reuses them while the
    device object (discovery reuses unchanged ones), its taints and the settings are the same."""
    t = taints.get(device.name) if taints else None
    key = (driver_name, list_attributes, share)
    if cache is not None:
        hit = cache.get(device.name)
        if hit is not None and hit[0] is device and hit[1] == t and hit[2] == key:
            return hit[3], list(hit[4])
    entry = shared_entry(device.to_api(), device, share)
    if device.pci.physfn:
        entry = _with_pf_attribute(entry, device.pci.physfn)
    entry = fitted(entry)
    if t:
        entry = {**entry, "taints": [dict(x) for x in t]}
    problems = device_problems(entry, driver_name, list_attributes)
    if cache is not None:
        cache[device.name] = (device, t, key, entry, tuple(problems))
    return entry, problems


def build_pool(inventory, *, node_name: str, driver_name: str, list_attributes: bool = False, pf_vf_exclusive: bool = False,
               partitions: bool = False, compatibility_groups: bool = False, taints: dict[str, list[dict]] | None = None, previous: PoolContent | None = None,
               cache: dict | None = None, share: SharePlan | None = None,
               skip_node_operations: dict[str, list[str]] | None = None, held: frozenset[str] = frozenset(),
               partition_type_attribute: bool = False) -> PoolContent:
    """Validated, chunked pool content for this node's devices (inventory order = allocation order).

    ``taints``: device name -> DeviceTaints (``--taint-unhealthy``); a tainted device makes
    its slice an advanced one (at most 64 devices). ``previous``: the pool published
    before, for sticky slice placement (``chunk_devices``). ``cache``: a dict kept by the
    caller across calls; entries (treated as read-only) are reused for unchanged devices.
    ``share``: kinds published multi-allocatable with capacity policies (``sharing.share_plan``).
    ``skip_node_operations``: device kind -> the slice's skipNodeOperations (``publish/nodeops.py``).
    ``held``: with ``partitions`` off, the PCI addresses of GPUs whose partitions claims prepared before hold:
    not offered whole (the scheduler cannot see those claims hold them; a claim of one would fail).
    ``partition_type_attribute``: slices with counter-consuming devices name their type (publish/partitiontype.py)."""
    if held and not partitions:
        inventory = inventory.replace(devices=tuple(d for d in inventory.devices if d.pci is None or d.pci.bdf not in held))
    entries, rejected, pf_of, bdf_of = _valid_entries(inventory, driver_name, list_attributes, partitions, taints,
                                                      cache, share)
    counter_sets: list[dict] = []
    if pf_vf_exclusive:
        entries, counter_sets = _pf_vf_counters(entries, pf_of, bdf_of)
    if partitions:  # GPU partitions after PF/VF counters: a GPU PF may consume from both
        entries, gpu_sets, bad = gpu_partitions.expand(entries, inventory.by_name(), groups=compatibility_groups,
                                                       driver_name=driver_name, list_attributes=list_attributes,
                                                       taints=taints)
        counter_sets += gpu_sets
        rejected += bad
    if partition_type_attribute:
        own = {name: counter_set_name(bdf) for name, bdf in bdf_of.items()}
        entries = partitiontype.typed(entries, inventory, own, driver_name, list_attributes)
    # counter slices first: PFs and GPUs come and go less often than devices, so indexes stay put
    slices = [{"sharedCounters": counter_sets[i : i + MAX_COUNTER_SETS]} for i in range(0, len(counter_sets), MAX_COUNTER_SETS)]
    if cache is not None and len(cache) > len(inventory.devices):
        names = {d.name for d in inventory.devices}
        for name in [n for n in cache if n not in names]:
            del cache[name]
    devices = _device_slices(entries, inventory, previous, skip_node_operations)
    slices.extend(partitiontype.declare(devices, driver_name) if partition_type_attribute else devices)
    return PoolContent(name=node_name, slices=tuple(slices), rejected=tuple(rejected))


def _valid_entries(inventory, driver_name: str, list_attributes: bool, partitions: bool, taints, cache: dict | None,
                   share: SharePlan | None) -> tuple[list[dict], list[tuple[str, str]], dict[str, str | None], dict[str, str]]:
    """The API entries of the devices the API server would take, in inventory order, and the
    others with why: (entries, rejected, device -> its PF's address, device -> its address)."""
    rejected: list[tuple[str, str]] = []
    entries: list[dict] = []
    seen: set[str] = set()
    pf_of: dict[str, str | None] = {}
    bdf_of: dict[str, str] = {}
    for device in inventory.devices:
        if not partitions and (whole_unusable(device) or instances_beside(device)):  # a GPU in MIG mode (with --partitions: its MIG devices)
            continue
        entry, problems = _entry(device, driver_name, list_attributes, taints, cache, share)
        if device.name in seen:
            problems.append("device name used twice in the pool")
        if problems:
            rejected.append((device.name, "; ".join(problems)))
            continue
        seen.add(device.name)
        pf_of[device.name], bdf_of[device.name] = device.pci.physfn, device.pci.bdf
        entries.append(entry)
    return entries, rejected, pf_of, bdf_of


def _device_slices(entries: list[dict], inventory, previous: PoolContent | None,
                   skip_node_operations: dict[str, list[str]] | None) -> list[dict]:
    """The device slices, placed as before where they can be (``chunk_devices``); with
    ``skip_node_operations``, the devices of kinds that differ there in slices of their own."""
    if skip_node_operations:
        kind_of = {d.name: d.kind for d in inventory.devices}
        prev = list(previous.slices) if previous is not None else None
        return grouped_slices(entries, kind_of, skip_node_operations, prev, chunk_devices)
    prev_chunks = [sl["devices"] for sl in previous.slices if "devices" in sl] if previous is not None else None
    return [{"devices": chunk} for chunk in chunk_devices(entries, prev_chunks)]


def index_width(count: int) -> int:
    return max(5, len(f"{max(count - 1, 0):x}"))


def generate_name(index: int, count: int, driver_name: str, node_name: str) -> str:
    """``<hex index>-<driver>-<node>-``: names sort in pool order (the allocator's first-fit order)."""
    return f"{index:0{index_width(count)}x}-{driver_name}-{node_name}-"


def parse_index(name: str, count: int) -> int | None:
    """The slice index encoded in ``name``, or None when the name is not one of ours for this count."""
    prefix, dash, _ = name.partition("-")
    if not dash or len(prefix) != index_width(count) or any(c not in "0123456789abcdef" for c in prefix):
        return None
    index = int(prefix, 16)
    return index if index < count else None


def stored_pool(stored: list[dict], name: str) -> PoolContent | None:
    """The pool as the store holds it (its slices' content by index, of the newest generation), for
    ``build_pool(previous=)``: a restarted agent keeps each device in the slice the last one put it
    in. A fresh split moves devices wherever that one's sticky placement differed from it, and the
    pool is rewritten with a generation bump. A missing index stays an empty slice (indexes stay)."""
    def generation(obj):
        pool = obj.get("spec", {}).get("pool")
        value = pool.get("generation") if isinstance(pool, dict) else None
        return value if type(value) is int else -1

    last = max(map(generation, stored), default=-1)
    newest = [s for s in stored if last >= 0 and generation(s) == last]
    count = max((s["spec"]["pool"].get("resourceSliceCount") for s in newest
                 if type(s["spec"]["pool"].get("resourceSliceCount")) is int), default=0)
    if not 0 < count <= 4096:  # (a damaged file may say anything: no placement to keep then)
        return None
    content: list[dict] = [{"devices": []} for _ in range(count)]
    for s in sorted(newest, key=lambda s: s["metadata"]["name"]):
        index, spec = parse_index(s["metadata"]["name"], count), s["spec"]
        devices = spec.get("devices") or []  # (the server leaves an empty list out)
        if index is None or content[index] != {"devices": []} or not isinstance(devices, list) or \
                not all(isinstance(d, dict) and isinstance(d.get("name"), str) for d in devices):
            continue
        if spec.get("sharedCounters"):  # a counter slice: no device placement, but its index is taken
            content[index] = {"sharedCounters": spec["sharedCounters"]}
        else:
            ops = spec.get("skipNodeOperations")
            ops_ok = isinstance(ops, list) and all(isinstance(o, str) for o in ops)
            content[index] = {"devices": devices, **({"skipNodeOperations": ops} if ops and ops_ok else {})}
    return PoolContent(name=name, slices=tuple(content))


def generate_prefix(prefix: str) -> str:
    """``prefix`` as the server keeps it for a name: its first 58 characters. Sent whole, a long
    node's (a Node name may have 253) passes the 253 the server takes of a generateName, and every
    slice is refused; a cut right after a dot would leave no valid DNS subdomain."""
    return prefix[:MAX_GENERATE_PREFIX].rstrip(".")


def offline_name(prefix: str) -> str:
    """A deterministic stand-in for the apiserver's generateName: same length rules, hashed suffix."""
    base = prefix[:MAX_GENERATE_PREFIX]
    digest = hashlib.sha256(prefix.encode()).digest()
    return base + "".join(_NAME_ALPHABET[b % len(_NAME_ALPHABET)] for b in digest[:5])


def node_owner(node_name: str, node_uid: str | None) -> list[dict] | None:
    if not node_uid:
        return None
    return [{"apiVersion": "v1", "kind": "Node", "name": node_name, "uid": node_uid, "controller": True}]


def render_slice(
    pool: PoolContent,
    index: int,
    *,
    driver_name: str,
    node_name: str,
    generation: int,
    node_uid: str | None = None,
    full_name: bool = False,
) -> dict:
    count = len(pool.slices)
    prefix = generate_name(index, count, driver_name, node_name)
    metadata: dict = {"name": offline_name(prefix)} if full_name else {"generateName": generate_prefix(prefix)}
    owner = node_owner(node_name, node_uid)
    if owner:
        metadata["ownerReferences"] = owner
    spec: dict = {
        "driver": driver_name,
        "pool": {"name": pool.name, "generation": generation, "resourceSliceCount": count},
        "nodeName": node_name,
    }
    spec.update(pool.slices[index])
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": spec}


def render(pool: PoolContent, **kwargs) -> list[dict]:
    return [render_slice(pool, i, **kwargs) for i in range(len(pool.slices))]


def pool_options(settings) -> dict:
    """``build_pool``'s keyword arguments from the publishing settings: one place, used by the
    daemon and by ``sysdra scan -o slices`` alike (the flags are agent/cli/publishing.py's)."""
    return {
        "node_name": settings.node_name,
        "driver_name": settings.driver_name,
        "list_attributes": settings.list_attributes,
        "pf_vf_exclusive": settings.pf_vf_exclusive,
        "partitions": settings.partitions,
        "compatibility_groups": settings.compatibility_groups,
        "share": share_plan(settings.share, settings.share_policies),
        "skip_node_operations": settings.skip_node_operations,
        "partition_type_attribute": settings.partition_type_attribute,
    }


def slices_list(inventory, settings, generation: int = 1, node_uid: str | None = None,
                taints: dict[str, list[dict]] | None = None) -> dict:
    """``sysdra scan -o slices``: what would be published for a fresh pool, as a Kubernetes List."""
    pool = build_pool(inventory, **pool_options(settings), taints=taints)
    items = render(pool, driver_name=settings.driver_name, node_name=settings.node_name, generation=generation, node_uid=node_uid, full_name=True)
    return {"apiVersion": "v1", "kind": "List", "metadata": {}, "items": items}

