"""Nsight Compute of one backward cell, ours and FA4, kernel by kernel; and a summary that puts
their main kernels side by side.

Profile (on the GPU machine, ``ncu`` on PATH):

    python scripts/ncu_bwd.py --out DIR --hdim 128 --seqlen 16384 [--causal true] \\
        [--who default fa4 NAME:field=value,... probe:NAME=VALUE[+NAME=VALUE]] \\
        [--sections SpeedOfLight ...]

For each entry of ``--who`` a child process runs under ``ncu --set full --import-source no
--clock-control none --profile-from-start off``: it builds the cell as ``scripts/ab_bench.py``
does (bf16, 16k tokens, hidden 2048), checks the gradients against the float32 reference
(not a probe's: Note [cost probes]), calls the backward ``--warmup`` times and profiles one
more call (cudaProfilerStart/Stop around it), so every kernel of that call: ours, the main
kernel, the preprocess beside it and the dQ postprocess; FA4, its preprocess, main kernel and
postprocess. ncu serializes them, so ours' preprocess no longer overlaps the main kernel.
Written: ``DIR/<who>_<cell>.ncu-rep`` and its ``details`` page as CSV, with the full set also
its ``raw`` page and the SASS ``source`` page (sampled warp stalls per instruction). The
cycle counts are ncu's, one launch per pass at the clock the board sets
(``--clock-control none``); time ratios belong to ``scripts/ab_bench.py``.

Summary (any machine; ``fa_sm100.nsight`` reads the CSVs):

    python scripts/ncu_bwd.py --summary DIR [--cell h128_16384_full] [--png stalls.png]

prints, per cell found in DIR: every kernel's duration and cycles, then ours' main kernel
beside FA4's (and beside any variant or probe profiled in the same cell): elapsed cycles,
tensor-pipe activity, issued instructions, the sampled warp states by reason, the MMA loop's
instructions per warp and turn, and its samples by opcode; ``--png`` draws the sampled warp
states of each cell's main kernels as bars (share of each report's samples).
"""

import argparse
import glob
import os
import pathlib
import re
import subprocess
import sys

from fa_sm100.cli import child_env

OURS_KEY = "Sm90FlashBackward"
FA4_KEY = "FlashAttentionBackwardSm90"
CELL_FILE = re.compile(r"_(h\d+_\d+_(?:full|causal))_details\.csv(?:\.gz)?$")
RAW_KEYS = {  # label -> raw metric
    "elapsed cycles": "gpc__cycles_elapsed.max",
    "tensor pipe active %": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "issued instructions": "smsp__inst_issued.sum",
    "warps active per SM": "sm__warps_active.avg.per_cycle_active",
}


def cell_name(hdim, seqlen, causal):
    return f"h{hdim}_{seqlen}_{'causal' if causal else 'full'}"


def report_stem(entry, cell):
    """File stem of one ``--who`` entry's report: ``default``, ``fa4``, a variant's name or
    ``probe-name-value``."""
    who, _, fields = entry.partition(":")
    if who == "probe":
        return f"probe-{fields.replace('=', '-').replace('+', '_')}_{cell}"
    return f"{who}_{cell}"


def child(args):
    import torch

    from fa_sm100.hopper import probes
    from fa_sm100.cli import ab_bench as ab
    who, _, fields = args.child.partition(":")
    probe = fields if who == "probe" else ""
    variants = ab.parse_variants([args.child], "bwd") if fields and not probe else []
    probe_list = [probes.parse_probe_set(probe)] if probe else []
    runs, check = ab.bwd_cell(args.hdim, args.seqlen, args.causal, 2048 // args.hdim,
                              variants, who == "fa4", torch, probe_list)
    run = runs[ab.PROBE_PREFIX + probe] if probe else runs[who]
    grads = run()
    if not probe:  # a probe's gradients are wrong by design
        failure = check(grads)
        if failure is not None:
            sys.exit(f"{who}: {failure}")
    for _ in range(args.warmup):
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def profile(args):
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cell = cell_name(args.hdim, args.seqlen, args.causal)
    full = args.sections == ["full"]
    sections = ["--set", "full"] if full else [x for s in args.sections for x in ("--section", s)]
    for i, entry in enumerate(args.who):
        rep = out / report_stem(entry, cell)
        print(f"[{i + 1}/{len(args.who)}] {entry} {cell}: profiling ...", flush=True)
        cmd = (["ncu"] + sections + ["--import-source", "no", "--clock-control", "none",
                                     "--profile-from-start", "off", "-f", "-o", str(rep),
                                     sys.executable, "-m", __spec__.name, "--child", entry,
                                     "--hdim", str(args.hdim), "--seqlen", str(args.seqlen),
                                     "--warmup", str(args.warmup)]
               + (["--causal"] if args.causal else []))
        subprocess.run(cmd, check=True, env=child_env())
        pages = [("details", [])] + ([("raw", []), ("source", ["--print-source", "sass"])]
                                     if full else [])
        for page, extra in pages:
            with open(f"{rep}_{page}.csv", "w") as f:
                subprocess.run(["ncu", "-i", f"{rep}.ncu-rep", "--page", page, "--csv"] + extra,
                               stdout=f, check=True)


