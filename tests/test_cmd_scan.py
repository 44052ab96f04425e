"""``sysdra scan -o slices`` takes the publishing flags of ``sysdra run`` (one definition)
and prints what run would publish with them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from agent.cli import main as cli
from agent.cli import publishing
from tests.conftest import REPO, profile_root


def _options(command: str) -> set[str]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return {opt for a in sub._actions for opt in a.option_strings}


def test_scan_and_run_take_every_publishing_flag():
    flags = {f"--{f}" for f in publishing.VALUE_FLAGS + publishing.SWITCH_FLAGS}
    assert flags <= _options("scan")
    assert flags <= _options("run")
    assert "--config" in _options("scan")


def _scan_slices(*argv: str, env: dict | None = None) -> list[dict]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SYSDRA_")}
    environ.update(env or {}, SYSDRA_CONFIG=os.devnull)
    out = subprocess.run([sys.executable, "-m", "agent", "scan", "-o", "slices", "--node-name", "node-a", *argv],
                         cwd=REPO, capture_output=True, text=True, timeout=60, env=environ)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["items"]


def _from_run(profile: str, *argv: str) -> list[dict]:
    """What the daemon's own pool code gives for the same settings as ``sysdra run`` parses them."""
    from agent.cli.run import settings_from_args
    from agent.publish.slices import slices_list
    from discovery.inventory import scan

    args = cli.build_parser().parse_args(["run", "--config", os.devnull, "--root", profile_root(profile),
                                          "--node-name", "node-a", *argv])
    settings = settings_from_args(args)
    return slices_list(scan(settings.root, list_attributes=settings.list_attributes), settings)["items"]


def test_pf_vf_exclusive_reaches_scan_output():
    plain = _scan_slices("--root", profile_root("sriov-nic"))
    exclusive = _scan_slices("--root", profile_root("sriov-nic"), "--pf-vf-exclusive")
    assert not any("sharedCounters" in s["spec"] for s in plain)
    assert any("sharedCounters" in s["spec"] for s in exclusive)
    assert exclusive == _from_run("sriov-nic", "--pf-vf-exclusive")


def test_settings_from_the_environment_apply_as_for_run():
    by_env = _scan_slices("--root", profile_root("sriov-nic"), env={"SYSDRA_PF_VF_EXCLUSIVE": "true"})
    assert by_env == _from_run("sriov-nic", "--pf-vf-exclusive")


def test_bad_publishing_setting_exits_78_like_run():
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SYSDRA_")}
    out = subprocess.run([sys.executable, "-m", "agent", "scan", "-o", "slices", "--root", profile_root("sriov-nic"),
                          "--config", os.devnull, "--driver-name", "Not_A_Domain"],
                         cwd=REPO, capture_output=True, text=True, timeout=60, env=environ)
    assert out.returncode == 78 and "driver-name" in out.stderr


def test_taint_unhealthy_shows_the_taint_run_would_publish(tmp_path):
    import glob
    import shutil

    root = tmp_path / "root"
    shutil.copytree(profile_root("server-2s-gpu-nic"), root, symlinks=True)
    nic_net = glob.glob(str(root / "sys/bus/pci/devices/0000:1a:00.0/net/*"))[0]
    with open(os.path.join(nic_net, "carrier"), "w") as f:
        f.write("0\n")

    def taints(*argv: str) -> dict:
        return {d["name"]: d.get("taints") for s in _scan_slices("--root", str(root), *argv) for d in s["spec"].get("devices", [])}

    assert taints()["nic-0000-1a-00-0"] is None
    tainted = taints("--taint-unhealthy")["nic-0000-1a-00-0"]
    assert tainted and tainted[0]["key"] == "sysdra.io/unhealthy" and tainted[0]["effect"] == "NoSchedule"


