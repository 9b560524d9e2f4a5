"""Round 33: what makes ours slower back to back than alone at hdim 128 16k (H200)?

Round 32 timed ours and FA4 alone (triton's do_bench: an L2 flush before every call, the
median call) and back to back (ab_bench's CUDA events over ~150 ms): ours was 1.1% (causal) /
1.7% (non-causal) slower back to back, FA4 0.1-0.2%. Candidates: the launch chain across calls
(pdl), the dQ postprocess launched early (early_dq_post), the preprocess beside the main
kernel (pre_ctas: its dQ semaphores are zeroed by a fill kernel), the clock under sustained
power, or mean against median. Here every variant and FA4, in alternating order, by both
methods, each measurement with the SM clock and board power nvidia-smi sampled beside it.

python docs/data/round33/timing_methods.py ROUNDS [causal|noncausal|both] [pdl|tail|pre] [SEQLEN]

Run 1 (timing_methods_run1_h200.txt): 8 rounds, both masks, the 'pdl' set, 16k.
"""
import importlib.util
import statistics
import sys
from pathlib import Path

import torch

from fa_sm100.benchmarking import ClockSampler, calls_per_round, events_ms, round_order

ROOT = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location("ab_bench", ROOT / "scripts" / "ab_bench.py")
ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab)

VARIANT_SETS = {
    "pdl": [("nopdl", {"pdl": False}), ("noearly", {"early_dq_post": False}),
            ("nopre", {"pre_ctas": 0})],
    "tail": [("noearly", {"early_dq_post": False}), ("nopre", {"pre_ctas": 0}),
             ("neither", {"early_dq_post": False, "pre_ctas": 0})],
    "pre": [("nopre", {"pre_ctas": 0}), ("pre64", {"pre_ctas": 64})],
}
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 8
masks = {"causal": (True,), "noncausal": (False,), "both": (True, False)}[
    sys.argv[2] if len(sys.argv) > 2 else "both"]
VARIANTS = VARIANT_SETS[sys.argv[3] if len(sys.argv) > 3 else "pdl"]
seqlen = int(sys.argv[4]) if len(sys.argv) > 4 else 16384


def alone(fn):
    """do_bench's calls (L2 flushed before each): (median ms, mean ms)."""
    from triton.testing import do_bench
    times = do_bench(fn, warmup=25, rep=100, return_mode="all")
    return statistics.median(times), statistics.fmean(times)


for causal in masks:
    runs, check = ab.bwd_cell(128, seqlen, causal, 16, VARIANTS, True, torch)
    for name, run in runs.items():
        check(run()) if name != "fa4" else run()
    torch.cuda.synchronize()
    calls = calls_per_round(events_ms(runs["default"], 3, torch), 300.0)
    res = {n: {"med": [], "mean": [], "b2b": [], "clk_alone": [], "clk_b2b": []} for n in runs}
    for rnd in range(rounds):
        for n in round_order(list(runs), rnd):
            with ClockSampler(interval_ms=50) as cs:
                med, mean = alone(runs[n])
            res[n]["med"].append(med)
            res[n]["mean"].append(mean)
            res[n]["clk_alone"].append(cs.result())
            with ClockSampler(interval_ms=50) as cs:
                res[n]["b2b"].append(events_ms(runs[n], calls, torch))
            res[n]["clk_b2b"].append(cs.result())
        print(f"s={seqlen} causal={causal} round {rnd + 1}/{rounds} done", flush=True)
    base = res["fa4"]
    for n, r in res.items():
        line = [f"s={seqlen} causal={causal} {n:8s}"]
        for key in ("med", "mean", "b2b"):
            ratios = sorted(f / o for o, f in zip(r[key], base[key]))
            line.append(f"{key} {statistics.median(r[key]):.4f} ms "
                        f"(over fa4, paired {ratios[len(ratios) // 2]:.4f})")
        slow = statistics.median(b / m for b, m in zip(r["b2b"], r["med"]))
        line.append(f"b2b/alone {slow:.4f}")
        for key in ("clk_alone", "clk_b2b"):
            vals = [c for c in r[key] if c is not None]
            if vals:
                line.append(f"{key} {statistics.median(v[0] for v in vals):.0f} MHz "
                            f"{statistics.median(v[1] for v in vals):.0f} W")
        print(" | ".join(line), flush=True)
