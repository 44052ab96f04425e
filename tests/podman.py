"""podman as the tests run it: the agent's image built by deploy/image/build.sh, and the settings
every container here needs."""

from __future__ import annotations

import os
import subprocess

from tests.conftest import REPO

# No rlimits set in the container (this VM kind refuses runc's RLIMIT_NOFILE), runc, cgroupfs,
# no events journal.
CONTAINERS_CONF = """\
[containers]
default_ulimits = []
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "none"
"""


def podman_env(directory: str) -> dict[str, str]:
    """The environment for podman commands: CONTAINERS_CONF written into ``directory``."""
    conf = os.path.join(directory, "containers.conf")
    with open(conf, "w") as f:
        f.write(CONTAINERS_CONF)
    return dict(os.environ, CONTAINERS_CONF=conf)


def build_agent_image(out: str, tag: str | None = None) -> str:
    """``make image``'s script: the agent's image tagged ``tag`` (the version by default), saved
    under ``out``; returns what the script printed."""
    env = dict(os.environ, OUT=out, **({"TAG": tag} if tag else {}))
    build = subprocess.run([os.path.join(REPO, "deploy", "image", "build.sh")], env=env, capture_output=True, text=True,
                           timeout=1800)  # fmt: skip
    assert build.returncode == 0, build.stdout + build.stderr
    return build.stdout
