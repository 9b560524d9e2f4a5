"""Plot ours over the best peer, paired, with 95% intervals, from benchmark grids' JSON.

    python scripts/plot_ratios.py docs/data/host_path/sm90_bwd_public_h200.json --png ratios.png
    python scripts/plot_ratios.py run1.json run2.json --label seeded --label unseeded --png r.png

Each JSON is what ``scripts/benchmark.py --json`` wrote (forward or backward, either grid; the
``--grid models`` cells are drawn one slot per cell, in one panel). Several runs
of one grid are drawn side by side in each cell: a run's interval says how far its own
rounds agree, the spread between runs how far a run can be trusted (docs/hopper_backward.md,
"Clocks, power and noise"). Cells are also printed, one line each, with the verdict of their interval.
"""

import argparse
import json
import sys
from pathlib import Path


from fa_sm100.benchmarking import (format_interval, interval_verdict,
                                   plot_ratio_intervals, ratio_points, verdict_summary)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("grids", nargs="+", help="JSON files written by scripts/benchmark.py --json")
    p.add_argument("--label", action="append", default=[],
                   help="one per grid, in order (default: the file names)")
    p.add_argument("--png", default=None, help="write the figure here (needs matplotlib)")
    p.add_argument("--title", default=None)
    a = p.parse_args(argv)
    if a.label and len(a.label) != len(a.grids):
        p.error(f"{len(a.label)} --label for {len(a.grids)} grids: give one per grid or none")
    return a


def load_points(path: str) -> list:
    """The ``RatioPoint``s of one grid JSON (a dict with "rows", or a bare list of rows);
    ValueError naming the file when it has none."""
    data = json.loads(Path(path).read_text())
    rows = data["rows"] if isinstance(data, dict) else data
    points = ratio_points(rows)
    if not points:
        raise ValueError(f"{path}: no cell with a paired ratio (ratio_paired): is it a grid "
                         f"that timed ours and a peer?")
    return points


def main(argv=None) -> int:
    a = parse_args(argv)
    labels = a.label or [Path(g).stem for g in a.grids]
    try:
        runs = {label: load_points(g) for label, g in zip(labels, a.grids)}
    except (OSError, ValueError, KeyError) as e:
        print(f"plot_ratios: {e}", file=sys.stderr)
        return 2
    for label, points in runs.items():
        print(f"== {label}")
        for p in points:
            where = p.cell or (f"hdim {p.hdim:3d} {'causal    ' if p.causal else 'non-causal'} "
                               f"{p.seqlen:6d}")
            print(f"{where}: {p.ratio:.3f}x {format_interval(p.interval)} "
                  f"{interval_verdict(p.interval)}")
        print(verdict_summary(p.interval for p in points))
    if a.png:
        plot_ratio_intervals(runs, a.png, a.title or "ours over the best peer, paired")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
