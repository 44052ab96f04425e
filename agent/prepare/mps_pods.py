"""MPS control daemons in pods of their own (``nvidia_mps_pod``): the DaemonSet's way, as
NVIDIA's driver runs them. The agent's pod ends on every upgrade, crash or ``kubectl delete``,
and the kernel ends its processes with it; a daemon in a pod of its own keeps serving the
shares' running containers meanwhile, and the next agent adopts it by its record.

One pod per GPU, ``sysdra-mps-<uuid>`` in the agent's namespace, bound to this node
(``nodeName``: no scheduler), ``restartPolicy: Never``: the agent alone restarts a daemon, with
the supervisor's bounds and health (prepare/mps_watch.py), also while its pod is away (it
starts what the prepared claims need at start). The pod mounts the GPU's directory at its host
path (pipe, log, and the shm tmpfs the agent mounted), the tmpfs again on ``/dev/shm``, and the
driver root read-only; it refuses to start when ``/dev/shm`` is not a tmpfs (a pod the kubelet
runs again after a reboot, before the agent mounted one). Root and privileged, for its
directories and the GPU's device nodes (its MPS servers open them); host network: it needs none
and must not wait for the node's CNI. The Node owns it, so a deleted node takes it along.

A record holds the pod's UID: a pod of the same name made since (another agent's) is never taken
for it, and every delete is conditional on the UID. Requests block (worker threads, the
supervisor's thread) through the agent's API connection settings.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable
from urllib.parse import urlencode

import orjson

from agent.kubeletplugin.claimapi import ApiFailure, ClaimApi
from agent.names import is_subdomain
from agent.prepare.driverlinks import DEFAULT_PATH, link_libraries
from agent.prepare.mps_process import BINARY, STOP_TIMEOUT, LaunchError
from agent.prepare.mps_records import MpsRecord
from agent.settings_mps import MpsPodSettings
from discovery.nvidia_driver import Library

log = logging.getLogger("agent.prepare.mps")

COMPONENT = "mps-control-daemon"
DRIVER_ROOT_IN_POD = "/driver-root"
GRACE = 5  # seconds: the daemon quits its servers on SIGTERM
POLL = 0.25  # seconds between looks at a pod being started or deleted
# /dev/shm must be the GPU's shm tmpfs (``$0``: the GPU's dir): the same file system as its
# shm dir, which is a mount of its own (a plain directory after a reboot is not)
_GUARD = ('d=$(stat -c %d /dev/shm) && [ "$d" = "$(stat -c %d "$0/shm")" ] && [ "$d" != "$(stat -c %d "$0")" ] '
          '|| { echo "/dev/shm is not the MPS shm tmpfs at $0/shm: not started" >&2; exit 1; }; exec "$@"')
_WAITING_FAILURES = {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError",
                     "CreateContainerError", "RunContainerError"}


def pod_name(uuid: str) -> str:
    return f"sysdra-mps-{uuid.lower()}"


class PodApi:
    """The pod requests of the launcher, in one namespace."""

    def __init__(self, namespace: str, api: ClaimApi | None = None):
        self.namespace = namespace
        self.api = api or ClaimApi()  # lightkube's connection settings, pooled connections

    def _pods(self, name: str = "") -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods" + (f"/{name}" if name else "")

    def _json(self, method: str, path: str, body: dict | None = None, ok: tuple[int, ...] = (200,),
              none: tuple[int, ...] = (404,)) -> dict | None:
        """The answer's object; None for the ``none`` codes (404: no such object)."""
        resp = self.api.request(method, path, orjson.dumps(body) if body is not None else None,
                                {"Content-Type": "application/json", "Accept": "application/json"})
        if resp.status in none:
            return None
        if resp.status not in ok:
            raise ApiFailure(f"{method} {path}: API error {resp.status}: {resp.body[:300].decode('utf-8', 'replace')}",
                             resp.status)
        try:
            out = orjson.loads(resp.body)
        except ValueError as err:
            raise ApiFailure(f"{method} {path}: the answer is not JSON: {err}") from err
        return out if isinstance(out, dict) else None

    def get(self, name: str) -> dict | None:
        return self._json("GET", self._pods(name))

    def create(self, pod: dict) -> dict:
        """The pod made; ApiFailure (409) when one of its name is there (another agent's)."""
        made = self._json("POST", self._pods(), pod, ok=(201, 200), none=())
        if made is None:
            raise ApiFailure("POST pod: no object in the answer")
        return made

    def delete(self, name: str, uid: str | None) -> None:
        body: dict = {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": GRACE}
        if uid:
            body["preconditions"] = {"uid": uid}
        self._json("DELETE", self._pods(name), body, ok=(200, 202), none=(404, 409))  # 409: another UID

    def on_node(self, node: str, driver: str, cached: bool = False) -> list[dict]:
        """This node's daemon pods; ``cached``: from the watch cache (the supervisor's round)."""
        query = urlencode({"labelSelector": f"app.kubernetes.io/component={COMPONENT},sysdra.io/driver={driver}",
                           "fieldSelector": f"spec.nodeName={node}"} | ({"resourceVersion": "0"} if cached else {}))
        found = self._json("GET", f"{self._pods()}?{query}") or {}
        return [p for p in found.get("items") or [] if isinstance(p, dict)]

    def node_uid(self, node: str) -> str | None:
        found = self._json("GET", f"/api/v1/nodes/{node}") or {}
        return (found.get("metadata") or {}).get("uid")


def _state(pod: dict | None, uid: str | None) -> str:
    """gone (none, another pod of the name, being deleted), ended, or up (starting or serving)."""
    meta = (pod or {}).get("metadata") or {}
    if pod is None or (uid is not None and meta.get("uid") != uid) or meta.get("deletionTimestamp"):
        return "gone"
    return "ended" if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed") else "up"


def _by_gpu(pods: list[dict]) -> dict[str, dict]:
    """Daemon pods by their GPU's UUID (annotated, and named for it)."""
    out = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        uuid = (meta.get("annotations") or {}).get("sysdra.io/gpu-uuid")
        if isinstance(uuid, str) and meta.get("name") == pod_name(uuid):
            out[uuid] = pod
    return out


def _why_not(pod: dict) -> str | None:
    """What keeps a pod's container from running, as the kubelet reports it; None: nothing yet."""
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        for state in ("terminated", "waiting"):
            got = (status.get("state") or {}).get(state)
            if got and (state == "terminated" or got.get("reason") in _WAITING_FAILURES):
                detail = str(got.get("message") or (f"exit code {got['exitCode']}" if "exitCode" in got else ""))
                return f"{got.get('reason') or state}: {detail[-400:].strip()}".strip(": ")  # a traceback's end says why
    if (pod.get("status") or {}).get("phase") == "Failed":
        return (pod.get("status") or {}).get("reason") or "the pod failed"
    return None


class PodLauncher:
    def __init__(self, settings: MpsPodSettings, base: str, node: str, driver: str, boot_id: str, driver_root: str,
                 driver_paths: Callable[[], tuple[str | None, tuple[Library, ...]]], api: PodApi | None = None):
        self.settings, self.node, self.driver, self.boot_id = settings, node, driver, boot_id
        self.base = base  # <plugin dir>/mps: host paths, the same in the pod
        self.start_timeout = settings.start_timeout
        self.stop_timeout = GRACE + STOP_TIMEOUT  # seconds for a deleted pod to be gone (the kubelet confirms)
        self.driver_root = driver_root  # the host path the driver's files are named under
        self.host_driver_root = settings.host_driver_root or driver_root  # the host directory the pod mounts
        self.driver_paths = driver_paths  # the MPS binary's host path and the driver's libraries, now
        self.api = api or PodApi(settings.namespace)
        self._owner: dict | None = None
        self._looked = 0.0
        self._api_down = False  # logged once per outage

    def describe(self, rec: MpsRecord | None) -> str:
        if rec is None or rec.pod_uid is None:
            return "not running"
        return f"pod {self.settings.namespace}/{pod_name(rec.uuid)}"

    def alive(self, rec: MpsRecord | None) -> bool:
        """The record's pod is there, not ended, and its daemon's pipe is: a pod that never
        served (adopted while its start was awaited) is not the daemon. Read from etcd, not the
        watch cache, which may not have the pod a reconcile just made (prepare and a death's
        confirmation ask; the supervisor's round looks at all at once: ``alive_all``)."""
        if not self._ours(rec):
            return False
        return self._looked_at(lambda: {rec.uuid: self.api.get(pod_name(rec.uuid))}, {rec.uuid: rec})[rec.uuid]

    def alive_all(self, recs: dict[str, MpsRecord | None]) -> dict[str, bool]:
        """One listing of the node's daemon pods, from the server's watch cache, for every record."""
        ours = {uuid: rec for uuid, rec in recs.items() if self._ours(rec)}
        found = self._looked_at(self._listed, ours) if ours else {}
        return {uuid: found.get(uuid, False) for uuid in recs}

    def _ours(self, rec: MpsRecord | None) -> bool:
        return rec is not None and rec.pod_uid is not None and (rec.boot_id is None or rec.boot_id == self.boot_id)

    def _listed(self) -> dict[str, dict]:
        return _by_gpu(self.api.on_node(self.node, self.driver, cached=True))

    def _looked_at(self, pods: Callable[[], dict[str, dict | None]], recs: dict[str, MpsRecord]) -> dict[str, bool]:
        """{uuid: up}: its pod (``pods()``: by GPU) up and its pipe there; the API away: the
        pod is not ours to judge, its pipe is."""
        try:
            found = pods()
        except (ApiFailure, OSError) as err:
            if not self._api_down:
                log.warning("MPS daemon pods not looked at (%s): their pipes say whether they serve", err)
            self._api_down = True
            return {uuid: self._pipe_there(uuid) for uuid in recs}
        if self._api_down:
            log.info("MPS daemon pods looked at again")
        self._api_down = False
        return {uuid: _state(found.get(uuid), rec.pod_uid) == "up" and self._pipe_there(uuid) for uuid, rec in recs.items()}

    def _pipe_there(self, uuid: str) -> bool:
        return os.path.exists(os.path.join(self.base, uuid, "pipe", "control"))

    def _in_pod(self, host_path: str) -> str | None:
        rel = os.path.relpath(host_path, self.driver_root)
        return None if rel.startswith("..") else os.path.join(DRIVER_ROOT_IN_POD, rel)

    def manifest(self, uuid: str, dirs: dict[str, str]) -> dict:
        binary, libraries = self.driver_paths()
        command = self._in_pod(binary) if binary else None
        if command is None:
            raise LaunchError(f"no {BINARY} under the driver root {self.driver_root}")
        gpu_dir = os.path.dirname(dirs["pipe"])
        env = {"CUDA_VISIBLE_DEVICES": uuid, "CUDA_MPS_PIPE_DIRECTORY": dirs["pipe"], "CUDA_MPS_LOG_DIRECTORY": dirs["log"],
               "PATH": f"{os.path.dirname(command)}:{DEFAULT_PATH}"}  # the daemon starts nvidia-cuda-mps-server by name
        if libraries:  # links to the driver's libraries alone (launch): the image's loader, never the host's libc
            env["LD_LIBRARY_PATH"] = os.path.join(gpu_dir, "lib")
        labels = {"app.kubernetes.io/name": "sysdra-mps", "app.kubernetes.io/part-of": "sysdra",
                  "app.kubernetes.io/component": COMPONENT, "sysdra.io/driver": self.driver}
        container = {
            "name": COMPONENT, "image": self.settings.image, "imagePullPolicy": self.settings.pull_policy,
            "command": ["sh", "-c", _GUARD, gpu_dir, command, "-f"],
            "env": [{"name": k, "value": v} for k, v in env.items()],
            # root, as the agent that made its directories (0755); the image's own user may be another
            "securityContext": {"privileged": True, "runAsUser": 0, "runAsGroup": 0},
            "terminationMessagePolicy": "FallbackToLogsOnError",  # why it ended, in its status: the claim's error
            "volumeMounts": [{"name": "gpu", "mountPath": gpu_dir}, {"name": "shm", "mountPath": "/dev/shm"},
                             {"name": "driver-root", "mountPath": DRIVER_ROOT_IN_POD, "readOnly": True}],
        }  # fmt: skip
        spec = {
            "nodeName": self.node, "restartPolicy": "Never", "hostNetwork": True, "automountServiceAccountToken": False,
            "enableServiceLinks": False, "terminationGracePeriodSeconds": GRACE, "tolerations": [{"operator": "Exists"}],
            "containers": [container],
            "volumes": [{"name": "gpu", "hostPath": {"path": gpu_dir, "type": "Directory"}},
                        {"name": "shm", "hostPath": {"path": dirs["shm"], "type": "Directory"}},
                        {"name": "driver-root", "hostPath": {"path": self.host_driver_root, "type": "Directory"}}],
        }  # fmt: skip
        if self.settings.service_account_name:
            spec["serviceAccountName"] = self.settings.service_account_name
        if self.settings.priority_class_name:
            spec["priorityClassName"] = self.settings.priority_class_name
        if self.settings.image_pull_secrets:
            spec["imagePullSecrets"] = [{"name": n} for n in self.settings.image_pull_secrets]
        meta: dict = {"name": pod_name(uuid), "namespace": self.settings.namespace, "labels": labels,
                      "annotations": {"sysdra.io/gpu-uuid": uuid}}
        if owner := self._node_owner():
            meta["ownerReferences"] = [owner]
        return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}

    def _node_owner(self) -> dict | None:
        if self._owner is None:
            try:
                uid = self.api.node_uid(self.node)
            except (ApiFailure, OSError) as err:
                log.warning("Node %s not read (%s): MPS daemon pods without an owner", self.node, err)
                return None
            # the controller: `kubectl drain` deletes a pod with one (and none without --force)
            self._owner = {"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": uid, "controller": True} if uid else {}
        return self._owner or None

    def launch(self, uuid: str, dirs: dict[str, str], env: dict[str, str], binary: str) -> MpsRecord:
        """``env`` and ``binary`` are the agent's view; the pod has its own (``manifest``)."""
        name = pod_name(uuid)
        if not is_subdomain(name) or len(name) > 253:
            raise LaunchError(f"{name!r} is no pod name")
        _, libraries = self.driver_paths()
        try:
            link_libraries(os.path.join(os.path.dirname(dirs["pipe"]), "lib"), libraries, self._in_pod)
            made = self.api.create(self.manifest(uuid, dirs))
        except (ApiFailure, OSError) as err:
            raise LaunchError(f"creating pod {self.settings.namespace}/{name}: {err}") from err
        log.info("MPS control daemon pod %s/%s created for GPU %s", self.settings.namespace, name, uuid)
        return MpsRecord(uuid=uuid, pod_uid=made["metadata"]["uid"], boot_id=self.boot_id)

    def start_failed(self, rec: MpsRecord) -> str | None:
        now = time.monotonic()
        if now - self._looked < POLL:
            return None
        self._looked = now
        try:
            pod = self.api.get(pod_name(rec.uuid))
        except (ApiFailure, OSError):
            return None  # the start timeout decides
        if _state(pod, rec.pod_uid) == "gone":
            return "its pod was deleted"
        return _why_not(pod) if pod is not None else None

    def settle(self, rec: MpsRecord) -> MpsRecord:
        return rec

    def _delete(self, uuid: str, uid: str | None) -> None:
        """The GPU's pod (``uid``'s only, when given) deleted and gone; errors logged."""
        name = pod_name(uuid)
        try:
            self.api.delete(name, uid)
            deadline = time.monotonic() + self.stop_timeout
            while (pod := self.api.get(name)) is not None and (uid is None or (pod.get("metadata") or {}).get("uid") == uid):
                if time.monotonic() > deadline:  # terminating still: a new pod of the name must wait
                    log.error("MPS daemon pod %s/%s still there after %.0f s", self.settings.namespace, name, self.stop_timeout)
                    return
                time.sleep(POLL)
        except (ApiFailure, OSError) as err:
            log.error("MPS daemon pod %s/%s not deleted: %s", self.settings.namespace, name, err)

    def end(self, rec: MpsRecord, quitting: bool) -> None:
        """The record's pod deleted; a record without a UID made none this agent knows of (a
        pod of the name is another's, or a stray that ``end_strays`` and ``end_orphans`` find)."""
        if rec.pod_uid is not None:
            self._delete(rec.uuid, rec.pod_uid)

    def end_strays(self, uuid: str, pipe: str, known: MpsRecord | None) -> None:
        """A pod of the GPU's name that is not the recorded one (an agent killed between creating
        it and saving its UID; another agent's), before another starts."""
        try:
            pod = self.api.get(pod_name(uuid))
        except (ApiFailure, OSError) as err:
            raise LaunchError(f"pod {pod_name(uuid)} not read: {err}") from err
        uid = ((pod or {}).get("metadata") or {}).get("uid")
        if pod is not None and (known is None or known.pod_uid != uid):
            log.warning("MPS daemon pod %s of GPU %s is not the recorded one: deleted", pod_name(uuid), uuid)
            self._delete(uuid, uid)

    def pod_unseen(self, rec: MpsRecord) -> bool:
        """No pod of the record's name in the agent's namespace (a namespace changed at a restart: the
        record's is another's); False where the API cannot tell."""
        try:
            return self.api.get(pod_name(rec.uuid)) is None
        except (ApiFailure, OSError):
            return False

    def forget(self, rec: MpsRecord) -> None:
        """A record of another boot: the kubelet may have run its pod again, without the tmpfs."""
        self._delete(rec.uuid, rec.pod_uid)

    def end_orphans(self, keep: set[str]) -> None:
        """This node's daemon pods of GPUs no share needs and no record names."""
        try:
            pods = self.api.on_node(self.node, self.driver)
        except (ApiFailure, OSError) as err:
            log.warning("MPS daemon pods of node %s not listed (%s): orphans stay until the next look", self.node, err)
            return
        for uuid, pod in _by_gpu(pods).items():
            if uuid not in keep:
                log.info("MPS daemon pod %s of GPU %s serves no share: deleted", pod_name(uuid), uuid)
                self._delete(uuid, pod["metadata"].get("uid"))
