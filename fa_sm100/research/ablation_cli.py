"""``scripts/ablation.py``: the matrix of the SM100 forward's switches.

    python scripts/ablation.py                      # model (no SM100 GPU) or measured (SM100)
    python scripts/ablation.py --model              # the model even on an SM100 GPU
    python scripts/ablation.py --json out.json --plot out.png
    python scripts/ablation.py --only q_stage,split_p   # vary a subset, the rest at default
    python scripts/ablation.py --sweep ex2_emu_fraction=0,0.125,0.25,0.5   # one field, many values
    python scripts/ablation.py --cost mufu_ex2_per_clk=64    # another cost table, recalibrated

Without an SM100 GPU the numbers are MODEL OUTPUT: the timing model, calibrated once so that
the default config reproduces FlashAttention-4's published B200 figure (1535 TFLOP/s).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from typing import Optional, Sequence

from fa_sm100.research import ablation as ab


def combos_for(problem: ab.Problem, only: Optional[Sequence[str]]) -> list:
    """The full matrix, or the combinations of the switches in ``only`` (others at default)."""
    if not only:
        return ab.ablation_matrix(problem)
    bad = [n for n in only if n not in ab.SWITCH_NAMES]
    if bad:
        raise ValueError(f"--only {','.join(bad)}: not a switch; switches: {', '.join(ab.SWITCH_NAMES)}")
    out = []
    choices = [vals if name in only else vals[:1] for name, vals in ab.SWITCHES]
    for vals in itertools.product(*choices):
        values = dict(zip(ab.SWITCH_NAMES, vals))
        ov = ab.overrides_of(values)
        out.append(ab.Combination(values, ov, ab.config_for(problem, ov)))
    return out


def to_json(res: ab.AblationResult) -> dict:
    return {
        "label": "model" if res.rows and res.rows[0].source == "model" else "measured",
        "problem": dataclasses.asdict(res.problem),
        "calibration": None if res.calibration is None else {
            "cost_scale": res.calibration.scale,
            "point": res.calibration.point.name,
            "published_tflops": res.calibration.point.tflops,
            "uncalibrated_model_tflops": res.calibration.model_tflops,
            "calibrated_model_tflops": res.calibration.calibrated_tflops,
            "iterations": res.calibration.iterations,
        },
        "published": [{"name": p.name, "causal": p.problem.causal, "published_tflops": p.tflops,
                       "predicted_tflops": pred, "switches": []} for p, pred in res.published]
                     + [{"name": p.name, "causal": p.problem.causal, "published_tflops": p.tflops,
                         "predicted_tflops": pred, "switches": list(sw)}
                        for p, sw, pred in res.published_as_fa4],
        "rows": [{"switches": r.combo.values, "kv_stage": r.combo.cfg.kv_stage,
                  "tile_us": None if r.tile_ns != r.tile_ns else r.tile_ns / 1000,  # NaN: not measured
                  "total_ms": r.total_ns / 1e6, "tflops": r.tflops,
                  "source": r.source} for r in res.rows],
    }


def plot_result(res: ab.AblationResult, path: str) -> dict:
    """Bar chart: TFLOP/s of the default and of each single switch flipped, plus the matrix."""
    from fa_sm100.research.plotting import _pyplot
    from fa_sm100.research.timeline import MODEL_LABEL

    plt = _pyplot()
    model = res.rows[0].source == "model"
    singles = [("default", res.default)]
    for name, vals in ab.SWITCHES:
        try:
            singles.append((f"{name}={ab._fmt(vals[1])}", res.row(**{name: vals[1]})))
        except KeyError:
            continue
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": (1, 1.4)})
    names = [n for n, _ in singles]
    vals = [r.tflops for _, r in singles]
    ax.barh(range(len(vals)), vals, color=["#555555"] + ["#4C72B0"] * (len(vals) - 1))
    ax.set_yticks(range(len(vals)), names, fontsize=8)
    ax.invert_yaxis()
    for y, v in enumerate(vals):
        ax.text(v, y, f" {v:.0f}", va="center", fontsize=8)
    for p, _ in res.published:
        if p.problem == res.problem:
            ax.axvline(p.tflops, color="#C44E52", linestyle="--", linewidth=1)
            ax.text(p.tflops, len(vals) - 0.4, f" {p.name}", color="#C44E52", fontsize=7)
    ax.set_xlabel("TFLOP/s" + (" (model, calibrated)" if model else " (measured)"), fontsize=8)
    ax.set_xlim(0, max(vals) * 1.25)
    ax.set_title("one switch flipped from the default", fontsize=9, loc="left")
    allv = sorted(((r.tflops, len(r.combo.flipped)) for r in res.rows), reverse=True)
    ax2.bar(range(len(allv)), [v for v, _ in allv],
            color=[plt.cm.viridis(k / len(ab.SWITCHES)) for _, k in allv])
    ax2.set_xlabel(f"all {len(allv)} combinations, sorted (colour: switches flipped, 0 = dark)", fontsize=8)
    ax2.set_ylabel("TFLOP/s", fontsize=8)
    ax2.set_title("the matrix", fontsize=9, loc="left")
    sup = f"SM100 forward switch ablation, {res.problem.label()}\n" + (MODEL_LABEL if model else "measured")
    fig.suptitle(sup, fontsize=10, color="#8B0000" if model else "black")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return {"path": path, "bars": names, "suptitle": sup}


def plot_sweep(res: ab.AblationResult, name: str, path: str) -> dict:
    """TFLOP/s against the swept field's value."""
    from fa_sm100.research.plotting import _pyplot
    from fa_sm100.research.timeline import MODEL_LABEL

    plt = _pyplot()
    model = res.rows[0].source == "model"
    xs = [r.combo.values[name] for r in res.rows]
    ys = [r.tflops for r in res.rows]
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    ax.plot([float(x) for x in xs], ys, marker="o", color="#4C72B0")
    for x, y in zip(xs, ys):
        ax.annotate(f"{y:.0f}", (float(x), y), textcoords="offset points", xytext=(0, 6),
                    ha="center", fontsize=7)
    ax.set_xlabel(name, fontsize=9)
    ax.set_ylabel("TFLOP/s" + (" (model, calibrated)" if model else " (measured)"), fontsize=9)
    ax.grid(alpha=0.3)
    sup = f"sweep of {name}, {res.problem.label()}\n" + (MODEL_LABEL if model else "measured")
    ax.set_title(sup, fontsize=9, color="#8B0000" if model else "black")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return {"path": path, "x": xs, "y": ys}


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="ablation.py", description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="store_true", help="report the model even on an SM100 GPU")
    ap.add_argument("--only", default="", help="comma-separated switches to vary (default: all)")
    ap.add_argument("--sweep", default=None, metavar="field=v1,v2,...",
                    help="instead of the matrix: one FmhaConfig field over several values")
    ap.add_argument("--causal", action="store_true", help="ablate the causal problem instead")
    ap.add_argument("--cost", action="append", default=[], metavar="field=value",
                    help="change one cost of the timing model's CostTable before calibrating "
                         "(repeatable), e.g. --cost mufu_ex2_per_clk=64")
    ap.add_argument("--json", default=None, help="write the result as JSON")
    ap.add_argument("--plot", default=None, help="write a PNG bar chart")
    args = ap.parse_args(argv)
    problem = dataclasses.replace(ab.CALIBRATION_POINT.problem, causal=args.causal)
    try:
        only = [s.strip() for s in args.only.split(",") if s.strip()]
        sweep = None
        if args.sweep:
            if only:
                raise ValueError("--sweep and --only: give one of them")
            sweep, combos = ab.parse_sweep(args.sweep, problem)
        else:
            combos = combos_for(problem, only)
        if args.plot and not args.plot.lower().endswith(".png"):
            raise ValueError(f"--plot {args.plot!r}: give a path ending in .png")
        costs = None
        if args.cost:
            from fa_sm100.research import model_backend

            costs = model_backend.cost_table(args.cost)
    except ValueError as e:
        print(f"ablation.py: error: {e}", file=sys.stderr)
        return 2
    mode, why = ab.device_mode()
    if args.model:
        mode, why = "model", "--model"
    print(f"mode: {mode} ({why})", flush=True)
    if mode == "measure":
        def progress(i, n, c):
            print(f"  [{i + 1}/{n}] measuring {' '.join(c.overrides)}", flush=True)

        res = ab.run_measured(problem, combos, progress)
    else:
        from fa_sm100.research import model_backend

        print("calibrating the timing model against the published FA4 B200 figure ...", flush=True)
        if args.cost:
            print("cost table changed: " + ", ".join(args.cost))
        cal, timer = ab.calibrate(model_backend.timer_factory(costs))
        print(f"simulating {len(combos)} combinations (4 timing simulations per distinct config) ...",
              flush=True)
        res = ab.run_model(problem, timer, cal, combos)
    print(ab.format_sweep(res, sweep) if sweep else ab.format_result(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(res), f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        if sweep:
            plot_sweep(res, sweep, args.plot)
        else:
            plot_result(res, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
