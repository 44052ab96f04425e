"""The pod sandboxes the runtime runs, as its NRI events tell: the agent's view of which pod
has which network namespace (the key for moving a claim's NIC into a pod)."""

from __future__ import annotations

import logging

from agent.nri.plugin import Pod

log = logging.getLogger(__name__)


class Sandboxes:
    """A :class:`agent.nri.plugin.PodEvents` keeping the running sandboxes by id."""

    def __init__(self) -> None:
        self.pods: dict[str, Pod] = {}

    def configured(self, request_timeout: float | None) -> None:
        pass

    async def synchronized(self, pods: list[Pod]) -> None:
        self.pods = {p.id: p for p in pods}

    async def pod_started(self, pod: Pod) -> None:
        self.pods[pod.id] = pod
        log.info("NRI: pod sandbox %s/%s started (%s)", pod.namespace, pod.name,
                 f"network namespace {pod.netns}" if pod.netns else "host network")

    async def pod_stopped(self, pod: Pod) -> None:
        log.info("NRI: pod sandbox %s/%s stopped", pod.namespace, pod.name)

    async def pod_removed(self, pod: Pod) -> None:
        self.pods.pop(pod.id, None)
        log.info("NRI: pod sandbox %s/%s removed", pod.namespace, pod.name)

    async def container_created(self, pod: Pod, container: str) -> None:
        log.debug("NRI: container %s of %s/%s created", container, pod.namespace, pod.name)

