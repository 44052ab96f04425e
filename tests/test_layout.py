"""The layout stays readable: wings by role, imports in one direction, short modules.

Read from the source (ast), lazy imports inside functions included, so a cycle cannot hide
behind a function-level import."""

from __future__ import annotations

import ast
import os

from tests.conftest import REPO

PACKAGES = ("agent", "discovery", "cdi")
# Top-level agent modules every wing may import; they import no wing themselves.
NEUTRAL = {"agent.settings", "agent.fsutil", "agent.protos"}
# Who may import whom among agent's wings (besides neutral modules and discovery/cdi).
WING_DEPENDS = {
    "cli": {"service", "kubeletplugin", "prepare", "publish", "health", "tools"},
    "tools": {"service", "kubeletplugin", "prepare", "publish", "health"},
    "service": {"kubeletplugin", "prepare", "publish", "health", "nri"},
    "nri": {"prepare", "kubeletplugin"},
    "prepare": {"kubeletplugin"},
    "kubeletplugin": set(),
    "publish": set(),
    "health": set(),
    "protos": set(),
}
MAX_LINES = 400
# Held to MAX_LINES beside the packages: the bench, the fixture generators and the tests. Not
# tests/peers: the Go peers built from upstream modules (tests/peers/build.sh), not our Python.
SHORT_TOO = ("bench", "fixtures", "tests")
NOT_OURS = {os.path.join("tests", "peers")}


def _modules() -> dict[str, str]:
    found = {}
    for top in PACKAGES:
        for d, dirs, files in os.walk(os.path.join(REPO, top)):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(d, f), REPO)[:-3].replace(os.sep, ".")
                    found[rel.removesuffix(".__init__")] = os.path.join(d, f)
    return found


def _imports(path: str, module: str, known: set[str]) -> set[str]:
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            # the longest known module the name refers to
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(p, m, set(mods)) for m, p in mods.items()}


def _wing(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "agent" or len(parts) < 2:
        return None
    if ".".join(parts[:2]) in NEUTRAL:
        return None
    return parts[1] if len(parts) > 2 or os.path.isdir(os.path.join(REPO, "agent", parts[1])) else None


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for dep in sorted(graph.get(m, ())):
            # a package's __init__ importing its own submodules is how packages re-export
            if dep.startswith(m + "."):
                continue
            if state.get(dep) == 1:
                cycles.append(stack[stack.index(dep):] + [dep] if dep in stack else [m, dep])
            elif dep not in state:
                visit(dep, stack + [dep])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, f"import cycles: {cycles}"


def test_discovery_and_cdi_stand_alone():
    graph = _graph()
    bad = [(m, d) for m, deps in graph.items() for d in deps
           if (m.startswith("discovery") and d.split(".")[0] in ("agent", "cdi"))
           or (m.startswith("cdi") and d.split(".")[0] == "agent")]
    assert not bad, f"discovery/ must import nothing of agent/ or cdi/, cdi/ nothing of agent/: {bad}"


def test_wings_import_in_one_direction():
    graph = _graph()
    bad = []
    for m, deps in graph.items():
        if ".".join(m.split(".")[:2]) in NEUTRAL:
            bad += [(m, d) for d in deps if _wing(d)]
            continue
        wing = _wing(m)
        if wing is None:
            continue
        for d in deps:
            other = _wing(d)
            if other and other != wing and other not in WING_DEPENDS[wing]:
                bad.append((m, d))
    assert not bad, f"imports against the layout (docs/architecture.md): {bad}"


def test_every_wing_is_known():
    wings = {d for d in os.listdir(os.path.join(REPO, "agent"))
             if os.path.isfile(os.path.join(REPO, "agent", d, "__init__.py"))}
    assert wings == set(WING_DEPENDS), "add the new wing to WING_DEPENDS and docs/architecture.md"


def _python_files(top: str):
    for d, dirs, files in os.walk(os.path.join(REPO, top)):
        dirs[:] = [x for x in dirs if x != "__pycache__" and os.path.relpath(os.path.join(d, x), REPO) not in NOT_OURS]
        yield from (os.path.join(d, f) for f in files if f.endswith(".py"))


def test_hand_written_modules_are_short():
    paths = [*_modules().values(), *(p for top in SHORT_TOO for p in _python_files(top))]
    long = {os.path.relpath(p, REPO): n for p in paths
            if "_pb2" not in p and (n := sum(1 for _ in open(p, encoding="utf-8"))) > MAX_LINES}
    assert not long, f"split these modules (over {MAX_LINES} lines): {long}"


def test_nothing_reads_outside_the_repository():
    """A clone in an empty folder must pass: no code or test names a path beside the repo."""
    import re
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    pattern = re.compile(r"""(["'/]\.\./shared|["']\.\.["'],\s*["']shared["']|REPO,\s*["']\.\.["'])""")
    bad = []
    for f in files:
        if f.endswith((".py", ".sh", "Makefile")) or f == ".ci/run":
            text = open(os.path.join(REPO, f), encoding="utf-8", errors="replace").read()
            bad += [f"{f}: {m.group(0)}" for m in pattern.finditer(text)]
    assert not bad, bad
