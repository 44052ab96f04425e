"""The kubelet plugin's sockets: a stale socket replaced and other files refused, a world-writable
registry dir refused, the rolling update's socket names (108-byte paths), two instances side by
side, and the new instance's start-up recovery waiting for the old one's prepare."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import stat
import tempfile

import pytest

from agent.kubeletplugin import KubeletPlugin, SocketError
from agent.kubeletplugin import sockets
from agent.kubeletplugin.claims import DirClaimSource
from agent.prepare.driver import Driver
from tests.kubelet_standin import (
    DRIVER, Env, KubeletStandIn, _waiting_for_flock, claim, find_registration_sockets, gpu, inventory, run, settings_for,
    store_claim,
)


def test_stale_socket_replaced_other_files_refused(tmp_path):
    e = Env(tmp_path)
    os.makedirs(e.settings.plugin_dir)
    s = socket.socket(socket.AF_UNIX)
    s.bind(e.plugin.dra_socket)  # left over from a killed instance
    s.close()

    async def main():
        async with e:
            assert stat.S_ISSOCK(os.stat(e.plugin.dra_socket).st_mode)
    run(main())

    os.makedirs(e.settings.registry_dir, exist_ok=True)
    with open(e.plugin.registration_socket, "w") as f:
        f.write("precious")
    e2 = Env(tmp_path)
    with pytest.raises(SocketError, match="is a file, not a socket"):
        run(e2.plugin.start())
    assert open(e.plugin.registration_socket).read() == "precious"
    assert not os.path.exists(e2.plugin.dra_socket)  # cleaned up after the failed start


def test_world_writable_registry_dir_refused(tmp_path):
    e = Env(tmp_path)
    os.makedirs(e.settings.registry_dir)
    os.chmod(e.settings.registry_dir, 0o777)
    with pytest.raises(SocketError, match="world-writable"):
        run(e.plugin.start())


def test_rolling_update_names(tmp_path):
    uid = "4f0c6cb4-9f8f-4d3b-a1c3-7b6f0c3a0d11"
    s = settings_for(str(tmp_path), kubelet_dir="/var/lib/kubelet", rolling_update_uid=uid)
    assert sockets.dra_socket_path(s).endswith(f"/plugins/{DRIVER}/dra-{uid}.sock")
    assert sockets.registration_socket_path(s) == os.path.join(s.registry_dir, f"{DRIVER}-{uid}-reg.sock")
    h8 = sockets.short_hash(uid, 8)
    h16 = sockets.short_hash(DRIVER + "\0" + uid, 16)
    assert len(h8) == 11 and len(h16) == 22 and "=" not in h8 + h16
    name1 = f"{DRIVER}-{uid}-reg.sock"
    for size, expected in [(108, name1), (109, f"{DRIVER}-{h8}-reg.sock")]:
        d = "/" + "d" * (size - len(name1) - 2)
        assert len(d + "/" + name1) == size
        assert sockets.rolling_update_registrar_name(d, DRIVER, uid) == expected
    name2 = f"{DRIVER}-{h8}-reg.sock"
    d = "/" + "d" * (109 - len(name2) - 2)
    assert sockets.rolling_update_registrar_name(d, DRIVER, uid) == f"dra-{h16}-reg.sock"
    assert sockets.rolling_update_registrar_name("/" + "d" * 200, DRIVER, uid) == f"dra-{h16}-reg.sock"


def test_rolling_update_two_instances_and_108_byte_path(tmp_path, request):
    """Two instances share the plugin dir; a registration path of exactly 108 bytes binds."""
    uid1 = "4f0c6cb4-9f8f-4d3b-a1c3-7b6f0c3a0d11"
    name1 = f"{DRIVER}-{uid1}-reg.sock"
    short = tempfile.mkdtemp(prefix="kp", dir="/tmp")  # pytest's tmp_path is too long for this
    request.addfinalizer(lambda: shutil.rmtree(short, ignore_errors=True))
    kubelet = os.path.join(short, "k")
    kubelet += "x" * (108 - len(kubelet + "/plugins_registry/" + name1))
    s1 = settings_for(str(tmp_path), kubelet_dir=kubelet, rolling_update_uid=uid1)
    s2 = settings_for(str(tmp_path), kubelet_dir=kubelet, rolling_update_uid="9a9a9a9a-0000-4000-8000-000000000000")
    inv = inventory(gpu(0))

    async def main():
        p1 = KubeletPlugin(s1, Driver(s1, lambda: inv), DirClaimSource(s1.cluster_dir))
        p2 = KubeletPlugin(s2, Driver(s2, lambda: inv), DirClaimSource(s2.cluster_dir))
        await p1.start()
        await p2.start()
        try:
            assert len(p1.registration_socket) == 108
            socks = find_registration_sockets(s1.registry_dir)
            assert socks == sorted([p1.registration_socket, p2.registration_socket])
            c = store_claim(s1, claim("c", [("r", "gpu-0000-1b-00-0")]))
            for sock in socks:  # prepare in one instance, unprepare in the other
                k = KubeletStandIn(s1.registry_dir)
                await k.register(sock)  # 108 bytes, as the kubelet takes them (gRPC alone stops at 107)
                resp = await (k.prepare(c) if sock == socks[0] else k.unprepare(c))
                assert resp.claims[c["metadata"]["uid"]].error == ""
            assert os.listdir(s1.cdi_dir) == []
        finally:
            await p2.stop()
            await p1.stop()
        assert find_registration_sockets(s1.registry_dir) == []
    run(main())


def test_start_up_recovery_waits_for_the_other_instance_of_a_rolling_update(tmp_path, request):
    """The old agent of a surge update still serves the kubelet while the new one starts: the new
    one's recovery (rolling back interrupted prepares, sweeping what no entry knows) holds the
    serialize lock, so it never takes the old one's prepare in progress for an interrupted one."""
    import threading

    from agent.kubeletplugin.service import SerializeLock
    from agent.prepare.checkpoint import COMPLETED, Checkpoint
    from tests.controlplane import wait_until

    kubelet = tempfile.mkdtemp(prefix="kp", dir="/tmp")  # pytest's tmp_path is too long for the sockets
    request.addfinalizer(lambda: shutil.rmtree(kubelet, ignore_errors=True))
    s1 = settings_for(str(tmp_path), kubelet_dir=kubelet, rolling_update_uid="4f0c6cb4-9f8f-4d3b-a1c3-7b6f0c3a0d11")
    s2 = settings_for(str(tmp_path), kubelet_dir=kubelet, rolling_update_uid="9a9a9a9a-0000-4000-8000-000000000000")
    inv = inventory(gpu(0))
    c = store_claim(s1, claim("c", [("r", "gpu-0000-1b-00-0")]))
    old, entered, proceed = Driver(s1, lambda: inv), threading.Event(), threading.Event()
    old.recover()
    old.fault = lambda point: (entered.set(), proceed.wait(30)) if point == "prepare:started" else None
    os.makedirs(s1.plugin_dir, exist_ok=True)
    lock = os.path.join(s1.plugin_dir, "serialize.lock")
    results = []
    preparing = threading.Thread(target=lambda: results.append(SerializeLock(lock).run(lambda _: old.prepare_claims([c]), None)))
    preparing.start()
    assert entered.wait(30)  # its intent saved (PrepareStarted), its steps under way, the lock held

    async def main():
        new = KubeletPlugin(s2, Driver(s2, lambda: inv), DirClaimSource(s2.cluster_dir))
        starting = asyncio.get_running_loop().create_task(new.start())
        try:
            await asyncio.to_thread(wait_until, lambda: starting.done() or _waiting_for_flock(lock), 30, what="the new start")
            assert not starting.done(), "recovery ran beside the old instance's prepare"
            proceed.set()
            await starting
            uid = c["metadata"]["uid"]
            assert results[0][uid].error is None
            assert Checkpoint.load(old.checkpoint_path).claims[uid]["state"] == COMPLETED  # not rolled back under it
            assert os.path.exists(old._spec_path(uid))
        finally:
            proceed.set()
            if not starting.done():
                await starting
            await new.stop()
    run(main())
    preparing.join()


