"""sysdra doctor's runtime checks (agent/tools/doctor_runtime.py): containerd's config (CDI and
NRI on, the agent's NRI socket and CDI dir, imports merged as containerd merges them: compared
with the real containerd's `config dump`), the NRI plugin's state from the agent's status, and
the kept GPU faults."""

from __future__ import annotations

import json
import os
import subprocess
import tomllib

import pytest

from agent.health.faults import FILE, FaultStore
from agent.tools.doctor_runtime import NRI, check_containerd, check_gpu_faults, check_nri
from tests.controlplane import peer

SOCK, CDI = "/var/run/nri/nri.sock", "/var/run/cdi"


def levels(findings) -> dict[str, str]:
    return {f.check: f.level for f in findings}


def expect(found, levels_by_check: dict[str, str]) -> None:
    """The findings have these levels, and every warning or failure says its fix."""
    assert levels(found) == levels_by_check, [f.message for f in found]
    assert all(f.fix for f in found if f.level in ("warn", "fail"))


def write(tmp_path, text: str, name: str = "config.toml") -> str:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text, cdi, nri", [
    ("version = 3\n", "ok", "ok"),  # containerd 2.x: both on by default
    ("version = 2\n", "warn", "warn"),  # 1.7 has both off unless set (2.x migrating it: on)
    ("version = 2\n[plugins.'io.containerd.grpc.v1.cri']\n  enable_cdi = true\n"
     "[plugins.'io.containerd.nri.v1.nri']\n  disable = false\n", "ok", "ok"),
    ("version = 2\n[plugins.'io.containerd.grpc.v1.cri']\n  enable_cdi = false\n", "fail", "warn"),
    ("version = 3\n[plugins.'io.containerd.cri.v1.runtime']\n  enable_cdi = false\n", "warn", "ok"),  # 2.4 ignores the key
    ("version = 3\n[plugins.'io.containerd.nri.v1.nri']\n  disable = true\n", "ok", "fail"),
    ("version = 3\n[plugins.'io.containerd.nri.v1.nri']\n  disable_connections = true\n", "ok", "fail"),
    ("version = 3\ndisabled_plugins = ['io.containerd.nri.v1.nri', 'io.containerd.cri.v1.runtime']\n", "fail", "fail"),
    ("version = 3\n[plugins.'io.containerd.nri.v1.nri']\n  socket_path = '/run/other.sock'\n", "ok", "warn"),
    ("version = 3\n[plugins.'io.containerd.cri.v1.runtime']\n  cdi_spec_dirs = ['/etc/cdi']\n", "fail", "ok"),
    ("version = 4\n", "ok", "ok"),  # what containerd 2.4 writes
])
def test_containerd_configs(tmp_path, text, cdi, nri):
    expect(check_containerd(str(tmp_path), SOCK, CDI, write(tmp_path, text)), {"containerd-cdi": cdi, "containerd-nri": nri})


def test_the_nri_default_validator_is_said(tmp_path):
    """The window between a runtime restart and the agent's registration (docs/networking.md)."""
    off = check_containerd(str(tmp_path), SOCK, CDI, write(tmp_path, "version = 3\n"))
    on = check_containerd(str(tmp_path), SOCK, CDI, write(tmp_path, "version = 3\n[plugins.'io.containerd.nri.v1.nri'.default_validator]\n"
                                                                      "  enable = true\n", "on.toml"))
    said = {f.check: f.message for f in off} | {f"{f.check}+": f.message for f in on}
    assert "default validator is off" in said["containerd-nri"] and "default validator on" in said["containerd-nri+"]


def test_the_config_under_the_root_and_its_imports(tmp_path):
    root = tmp_path / "root"
    assert levels(check_containerd(str(root), SOCK, CDI)) == {"containerd": "skip"}
    write(root, "version = 3\nimports = ['more/*.toml']\n", "etc/containerd/config.toml")
    write(root, "[plugins.'io.containerd.nri.v1.nri']\n  socket_path = '/var/run/nri/nri.sock'\n", "etc/containerd/more/a.toml")
    assert levels(check_containerd(str(root), SOCK, CDI))["containerd-nri"] == "ok"
    write(root, "[plugins.'io.containerd.nri.v1.nri']\n  disable = true\n", "etc/containerd/more/z.toml")
    assert levels(check_containerd(str(root), SOCK, CDI))["containerd-nri"] == "fail"
    assert levels(check_containerd(str(root), "", CDI))["containerd-nri"] == "skip"  # the agent's NRI is off


