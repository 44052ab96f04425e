"""``exclude_devices`` (discovery/exclude.py): devices the operator leaves out by PCI address glob,
netdev name glob or kind are never published, nor in health; ``sysdra scan`` names the rule."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from agent.service.daemon import Agent
from agent.settings import ConfigError, Settings
from discovery.exclude import Exclusions
from discovery.inventory import IncrementalScanner, scan
from tests.conftest import REPO, profile_root
from tests.kubelet_standin import settings_for

ROOT = profile_root("server-2s-gpu-nic")  # NICs 1a:00.0 ibp26s0, 3c:00.0 enp60s0np0, 9f:00.0 ibp159s0, bd:00.0 enp189s0np0


def test_rules_are_parsed_strictly():
    rules = Exclusions.parse(["PCI:0000:3B:00.*", " interface: ens1f* ", "kind:fpga", "kind:fpga"])
    assert rules.rules == (("pci", "0000:3b:00.*"), ("interface", "ens1f*"), ("kind", "fpga"))
    for bad, said in (("0000:3b:00.0", "is not pci:<glob>"), ("pci:eth0", "not a glob of PCI addresses"),
                      ("interface:a b", "not a glob of interface names"), ("kind:disk", "is not a device kind"),
                      ("slot:1", "is not pci:<glob>")):
        with pytest.raises(ValueError, match=said):
            Exclusions.parse([bad])
    assert not Exclusions.parse([])
    assert len(Exclusions.parse([f"interface:eth{i}" for i in range(256)]).rules) == 256
    with pytest.raises(ValueError, match="257 rules, at most 256"):
        Exclusions.parse([f"interface:eth{i}" for i in range(257)])


def test_an_interface_rule_takes_a_nic_by_any_of_its_netdevs():
    rules = Exclusions.parse(["interface:ens1f*"])
    assert rules.interfaces(["eth9", "ens1f0"]) == "interface:ens1f*" and rules.interfaces(["eth9"]) is None


def test_excluded_devices_are_not_offered_and_say_which_rule():
    whole = scan(ROOT, nvml=None)
    inv = scan(ROOT, exclude=Exclusions.parse(["pci:0000:1a:*", "interface:enp189*", "kind:gpu"]))
    names = {d.name for d in inv.devices}
    assert names == {"nic-0000-3c-00-0", "nic-0000-9f-00-0"}
    reasons = {s.bdf: s.reason for s in inv.skipped}
    assert reasons["0000:1a:00.0"] == "excluded by the node's exclude_devices (pci:0000:1a:*)"
    assert reasons["0000:bd:00.0"] == "excluded by the node's exclude_devices (interface:enp189*)"
    assert reasons["0000:18:00.0"] == "excluded by the node's exclude_devices (kind:gpu)"
    assert [d for d in whole.devices if d.name in names] == list(inv.devices)  # the others as without rules
    assert scan(ROOT, exclude=Exclusions()) == whole


def test_an_incremental_rescan_keeps_them_out():
    sc = IncrementalScanner(ROOT, exclude=Exclusions.parse(["interface:enp60s0np0"]))
    sc.full()
    inv = sc.update({"0000:3c:00.0"})
    assert "nic-0000-3c-00-0" not in inv.by_name()
    assert any(s.bdf == "0000:3c:00.0" and "interface:enp60s0np0" in s.reason for s in inv.skipped)


def test_the_setting_takes_a_list_or_a_comma_list_and_names_a_bad_rule():
    assert Settings.of({"exclude_devices": "kind:fpga, interface:ens1f*"}).exclude_devices == ("kind:fpga", "interface:ens1f*")
    assert Settings.of({"exclude_devices": ["pci:0000:3B:00.0"]}).exclude_devices == ("pci:0000:3b:00.0",)
    with pytest.raises(ConfigError, match="invalid setting exclude-devices: 'gpu' is not pci:<glob>"):
        Settings.of({"exclude_devices": "gpu"})


def test_the_agent_publishes_none_of_them_and_checks_no_health(tmp_path):
    from agent.health.monitor import HealthMonitor

    s = settings_for(str(tmp_path), root=ROOT, metrics_address="", exclude_devices=("interface:enp60s0np0", "kind:gpu"))
    agent = Agent(s)

    async def publish():
        await agent.rescan()
        await agent.publisher.sync_once()

    asyncio.run(publish())
    published = set()
    for dirpath, _, files in os.walk(s.cluster_dir):
        for name in files:
            with open(os.path.join(dirpath, name)) as f:
                published |= {d["name"] for d in json.load(f)["spec"]["devices"]}
    assert published == {"nic-0000-1a-00-0", "nic-0000-9f-00-0", "nic-0000-bd-00-0"}
    assert set(HealthMonitor(s, lambda: agent.inventory)._check_all()) == published


def test_scan_takes_the_flag():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYSDRA_")}
    out = subprocess.run([sys.executable, "-m", "agent", "scan", "--root", ROOT, "--nvml", "false", "--exclude-devices",
                          "kind:gpu,interface:enp60s0*"], cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert "0000:3c:00.0  excluded by the node's exclude_devices (interface:enp60s0*)" in out.stdout
    assert "gpu-0000" not in out.stdout.split("not offered")[0]
    items = json.loads(subprocess.run(
        [sys.executable, "-m", "agent", "scan", "--root", ROOT, "-o", "slices", "--node-name", "node-a",
         "--exclude-devices", "kind:nic"], cwd=REPO, capture_output=True, text=True, timeout=60,
        env={**env, "SYSDRA_CONFIG": os.devnull}).stdout)["items"]
    assert not [d for item in items for d in item["spec"]["devices"] if d["name"].startswith("nic-")]
    bad = subprocess.run([sys.executable, "-m", "agent", "scan", "--root", ROOT, "--exclude-devices", "gpu"], cwd=REPO,
                         capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 2 and "'gpu' is not pci:<glob>" in bad.stderr
