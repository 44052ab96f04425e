"""Fields the API server did not keep. It drops a field whose feature gate is off, silently
(taints without DRADeviceTaints, ...): compared with what it keeps, our slices would differ
forever and every sync would bump the generation and rewrite the pool, each write's watch event
asking for the next sync. So what each write returns tells which fields to leave out of the
comparison; a later write that keeps one (the gate turned on) brings it back, and so does the dry
run that offers them again now and then (publish/reconcile.py, ``RECHECK_DROPPED``)."""

from __future__ import annotations

import logging

log = logging.getLogger("sysdra.publish")

GATES = {"taints": "DRADeviceTaints", "sharedCounters": "DRAPartitionableDevices",
         "consumesCounters": "DRAPartitionableDevices", "skipNodeOperations": "DRAOptionalNodeOperations",
         "requestPolicy": "DRAConsumableCapacity", "partitionTypeAttribute": "DRAPartitionableDevicesType"}  # fmt: skip
_EMPTY = (None, [], {})  # absent and empty compare equal (reconcile._canonical)
_UNSENT = (None, [], {}, "")  # sent like this, a field the server leaves out is not dropped (omitempty strings)


def missing(sent, got, path: tuple = ()):
    """Paths (list positions as "*") of what ``sent`` holds and ``got`` lacks."""
    if isinstance(sent, dict) and isinstance(got, dict):
        for key, value in sent.items():
            if value in _UNSENT:
                continue
            if got.get(key) in _EMPTY:
                yield (*path, key)
            else:
                yield from missing(value, got[key], (*path, key))
    elif isinstance(sent, list) and isinstance(got, list) and len(sent) == len(got):  # the server keeps order
        for a, b in zip(sent, got):
            yield from missing(a, b, (*path, "*"))


def _values(value, path: tuple):
    if not path:
        yield value
    elif path[0] == "*":
        for item in value if isinstance(value, list) else ():
            yield from _values(item, path[1:])
    elif isinstance(value, dict) and path[0] in value:
        yield from _values(value[path[0]], path[1:])


def _without(value, path: tuple):
    head, rest = path[0], path[1:]
    if head == "*":
        return [_without(v, rest) for v in value] if isinstance(value, list) else value
    if not isinstance(value, dict) or head not in value:
        return value
    if not rest:
        return {k: v for k, v in value.items() if k != head}
    return {**value, head: _without(value[head], rest)}


def spelled(path: tuple) -> str:
    return "spec." + ".".join(path).replace(".*", "[]")


class Dropped:
    """What the server dropped from our slices' specs, learned from our own writes."""

    def __init__(self):
        self.paths: set[tuple] = set()

    def learn(self, sent: dict, got) -> None:
        if not isinstance(got, dict):
            return
        spec = sent.get("spec", {})
        now = set(missing(spec, got.get("spec", {})))
        for path in sorted(now - self.paths):  # once per field, not per write
            log.warning("the API server dropped %s from ResourceSlice %s (feature gate %s off?); "
                        "publishing it still, comparing without it", spelled(path),
                        got.get("metadata", {}).get("name"), GATES.get(path[-1], "unknown"))
        kept = {p for p in self.paths - now if any(v not in _EMPTY for v in _values(spec, p))}
        for path in kept:
            log.info("the API server keeps %s again", spelled(path))
        self.paths = (self.paths | now) - kept

    def carried(self, obj: dict) -> bool:
        """Whether ``obj`` holds a value of a field the server dropped."""
        spec = obj.get("spec", {})
        return any(v not in _EMPTY for p in self.paths for v in _values(spec, p))

    def strip(self, obj: dict) -> dict:
        """``obj`` as the server would keep it."""
        if not self.paths:
            return obj
        spec = obj.get("spec", {})
        for path in self.paths:
            spec = _without(spec, path)
        return {**obj, "spec": spec}
