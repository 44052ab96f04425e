"""bench/report.py: figures merged by name into latest.json with when, where and at which load
they were measured, and the table between the markers of docs/performance.md, the page's prose
untouched."""

from __future__ import annotations

import json

from bench.report import BEGIN, DOCS, END, Figure, write_docs, write_results

INFO = {"measured": "2026-12-01 12:00 UTC", "commit": "abc1234", "load": 0.5}


def test_partial_runs_merge_by_name_and_say_when(tmp_path):
    path = str(tmp_path / "latest.json")
    write_results([Figure("scan", 250.0, "ms", 150.0, "ratio <= 1.3", False),
                   Figure("idle_rss", 64.0, "MB", None, "value <= 80 MB", True)], path, INFO)
    later = {**INFO, "measured": "2026-12-01 13:00 UTC", "commit": "def5678"}
    entries = write_results([Figure("scan", 200.0, "ms", 160.0, "ratio <= 1.3", True)], path, later)
    assert entries == json.load(open(path))
    by_name = {e["name"]: e for e in entries}
    assert by_name["scan"]["value"] == 200.0 and by_name["scan"]["ratio"] == 1.25 and by_name["scan"]["commit"] == "def5678"
    assert by_name["idle_rss"]["commit"] == "abc1234" and by_name["idle_rss"]["ratio"] is None


def test_the_docs_table_replaces_only_what_is_between_the_markers(tmp_path):
    doc = tmp_path / "performance.md"
    doc.write_text(f"# Perf\n\nprose before\n\n{BEGIN}\nold table\n{END}\n\nprose after\n")
    entries = write_results([Figure("scan", 250.0, "ms", 150.0, "ratio <= 1.3", False)], str(tmp_path / "l.json"), INFO)
    assert write_docs(entries, str(doc))
    text = doc.read_text()
    assert "old table" not in text and text.startswith("# Perf\n\nprose before\n\n") and text.endswith(f"{END}\n\nprose after\n")
    assert "| `scan` | 250 ms | 150 | 1.667 | ratio <= 1.3 | **no** | 2026-12-01 12:00 UTC, abc1234, load 0.5 |" in text
    assert write_docs(entries, str(doc)) and doc.read_text() == text  # the same figures: the same page


def test_a_page_without_markers_is_left_alone(tmp_path):
    doc = tmp_path / "performance.md"
    doc.write_text("# Perf\n")
    assert not write_docs([], str(doc)) and doc.read_text() == "# Perf\n"
    assert not write_docs([], str(tmp_path / "missing.md"))


def test_the_real_page_has_the_markers_in_order():
    text = open(DOCS, encoding="utf-8").read()
    assert 0 <= text.find(BEGIN) < text.find(END)


def test_the_real_node_page_has_the_markers_in_order():
    from bench.run import REAL_NODE_DOCS

    text = open(REAL_NODE_DOCS, encoding="utf-8").read()
    assert 0 <= text.find(BEGIN) < text.find(END)
