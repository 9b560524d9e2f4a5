"""The figures of docs/, drawn from the project's own objects (no numbers typed in here).

    python -m fa_sm100.research.figures --out docs/figures [--only tmem,warps,...]

- ``tmem_plan.png``   the TMEM column plan (``TmemPlan.for_config``) for q_stage 2 and 1,
                      with the split-P boundary (``FmhaConfig.split_p_col``);
- ``warp_roles.png``  the 16 warps by role (``WarpRoles``) and the register file after each
                      warpgroup's setmaxnreg;
- ``smem_budget.png`` the SMEM plan (``SmemPlan``) of the switch combinations that change it;
- ``pipeline_graph.png`` the roles and one arrow per pipeline of ``pipelines.spec.PIPELINES``;
- ``timeline_compare.png``, ``ablation.png``, ``sweep_ex2.png``: MODEL OUTPUT of the timing
                      mode (``scripts/timeline.py --compare --calibrate``, ``scripts/ablation.py
                      --plot``, ``scripts/ablation.py --sweep ex2_emu_fraction=...``);
- ``timeline_bwd.png`` MODEL OUTPUT of the backward's timing mode (``scripts/timeline.py
                      --kernel sm100_bwd --compare``: its recorded protocol, a cross-compile
                      per panel).
"""

from __future__ import annotations

import argparse
import os
import sys

from fa_sm100.config import WARP_SIZE, WARPGROUP_WARPS, REGISTER_FILE, config_from_overrides
from fa_sm100.research.plotting import ROLE_COLORS, _pyplot

SMEM_CONFIGS = (
    ("default (2-CTA, 2 Q stages)", ()),
    ("use_2cta=false", ("use_2cta=false",)),
    ("q_stage=1", ("q_stage=1", "use_2cta=false")),
    ("head_dim=64", ("head_dim=64",)),
    ("head_dim=192, dv=128", ("head_dim=192",)),
)


