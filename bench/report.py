"""Results table and ``bench/results/latest.json`` (one entry per figure)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "latest.json")


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


def write_results(figures: list[Figure], path: str = RESULTS) -> None:
    """Merge by name into latest.json so partial runs keep the other figures."""
    existing: dict[str, dict] = {}
    if os.path.exists(path):
        try:
            existing = {e["name"]: e for e in json.load(open(path))}
        except (ValueError, KeyError, TypeError):
            existing = {}
    for f in figures:
        existing[f.name] = f.to_json()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as out:
        json.dump(sorted(existing.values(), key=lambda e: e["name"]), out, indent=2)
        out.write("\n")
    os.replace(tmp, path)
