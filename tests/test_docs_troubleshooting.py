"""docs/troubleshooting.md stays true (its conventions are explained at its top):

- every sysdra message it quotes, «`fragment`», is in the agent's source: one string literal of
  agent/, discovery/ or cdi/ (an f-string's constant parts; ``…`` stands for a variable part)
  holds the fragment's pieces in order;
- every upstream message, `fragment` (source: path), is in that file of the module the tests' peers
  build (tests/peers/go.mod, tests/peers/containerd/go.mod; the chart's in this repository);
- every ``sysdra ...`` command parses with the real parser (agent.cli.main.build_parser);
- every metric (with its label values) is one the agent exports, every alert one of
  deploy/helm/sysdra/files/alerts.yaml, every doctor check one that `sysdra doctor` makes;
- every link to a docs/*.md section (or README.md) names a heading there."""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import shlex

import pytest

from tests.conftest import REPO, _missing

GUIDE = os.path.join(REPO, "docs", "troubleshooting.md")
SOURCES = ("agent", "discovery", "cdi")
# the label a citation names -> (the go.mod that pins its module, the module); "chart": this repository
UPSTREAM = {
    "kubelet": ("tests/peers/go.mod", "k8s.io/kubernetes"),
    "scheduler": ("tests/peers/go.mod", "k8s.io/kubernetes"),
    "kube-apiserver": ("tests/peers/go.mod", "k8s.io/kubernetes"),
    "k8s.io/apiserver": ("tests/peers/go.mod", "k8s.io/apiserver"),
    "k8s.io/apimachinery": ("tests/peers/go.mod", "k8s.io/apimachinery"),
    "allocator": ("tests/peers/go.mod", "k8s.io/dynamic-resource-allocation"),
    "cel-go": ("tests/peers/go.mod", "github.com/google/cel-go"),
    "containerd": ("tests/peers/containerd/go.mod", "github.com/containerd/containerd/v2"),
    "CDI": ("tests/peers/containerd/go.mod", "tags.cncf.io/container-device-interface"),
    "chart": (None, None),
}
SYSDRA_MSG = re.compile(r"«`([^`]+)`»")
UPSTREAM_MSG = re.compile(r"`([^`]+)`\s+\(([^():`]+):\s+([^)\s]+)\)")
CITATION = re.compile(r"\(([^():`]+):\s+([^)\s]+\.(?:go|yaml))\)")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s#]*)(#[^)\s]+)?\)")


def _guide() -> str:
    with open(GUIDE) as f:
        return f.read()


def _pieces(fragment: str) -> list[str]:
    return [p.strip() for p in fragment.split("…") if p.strip()]


def _in_order(pieces: list[str], text: str) -> bool:
    at = 0
    for piece in pieces:
        at = text.find(piece, at)
        if at < 0:
            return False
        at += len(piece)
    return True


