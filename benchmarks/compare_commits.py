"""Run a benchmark script against two checkouts of the package, alternating, and print ratios.

    .venv/bin/python benchmarks/compare_commits.py OLD_TREE -- benchmarks/step_overhead.py --quick
    .venv/bin/python benchmarks/compare_commits.py /tmp/base --rounds 3 -- benchmarks/trace_replay.py --pools 500

``OLD_TREE`` is a checkout of the commit to compare with (``git worktree add /tmp/base HEAD~3``);
the new one is this checkout. Each round runs the script once from each tree (old first, then
new; the machine's noise hits both), with ``PYTHONPATH`` set so that each imports its own
``course_pkg``. Lines are matched by their place and their words (numbers taken out); every number of a line
is the median over the rounds, and the ratio new / old is printed beside it -- below 1 means the
new tree is faster for a time, lower for a count.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")


def run(tree: Path, script: list[str]) -> list[str]:
    env = dict(os.environ, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, str(tree / script[0]), *script[1:]]
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def table(runs: list[list[str]]) -> dict[str, list[list[float]]]:
    """Per line (matched by its position and its words, numbers taken out), the numbers of
    that line in each run."""
    rows: dict[str, list[list[float]]] = {}
    for lines in runs:
        for i, line in enumerate(lines):
            label = " ".join(NUMBER.sub("#", line).split())
            if "#" in label:
                rows.setdefault(f"{i:03d} {label}", []).append([float(x) for x in NUMBER.findall(line)])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("old", type=Path, help="a checkout of the commit to compare with")
    ap.add_argument("--rounds", type=int, default=3)
    argv = sys.argv[1:]
    if "--" not in argv:
        ap.error("give the benchmark after --: compare_commits.py OLD_TREE -- benchmarks/x.py ARGS")
    cut = argv.index("--")
    args, script = ap.parse_args(argv[:cut]), argv[cut + 1:]
    new = Path(__file__).resolve().parent.parent
    runs = {"old": [], "new": []}
    for _ in range(args.rounds):
        runs["old"].append(run(args.old.resolve(), script))
        runs["new"].append(run(new, script))
    old_rows, new_rows = table(runs["old"]), table(runs["new"])
    print(f"{' '.join(script)}: median of {args.rounds} alternating rounds; each number old -> new (new / old)")
    for label, old_values in old_rows.items():
        new_values = new_rows.get(label)
        if new_values is None or {len(v) for v in old_values + new_values} != {len(old_values[0])}:
            continue
        cells = []
        for col in range(len(old_values[0])):
            a = statistics.median(v[col] for v in old_values)
            b = statistics.median(v[col] for v in new_values)
            cells.append(f"{a:g} -> {b:g}" + (f" ({b / a:.2f}x)" if a else ""))
        print(f"{label[4:]}\n    " + " | ".join(cells))


if __name__ == "__main__":
    main()
