"""Checks of a whole published pool (the ResourceSlice objects of one node), by the real peers:
each slice by the kube-apiserver's own validation (server-side dry-run create), the pool by the
scheduler's allocator (tests/peers/allocator), and ``pool_problems``: the rules the allocator
holds a pool to (GatherPools in k8s.io/dynamic-resource-allocation v0.37.2,
structured/internal/*/pools_*.go: device names and counter set names unique in the pool,
every consumption naming a counter set and counters that exist) plus those of a pool as such
(one generation, resourceSliceCount the number of slices)."""

from __future__ import annotations

from collections import Counter

from tests.controlplane import Unschedulable, allocate, claim_from

DRIVER = "sysdra.io"
ANY = {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "any.sysdra.io"},
       "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]}}
# a claim no device fits: the allocator then says whether it found an invalid pool
NOTHING = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "nothing", "namespace": "default"},
           "spec": {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": "any.sysdra.io",
                                                                         "selectors": [{"cel": {"expression": "false"}}]}}]}}}  # fmt: skip


def server_refusals(plane, slices: list[dict]) -> list[str]:
    """The server's message for each slice it would refuse (dry run: nothing is stored)."""
    out = []
    for obj in slices:
        r = plane.request("POST", "/apis/resource.k8s.io/v1/resourceslices", body=obj, params={"dryRun": "All"}, ok=False)
        if r.status_code != 201:
            out.append(f"{obj['metadata']}: {r.status_code} {r.json().get('message', r.text)[:2000]}")
    return out


def pool_problems(slices: list[dict]) -> list[str]:
    problems = []
    pools = {(o["spec"]["pool"]["generation"], o["spec"]["pool"]["resourceSliceCount"]) for o in slices}
    if len(pools) != 1 or next(iter(pools))[1] != len(slices):
        problems.append(f"(generation, resourceSliceCount) {sorted(pools)} in a pool of {len(slices)} slices")
    devices = [d for o in slices for d in o["spec"].get("devices", [])]
    sets = [s for o in slices for s in o["spec"].get("sharedCounters", [])]
    for what, names in (("device", [d["name"] for d in devices]), ("counter set", [s["name"] for s in sets])):
        problems += [f"duplicate {what} name {n}" for n, c in Counter(names).items() if c > 1]
    counters = {s["name"]: set(s["counters"]) for s in sets}
    for d in devices:
        for c in d.get("consumesCounters", []):
            if c["counterSet"] not in counters:
                problems.append(f"{d['name']}: counter set {c['counterSet']} not found")
            elif missing := set(c["counters"]) - counters[c["counterSet"]]:
                problems.append(f"{d['name']}: counters {sorted(missing)} not in counter set {c['counterSet']}")
    return problems


def allocator_problem(slices: list[dict], node: str) -> str | None:
    """The allocator's word on the pool when nothing fits: None, or why it found it invalid."""
    try:
        allocate(slices, [ANY], claim_from(NOTHING), node=node)
    except Unschedulable as err:
        return str(err) if "invalid" in str(err) else None
    return "a claim no device fits was allocated"


def partition_type_problems(slices: list[dict]) -> list[str]:
    """The rule kube-controller-manager v1.37.2 holds a pool's partition summary to (its
    resourcepoolstatusrequest views.go): the counter-consuming devices of a slice naming a
    ``partitionTypeAttribute`` carry it as a string, and two devices of one value consume alike,
    counter set names included (else ``PartitionCostMismatch``: no summary for the pool)."""
    problems, cost_of = [], {}
    for o in slices:
        name = o["spec"].get("partitionTypeAttribute")
        for d in o["spec"].get("devices", []) if name else ():
            if not d.get("consumesCounters"):
                continue
            attrs = d.get("attributes") or {}
            value = attrs.get(name, attrs.get(name.removeprefix(f"{o['spec']['driver']}/"), {})).get("string")
            cost = sorted((c["counterSet"], k, v["value"]) for c in d["consumesCounters"] for k, v in c["counters"].items())
            if value is None:
                problems.append(f"{d['name']}: no string attribute {name}")
            elif cost_of.setdefault((name, value), cost) != cost:
                problems.append(f"{d['name']}: partition type {value!r} consumes {cost}, another {cost_of[(name, value)]}")
    return problems
