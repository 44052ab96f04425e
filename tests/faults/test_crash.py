"""Crash anywhere: SIGKILL the real agent while it prepares, unprepares and publishes.

Each trial starts ``python -m agent run`` (through tests.faults.crashpoint) on a copied
fixture node, checks every invariant after the restart, then drives a random mix of
NodePrepareResources / NodeUnprepareResources (real sockets, a KubeletClient in this
process) and hardware changes (unplug/replug in the copied tree) and kills the agent:

- ``delay`` trials: SIGKILL from this process at a random moment in the operation window;
- ``point`` trials: the agent SIGKILLs itself at a chosen point (a Driver.fault point, or
  just before/after the rename of a checkpoint snapshot or journal, CDI spec, metadata file
  or slice, half-way through a checkpoint journal append, or before its fdatasync).

Seeded by ``SYSDRA_FAULT_SEED`` (default fixed); every failure names the seed and the
trial. The operation mix, the points and the delays replay exactly; where a delay kill
lands depends on timing. ``SYSDRA_FAULT_TRIALS`` overrides the trial count (>= 200 in CI).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import time
from collections import Counter

import grpc
import pytest

from tests.faults.harness import SEED, Node, run

pytestmark = pytest.mark.slow

TRIALS = int(os.environ.get("SYSDRA_FAULT_TRIALS", "200"))
FULL_CLEANUP_EVERY = 25
DRIVER_POINTS = ["prepare:started", "prepare:specs-written", "prepare:completed", "unprepare:saved", "unprepare:done"]
RENAME_POINTS = [f"rename-{when}:{what}" for when in ("before", "after")
                 for what in ("checkpoint", "journal", "cdi-claim", "cdi-metadata", "metadata", "slice")]
JOURNAL_POINTS = ["journal-torn", "journal-written"]
POINTS = ["driver:" + p for p in DRIVER_POINTS] + RENAME_POINTS + JOURNAL_POINTS


def make_claims(node: Node) -> tuple[list[dict], list[str]]:
    devs = node.devices()
    g = [d for d in devs if d.startswith("gpu-")]
    n = [d for d in devs if d.startswith("nic-")]
    specs = [
        ("c0", [("gpu", g[0])], "accel"),
        ("c1", [("gpu", g[1]), ("nic", n[0])], None),
        ("c2", [("a", g[2]), ("b", g[3])], None),
        ("c3", [("nic", n[1])], "net"),
        ("c4", [("r/sub", g[4])], None),
        ("c5", [("multi", g[5]), ("multi", g[6])], None),
    ]
    claims = [node.write_claim(name, res, uid=f"{i:08d}-0000-4000-8000-00000000c1a1", pod_claim_name=pcn)
              for i, (name, res, pcn) in enumerate(specs)]
    return claims, [g[7], g[0], n[3]]  # hot-plug candidates: free GPU, c0's GPU, free NIC


def answer(resp, uid: str) -> list[tuple]:
    return [(d.pool_name, d.device_name, tuple(d.request_names), tuple(d.cdi_device_ids)) for d in resp.claims[uid].devices]


def uid_of(c: dict) -> str:
    return c["metadata"]["uid"]


def targeted_ops(rnd: random.Random, point: str, nth: int, claims: list[dict], hotplug: list[str]) -> list:
    """Operations that reach ``point`` ``nth`` times (unprepare before prepare makes it do work)."""
    if not point:
        return []
    subset = rnd.sample(claims, rnd.randint(1, 3))
    if point.endswith(":slice"):
        return [("hotplug", rnd.choice(hotplug)) for _ in range(nth)]
    if "unprepare" in point or ("checkpoint" in point or "journal" in point) and rnd.random() < 0.5:
        return [("prepare", subset), ("unprepare", subset)] * nth
    return [("unprepare", subset), ("prepare", subset)] * nth


@pytest.mark.timeout(900)  # ~140 s for 200 trials on 2 cores
def test_sigkill_anywhere(tmp_path, faults):
    rnd = random.Random(SEED)
    node = Node(tmp_path)
    claims, hotplug = make_claims(node)
    by_uid = {uid_of(c): c for c in claims}
    answers: dict[str, list[tuple]] = {}  # the first successful answer per claim
    generations: dict = {}
    stats = Counter()
    t_start = time.monotonic()

    def ctx(trial: int) -> str:
        return f"[SYSDRA_FAULT_SEED={SEED} trial={trial}; agent log {node.log_path}]"

    def check_answer(trial: int, resp, uid: str, ops_unplugged: set[str]) -> None:
        err = resp.claims[uid].error
        if err:
            devices = [r["device"] for r in by_uid[uid]["status"]["allocation"]["devices"]["results"]]
            assert "not on this node" in err and set(devices) & ops_unplugged, f"{ctx(trial)} claim {uid}: {err}"
            return
        got = answer(resp, uid)
        assert answers.setdefault(uid, got) == got, f"{ctx(trial)} claim {uid}: re-prepare answered differently"

    for trial in range(TRIALS):
        mode = "point" if trial % 2 else "delay"
        env = {}
        if mode == "point":
            point = POINTS[(trial // 2) % len(POINTS)]
            env = {"SYSDRA_FAULT_KILL_POINT": point, "SYSDRA_FAULT_KILL_NTH": str(rnd.randint(1, 2))}
        t_trial = time.monotonic()
        node.start(env=env)
        t_started = time.monotonic()
        # --- after the restart: every invariant ---------------------------------------
        try:
            cp = node.check_state(generations)
            node.wait_slices_converge()
            prepared = [by_uid[u] for u in cp.claims]
            if prepared:
                resp = run(node.prepare(*prepared))
                for c in prepared:
                    assert not resp.claims[uid_of(c)].error, f"re-prepare of a prepared claim failed: {resp.claims[uid_of(c)].error}"
                    check_answer(trial, resp, uid_of(c), set())
                node.check_state(generations)
            if trial % FULL_CLEANUP_EVERY == FULL_CLEANUP_EVERY - 1:
                resp = run(node.unprepare(*claims))
                assert all(not resp.claims[uid_of(c)].error for c in claims), resp
                node.check_clean()
                generations.clear()
                stats["full cleanups"] += 1
        except AssertionError as err:
            raise AssertionError(f"{ctx(trial)} {err}") from err
        t_checked = time.monotonic()
        # --- operations, killed somewhere ---------------------------------------------------
        ops = targeted_ops(rnd, env.get("SYSDRA_FAULT_KILL_POINT", ""), int(env.get("SYSDRA_FAULT_KILL_NTH", "1")),
                           claims, hotplug)
        for _ in range(rnd.randint(0 if ops else 1, 2)):
            kind = rnd.choices(["prepare", "unprepare", "hotplug"], weights=[5, 3, 2])[0]
            if kind == "hotplug":
                ops.append(("hotplug", rnd.choice(hotplug)))
            else:
                ops.append((kind, rnd.sample(claims, rnd.randint(1, len(claims)))))
        delay = rnd.uniform(0.0, 0.25)
        if mode == "point":
            node.proc.send_signal(signal.SIGUSR1)  # arm the kill point
            time.sleep(0.01)
        unplugged = set(node.unplugged())

        async def drive():
            loop = asyncio.get_running_loop()
            if mode == "delay":
                loop.call_later(delay, node.kill)
            for op, arg in ops:
                if op == "hotplug":
                    if arg in node.unplugged():
                        node.replug(arg)
                        unplugged.discard(arg)
                    else:
                        node.unplug(arg)
                        unplugged.add(arg)
                    stats["hotplug ops"] += 1
                    await asyncio.sleep(0.1)  # the agent's debounce, so the republish is in the window
                    continue
                try:
                    resp = await (node.prepare(*arg) if op == "prepare" else node.unprepare(*arg))
                except grpc.aio.AioRpcError:
                    stats["RPCs cut by the kill"] += 1
                    return
                stats[f"{op} RPCs completed"] += 1
                for c in arg:
                    if op == "prepare":
                        check_answer(trial, resp, uid_of(c), unplugged)
                    else:
                        assert not resp.claims[uid_of(c)].error, f"{ctx(trial)} unprepare: {resp.claims[uid_of(c)].error}"
                        for key in [k for k in generations if k[0] == uid_of(c)]:
                            del generations[key]  # a later prepare starts a new metadata lifetime
            await asyncio.sleep(0.2)  # let a point in publishing (slice rename) be reached

        run(drive())
        if os.environ.get("SYSDRA_FAULT_VERBOSE"):
            print(f"trial {trial} {mode} start {t_started - t_trial:.2f}s check {t_checked - t_started:.2f}s "
                  f"ops {time.monotonic() - t_checked:.2f}s {[o[0] for o in ops]}")
        died_by_itself = False
        if mode == "point":
            try:  # a cut RPC is seen before the dying process can be reaped
                node.proc.wait(timeout=0.5)
                died_by_itself = True
            except subprocess.TimeoutExpired:
                pass
        node.kill()
        stats[f"{mode} kills"] += 1
        if mode == "point":
            stats[f"point {env['SYSDRA_FAULT_KILL_POINT']} " + ("hit" if died_by_itself else "not reached")] += 1
        assert node.proc.returncode == -signal.SIGKILL, ctx(trial)

    # the last restart: check, then unprepare everything and nothing is left
    node.start()
    node.check_state(generations)
    node.wait_slices_converge()
    resp = run(node.unprepare(*claims))
    assert all(not resp.claims[uid_of(c)].error for c in claims)
    node.check_clean()
    assert node.stop() == 0
    elapsed = time.monotonic() - t_start
    print(f"seed {SEED}: {TRIALS} trials in {elapsed:.0f}s: {dict(sorted(stats.items()))}")
    hit = sum(v for k, v in stats.items() if k.endswith(" hit"))
    faults.add("Crash anywhere", "SIGKILL at a random moment while preparing/unpreparing/publishing",
               stats["delay kills"], "restart consistent; re-prepare same devices; slices converge")
    faults.add("Crash anywhere", f"SIGKILL at a chosen point ({len(POINTS)} points: Driver.fault points, "
               "before/after each atomic rename, mid-append and before fdatasync of the checkpoint journal)",
               stats["point kills"],
               f"restart consistent ({hit} kills landed exactly on the point)")
    faults.add("Crash anywhere", "unprepare everything after a series of crashes", stats["full cleanups"] + 1,
               "no CDI spec, metadata dir or temp file left")
    missed = [k for k in stats if k.endswith(" not reached")]
    never = [p for p in POINTS if f"point {p} hit" not in stats] if TRIALS >= 100 else []
    assert hit >= 0.9 * stats["point kills"] and not never, \
        f"point kills that did not land: {missed}"
