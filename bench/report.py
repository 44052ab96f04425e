"""Results table, ``bench/results/latest.json`` (one entry per figure) and the table of the
latest figures in docs/performance.md (between two markers; the rest of the page is prose)."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "bench", "results", "latest.json")
DOCS = os.path.join(REPO, "docs", "performance.md")
BEGIN = "<!-- latest make bench figures: written by bench/report.py, edits are lost -->"
END = "<!-- end of the latest make bench figures -->"


@dataclass
class Figure:
    name: str
    value: float
    unit: str
    floor: float | None  # same measurement of the minimal baseline, same run
    goal: str  # human form, e.g. "ratio <= 2"
    met: bool

    @property
    def ratio(self) -> float | None:
        return None if not self.floor else self.value / self.floor

    def to_json(self) -> dict:
        d = asdict(self)
        d["ratio"] = None if self.ratio is None else round(self.ratio, 3)
        return d


def progress(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


def print_table(figures: list[Figure]) -> None:
    rows = [["NAME", "VALUE", "UNIT", "FLOOR", "RATIO", "GOAL", "MET"]]
    for f in figures:
        rows.append([f.name, f"{f.value:.4g}", f.unit, "-" if f.floor is None else f"{f.floor:.4g}",
                     "-" if f.ratio is None else f"{f.ratio:.2f}", f.goal, "yes" if f.met else "NO"])  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def run_info() -> dict:
    """Where and when figures were measured: UTC time, the commit (``-dirty`` with local
    changes) and the 1-minute load average (this VM's figures move with it)."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results", ":!docs/performance.md"):
        commit += "-dirty"
    return {"measured": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": commit, "load": round(os.getloadavg()[0], 2)}


def write_results(figures: list[Figure], path: str = RESULTS, info: dict | None = None) -> list[dict]:
    """Merge by name into latest.json so partial runs keep the other figures; each entry
    says when, on which commit and at which load it was measured. Returns all entries."""
    existing: dict[str, dict] = {}
    if os.path.exists(path):
        try:
            existing = {e["name"]: e for e in json.load(open(path))}
        except (ValueError, KeyError, TypeError):
            existing = {}
    info = run_info() if info is None else info
    for f in figures:
        existing[f.name] = {**f.to_json(), **info}
    entries = sorted(existing.values(), key=lambda e: e["name"])
    _replace_file(path, json.dumps(entries, indent=2) + "\n")
    return entries


def docs_table(entries: list[dict]) -> str:
    """The figures as a Markdown table (the order of latest.json: by name)."""
    def num(v) -> str:
        return "-" if v is None else f"{v:.4g}"

    lines = ["| figure | value | floor | ratio | goal | met | measured |", "|---|---|---|---|---|---|---|"]
    for e in entries:
        when = f"{e.get('measured', '?')}, {e.get('commit', '?')}, load {e.get('load', '?')}"
        lines.append(f"| `{e['name']}` | {num(e['value'])} {e['unit']} | {num(e.get('floor'))} | {num(e.get('ratio'))} "
                     f"| {e['goal']} | {'yes' if e['met'] else '**no**'} | {when} |")
    return "\n".join(lines)


def write_docs(entries: list[dict], path: str = DOCS) -> bool:
    """Put the table between the markers of docs/performance.md; False (and nothing
    written) when the page lacks them."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return False
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        return False
    _replace_file(path, text[: start + len(BEGIN)] + "\n" + docs_table(entries) + "\n" + text[end:])
    return True


def _replace_file(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as out:
        out.write(text)
    os.replace(tmp, path)
