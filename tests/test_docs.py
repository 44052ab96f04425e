"""Docs stay true: every module is in docs/architecture.md, every setting in the operations doc."""

from __future__ import annotations

import os
import re
import subprocess

from agent.settings import FIELDS
from tests.conftest import REPO


def _modules() -> list[str]:
    files = subprocess.run(["git", "ls-files", "agent", "discovery", "cdi"], cwd=REPO, capture_output=True, text=True).stdout.split()
    if not files:  # not a git checkout: walk instead
        files = [os.path.relpath(os.path.join(d, f), REPO) for top in ("agent", "discovery", "cdi")
                 for d, _, fs in os.walk(os.path.join(REPO, top)) for f in fs]
    return sorted(f for f in files if f.endswith(".py") and "_pb2" not in f and not f.endswith(("__init__.py", "__main__.py"))
                  and not f.startswith("agent/protos/"))


def test_every_module_is_in_the_architecture_doc():
    doc = open(os.path.join(REPO, "docs", "architecture.md")).read()
    missing = []
    for path in _modules():
        top, rest = path.split("/", 1)
        if f"`{rest}`" not in doc and f"`{path}`" not in doc:
            missing.append(path)
    assert not missing, f"add a line to docs/architecture.md for: {missing}"


def test_every_setting_is_documented():
    doc = open(os.path.join(REPO, "docs", "operations.md")).read()
    example = open(os.path.join(REPO, "systemd", "config.yaml")).read()
    for name in FIELDS:
        assert f"`{name}`" in doc, name
        assert re.search(rf"^#?\s*{name}:", example, re.M), name
