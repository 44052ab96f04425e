"""A stand-in Kubernetes API server for tests — NOT a real kube-apiserver.

A real HTTP server on 127.0.0.1 (ephemeral port, one thread per request) that enforces
the semantics the publisher relies on, for ``resource.k8s.io/v1`` ResourceSlices:
generateName, uid, resourceVersion, 409 on stale updates and failed delete
preconditions, 404, immutable fields, field selectors, list resourceVersion, watch
streams (ADDED/MODIFIED/DELETED, 410 Gone for compacted versions), DeleteCollection
(the kubelet's wipe), and 422 for objects that fail the kubernetes-validate 1.37 strict
schema or the DRA limits. Nodes and ResourceClaims support GET only.
Fault hooks: ``fail_next``, ``delay``, ``drop_watches``, ``compact``.
"""

from __future__ import annotations

import copy
import json
import random
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import kubernetes_validate

SLICES = "/apis/resource.k8s.io/v1/resourceslices"
NODES = "/api/v1/nodes/"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/"
_SUFFIX_CHARS = "bcdfghjklmnpqrstvwxz2456789"


def status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message, "reason": reason, "code": code}


def _field(obj: dict, path: str):
    for part in path.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None
    return obj


def matches(obj: dict, selector: str | None) -> bool:
    for term in filter(None, (selector or "").split(",")):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if (_field(obj, key) or "") == value:
                return False
        else:
            key, value = term.split("==", 1) if "==" in term else term.split("=", 1)
            if (_field(obj, key) or "") != value:
                return False
    return True


def dra_limit_problems(obj: dict, pool_devices: dict[str, str]) -> list[str]:
    """The limits the OpenAPI schema cannot express (protocol reference §5)."""
    spec = obj.get("spec", {})
    devices = spec.get("devices") or []
    problems = []
    if devices and spec.get("sharedCounters"):
        problems.append("only one of devices and sharedCounters may be set")
    advanced = any(d.get("taints") or d.get("consumesCounters") or any(k in ("ints", "bools", "strings", "versions") for a in (d.get("attributes") or {}).values() for k in a) for d in devices)
    limit = 64 if advanced else 128
    if len(devices) > limit:
        problems.append(f"spec.devices: must have at most {limit} items")
    if len(spec.get("sharedCounters") or []) > 8:
        problems.append("spec.sharedCounters: must have at most 8 items")
    for d in devices:
        attrs, caps = d.get("attributes") or {}, d.get("capacity") or {}
        if len(attrs) + len(caps) > 32:
            problems.append(f"device {d['name']}: more than 32 attributes and capacities")
        values = sum(len(next(iter(v.values()))) if next(iter(v)) in ("ints", "bools", "strings", "versions") else 1 for v in attrs.values())
        if values > 48:
            problems.append(f"device {d['name']}: more than 48 attribute values")
        for key, v in attrs.items():
            items = next(iter(v.values()))
            for item in items if isinstance(items, list) else [items]:
                if isinstance(item, str) and len(item.encode()) > 64:
                    problems.append(f"device {d['name']}: attribute {key} longer than 64 bytes")
        other = pool_devices.get(d["name"])
        if other is not None and other != obj["metadata"]["name"]:
            problems.append(f"device {d['name']}: duplicate device name in pool (also in {other})")
    return problems


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)  # a bug in the stand-in: show it


