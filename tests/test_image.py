"""The agent's image (Containerfile, `make image`): built with podman from the bookworm base
(deploy/image/base.sh makes it with debootstrap where no registry is reachable), small, with
`sysdra --version` and the licence, an unprivileged user, and the agent working with only what
the DaemonSet grants (uid 0, every capability dropped but DAC_OVERRIDE, a read-only root)."""

from __future__ import annotations

import os
import subprocess
import tempfile

import pytest

from agent.cli.main import main
from tests.conftest import profile_root, require_root, require_tool
from tests.podman import build_agent_image, podman_env

VERSION = "0.1.0"
IMAGE = f"ghcr.io/sysdra/sysdra:{VERSION}"


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out == f"sysdra {VERSION}\n"


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    require_root()
    for tool in ("podman", "debootstrap"):
        require_tool(tool)
    out = str(tmp_path_factory.mktemp("image"))
    return IMAGE, os.path.join(out, f"sysdra-{VERSION}.oci.tar"), build_agent_image(out)



def podman_run(image: str, *args: str, options: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as conf:
        return subprocess.run(["podman", "run", "--rm", "--network=none", *options, image, *args], capture_output=True,
                              text=True, timeout=120, env=podman_env(conf))  # fmt: skip


@pytest.mark.slow
@pytest.mark.root
def test_image_small_versioned_licensed_unprivileged(image):
    name, archive, _ = image
    assert os.path.getsize(archive) > 0
    size = int(subprocess.run(["podman", "image", "inspect", "--format", "{{.Size}}", name],
                              capture_output=True, text=True, check=True).stdout)  # fmt: skip
    assert size < 200_000_000
    assert podman_run(name, "--version").stdout == f"sysdra {VERSION}\n"
    licence = podman_run(name, "/usr/share/doc/sysdra/LICENSE", options=("--entrypoint", "cat")).stdout
    assert "Apache License" in licence and "Version 2.0" in licence
    assert podman_run(name, "-u", options=("--entrypoint", "id")).stdout.strip() == "65532"


@pytest.mark.slow
@pytest.mark.root
def test_agent_runs_with_what_the_daemonset_grants(image):
    """`sysdra scan` of a fixture node as the DaemonSet runs the image; and as its own user."""
    name, _, _ = image
    host = profile_root("server-2s-gpu-nic")
    daemonset = ("--user", "0:0", "--cap-drop", "ALL", "--cap-add", "DAC_OVERRIDE", "--read-only",
                 "--security-opt", "no-new-privileges", "-v", f"{host}:/host:ro")  # fmt: skip
    for options in (daemonset, ("-v", f"{host}:/host:ro")):
        scan = podman_run(name, "scan", "--root", "/host", "-o", "json", options=options)
        assert scan.returncode == 0, scan.stderr
        assert '"gpu-0000-18-00-0"' in scan.stdout
