"""``scripts/timeline.py``: per-role Gantt charts of the SM100 forward from the timing model.

    python scripts/timeline.py [--set field=value ...] --out PATH.png
    python scripts/timeline.py --compare --out PATH.png          # default, q_stage=1,
                                                                 # split_p=false, rescale_threshold=0
    python scripts/timeline.py --group q_stage=1 --group kv_stage=2 --out PATH.png
    python scripts/timeline.py --compare --calibrate --out PATH.png  # cost table as ablation.py
    python scripts/timeline.py --set ... --emu-trace t.json --out PATH.png
        # t.json from `scripts/emulate_sm100.py --set ... --trace t.json` (same --set): a panel of
        # the PTX emulator's per-role execution order (no clock) below the model's panel

Every panel is MODEL OUTPUT of the protocol model's timing mode (pipelines/), never a
measurement. The text rendering of each panel goes to stdout. The ``--emu-trace`` panel is the
PTX emulator's execution order (``step``), not time; its per-role summary goes to stdout too.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from fa_sm100.config import config_from_overrides, parse_overrides

# The --compare panels: the switches the reference analysis discusses, one at a time.
COMPARE_GROUPS = (
    ("q_stage=1", ("q_stage=1",)),
    ("split_p off", ("split_p=false",)),
    ("rescale every step", ("rescale_threshold=0",)),
)


def panel_overrides(base: Sequence[str], group: Sequence[str]) -> tuple[str, ...]:
    """``base`` then ``group``; use_2cta is pinned to the base's value unless the group sets it,
    so that q_stage=1 (which alone would also turn 2-CTA off) changes one switch only."""
    base_cfg = config_from_overrides(base)
    items = list(base) + list(group)
    if "use_2cta" not in parse_overrides(group):
        items.append(f"use_2cta={str(base_cfg.use_2cta).lower()}")
    return tuple(items)


def build_panels(base: Sequence[str], groups: Sequence[tuple[str, Sequence[str]]], compare: bool):
    """(title, overrides) of each panel; the base config first."""
    base_title = "default" if not base else " ".join(base)
    panels = [(base_title, tuple(base))]
    extra = list(COMPARE_GROUPS) if compare else []
    extra += list(groups)
    for title, group in extra:
        panels.append((title, panel_overrides(base, group)))
    for _, items in panels:
        config_from_overrides(items)  # ValueError naming the rule, before any simulation
    return panels


def _group(text: str) -> tuple[str, tuple[str, ...]]:
    items = tuple(t.strip() for t in text.replace(",", " ").split() if t.strip())
    if not items:
        raise argparse.ArgumentTypeError("--group needs field=value items")
    return " ".join(items), items


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="timeline.py",
        description="Per-role Gantt charts of the SM100 forward (MODEL OUTPUT of the protocol "
                    "model's timing mode, not measured).")
    ap.add_argument("--set", action="append", default=[], metavar="field=value",
                    help="config override for every panel (repeatable), e.g. --set kv_stage=4")
    ap.add_argument("--compare", action="store_true",
                    help="add panels for q_stage=1, split_p=false and rescale_threshold=0")
    ap.add_argument("--group", action="append", default=[], type=_group, metavar="'f=v[,f=v]'",
                    help="add a panel with these overrides on top of --set (repeatable)")
    ap.add_argument("--out", required=True, help="PNG path of the figure")
    ap.add_argument("--n-blocks", type=int, default=8, help="K/V blocks per work tile (default 8)")
    ap.add_argument("--work-tiles", type=int, default=2, help="work tiles per CTA (default 2)")
    ap.add_argument("--width", type=int, default=96, help="columns of the text chart")
    ap.add_argument("--quiet", action="store_true", help="print only the comparison table")
    ap.add_argument("--source", choices=("design", "kernel"), default="design",
                    help="role programs to time: the design's (pipelines/design.py, default) or the "
                         "SM100 kernel's own, recorded while cross-compiling it (slower)")
    ap.add_argument("--cost", action="append", default=[], metavar="field=value",
                    help="change one cost of the timing model's CostTable (repeatable), e.g. "
                         "--cost mufu_ex2_per_clk=64")
    ap.add_argument("--calibrate", action="store_true",
                    help="scale the cost table as scripts/ablation.py does (default config = FA4's "
                         "published B200 1535 TFLOP/s) before simulating")
    ap.add_argument("--emu-trace", default=None, metavar="PATH",
                    help="per-warp trace of scripts/emulate_sm100.py --trace (run with the same "
                         "--set): drawn per role below the model's panel, x = execution step "
                         "(the emulator has no clock)")
    args = ap.parse_args(argv)
    try:
        if args.n_blocks < 1 or args.work_tiles < 1:
            raise ValueError(f"--n-blocks {args.n_blocks} and --work-tiles {args.work_tiles} must be >= 1")
        panels = build_panels(args.set, args.group, args.compare)
        if not args.out.lower().endswith(".png"):
            raise ValueError(f"--out {args.out!r}: the figure is written as PNG; give a path ending in .png")
        from fa_sm100.research import model_backend

        costs = model_backend.cost_table(args.cost)
        emu = None
        if args.emu_trace is not None:
            from fa_sm100.research.emu_trace import load_emu_trace

            emu = load_emu_trace(args.emu_trace)
    except ValueError as e:
        print(f"timeline.py: error: {e}", file=sys.stderr)
        return 2
    from fa_sm100.research.plotting import plot_timelines
    from fa_sm100.research.timeline import compare_table, render_text

    if args.cost:
        print("cost table changed: " + ", ".join(args.cost))
    if args.calibrate:
        cal, costs = model_backend.calibrated_costs(costs)
        print(cal.describe())
    timelines = []
    for title, items in panels:
        cfg = config_from_overrides(items)
        tl = model_backend.model_timeline(cfg, title, items, args.n_blocks, args.work_tiles, costs,
                                          args.source)
        timelines.append(tl)
        if not args.quiet:
            print(render_text(tl, args.width))
            print()
    print(compare_table(timelines))
    title = f"SM100 forward, {args.n_blocks} K/V blocks x {args.work_tiles} work tiles per CTA"
    if emu is not None:
        print()
        print(emu.summary_text())
    info = plot_timelines(timelines, args.out, title=title, emu_trace=emu)
    emu_note = " + the PTX emulator panel" if info.emu_title else ""
    print(f"wrote {info.path} ({info.bytes} bytes, {len(info.panel_titles)} panels{emu_note})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
