"""The NRI netdev mover when things fail (agent/nri/netdev.py): a request the runtime gave up on,
a sandbox whose move failed, a look every 10 s that fails. On the real kernel, as
tests/test_nri_netdev.py (its namespaces and records). Root only.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading

from tests.controlplane import wait_until
from tests.test_nri_netdev import mover, nets, pod, records, run, write_checkpoint  # noqa: F401 - fixtures


def test_the_look_every_10s_survives_an_os_error(tmp_path, nets, caplog):
    """A round that fails with an OSError (the plugin's lock file cannot be opened) is logged; the
    next round looks again."""
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    m = mover(tmp_path, nets)
    run(m.pod_started(pod(nets)))
    os.unlink(tmp_path / "serialize.lock")
    os.mkdir(tmp_path / "serialize.lock")  # EISDIR for the flock's open
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever)
    thread.start()
    watching = asyncio.run_coroutine_threadsafe(m.watch(interval=0.05), loop)
    try:
        wait_until(lambda: "netdev records not looked at" in caplog.text, 30, what="a failed round")
        os.rmdir(tmp_path / "serialize.lock")
        subprocess.run(["ip", "netns", "del", nets.names["pod"]], check=True)
        wait_until(lambda: records(tmp_path)[0].get("state", "planned") == "planned", 30, what="the next round")
    finally:
        watching.cancel()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
