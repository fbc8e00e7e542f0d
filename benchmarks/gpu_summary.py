"""One line per benchmark of the files ``gpu_check.sh`` wrote: the figures RESULTS.md quotes.

Usage: python benchmarks/gpu_summary.py OUT/*.json OUT/cases.jsonl. A ``.jsonl`` file holds the cases that
``SIGMAFAST_BENCH_LOG`` logged one by one, including those of a part cut off by its time limit.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

KEYS = ("ms", "graph_ms", "graph_fraction_of_copy_bw", "graph_read_flushed_ms",
        "graph_read_flushed_fraction_of_copy_bw", "fraction_of_copy_bw", "graph_error", "ms_per_token",
        "ms_per_iteration", "later_iterations_ms", "synced_later_iterations_ms_median", "iterations_max",
        "first_call_s", "first_call_variants", "later_calls_s", "later_calls_variants", "max_variants_per_kernel",
        "warmup_s", "scoring_choices")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args(argv)
    for path in args.files:
        if not path.exists():
            print(f"{path}: missing (its part did not finish)")
            continue
        if path.suffix == ".jsonl":
            cases = []
            for line in path.read_text().splitlines():
                try:
                    cases.append(json.loads(line))
                except json.JSONDecodeError:  # a process killed while writing its last line
                    print(f"{path}: skipped a line that is not JSON: {line[:80]!r}")
        else:
            cases = [{"name": b["name"], "median_s": b["stats"]["median"], "extra_info": b.get("extra_info", {})}
                     for b in json.loads(path.read_text())["benchmarks"]]
        for case in cases:
            info = case["extra_info"]
            shown = " ".join(f"{k}={_fmt(info[k])}" for k in KEYS if info.get(k) is not None)
            print(f"{case['name']}: median {1e3 * case['median_s']:.4g} ms {shown}")


if __name__ == "__main__":
    main()
