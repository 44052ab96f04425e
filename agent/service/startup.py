"""What ``sysdra run`` settles before it serves anything: its directories, resolved once
and checked, and the exit codes of a refused start.

Directories are resolved (``realpath``) once here and used in that form for the life of
the process, so swapping a symlink later cannot redirect a write or a delete. A directory
that someone other than root or us could change, itself or through a parent, is refused:
whoever can write there can replace our sockets or plant files we would trust. Our own
plugin directory gets mode 0750 (a looser existing one is tightened, with a warning).

The store for ``--cluster`` is made here too. Every refusal is a ``StartupError``: one line on
stderr and a documented exit code (docs/operations.md "Exit codes"), never a traceback."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat

from agent.fsutil import make_dirs
from agent.settings import Settings

log = logging.getLogger("sysdra.startup")

EX_DATAERR = 65  # the checkpoint is of a newer sysdra
EX_CANTCREAT = 73  # a directory or socket cannot be created
EX_TEMPFAIL = 75  # another agent serves the same sockets (systemd retries)
EX_NOPERM = 77  # a directory others can write to
EX_CONFIG = 78  # a bad setting; also the API's connection settings (kubeconfig)
PLUGIN_DIR_MODE = 0o750
CDI_DIR_MODE = 0o755


class StartupError(Exception):
    """The agent must not start; ``str()`` is the one line to print, ``code`` the exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def unsafe_reason(path: str) -> str | None:
    """Why ``path`` (resolved, existing) or one of its parents could be changed by another
    user, or None. Allowed: owned by root or us, and not writable by group or others unless
    the group is root's or ours, or the directory is sticky (like /tmp: others cannot
    rename or remove what we own in it)."""
    euid, egid = os.geteuid(), os.getegid()
    p = path
    while True:
        st = os.lstat(p)
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid not in (0, euid):
            return f"{p} is owned by uid {st.st_uid}, not root or this user"
        if not stat.S_ISVTX & mode:
            if mode & stat.S_IWOTH:
                return f"{p} is writable by others (mode {mode:o})"
            if mode & stat.S_IWGRP and st.st_gid not in (0, egid):
                return f"{p} is writable by group {st.st_gid} (mode {mode:o})"
        parent = os.path.dirname(p)
        if parent == p:
            return None
        p = parent


def _ensure(path: str, mode: int, what: str) -> None:
    try:
        make_dirs(path, mode)
    except OSError as err:
        raise StartupError(f"cannot create the {what} {path}: {err.strerror or err}", EX_CANTCREAT) from err
    if not os.path.isdir(path):
        raise StartupError(f"the {what} {path} is not a directory", EX_CANTCREAT)


def resolve(settings: Settings) -> Settings:
    """Create and check the directories; return settings holding their resolved paths."""
    kubelet = os.path.realpath(settings.kubelet_dir)
    _ensure(kubelet, PLUGIN_DIR_MODE, "kubelet directory")
    cdi = os.path.realpath(settings.cdi_dir)
    _ensure(cdi, CDI_DIR_MODE, "CDI directory")
    update: dict = {"kubelet_dir": kubelet, "cdi_dir": cdi}
    if settings.cluster_dir is not None:
        update["cluster"] = "dir:" + os.path.realpath(settings.cluster_dir)
    if settings.status_socket:
        d, name = os.path.split(settings.status_socket)
        update["status_socket"] = os.path.join(os.path.realpath(d), name)
    resolved = settings.replace(**update)
    plugin = resolved.plugin_dir
    _ensure(plugin, PLUGIN_DIR_MODE, "plugin directory")
    if os.path.realpath(plugin) != plugin:
        raise StartupError(f"the plugin directory {plugin} is (or is below) a symlink to {os.path.realpath(plugin)}; "
                           "it must be a real directory", EX_NOPERM)
    for what, path in (("kubelet directory", kubelet), ("CDI directory", cdi), ("plugin directory", plugin)):
        reason = unsafe_reason(path)
        if reason is not None and what == "plugin directory" and reason.startswith(plugin + " is writable"):
            reason = None  # ours: tightened below
        if reason is not None:
            raise StartupError(f"refusing the {what} {path}: {reason}; fix its owner or mode", EX_NOPERM)
    mode = stat.S_IMODE(os.stat(plugin).st_mode)
    if mode & ~PLUGIN_DIR_MODE:
        log.warning("plugin directory %s had mode %o: tightened to %o", plugin, mode, PLUGIN_DIR_MODE)
        os.chmod(plugin, mode & PLUGIN_DIR_MODE)
    return resolved


REGISTRATION_WAIT = 10.0  # seconds the first publish to the API waits for the kubelet's registration


async def until_registered(answered: asyncio.Event) -> None:
    """The kubelet's answer to the registration (it looks for new sockets about once a second),
    or REGISTRATION_WAIT seconds: a kubelet that is down must not keep the devices unpublished."""
    try:
        await asyncio.wait_for(answered.wait(), REGISTRATION_WAIT)
    except asyncio.TimeoutError:
        log.warning("the kubelet has not registered the plugin within %.0f s: publishing anyway (a pod allocated "
                    "before it does fails prepare with \"not registered\" until then)", REGISTRATION_WAIT)


async def unless_stopped(stop: asyncio.Event, step, cancel: bool = True) -> bool:
    """Run a start-up step unless ``stop`` is set first (SIGTERM during start-up): then the
    step is cancelled (``cancel=False``: let finish) and False returned."""
    task = asyncio.ensure_future(step)
    waiter = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        waiter.cancel()
        task.result()
        return True
    if cancel:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    else:
        await task
    log.info("stopping: stop requested during start-up")
    return False


async def cancel_all(tasks: list[asyncio.Task]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def make_store(settings: Settings):
    """The store for ``--cluster``; returns (store, closer)."""
    if settings.cluster_dir is not None:
        from agent.publish.dirstore import DirStore

        try:
            return DirStore(settings.cluster_dir, node_name=settings.node_name, driver_name=settings.driver_name), None
        except OSError as err:  # e.g. a read-only file system (a systemd unit's sandbox)
            raise StartupError(f"cluster directory {settings.cluster_dir}: {err}", EX_CANTCREAT) from None
    from agent.publish.kubestore import KubeStore, kube_client

    from lightkube.core.exceptions import ConfigError as KubeConfigError

    try:
        client = kube_client(field_manager=settings.driver_name)
    except KubeConfigError as err:  # no kubeconfig yet, or a broken one: not a crash to restart in a loop
        raise StartupError(f"the API server's connection settings ($KUBECONFIG, ~/.kube/config or the in-cluster "
                           f"service account): {err}", EX_CONFIG) from None
    return KubeStore(client, node_name=settings.node_name, driver_name=settings.driver_name), client