def test_conf_d_counts_only_where_a_config_imports_it(tmp_path):
    """containerd 2.x follows the files' own imports alone (cmd/containerd/server/config/config.go,
    LoadConfigWithPlugins): /etc/containerd/conf.d/*.toml is read where config.toml imports it,
    as `containerd config default` writes, not otherwise (its `config dump` then prints the
    default's imports line all the same)."""
    root = tmp_path / "root"
    nri_off = "[plugins.'io.containerd.nri.v1.nri']\n  disable = true\n"
    write(root, "version = 3\n" + nri_off, "etc/containerd/config.toml")
    write(root, "[plugins.'io.containerd.nri.v1.nri']\n  disable = false\n", "etc/containerd/conf.d/z.toml")
    assert levels(check_containerd(str(root), SOCK, CDI))["containerd-nri"] == "fail"  # conf.d is not read
    write(root, "version = 3\nimports = ['/etc/containerd/conf.d/*.toml']\n" + nri_off, "etc/containerd/config.toml")
    assert levels(check_containerd(str(root), SOCK, CDI))["containerd-nri"] == "ok"


@pytest.mark.parametrize("main, imported, cdi, nri", [
    # containerd 1.7's NRI is off unless its section says disable = false (its default is true)
    ("version = 2\n[plugins.'io.containerd.grpc.v1.cri']\n  enable_cdi = true\n"
     "[plugins.'io.containerd.nri.v1.nri']\n  socket_path = '/var/run/nri/nri.sock'\n", "", "ok", "warn"),
    # containerd 1.7 replaces a plugin's whole table with an imported file's: enable_cdi is gone
    ("version = 2\nimports = ['a.toml']\n[plugins.'io.containerd.grpc.v1.cri']\n  enable_cdi = true\n"
     "[plugins.'io.containerd.nri.v1.nri']\n  disable = false\n",
     "version = 2\n[plugins.'io.containerd.grpc.v1.cri'.registry]\n  config_path = '/etc/containerd/certs.d'\n", "warn", "ok"),
])
def test_version_2_configs_as_containerd_1_7_reads_them(tmp_path, main, imported, cdi, nri):
    """containerd 1.7 (services/server/config/config.go mergeConfig: "Replace entire sections";
    pkg/nri/config.go DefaultConfig: Disable true)."""
    write(tmp_path, imported, "a.toml")
    expect(check_containerd(str(tmp_path), SOCK, CDI, write(tmp_path, main)), {"containerd-cdi": cdi, "containerd-nri": nri})


@pytest.mark.parametrize("text", ["version = 3\n[plugins\n", "version = 1\n", "version = 3\nimports = 'x'\n",
                                  "version = 3\na = " + "[" * 5000 + "]" * 5000 + "\n"])  # nested too deep: doctor's RecursionError
def test_configs_that_say_nothing_usable(tmp_path, text):
    (finding,) = check_containerd(str(tmp_path), SOCK, CDI, write(tmp_path, text))
    assert finding.check == "containerd" and finding.level == "warn" and finding.fix