def test_the_scan_command_ends_its_process_without_teardown_and_loses_no_output(tmp_path):
    """As a command (``python -m agent``, the ``sysdra`` script), scan leaves by ``os._exit``
    once its output is flushed: the whole output reaches a pipe and a file, the exit status
    is kept, and no teardown runs (an atexit handler would otherwise print)."""
    from agent.cli.scan import json_text
    from discovery.inventory import scan

    root = profile_root("server-2s-gpu-nic")
    expected = json_text(scan(root).to_json())
    probe = ("import atexit, sys; atexit.register(lambda: sys.stderr.write('teardown ran'));"
             "sys.argv[0] = 'sysdra'; from agent.cli.main import entry; entry()")  # fmt: skip
    piped = subprocess.run([sys.executable, "-c", probe, "scan", "--root", root, "-o", "json"], cwd=REPO,
                           capture_output=True, timeout=60)
    assert piped.returncode == 0 and piped.stdout == expected and b"teardown ran" not in piped.stderr
    with open(tmp_path / "out.json", "wb") as out:
        to_file = subprocess.run([sys.executable, "-m", "agent", "scan", "--root", root, "-o", "json"], cwd=REPO,
                                 stdout=out, stderr=subprocess.PIPE, timeout=60)
    assert to_file.returncode == 0 and (tmp_path / "out.json").read_bytes() == expected
    missing = subprocess.run([sys.executable, "-c", probe, "scan", "--root", str(tmp_path / "absent")], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "is not a directory" in missing.stderr and "teardown ran" not in missing.stderr


def test_only_commands_that_ask_for_it_skip_the_teardown():
    """``run`` (the daemon) and the commands that write files keep the interpreter's normal
    exit; in-process callers (tests, ``main(argv)``) always get the status back."""
    parser = cli.build_parser()
    assert parser.parse_args(["scan"]).quick_exit is True
    for argv in (["run"], ["status"], ["doctor"]):
        assert not getattr(parser.parse_args(argv), "quick_exit", False), argv


def test_a_named_command_parses_as_with_every_command_and_loads_no_other():
    """``sysdra scan ...`` builds the scan parser alone: the same arguments parse to the same
    values as with the whole parser, the other commands' modules are not imported, and
    ``sysdra --help`` (or a mistyped command) still lists or names every command."""
    root = profile_root("sriov-nic")
    for argv in (["scan", "--root", root, "-o", "json"], ["scan", "--root", root, "-o", "slices", "--node-name", "n"],
                 ["run", "--root", root, "--node-name", "n", "--debounce", "0.5"], ["status"], ["doctor"]):
        assert cli.build_parser(argv[0]).parse_args(argv) == cli.build_parser().parse_args(argv), argv
    probe = ("import sys; from agent.cli.main import main; main(sys.argv[1:]);"
             "print(sorted(m for m in sys.modules if m.startswith('agent.cli.')), file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", probe, "scan", "--root", root, "-o", "json"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and json.loads(out.stdout)["devices"]
    assert out.stderr.strip().splitlines()[-1] == "['agent.cli.main', 'agent.cli.publishing', 'agent.cli.scan']"
    helped = subprocess.run([sys.executable, "-m", "agent", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and all(name in helped.stdout for name in cli.COMMANDS)
    wrong = subprocess.run([sys.executable, "-m", "agent", "scna"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and "invalid choice: 'scna'" in wrong.stderr and "metadata" in wrong.stderr


def test_compatibility_groups_and_skipped_node_operations_reach_the_pool():
    """``pool_options``: the one place the settings become the pool's shape, for run and scan."""
    grouped = _from_run("mi300x-partitions", "--partitions", "--compatibility-groups")
    assert grouped != _from_run("mi300x-partitions", "--partitions")
    assert _scan_slices("--root", profile_root("mi300x-partitions"), "--partitions", "--compatibility-groups") == grouped
    skipped = _scan_slices("--root", profile_root("h200-vm"), env={"SYSDRA_SKIP_NODE_OPERATIONS": '{gpu: ["*"]}'})
    assert ["*"] in [s["spec"].get("skipNodeOperations") for s in skipped]



_FROZEN = """
import asyncio, gc, sys
from agent.cli import main as cli
cli._quick_exit = lambda status: None
asyncio.run = lambda coro: coro.close()  # run: what start-up left, not the daemon
code = cli.main(sys.argv[1:], own_process={own})
print(code, gc.get_freeze_count() > 0)
"""


def test_the_sysdra_process_takes_its_start_up_heap_out_of_the_collectors_walks(tmp_path):
    """``sysdra scan`` and ``sysdra run`` as their own process freeze what their start-up made
    (a full scan's collections need not walk it); called in a process of someone else's (tests,
    tools) they leave that process's collector alone."""
    root = profile_root("server-2s-gpu-nic")
    commands = (["scan", "--root", root, "-o", "json"],
                ["run", "--root", root, "--node-name", "n", "--cluster", f"dir:{tmp_path}", "--metrics-address", ""])
    for argv in commands:
        for own in (True, False):
            out = subprocess.run([sys.executable, "-c", _FROZEN.format(own=own), *argv], cwd=REPO, capture_output=True,
                                 text=True, timeout=60, env={**os.environ, "SYSDRA_CONFIG": os.devnull})
            assert out.returncode == 0, out.stderr
            assert out.stdout.splitlines()[-1].split()[-1] == str(own), (argv[0], own)