class StandinAPIServer:
    def __init__(self, history: int = 1000):
        self.lock = threading.Condition()
        self.slices: dict[str, dict] = {}
        self.nodes: dict[str, dict] = {}
        self.claims: dict[tuple[str, str], dict] = {}
        self.rv = 100
        self.events: list[tuple[int, str, dict]] = []  # (rv, type, object) for watches
        self.oldest_rv = self.rv  # watches from before this get 410 Gone
        self.history = history
        self.requests: list[tuple[str, str]] = []  # (verb, path) of every request
        self.writes = {"create": 0, "update": 0, "delete": 0, "deletecollection": 0}
        self._faults: list[tuple[int, str | None]] = []  # (status, only this verb)
        self._delay = 0.0
        self._delay_only: str | None = None
        self._watch_epoch = 0
        self.gone_served = 0  # watches answered with 410 Gone
        self._stopped = False
        self._server = _QuietServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="standin-apiserver", daemon=True)

    # --- lifecycle ---------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> "StandinAPIServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        with self.lock:
            self._stopped = True
            self.lock.notify_all()
        self._server.shutdown()
        self._server.server_close()

    def kubeconfig(self, path: str) -> str:
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "standin",
            "clusters": [{"name": "standin", "cluster": {"server": self.url}}],
            "users": [{"name": "standin", "user": {"token": "standin"}}],
            "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "standin"}}],
        }
        with open(path, "w") as f:
            json.dump(config, f)
        return path

    # --- fixtures and fault injection --------------------------------------------------
    def add_node(self, name: str, uid: str | None = None) -> dict:
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "uid": uid or str(uuid.uuid4()), "resourceVersion": "1"}}
        self.nodes[name] = node
        return node

    def fail_next(self, count: int, code: int = 500, verb: str | None = None) -> None:
        """The next ``count`` requests (of ``verb`` if given: list, watch, create, update, delete) fail with ``code``."""
        with self.lock:
            self._faults.extend([(code, verb)] * count)

    def delay(self, seconds: float, only: str | None = None) -> None:
        """Every request (whose path starts with ``only``, e.g. ``SLICES``) waits this long first:
        a slow or stalled server. Requests already waiting finish their wait."""
        self._delay, self._delay_only = seconds, only

    def drop_watches(self) -> None:
        """Cut every open watch stream without a clean end (like a load balancer timeout)."""
        with self.lock:
            self._watch_epoch += 1
            self.lock.notify_all()

    def compact(self) -> None:
        """Forget event history: a watch resuming from an older resourceVersion gets 410 Gone."""
        with self.lock:
            self.events.clear()
            self.oldest_rv = self.rv

    def wipe(self, node: str, driver: str | None = None) -> int:
        """The kubelet's DeleteCollection, done in-process."""
        selector = f"spec.nodeName={node}" + (f",spec.driver={driver}" if driver else "")
        with self.lock:
            return len(self._delete_collection(selector))

    def slice_list(self) -> list[dict]:
        with self.lock:
            return [copy.deepcopy(s) for _, s in sorted(self.slices.items())]

    # --- state changes (lock held) -----------------------------------------------------
    def _bump(self, kind: str, obj: dict) -> dict:
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.events.append((self.rv, kind, copy.deepcopy(obj)))
        if len(self.events) > self.history:
            dropped = self.events[: len(self.events) - self.history]
            del self.events[: len(dropped)]
            self.oldest_rv = dropped[-1][0]
        self.lock.notify_all()
        return obj

    def _pool_devices(self, pool: str, driver: str) -> dict[str, str]:
        out = {}
        for name, s in self.slices.items():
            spec = s["spec"]
            if spec.get("pool", {}).get("name") == pool and spec.get("driver") == driver:
                out.update({d["name"]: name for d in spec.get("devices") or []})
        return out

    def _validate(self, obj: dict) -> tuple[int, dict] | None:
        try:
            kubernetes_validate.validate(obj, "1.37", strict=True)
        except kubernetes_validate.ValidationError as err:
            return 422, status(422, "Invalid", f"ResourceSlice is invalid: {err.message}")
        spec = obj.get("spec", {})
        problems = dra_limit_problems(obj, self._pool_devices(spec.get("pool", {}).get("name"), spec.get("driver")))
        if problems:
            return 422, status(422, "Invalid", "ResourceSlice is invalid: " + "; ".join(problems))
        return None

    def _create(self, obj: dict) -> tuple[int, dict]:
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"][:58] + "".join(random.choice(_SUFFIX_CHARS) for _ in range(5))
        if not meta.get("name"):
            return 422, status(422, "Invalid", "metadata.name: Required value")
        if meta["name"] in self.slices:
            return 409, status(409, "AlreadyExists", f'resourceslices.resource.k8s.io "{meta["name"]}" already exists')
        if meta.get("resourceVersion"):
            return 400, status(400, "BadRequest", "resourceVersion should not be set on objects to be created")
        error = self._validate(obj)
        if error:
            return error
        meta.update(uid=str(uuid.uuid4()), generation=1, creationTimestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        self.slices[meta["name"]] = self._bump("ADDED", obj)
        self.writes["create"] += 1
        return 201, obj

    def _update(self, name: str, obj: dict) -> tuple[int, dict]:
        old = self.slices.get(name)
        if old is None:
            return 404, status(404, "NotFound", f'resourceslices.resource.k8s.io "{name}" not found')
        meta = obj.get("metadata", {})
        if meta.get("name") != name:
            return 400, status(400, "BadRequest", "the name of the object does not match the name on the URL")
        if meta.get("uid") and meta["uid"] != old["metadata"]["uid"]:
            return 409, status(409, "Conflict", "Precondition failed: UID in precondition does not match")
        if meta.get("resourceVersion") and meta["resourceVersion"] != old["metadata"]["resourceVersion"]:
            return 409, status(409, "Conflict", f'Operation cannot be fulfilled on resourceslices.resource.k8s.io "{name}": '
                               "the object has been modified; please apply your changes to the latest version and try again")
        for field in ("driver", "nodeName"):
            if obj.get("spec", {}).get(field) != old["spec"].get(field):
                return 422, status(422, "Invalid", f"spec.{field}: field is immutable")
        error = self._validate(obj)
        if error:
            return error
        for key in ("uid", "creationTimestamp"):
            meta[key] = old["metadata"][key]
        meta["generation"] = old["metadata"]["generation"] + (obj["spec"] != old["spec"])
        self.slices[name] = self._bump("MODIFIED", obj)
        self.writes["update"] += 1
        return 200, obj

    def _delete(self, name: str, options: dict) -> tuple[int, dict]:
        old = self.slices.get(name)
        if old is None:
            return 404, status(404, "NotFound", f'resourceslices.resource.k8s.io "{name}" not found')
        pre = options.get("preconditions") or {}
        if pre.get("uid") and pre["uid"] != old["metadata"]["uid"]:
            return 409, status(409, "Conflict", f"Precondition failed: UID in precondition: {pre['uid']}, UID in object meta: {old['metadata']['uid']}")
        if pre.get("resourceVersion") and pre["resourceVersion"] != old["metadata"]["resourceVersion"]:
            return 409, status(409, "Conflict", "Precondition failed: ResourceVersion in precondition does not match")
        del self.slices[name]
        self.writes["delete"] += 1
        return 200, self._bump("DELETED", old)

    def _delete_collection(self, selector: str | None) -> list[dict]:
        gone = [self.slices.pop(n) for n in sorted(self.slices) if matches(self.slices[n], selector)]
        for obj in gone:
            self._bump("DELETED", obj)
        self.writes["deletecollection"] += 1
        return gone

    # --- HTTP --------------------------------------------------------------------------
    def _handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _body(self) -> dict:
                length = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(length) or b"{}") if length else {}

            def _send(self, code: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self, method: str):
                url = urlsplit(self.path)
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                body = self._body() if method in ("POST", "PUT", "DELETE") else {}
                path = url.path.rstrip("/")
                watch = query.get("watch") in ("1", "true")
                verb = {"GET": "watch" if watch else ("list" if path == SLICES else "get"), "POST": "create", "PUT": "update",
                        "DELETE": "deletecollection" if path == SLICES else "delete"}[method]
                server.requests.append((verb, path))
                if server._delay and (server._delay_only is None or path.startswith(server._delay_only)):
                    time.sleep(server._delay)
                with server.lock:
                    for i, (code, only) in enumerate(server._faults):
                        if only in (None, verb):
                            del server._faults[i]
                            return self._send(code, status(code, "InternalError" if code >= 500 else "Injected", "injected fault"))
                if path.startswith(NODES) and method == "GET":
                    node = server.nodes.get(path[len(NODES):])
                    return self._send(200, node) if node else self._send(404, status(404, "NotFound", "node not found"))
                if path.startswith(CLAIMS) and "/resourceclaims/" in path and method == "GET":
                    ns, _, name = path[len(CLAIMS):].partition("/resourceclaims/")
                    claim = server.claims.get((ns, name))
                    return self._send(200, claim) if claim else self._send(404, status(404, "NotFound", "claim not found"))
                if path == SLICES and watch:
                    return self._watch(query)
                with server.lock:
                    if path == SLICES and method == "GET":
                        items = [copy.deepcopy(s) for _, s in sorted(server.slices.items()) if matches(s, query.get("fieldSelector"))]
                        return self._send(200, {"kind": "ResourceSliceList", "apiVersion": "resource.k8s.io/v1",
                                                "metadata": {"resourceVersion": str(server.rv)}, "items": items})
                    if path == SLICES and method == "POST":
                        return self._send(*server._create(body))
                    if path == SLICES and method == "DELETE":
                        items = server._delete_collection(query.get("fieldSelector"))
                        return self._send(200, {"kind": "ResourceSliceList", "apiVersion": "resource.k8s.io/v1", "metadata": {}, "items": items})
                    if path.startswith(SLICES + "/"):
                        name = path[len(SLICES) + 1:]
                        if method == "GET":
                            obj = server.slices.get(name)
                            return self._send(200, obj) if obj else self._send(404, status(404, "NotFound", f"{name} not found"))
                        if method == "PUT":
                            return self._send(*server._update(name, body))
                        if method == "DELETE":
                            return self._send(*server._delete(name, body))
                return self._send(404, status(404, "NotFound", f"no route for {method} {path}"))

            def _chunk(self, obj: dict) -> None:
                data = json.dumps(obj).encode() + b"\n"
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def _watch(self, query: dict) -> None:
                selector = query.get("fieldSelector")
                deadline = time.monotonic() + float(query.get("timeoutSeconds") or 3600)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                with server.lock:
                    epoch = server._watch_epoch
                    if query.get("resourceVersion"):
                        since = int(query["resourceVersion"])
                        if since < server.oldest_rv:
                            server.gone_served += 1
                            self._chunk({"type": "ERROR", "object": status(410, "Expired", f"too old resource version: {since} ({server.oldest_rv})")})
                            self.wfile.write(b"0\r\n\r\n")
                            return
                        pending = [(rv, k, o) for rv, k, o in server.events if rv > since]
                    else:  # no version: synthetic ADDED for what exists, then changes
                        since = server.rv
                        pending = [(since, "ADDED", copy.deepcopy(s)) for s in server.slices.values()]
                try:
                    while True:
                        for rv, kind, obj in pending:
                            if matches(obj, selector):
                                self._chunk({"type": kind, "object": obj})
                            since = max(since, rv)
                        with server.lock:
                            while True:
                                if server._stopped or server._watch_epoch != epoch:
                                    self.close_connection = True
                                    return  # no terminating chunk: an abrupt drop
                                pending = [(rv, k, o) for rv, k, o in server.events if rv > since]
                                remaining = deadline - time.monotonic()
                                if pending or remaining <= 0:
                                    break
                                server.lock.wait(min(remaining, 0.5))
                        if not pending:
                            self.wfile.write(b"0\r\n\r\n")  # server-side timeout: clean end
                            return
                except (BrokenPipeError, ConnectionResetError):
                    return

            def do_GET(self):
                self._route("GET")

            def do_POST(self):
                self._route("POST")

            def do_PUT(self):
                self._route("PUT")

            def do_DELETE(self):
                self._route("DELETE")

        return Handler
