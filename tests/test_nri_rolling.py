"""Both instances of a rolling update are NRI plugins of the runtime at once, both ``50-sysdra``:
containerd (NRI v0.12.3, pkg/adaptation/adaptation.go) keeps both and calls every subscribed event
on each, one after the other, in no set order, and goes on to the next plugin when one's connection
closed (the old pod stopped mid-event). The two share the plugin directory (the checkpoint, its
``serialize.lock``): a NIC moves once, into its pod and back, whichever is called first, and an
event the first left halfway is finished by the second (docs/networking.md, "Rolling updates").
On the real kernel, as tests/test_nri_netdev.py. Root only."""

from __future__ import annotations

import pytest

from tests.test_nri_netdev import POINTS, Crash, mover, nets, pod, records, run, where, write_checkpoint  # noqa: F401


def test_two_instances_called_for_each_event_move_the_netdev_once(tmp_path, nets):  # noqa: F811
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)
    old, new = mover(tmp_path, nets), mover(tmp_path, nets)
    run(old.synchronized([]))
    run(new.synchronized([]))
    for first, second in ((old, new), (new, old)):
        for m in (first, second):
            run(m.pod_started(pod(nets)))
            assert where(nets) == (False, True)
            assert [r["state"] for r in records(tmp_path)] == ["in-pod"]
        for m in (second, first):
            run(m.pod_stopped(pod(nets)))
            assert where(nets) == (True, False)
            assert [r.get("state", "planned") for r in records(tmp_path)] == ["planned"]
        for m in (first, second):
            run(m.pod_removed(pod(nets)))
    assert where(nets) == (True, False)


@pytest.mark.parametrize("point", POINTS)
def test_an_event_the_stopped_instance_left_halfway_is_finished_by_the_other(tmp_path, nets, point):  # noqa: F811
    """The old pod stopped mid-event (containerd: its connection closed, the next plugin called)."""
    write_checkpoint(tmp_path / "checkpoint.json", nets.nic)

    def crash(at):
        if at == point:
            raise Crash(at)

    old, new = mover(tmp_path, nets, fault=crash), mover(tmp_path, nets)
    returning = point in ("netdev:returning", "netdev:returned")
    if returning:
        run(old.pod_started(pod(nets)))
        run(new.pod_started(pod(nets)))
    with pytest.raises(Crash):
        run((old.pod_stopped if returning else old.pod_started)(pod(nets)))
    run((new.pod_stopped if returning else new.pod_started)(pod(nets)))
    expect = (True, False) if returning else (False, True)
    assert where(nets) == expect
    assert [r.get("state", "planned") for r in records(tmp_path)] == ["planned" if returning else "in-pod"]
