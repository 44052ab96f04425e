"""Docs stay true: every module is in docs/architecture.md, every setting in the operations doc, every metric they name is one the agent exports."""

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


def _exported() -> tuple[set[str], set[str]]:
    """(the agent's metric families by the name operators query, every name it can serve)."""
    from agent.service.metrics import Metrics

    families, names = set(), set()
    for family in Metrics().registry.collect():
        if family.name.startswith("sysdra_"):
            # a counter is queried as <name>_total; one with labels has no samples before its first count
            families.add(family.name + ("_total" if family.type == "counter" else ""))
            names.update(s.name for s in family.samples)
    return families, families | names


def test_the_docs_name_only_metrics_the_agent_exports_and_the_operations_doc_lists_each():
    families, exported = _exported()
    named = {}
    for doc in sorted(os.listdir(os.path.join(REPO, "docs"))) + ["../README.md"]:
        if doc.endswith(".md"):
            text = open(os.path.join(REPO, "docs", doc)).read()
            for name in re.findall(r"\b(sysdra_[a-z_]+)\b(?![.\w])", text):
                named.setdefault(name, doc)
    unknown = {n: doc for n, doc in named.items() if n not in exported}
    assert not unknown, f"docs name metrics the agent does not export: {unknown}"
    listed = open(os.path.join(REPO, "docs", "operations.md")).read()
    missing = sorted(f for f in families if not re.search(rf"`{f}[`{{]", listed))
    assert not missing, f"add these metrics to docs/operations.md's table: {missing}"