def plot_tmem_plan(path: str) -> dict:
    """One bar per config: TMEM columns 0..511 with the regions of ``TmemPlan``."""
    from layouts.tmem import TMEM_COLS, TmemPlan

    plt = _pyplot()
    cases = (("q_stage=2 (default)", ()), ("q_stage=1", ("q_stage=1",)))
    fig, axes = plt.subplots(len(cases), 1, figsize=(11, 1.2 + 1.45 * len(cases)))
    colors = {"S": "#C44E52", "P": "#55A868", "O": "#4C72B0"}
    drawn = {}
    for ax, (name, items) in zip(axes, cases):
        cfg = config_from_overrides(items)
        plan = TmemPlan.for_config(cfg)
        hosts = [r for r in plan.regions if r.host is None]
        aliases = [r for r in plan.regions if r.host is not None]
        for r in hosts:
            ax.broken_barh([(r.start, r.cols)], (0.0, 1.0), facecolors=colors[r.name[0]], alpha=0.35,
                           edgecolor="black")
            ax.text(r.start + 2, 0.82, f"{r.name}  {r.start}..{r.stop - 1}", fontsize=8, va="center")
        for r in aliases:
            ax.broken_barh([(r.start, r.cols)], (0.08, 0.52), facecolors=colors["P"], edgecolor="black")
            per_col = 4 // cfg.dtype_bytes
            split = r.start + cfg.split_p_col // per_col
            ax.plot([split, split], [0.08, 0.6], color="black", linewidth=1.5, linestyle="--")
            ax.text(r.start + 2, 0.34, f"{r.name}", fontsize=8, va="center", color="white",
                    fontweight="bold")
            ax.text(split + 1, 0.68, f"split {cfg.split_p_col}/{cfg.n_block} keys", fontsize=6.5)
        free = [(a, b) for a, b in _gaps(plan, TMEM_COLS)]
        for a, b in free:
            ax.broken_barh([(a, b - a)], (0.0, 1.0), facecolors="white", edgecolor="#999999", hatch="..")
            ax.text(a + 2, 0.82, f"unused {a}..{b - 1}", fontsize=8, va="center", color="#666666")
        ax.set_xlim(0, TMEM_COLS)
        ax.set_ylim(0, 1)
        ax.set_yticks([])
        ax.set_xticks(range(0, TMEM_COLS + 1, 64))
        ax.set_title(f"{name}: {plan.cols_used} of {plan.alloc_cols} columns used", fontsize=9, loc="left")
        drawn[name] = plan.names
    axes[-1].set_xlabel("TMEM column (32-bit cells; 128 lanes = 128 query rows per CTA)", fontsize=8)
    fig.suptitle("TMEM plan of the SM100 forward (layouts/tmem.py: TmemPlan.for_config)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return drawn


def _gaps(plan, total: int):
    used = sorted((r.start, r.stop) for r in plan.regions if r.host is None)
    pos = 0
    for a, b in used:
        if a > pos:
            yield pos, a
        pos = max(pos, b)
    if pos < total:
        yield pos, total


def plot_warp_roles(path: str) -> dict:
    """The 16 warps coloured by role, and the register file split by setmaxnreg."""
    plt = _pyplot()
    cfg = config_from_overrides(())
    roles = cfg.warp_roles().validate()
    colors = dict(ROLE_COLORS, empty="#EEEEEE")
    fig, (ax, reg) = plt.subplots(1, 2, figsize=(11, 3.2), gridspec_kw={"width_ratios": (3, 1.3)})
    by_warp = {w: r for r, ws in roles.role_warps().items() for w in ws}
    budget = {0: roles.regs_softmax, 1: roles.regs_softmax, 2: roles.regs_correction, 3: roles.regs_other}
    for w in range(roles.num_warps):
        wg, lane = divmod(w, WARPGROUP_WARPS)
        role = by_warp[w]
        ax.add_patch(plt.Rectangle((lane, 3 - wg), 0.94, 0.88, facecolor=colors[role], edgecolor="black"))
        ax.text(lane + 0.47, 3 - wg + 0.55, f"warp {w}", ha="center", fontsize=8)
        ax.text(lane + 0.47, 3 - wg + 0.25, role, ha="center", fontsize=8, fontweight="bold")
    for wg in range(4):
        ax.text(4.05, 3 - wg + 0.44, f"warpgroup {wg}\nsetmaxnreg {budget[wg]}", fontsize=8, va="center")
    ax.set_xlim(0, 5.3)
    ax.set_ylim(0, 4)
    ax.axis("off")
    ax.set_title(f"{roles.num_warps} warps = {roles.threads_per_cta} threads per CTA "
                 f"(fa_sm100/config.py: WarpRoles)", fontsize=9, loc="left")
    per_wg = WARPGROUP_WARPS * WARP_SIZE
    parts = [("softmax 0", per_wg * roles.regs_softmax, colors["softmax0"]),
             ("softmax 1", per_wg * roles.regs_softmax, colors["softmax1"]),
             ("correction", per_wg * roles.regs_correction, colors["correction"]),
             ("mma/epi/load/empty", per_wg * roles.regs_other, colors["mma"])]
    bottom = 0
    for name, n, c in parts:
        reg.bar(0, n, bottom=bottom, color=c, edgecolor="black", width=0.6)
        reg.text(0.35, bottom + n / 2, f"{name}: {n}", va="center", fontsize=8)
        bottom += n
    reg.axhline(REGISTER_FILE, color="black", linestyle="--")
    reg.text(0.35, REGISTER_FILE * 1.015, f"register file {REGISTER_FILE}", fontsize=8)
    reg.set_xlim(-0.4, 1.6)
    reg.set_ylim(0, REGISTER_FILE * 1.08)
    reg.set_xticks([])
    reg.set_ylabel("32-bit registers per SM", fontsize=8)
    reg.set_title(f"used {roles.registers_used()}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return {"warps": dict(by_warp), "registers_used": roles.registers_used()}


def plot_smem_budget(path: str) -> dict:
    """Stacked SMEM bytes per CTA (sQ, K/V ring, sO, barriers) for configs that change it."""
    from layouts.smem import SmemPlan

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 3.4))
    out = {}
    colors = ("#4C72B0", "#C44E52", "#CCB974", "#999999")
    for i, (name, items) in enumerate(SMEM_CONFIGS):
        cfg = config_from_overrides(items)
        plan = SmemPlan.for_config(cfg)
        parts = (("sQ", plan.q_bytes), (f"K/V ring {plan.kv_stage} x {plan.kv_stage_bytes // 1024} KiB",
                 plan.kv_bytes), ("sO", plan.o_bytes), ("barriers+stats", plan.misc_bytes))
        left = 0
        for (label, b), c in zip(parts, colors):
            ax.barh(i, b / 1024, left=left / 1024, color=c, edgecolor="black")
            if b > 8 * 1024:
                ax.text((left + b / 2) / 1024, i, label, ha="center", va="center", fontsize=7, color="white")
            left += b
        out[name] = plan.total
        budget = plan.budget
    ax.axvline(budget / 1024, color="black", linestyle="--")
    ax.text(budget / 1024, len(SMEM_CONFIGS) - 0.4, f" budget {budget // 1024} KiB", fontsize=8)
    ax.set_yticks(range(len(SMEM_CONFIGS)), [n for n, _ in SMEM_CONFIGS], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("KiB of shared memory per CTA (layouts/smem.py: SmemPlan; kv_stage fills the budget)",
                  fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return out


# Where each role sits in the pipeline graph (x, y).
GRAPH_POS = {
    "load": (0.0, 1.2), "mma": (2.2, 1.2), "softmax": (5.0, 2.6), "correction": (5.0, -0.2),
    "epilogue": (7.4, -0.2),
}


def plot_pipeline_graph(path: str) -> dict:
    """Roles as nodes, one arrow per pipeline of ``pipelines.spec.PIPELINES`` (producer ->
    consumer), labelled with the name, the stage count and how each side arrives."""
    from pipelines.spec import PIPELINES

    plt = _pyplot()
    cfg = config_from_overrides(())
    fig, ax = plt.subplots(figsize=(11, 5.2))
    colors = dict(ROLE_COLORS, softmax=ROLE_COLORS["softmax0"])
    ax.set_xlim(-0.8, 8.2)
    ax.set_ylim(-0.6, 3.0)
    for role, (x, y) in GRAPH_POS.items():
        ax.add_patch(plt.Rectangle((x - 0.55, y - 0.22), 1.1, 0.44, facecolor=colors[role],
                                   edgecolor="black", alpha=0.9))
        ax.text(x, y, role if role != "softmax" else "softmax 0/1", ha="center", va="center",
                fontsize=9, fontweight="bold", color="white")
    drawn = []
    bends = {}
    for spec in PIPELINES:
        for prod in spec.producer.roles:
            for cons in spec.consumer.roles:
                (x0, y0), (x1, y1) = GRAPH_POS[prod], GRAPH_POS[cons]
                pair = tuple(sorted((prod, cons)))
                k = bends.get(pair, 0)
                bends[pair] = k + 1
                rad = (0.15 + 0.3 * k) * (1 if (prod, cons) == pair else -1)
                ax.annotate("", xy=(x1, y1), xytext=(x0, y0),
                            arrowprops=dict(arrowstyle="-|>", color="#333333", lw=1.2,
                                            shrinkA=24, shrinkB=24,
                                            connectionstyle=f"arc3,rad={rad}"))
                # Label at the middle of the quadratic curve arc3 draws (in display space).
                (p0x, p0y), (p1x, p1y) = ax.transData.transform([(x0, y0), (x1, y1)])
                cx = (p0x + p1x) / 2 + rad * (p1y - p0y)
                cy = (p0y + p1y) / 2 - rad * (p1x - p0x)
                mid = (0.25 * p0x + 0.5 * cx + 0.25 * p1x, 0.25 * p0y + 0.5 * cy + 0.25 * p1y)
                mx, my = ax.transData.inverted().transform(mid)
                ox = oy = 0.0
                on = "" if spec.enabled(cfg) else " (off)"
                ax.text(mx + ox, my + oy, f"{spec.name}{on}\n{spec.num_stages(cfg)} st, "
                        f"{spec.producer.arrive}->{spec.consumer.arrive}", ha="center", va="center",
                        fontsize=7, bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="#BBBBBB"))
                drawn.append((spec.name, prod, cons))
    ax.set_xlim(-0.8, 8.2)
    ax.set_ylim(-0.6, 3.0)
    ax.axis("off")
    ax.set_title("pipelines of the SM100 forward, producer -> consumer (pipelines/spec.py: PIPELINES; "
                 "stages for the default config)", fontsize=9, loc="left")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return {"edges": drawn}


STATIC_FIGURES = {
    "tmem": ("tmem_plan.png", plot_tmem_plan),
    "warps": ("warp_roles.png", plot_warp_roles),
    "smem": ("smem_budget.png", plot_smem_budget),
    "pipes": ("pipeline_graph.png", plot_pipeline_graph),
}


# MODEL OUTPUT figures: key -> file (drawn by the timeline and ablation tools).
MODEL_FIGURES = {
    "timeline": "timeline_compare.png",
    "ablation": "ablation.png",
    "sweep": "sweep_ex2.png",
    "timeline_bwd": "timeline_bwd.png",
}
# The command line of timeline_bwd.png (docs/sm100_backward.md quotes it).
BWD_TIMELINE_ARGS = ("--kernel", "sm100_bwd", "--compare", "--quiet")
EX2_SWEEP = "ex2_emu_fraction=0,0.0625,0.125,0.25,0.375,0.5"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Draw the figures of docs/ from the project's objects.")
    ap.add_argument("--out", default="docs/figures", help="directory for the PNGs")
    ap.add_argument("--only", default=",".join(list(STATIC_FIGURES) + list(MODEL_FIGURES)),
                    help="comma-separated subset of " + ",".join(list(STATIC_FIGURES) + list(MODEL_FIGURES)))
    args = ap.parse_args(argv)
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    known = set(STATIC_FIGURES) | set(MODEL_FIGURES)
    bad = [w for w in wanted if w not in known]
    if bad:
        raise SystemExit(f"--only: unknown figure(s) {bad}; choose from {sorted(known)}")
    os.makedirs(args.out, exist_ok=True)
    for key in wanted:
        if key in STATIC_FIGURES:
            name, fn = STATIC_FIGURES[key]
            path = os.path.join(args.out, name)
            fn(path)
            print(f"wrote {path}")
        elif key == "timeline":
            from fa_sm100.research import timeline_cli

            timeline_cli.main(["--compare", "--calibrate", "--quiet",
                               "--out", os.path.join(args.out, "timeline_compare.png")])
        elif key == "timeline_bwd":
            from fa_sm100.research import timeline_cli

            timeline_cli.main([*BWD_TIMELINE_ARGS, "--out", os.path.join(args.out, "timeline_bwd.png")])
        elif key == "ablation":
            from fa_sm100.research import ablation_cli

            ablation_cli.main(["--plot", os.path.join(args.out, "ablation.png")])
        elif key == "sweep":
            from fa_sm100.research import ablation_cli

            ablation_cli.main(["--sweep", EX2_SWEEP, "--plot", os.path.join(args.out, "sweep_ex2.png")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