def _dump(path: str) -> dict:
    out = subprocess.run([peer("containerd"), "--config", path, "config", "dump"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return tomllib.loads(out.stdout)


def test_imports_merge_as_the_real_containerd_merges_them(tmp_path):
    """containerd 2.x's own reading of the same files (`config dump`): an imported file's NRI keys
    merge into the main file's, key by key; our verdict follows what it shows."""
    from tests.realnode_setup import containerd_config

    cases = {
        "import-disables": ("version = 3\nimports = ['%s/a.toml']\n[plugins.'io.containerd.nri.v1.nri']\n"
                            "  socket_path = '/var/run/nri/nri.sock'\n", "[plugins.'io.containerd.nri.v1.nri']\n  disable = true\n"),
        "import-moves-socket": ("version = 3\nimports = ['%s/a.toml']\n[plugins.'io.containerd.nri.v1.nri']\n  disable = false\n",
                                "[plugins.'io.containerd.nri.v1.nri']\n  socket_path = '/run/elsewhere.sock'\n"),
        "import-keeps-main-keys": ("version = 3\nimports = ['%s/a.toml']\n[plugins.'io.containerd.nri.v1.nri']\n"
                                   "  disable_connections = true\n",
                                   "[plugins.'io.containerd.nri.v1.nri']\n  socket_path = '/var/run/nri/nri.sock'\n"),
        "no-connections": ("version = 3\n[plugins.'io.containerd.nri.v1.nri']\n  disable_connections = true\n", ""),
        # an imported file of version 2 (or none) is migrated first: its CRI plugin's keys count
        "import-v2-cdi-dirs": ("version = 3\nimports = ['%s/a.toml']\n",
                               "version = 2\n[plugins.'io.containerd.grpc.v1.cri']\n  cdi_spec_dirs = ['/etc/cdi']\n"),
        "import-unversioned-cdi-dirs": ("version = 3\nimports = ['%s/a.toml']\n",
                                        "[plugins.'io.containerd.grpc.v1.cri']\n  cdi_spec_dirs = ['/etc/cdi']\n"),
        # an imported file's own imports are read too, and its disabled_plugins count
        "nested-import": ("version = 3\nimports = ['%s/a.toml']\n", "imports = ['b.toml']\n"),
        "import-disables-plugin": ("version = 3\nimports = ['%s/a.toml']\n",
                                   "version = 3\ndisabled_plugins = ['io.containerd.nri.v1.nri']\n"),
        "defaults": ("version = 3\n", ""),
    }
    paths = {}
    for name, (main, imported) in cases.items():
        d = tmp_path / name
        write(d, imported, "more/a.toml")
        write(d, "version = 3\n[plugins.'io.containerd.nri.v1.nri']\n  disable = true\n", "more/b.toml")
        paths[name] = write(d, main.replace("%s", str(d / "more")) if "%s" in main else main)
    paths["realnode"] = containerd_config(str(tmp_path / "realnode"), CDI, str(tmp_path / "c.sock"), "sdrbrtest0")
    for name, path in paths.items():
        top = _dump(path)
        dumped = top["plugins"]
        nri, cri = dumped.get(NRI, {}), dumped["io.containerd.cri.v1.runtime"]
        if NRI in top.get("disabled_plugins", []) or nri["disable"] or nri["disable_connections"]:
            expect = "fail"
        else:
            expect = "ok" if os.path.normpath(nri["socket_path"]) == SOCK else "warn"
        found = levels(check_containerd("/", SOCK, CDI, path))
        assert found["containerd-nri"] == expect, (name, nri)
        assert found["containerd-cdi"] == ("ok" if CDI in cri["cdi_spec_dirs"] else "fail"), (name, cri["cdi_spec_dirs"])


# --- NRI, from the agent's status ----------------------------------------------------------------
def test_nri_findings_from_the_status():
    assert check_nri(None) == [] and check_nri({"registration": {}}) == []  # not running / an older agent
    assert levels(check_nri({"nri": {"state": "registered", "runtime": "containerd v2.4.2", "socket": SOCK}})) == {"nri": "ok"}
    assert levels(check_nri({"nri": {"state": "disabled"}})) == {"nri": "skip"}
    (f,) = check_nri({"nri": {"state": "failed", "reason": "no NRI socket at /x", "claimsWaiting": []}})
    assert f.level == "warn" and "no NRI socket at /x" in f.message  # nothing waits: a node without NICs to move
    waiting = [{"namespace": "ml", "name": "net-0", "uid": "u", "netdevs": ["eth1"]}]
    (f,) = check_nri({"nri": {"state": "connecting", "reason": None, "claimsWaiting": waiting}})
    assert f.level == "fail" and "ml/net-0" in f.message


# --- kept GPU faults -----------------------------------------------------------------------------
def test_kept_gpu_faults(tmp_path):
    root = tmp_path / "root"
    boot = root / "proc/sys/kernel/random/boot_id"
    boot.parent.mkdir(parents=True)
    boot.write_text("b007-1\n")
    plugin = tmp_path / "plugin"
    plugin.mkdir()
    assert check_gpu_faults(str(plugin), str(root)) == []
    FaultStore(str(plugin), str(root)).record("GPU-7e3a1c52-0d4b-4f6e-9a81-2b3c4d5e6f70", "0000:00:06.0", "xid-79", "NVML: critical XID 79")
    (f,) = check_gpu_faults(str(plugin), str(root))
    assert f.level == "warn" and "gpu-0000-00-06-0" in f.message and "xid-79" in f.message
    assert "sysdra health clear gpu-0000-00-06-0" in f.fix
    (plugin / FILE).write_text(json.dumps({"version": 1, "faults": "all of them"}))
    (f,) = check_gpu_faults(str(plugin), str(root))
    assert f.check == "gpu-faults" and f.level == "warn" and "damaged" in f.message