def _another_is_refused(s) -> None:
    """A second agent on the same sockets (plugin dir and rolling-update UID) is refused."""
    with pytest.raises(sockets.InstanceLocked):
        sockets.InstanceLock(sockets.dra_socket_path(s)).acquire()


def test_instance_locks_of_a_rolling_update_do_not_pile_up_in_the_plugin_dir(tmp_path):
    """Every pod of a surge update has its own UID, so its own ``dra-<uid>.sock.lock``: one that
    stays after its agent stopped is left in the plugin dir for good (no later pod has that UID),
    one more file per agent pod the node ever ran. A stopped instance's lock file goes; a second
    agent with the same UID is still refused while the first one runs."""
    for uid in ("4f0c6cb4-9f8f-4d3b-a1c3-7b6f0c3a0d11", "9a9a9a9a-0000-4000-8000-000000000000"):
        s = settings_for(str(tmp_path), rolling_update_uid=uid)
        os.makedirs(s.plugin_dir, exist_ok=True)
        lock = sockets.InstanceLock(sockets.dra_socket_path(s))
        lock.acquire()
        _another_is_refused(s)
        lock.release()
    assert [n for n in os.listdir(s.plugin_dir) if n.endswith(".lock")] == []
    again = sockets.InstanceLock(sockets.dra_socket_path(s))  # the same UID again (a container restart)
    again.acquire()
    try:
        _another_is_refused(s)
    finally:
        again.release()


def test_an_instance_lock_released_while_the_next_agent_opens_it_is_not_held_twice(tmp_path, monkeypatch):
    """The stopping agent removes its lock file: an agent that opened the old file just before
    locks the file at the path, so a third one is refused while it runs."""
    import fcntl as real_fcntl
    import types

    s = settings_for(str(tmp_path), rolling_update_uid="4f0c6cb4-9f8f-4d3b-a1c3-7b6f0c3a0d11")
    os.makedirs(s.plugin_dir, exist_ok=True)
    first = sockets.InstanceLock(sockets.dra_socket_path(s))
    first.acquire()
    calls = []

    def flock(fd, op):  # the first agent stops between the second one's open and its flock
        if not calls:
            first.release()
        calls.append(op)
        return real_fcntl.flock(fd, op)

    monkeypatch.setattr(sockets, "fcntl", types.SimpleNamespace(flock=flock, LOCK_EX=real_fcntl.LOCK_EX,
                                                                LOCK_NB=real_fcntl.LOCK_NB))
    second = sockets.InstanceLock(sockets.dra_socket_path(s))
    second.acquire()
    monkeypatch.undo()
    try:
        _another_is_refused(s)
    finally:
        second.release()