def _page(stem, page):
    """The CSV of one page of a report, plain or gzip-compressed; None when neither exists."""
    for path in (f"{stem}_{page}.csv", f"{stem}_{page}.csv.gz"):
        if os.path.exists(path):
            return path
    return None


def summarize(folder, only_cell=None, png=None):
    """Print the tables of the module docstring for each cell of ``folder``; with ``png``,
    also draw each cell's stall reasons (``nsight.plot_stalls``) there."""
    from fa_sm100 import nsight

    panels = {}

    cells = sorted({m.group(1) for p in pathlib.Path(folder).iterdir()
                    for m in [CELL_FILE.search(p.name)] if m})
    if only_cell:
        cells = [c for c in cells if c == only_cell]
    if not cells:
        raise SystemExit(f"no *_details.csv in {folder}" + (f" for {only_cell}" if only_cell
                                                             else ""))
    for cell in cells:
        stems = sorted(CELL_FILE.sub("", p) + "_" + cell
                       for p in glob.glob(os.path.join(folder, f"*_{cell}_details.csv*")))
        print(f"== {cell}")
        for stem in stems:
            for kernel, t in nsight.kernel_times(_page(stem, "details")).items():
                print(f"  {os.path.basename(stem).rsplit('_' + cell, 1)[0]:>10}  "
                      f"{kernel[:70]:70s} {t.get('duration_us', float('nan')):9.1f} us "
                      f"{t.get('cycles', float('nan')):13,.0f} cycles "
                      f"{t.get('sm_ghz', float('nan')):.2f} GHz")
        raw, loops, samples = {}, {}, {}
        for stem in stems:
            label = os.path.basename(stem).rsplit("_" + cell, 1)[0]
            key = FA4_KEY if label == "fa4" else OURS_KEY
            if _page(stem, "raw"):
                metrics = nsight.raw_metrics(_page(stem, "raw"))
                m = metrics[nsight.find_kernel(metrics, key)]
                raw[label] = {**{k: m.get(v) for k, v in RAW_KEYS.items()},
                              **nsight.stall_samples(m)}
            if _page(stem, "source"):
                rows = nsight.source_rows(_page(stem, "source"))
                kernel_rows = rows[nsight.find_kernel(rows, key)]
                loops[label] = nsight.loop_opcodes(kernel_rows)
                samples[label] = nsight.loop_samples(kernel_rows)
        if raw:
            panels[cell] = {label: {k: v for k, v in r.items()
                                    if k not in RAW_KEYS or k == "tensor pipe active %"}
                            for label, r in raw.items()}
            print("  main kernel (raw page; stalls: sampled warp states by reason)")
            keys = list(RAW_KEYS) + [k for k in next(iter(raw.values())) if k not in RAW_KEYS]
            for line in nsight.side_by_side(raw, keys, fmt="{:>14,.1f}"):
                print("    " + line)
        if loops:
            print("  MMA loop: instructions per warp and turn")
            keys = sorted({k for v in loops.values() for k in v},
                          key=lambda k: -max(v.get(k, 0) for v in loops.values()))
            for line in nsight.side_by_side(loops, keys):
                print("    " + line)
            print("  MMA loop: sampled warp states by opcode")
            keys = sorted({k for v in samples.values() for k in v},
                          key=lambda k: -max(v.get(k, 0) for v in samples.values()))
            for line in nsight.side_by_side(samples, keys[:25]):
                print("    " + line)
    if png:
        if not panels:
            raise SystemExit(f"--png: no raw page in {folder} to plot")
        nsight.plot_stalls(panels, png, f"sampled warp states of the main kernel ({folder})")
        print(f"wrote {png}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--summary", metavar="DIR", help="summarize the CSVs in DIR and exit")
    ap.add_argument("--cell", help="with --summary: only this cell, e.g. h128_16384_full")
    ap.add_argument("--png", help="with --summary: also plot each cell's stall reasons here")
    ap.add_argument("--out", default="ncu_out", help="where the reports and CSVs go")
    ap.add_argument("--hdim", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=16384)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--who", nargs="+", default=["default", "fa4"],
                    help="default, fa4, NAME:field=value,... (a variant) or "
                         "probe:NAME=VALUE[+NAME=VALUE] (a cost probe)")
    ap.add_argument("--sections", nargs="+", default=["full"],
                    help="ncu sections (default: the full set, with raw and source pages)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.summary:
        summarize(args.summary, args.cell, args.png)
    elif args.child:
        child(args)
    else:
        from fa_sm100.hopper import probes
        for entry in args.who:  # bad entries fail here, before any profiling
            who, _, fields = entry.partition(":")
            if who == "probe":
                probes.parse_probe_set(fields)
            elif fields and "=" not in fields:
                raise SystemExit(f"--who {entry!r}: expected NAME:field=value,...")
        profile(args)


if __name__ == "__main__":
    main()
