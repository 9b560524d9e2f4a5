"""``scripts/timeline.py``: per-role Gantt charts of the SM100 forward (or backward) from the
timing model.

    python scripts/timeline.py [--set field=value ...] --out PATH.png
    python scripts/timeline.py --compare --out PATH.png          # default, q_stage=1,
                                                                 # split_p=false, rescale_threshold=0
    python scripts/timeline.py --group q_stage=1 --group kv_stage=2 --out PATH.png
    python scripts/timeline.py --compare --calibrate --out PATH.png  # cost table as ablation.py
    python scripts/timeline.py --set ... --emu-trace t.json --out PATH.png
        # t.json from `scripts/emulate_sm100.py --set ... --trace t.json` (same --set): a panel of
        # the PTX emulator's per-role execution order (no clock) below the model's panel
    python scripts/timeline.py --kernel sm100_bwd [--set causal=true ...] [--compare]
        [--n-blocks STEPS] --out PATH.png   # the SM100 backward: one CTA's walk of STEPS
        # steps (its recorded protocol; --compare adds q_stage=1 and head_dim=64)

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
# The backward's --compare panels: one Q / dO stage (the next step's load starts only once dK
# has read the stage) and the smaller head dim (less MMA work beside the same P / dS work).
BWD_COMPARE_GROUPS = (
    ("q_stage=1", ("q_stage=1",)),
    ("head_dim=64", ("head_dim=64",)),
)
KERNELS = ("sm100_fwd", "sm100_bwd")


def make_config(kernel: str, items: Sequence[str]):
    """The validated config of ``kernel`` with the ``--set`` items (ValueError naming the rule)."""
    if kernel == "sm100_bwd":
        from fa_sm100.registry import get_kernel

        return get_kernel(kernel).make_config(items)
    return config_from_overrides(items)


def panel_overrides(base: Sequence[str], group: Sequence[str]) -> tuple[str, ...]:
    """``base`` then ``group``; use_2cta is pinned to the base's value unless the group sets it,
    so that q_stage=1 (which alone would also turn 2-CTA off) changes one switch only."""
    base_cfg = config_from_overrides(base)
    items = list(base) + list(group)
    if "use_2cta" not in parse_overrides(group):
        items.append(f"use_2cta={str(base_cfg.use_2cta).lower()}")
    return tuple(items)


def build_panels(base: Sequence[str], groups: Sequence[tuple[str, Sequence[str]]], compare: bool,
                 kernel: str = "sm100_fwd"):
    """(title, overrides) of each panel; the base config first."""
    backward = kernel == "sm100_bwd"
    base_title = "default" if not base else " ".join(base)
    panels = [(base_title, tuple(base))]
    extra = list(BWD_COMPARE_GROUPS if backward else COMPARE_GROUPS) if compare else []
    extra += list(groups)
    for title, group in extra:
        panels.append((title, tuple(base) + tuple(group) if backward else panel_overrides(base, group)))
    for _, items in panels:
        make_config(kernel, items)  # ValueError naming the rule, before any simulation
    return panels


def _backward_options(args) -> None:
    """The options the backward's timeline refuses (ValueError naming why)."""
    if args.work_tiles is not None:
        raise ValueError("--work-tiles: a backward CTA has one work tile (its key block); "
                         "--n-blocks gives the steps of its walk")
    if args.source == "design":
        raise ValueError("--source design: the backward's protocol is only its kernel's "
                         "recording (--source kernel)")
    if args.emu_trace is not None:
        raise ValueError("--emu-trace: the emulator panel charts the forward's roles")


def _group(text: str) -> tuple[str, tuple[str, ...]]:
    items = tuple(t.strip() for t in text.replace(",", " ").split() if t.strip())
    if not items:
        raise argparse.ArgumentTypeError("--group needs field=value items")
    return " ".join(items), items


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="timeline.py",
        description="Per-role Gantt charts of the SM100 forward or backward (MODEL OUTPUT of the "
                    "protocol model's timing mode, not measured).")
    ap.add_argument("--kernel", choices=KERNELS, default="sm100_fwd",
                    help="the forward (default) or the backward, whose configs are "
                         "Sm100BwdConfig's (--set causal=true, qhead_per_kvhead=4, ...)")
    ap.add_argument("--set", action="append", default=[], metavar="field=value",
                    help="config override for every panel (repeatable), e.g. --set kv_stage=4")
    ap.add_argument("--compare", action="store_true",
                    help="add panels for q_stage=1, split_p=false and rescale_threshold=0 "
                         "(the backward: q_stage=1 and head_dim=64)")
    ap.add_argument("--group", action="append", default=[], type=_group, metavar="'f=v[,f=v]'",
                    help="add a panel with these overrides on top of --set (repeatable)")
    ap.add_argument("--out", required=True, help="PNG path of the figure")
    ap.add_argument("--n-blocks", type=int, default=8,
                    help="K/V blocks per work tile (default 8); the backward: steps of the CTA's "
                         "walk (query blocks x query heads of the group)")
    ap.add_argument("--work-tiles", type=int, default=None,
                    help="work tiles per CTA (default 2; the forward only)")
    ap.add_argument("--width", type=int, default=96, help="columns of the text chart")
    ap.add_argument("--quiet", action="store_true", help="print only the comparison table")
    ap.add_argument("--source", choices=("design", "kernel"), default=None,
                    help="role programs to time: the design's (pipelines/design.py, the "
                         "forward's default) or the SM100 kernel's own, recorded while "
                         "cross-compiling it (slower; the backward's only source)")
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
    backward = args.kernel == "sm100_bwd"
    try:
        if backward:
            _backward_options(args)
        work_tiles = 2 if args.work_tiles is None else args.work_tiles
        if args.n_blocks < 1 or work_tiles < 1:
            raise ValueError(f"--n-blocks {args.n_blocks} and --work-tiles {work_tiles} must be >= 1")
        panels = build_panels(args.set, args.group, args.compare, args.kernel)
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
        cfg = make_config(args.kernel, items)
        if backward:
            tl = model_backend.bwd_model_timeline(cfg, title, items, args.n_blocks, costs)
        else:
            tl = model_backend.model_timeline(cfg, title, items, args.n_blocks, work_tiles, costs,
                                              args.source or "design")
        timelines.append(tl)
        if not args.quiet:
            print(render_text(tl, args.width))
            print()
    print(compare_table(timelines))
    title = (f"SM100 backward, one CTA's walk of {args.n_blocks} steps (query blocks x query heads "
             f"against its key block)" if backward else
             f"SM100 forward, {args.n_blocks} K/V blocks x {work_tiles} work tiles per CTA")
    if emu is not None:
        print()
        print(emu.summary_text())
    info = plot_timelines(timelines, args.out, title=title, emu_trace=emu)
    emu_note = " + the PTX emulator panel" if info.emu_title else ""
    print(f"wrote {info.path} ({info.bytes} bytes, {len(info.panel_titles)} panels{emu_note})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