def _literals(path: str) -> list[str]:
    """The file's string literals, an f-string's placeholders as NUL (never in a fragment)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            out.append("".join(v.value if isinstance(v, ast.Constant) else "\0" for v in node.values))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append(node.value)
    return out


def _source_literals(tops=SOURCES) -> list[str]:
    out = []
    for top in tops:
        for d, _, files in os.walk(os.path.join(REPO, top)):
            out += [s for f in files if f.endswith(".py") and "_pb2" not in f for s in _literals(os.path.join(d, f))]
    return out


def _sysdra_messages(text: str) -> list[str]:
    return SYSDRA_MSG.findall(text)


def test_the_guide_quotes_sysdra_messages_and_upstream_ones():
    """Each marker belongs to a quote the tests below check (none left unchecked by a typo)."""
    text = _guide()
    assert len(_sysdra_messages(text)) >= 40, "the guide's sysdra messages are marked «`...`»"
    assert text.count("«") == text.count("»") == len(_sysdra_messages(text)), "a «...» that is not «`fragment`»"
    assert len(UPSTREAM_MSG.findall(text)) >= 10, "upstream messages are followed by (source: path)"
    assert len(CITATION.findall(text)) == len(UPSTREAM_MSG.findall(text)), "a citation that follows no `message`"
    assert len(set(LINK.findall(text))) >= 20, "the guide points to the docs' sections"


def test_every_sysdra_message_quoted_is_in_the_source():
    literals = _source_literals()
    missing = []
    for fragment in _sysdra_messages(_guide()):
        pieces = _pieces(fragment)
        if sum(len(p) for p in pieces) < 4 or not any(_in_order(pieces, s) for s in literals):
            missing.append(fragment)
    assert not missing, f"quoted as sysdra's but no literal of {SOURCES} says so: {missing}"


def _module_versions(gomod: str) -> dict[str, str]:
    """module -> version as the go.mod pins it (a replace wins over a require)."""
    versions, replaced = {}, {}
    with open(os.path.join(REPO, gomod)) as f:
        for line in f:
            line = line.split("//")[0].strip()
            if m := re.match(r"(?:require\s+)?(\S+) (v\S+)$", line):
                versions[m[1]] = m[2]
            elif m := re.match(r"\S+(?: v\S+)? => (\S+) (v\S+)$", line):
                replaced[m[1]] = m[2]
    return {**versions, **replaced}


def _upstream_file(label: str, path: str) -> str:
    gomod, module = UPSTREAM[label]
    if gomod is None:
        return os.path.join(REPO, path)
    cache = os.environ.get("GOMODCACHE") or os.path.join(REPO, ".peers", "gomod")
    version = _module_versions(gomod).get(module)
    assert version, f"{module} is not in {gomod}"
    root = os.path.join(cache, f"{module}@{version}")
    if not os.path.isdir(root):
        _missing(f"{root} is not there: run tests/peers/build.sh (it fills the module cache)")
    return os.path.join(root, path)


def test_every_upstream_message_quoted_is_in_the_file_cited():
    cited = UPSTREAM_MSG.findall(_guide())
    unknown = sorted({label for _, label, _ in cited if label not in UPSTREAM})
    assert not unknown, f"cite upstream messages as (one of {sorted(UPSTREAM)}: path), not {unknown}"
    missing = []
    for fragment, label, path in cited:
        file = _upstream_file(label, path)
        if not os.path.isfile(file):
            missing.append(f"{label}: {path} (no such file)")
            continue
        with open(file) as f:
            if not _in_order(_pieces(fragment), f.read()):
                missing.append(f"{fragment!r} ({label}: {path})")
    assert not missing, f"not in the file cited: {missing}"


def _commands(text: str) -> list[list[str]]:
    """Each ``sysdra ...`` command line in code (spans and blocks): its arguments. A command
    starts a shell segment, or follows ``sudo`` or ``--`` (``kubectl exec ... -- sysdra ...``)."""
    text = UPSTREAM_MSG.sub("", SYSDRA_MSG.sub("", text))
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)
    code = [line for b in blocks for line in b.splitlines()]
    code += CODE_SPAN.findall(re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.M | re.S))
    found = []
    for line in code:
        for segment in re.split(r";|\|\||&&|\|", line):
            tokens = shlex.split(segment, comments=True)
            for i, tok in enumerate(tokens):
                if tok == "sysdra" and (i == 0 or tokens[i - 1] in ("sudo", "--")) and tokens[i + 1:]:
                    found.append([t for t in tokens[i + 1:] if t not in ("...", "…")])
    return found


def test_every_sysdra_command_parses():
    from agent.cli.main import COMMANDS, build_parser

    commands = _commands(_guide())
    assert len(commands) >= 10
    bad = []
    for argv in commands:
        if len(argv) == 1:  # the command named, not run (`sysdra record` for a bug report)
            if argv[0] not in COMMANDS:
                bad.append(f"sysdra {argv[0]}: no such command")
            continue
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                build_parser(argv[0]).parse_args(argv)
        except SystemExit:
            bad.append(f"sysdra {' '.join(argv)}: {err.getvalue().strip().splitlines()[-1:]}")
    assert not bad, bad


def test_every_metric_and_label_value_named_is_exported():
    from agent.service.metrics import Metrics

    from tests.test_docs import _exported

    series: dict[str, set] = {}  # the series there from the start, with their labels
    for family in Metrics().registry.collect():
        for s in family.samples:
            series.setdefault(s.name, set()).update(s.labels.items())
    text = _guide()
    unknown = [n for n in re.findall(r"\b(sysdra_[a-z_]+)\b(?![.\w])", text) if n not in _exported()[1]]
    assert not unknown, f"not exported: {unknown}"
    for name, selector in re.findall(r"\b(sysdra_[a-z_]+)\{([^}]*)\}", text):
        for key, op, values in re.findall(r'(\w+)\s*(=~|=)\s*"([^"]*)"', selector):
            for value in values.split("|") if op == "=~" else [values]:
                assert (key, value) in series.get(name, ()), f"{name} has no series {key}={value!r}"


def test_every_alert_named_is_one_of_the_rules():
    with open(os.path.join(REPO, "deploy", "helm", "sysdra", "files", "alerts.yaml")) as f:
        alerts = set(re.findall(r"alert:\s*(\w+)", f.read()))
    named = set(re.findall(r"\b(Sysdra[A-Z]\w+)", _guide()))
    assert named, "the guide names the alerts"
    assert not named - alerts, f"no such alert: {sorted(named - alerts)}"


def test_every_doctor_check_named_exists():
    """``doctor `name` `` in the guide: a check name `sysdra doctor` reports."""
    names = set(_source_literals(("agent/tools", "agent/cli")))
    named = re.findall(r"doctor `([a-z0-9:-]+)`", _guide())
    assert len(named) >= 5
    unknown = [n for n in named if n not in names and not any(n.startswith(p) for p in names if p.endswith(":"))]
    assert not unknown, f"sysdra doctor makes no check named {unknown}"


def _anchors(path: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (fenced code left out)."""
    seen: dict[str, int] = {}
    out = set()
    with open(path) as f:
        text = re.sub(r"^```.*?^```", "", f.read(), flags=re.M | re.S)
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("target,anchor", sorted(set(LINK.findall(_guide()))) if os.path.exists(GUIDE) else [])
def test_every_link_resolves_to_a_heading(target, anchor):
    if target.startswith(("http://", "https://")):
        return
    path = os.path.normpath(os.path.join(os.path.dirname(GUIDE), target)) if target else GUIDE
    assert os.path.isfile(path), f"{target}: no such file"
    if anchor:
        assert anchor[1:] in _anchors(path), f"{target}{anchor}: no such heading"
