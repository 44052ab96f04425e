"""The agent's alerts (deploy/helm/sysdra/files/alerts.yaml) with the real Prometheus (Debian's
``prometheus`` package: ``promtool`` and the server):

- promtool checks the rule file and runs its cases (tests/alerts/sysdra_alerts_test.yaml);
- a real Prometheus scrapes a real ``sysdra run`` (offline mode) and evaluates the rules: every
  series a rule selects is there from the first scrape (at 0 where it counts), a checkpoint
  damaged at start fires, the missing registration is pending until the kubelet registers, and the
  first prepare error fires (it would not if ``sysdra_prepare_total{result="error"}`` appeared
  with it). The kubelet is the repository's stand-in client (agent/kubeletplugin/kubelet_client.py):
  what the alerts watch is the agent's metrics, whoever calls it; the real kubelet's registration
  and prepare are tests/test_realnode*.py's."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import urllib.parse
import urllib.request

import pytest
import yaml

from tests.conftest import REPO, require_tool
from tests.controlplane import wait_until
from tests.kubelet_standin import KubeletStandIn, claim
from tests.test_agent_service import _agent, _free_port, _stop

RULES = os.path.join(REPO, "deploy", "helm", "sysdra", "files", "alerts.yaml")
CASES = os.path.join(REPO, "tests", "alerts", "sysdra_alerts_test.yaml")
# a metric name with its label matchers, as the rules write them
_SELECTOR = re.compile(r"\b((?:sysdra_\w+|process_start_time_seconds)(?:\{[^}]*\})?)")


def _rules() -> list[dict]:
    with open(RULES) as f:
        return [r for g in yaml.safe_load(f)["groups"] for r in g["rules"]]


def test_promtool_checks_the_rules_and_runs_their_cases():
    promtool = require_tool("promtool")
    for args in (["check", "rules", RULES], ["test", "rules", CASES]):
        got = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)
        assert got.returncode == 0, got.stdout + got.stderr
    tested = {t["alertname"] for case in yaml.safe_load(open(CASES))["tests"] for t in case["alert_rule_test"]}
    assert tested == {r["alert"] for r in _rules()}, "every alert has a case"


def test_every_selector_of_the_rules_is_one_the_agent_can_export():
    """Names and label values the rules select, against the agent's metric definitions (a renamed
    metric or label value would leave an alert that never fires)."""
    from agent.service.metrics import Metrics

    exported = {}
    for family in Metrics().registry.collect():
        for sample in family.samples:
            exported.setdefault(sample.name, []).append(sample.labels)
    for rule in _rules():
        for selector in _SELECTOR.findall(rule["expr"]):
            name, _, matchers = selector.partition("{")
            assert name in exported, f"{rule['alert']}: {name} is not exported"
            for label, op, value in re.findall(r'(\w+)\s*(=~|=)\s*"([^"]*)"', matchers):
                values = {labels.get(label) for labels in exported[name]}
                wanted = value.split("|") if op == "=~" else [value]
                assert set(wanted) <= values, f"{rule['alert']}: {name}{{{label}}} has {values}, not {wanted}"


class _Prometheus:
    """A real Prometheus server on 127.0.0.1 scraping one target each second, with the rules."""

    def __init__(self, tmp_path, target: str):
        self.port = _free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [RULES],
            "scrape_configs": [{"job_name": "sysdra", "static_configs": [{"targets": [target], "labels": {"node": "node-a"}}]}],
        }))  # fmt: skip
        self.proc = subprocess.Popen(
            [require_tool("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))  # fmt: skip
        self.log = tmp_path / "prometheus.log"

    def get(self, path: str, **params) -> dict:
        url = f"http://127.0.0.1:{self.port}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.load(r)["data"]

    def query(self, expr: str) -> list[dict]:
        return self.get("/api/v1/query", query=expr)["result"]

    def alerts(self, but: str = "") -> dict[str, str]:
        """alert name -> state (pending, firing) of the active alerts (``but`` left out)."""
        return {a["labels"]["alertname"]: a["state"] for a in self.get("/api/v1/alerts")["alerts"]
                if a["labels"]["alertname"] != but}

    def wait(self, what: str, check, timeout: float = 60.0):
        """The first true ``check()`` (tests.controlplane.wait_until), with the alerts and the log if none."""
        return wait_until(check, timeout, what=what, proc=self.proc,
                          tail=lambda: f"alerts {self.alerts()}\n{self.log.read_text()[-3000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.mark.slow
def test_a_real_prometheus_alerts_on_a_real_agent(tmp_path):
    kubelet_dir = tmp_path / "kubelet"
    plugin_dir = kubelet_dir / "plugins" / "sysdra.io"
    plugin_dir.mkdir(parents=True)
    (plugin_dir / "checkpoint.json").write_text("{nope")  # damaged before the agent's start
    port = _free_port()
    config = tmp_path / "config.yaml"
    config.write_text(f"metrics_address: 127.0.0.1:{port}\n")
    agent = _agent(tmp_path, str(config), {})
    prometheus = None
    try:
        prometheus = _Prometheus(tmp_path, f"127.0.0.1:{port}")
        # `up` is stored with the scrape's samples (a target's health is reported before they are)
        prometheus.wait("the agent scraped", lambda: prometheus.query('up{job="sysdra"} == 1'))
        # every series the rules select, from the first scrape on
        for rule in _rules():
            for selector in _SELECTOR.findall(rule["expr"]):
                assert prometheus.query(selector), f"{rule['alert']}: no series {selector}"
        assert prometheus.query('sysdra_prepare_total{result="error"}')[0]["value"][1] == "0"
        at_start = {"SysdraCheckpointDamaged": "firing", "SysdraNotRegistered": "pending"}
        # (the fixture's NIC without a link makes SysdraDevicesUnhealthy pending once the health monitor ran)
        prometheus.wait("the alerts at start", lambda: prometheus.alerts(but="SysdraDevicesUnhealthy") == at_start)
        (fired,) = [a for a in prometheus.get("/api/v1/alerts")["alerts"] if a["labels"]["alertname"] == "SysdraCheckpointDamaged"]
        assert fired["annotations"]["summary"] == "sysdra moved a damaged checkpoint aside on node-a"

        prometheus.wait("the registration socket", (kubelet_dir / "plugins_registry" / "sysdra.io-reg.sock").exists)
        kubelet = KubeletStandIn(str(kubelet_dir / "plugins_registry"))
        missing = claim("gone", [("gpu", "gpu-0")], pool="node-a")  # never stored: its prepare fails

        async def register_and_prepare():
            await kubelet.register()
            resp = await kubelet.prepare(missing)
            assert resp.claims[missing["metadata"]["uid"]].error

        asyncio.run(register_and_prepare())
        prometheus.wait("the prepare error and the registration", lambda: prometheus.alerts(but="SysdraDevicesUnhealthy") == {
            "SysdraCheckpointDamaged": "firing", "SysdraPrepareFailing": "firing"})
    finally:
        if prometheus is not None:
            prometheus.stop()
        err = _stop(agent)
    assert "CHECKPOINT CORRUPT" in err
