"""``make bench``: run every benchmark, print one table, write bench/results/latest.json and
the table of latest figures in docs/performance.md."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from bench.report import REPO, print_table, progress, write_docs, write_results

REAL_NODE_DOCS = os.path.join(REPO, "docs", "real-node.md")
# module -> what it measures; each has run() -> list[Figure]
BENCHMARKS = ("bench.bench_scan", "bench.bench_cli", "bench.bench_publish", "bench.bench_prepare", "bench.bench_idle",
              "bench.bench_realnode")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench")
    parser.add_argument("--only", action="append", help="run only these modules (e.g. bench_scan)")
    args = parser.parse_args(argv)
    figures = []
    for module in BENCHMARKS:
        if args.only and module.split(".")[-1] not in args.only:
            continue
        progress(f"running {module}")
        figures += importlib.import_module(module).run()
    print_table(figures)
    entries = write_results(figures)
    if not write_docs(entries):
        progress("docs/performance.md has no markers for the figures table: not updated")
    # the real node's figures also in its own page, beside what they mean there
    if not write_docs([e for e in entries if e["name"].startswith("realnode_")], path=REAL_NODE_DOCS):
        progress("docs/real-node.md has no markers for the figures table: not updated")
    return 0 if all(f.met for f in figures) else 1


if __name__ == "__main__":
    sys.exit(main())
