"""Round 34: time per backward call at the top SM clock, probes and switches beside FA4.

ab_bench times back-to-back calls near the H200's 700 W cap, where the power manager sets the
clock, so a probe that spends less energy (pointwise=none takes 40 exp2 per thread out of every
block) may run faster for its clock as much as for its work. Here every call is followed by a
GPU sleep as long as the default's call (as in round 33's energy_per_call.py), so the board
stays well below the cap and the clock at its top: the time per call is then the work's own.
Printed per run: median ms per call (CUDA events around each call), the median over rounds of
its ratio to the default's in the same round (a paired ratio, with its 95% interval), the SM
clock (NVML, after each sequence) and joules per call (NVML's energy counter, less the sleeps
alone). Runs alternate in a balanced order over ROUNDS rounds of CALLS calls each. (The
NVML reads and the duty-cycled calls were this script's own when it ran; they are now
``fa_sm100.benchmarking``'s, the same code, with sleeps 1% longer: 2.0e6 cycles per ms of
call instead of 1.98e6.)

python docs/data/round34/pinned_clock.py --rounds R --calls C --hdim D --seqlen S.. \
    [--variant NAME:field=value,...] [--probe NAME=VALUE[+NAME=VALUE]]
"""
import argparse
import importlib.util
import statistics
import sys

import torch

from fa_sm100.benchmarking import (NvmlDevice, duty_cycled_rounds, format_interval,
                                   paired_interval, paired_ratio)
from fa_sm100.hopper import probes

spec = importlib.util.spec_from_file_location("ab_bench", "scripts/ab_bench.py")
ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab)

parser = argparse.ArgumentParser()
parser.add_argument("--rounds", type=int, default=6)
parser.add_argument("--calls", type=int, default=100)
parser.add_argument("--hdim", type=int, default=128)
parser.add_argument("--seqlen", type=int, nargs="+", default=[16384])
parser.add_argument("--causal", choices=("both", "true", "false"), default="both")
parser.add_argument("--variant", action="append", default=[])
parser.add_argument("--probe", action="append", default=[])
args = parser.parse_args()
rounds, calls, hdim = args.rounds, args.calls, args.hdim
nvml = NvmlDevice()

VARIANTS = ab.parse_variants(args.variant, "bwd")
PROBES = [probes.parse_probe_set(spec) for spec in args.probe]
heads = 2048 // hdim
masks = {"both": (False, True), "true": (True,), "false": (False,)}[args.causal]
for seqlen, causal in [(s, c) for s in args.seqlen for c in masks]:
    runs, check = ab.bwd_cell(hdim, seqlen, causal, heads, VARIANTS, True, torch, PROBES)
    for name, run in runs.items():
        grads = run()
        if not name.startswith(ab.PROBE_PREFIX):  # probes are wrong by design
            failure = check(grads)
            if failure is not None:
                sys.exit(f"{name} at hdim {hdim} {seqlen} causal={causal}: {failure}")
    res = duty_cycled_rounds(runs, rounds, calls, torch, nvml, lambda rnd, _: print(
        f"hdim {hdim} {seqlen} causal={causal} round {rnd + 1}/{rounds}", flush=True))
    times = {n: [x[1] for x in r] for n, r in res.items()}
    for n, r in res.items():
        # the default's ms over this run's, round by round: > 1 means this run is faster
        ratio = paired_ratio(times, n, ["default"])
        print(f"hdim {hdim} {seqlen} causal={causal} {n:28s} {statistics.median(times[n]):.4f} "
              f"ms  x{ratio:.3f} {format_interval(paired_interval(times, n, ['default']))} vs "
              f"default  "
              f"{statistics.median(x[2] for x in r)} MHz  "
              f"{statistics.median(x[0] for x in r):.3f} J", flush=True)
