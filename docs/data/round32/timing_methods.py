"""Round 32: why the grid and ab_bench disagree at hdim 128 causal 16k (H200).

The grid (scripts/benchmark.py) times each call alone with triton's do_bench, which flushes
the L2 before every call and takes the median call; ab_bench times back-to-back calls between
two CUDA events (fa_sm100.benchmarking.events_ms), the L2 warm and the calls' PDL chains
overlapping. Both methods, both providers, in alternating order, the same tensors:
ours over FA4 by the median of the per-round ratios of each method.
"""
import sys

import torch

from fa_sm100.benchmarking import calls_per_round, events_ms, round_order, time_ms
from fa_sm100.hopper.bwd_bench import _fa4_backward, _fa4_fn
from fa_sm100.hopper.bwd_interface import sm90_bwd

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
fa4, why = _fa4_fn()
assert fa4 is not None, why
for causal in (True, False):
    b, s, h, d = 1, 16384, 16, 128
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    with torch.no_grad():
        out, lse = fa4(q, k, v, causal=causal, return_lse=True)
    lse = (lse if lse.shape == (b, h, s) else lse.permute(0, 2, 1)).float().contiguous()
    runs = {"ours": lambda: sm90_bwd(dout, q, k, v, out, lse, causal=causal),
            "fa4": _fa4_backward(fa4, q, k, v, dout, causal)}
    for run in runs.values():
        run()
    torch.cuda.synchronize()
    calls = calls_per_round(events_ms(runs["ours"], 3, torch), 150.0)
    methods = {"do_bench, L2 flushed, one call at a time": lambda fn: time_ms(fn, 25, 100, torch),
               f"back to back, {calls} calls": lambda fn: events_ms(fn, calls, torch)}
    res = {m: {n: [] for n in runs} for m in methods}
    for rnd in range(rounds):
        for m, measure in methods.items():
            for n in round_order(list(runs), rnd):
                res[m][n].append(measure(runs[n]))
    for m in methods:
        ratios = sorted(f / o for o, f in zip(res[m]["ours"], res[m]["fa4"]))
        med = ratios[len(ratios) // 2]
        ms = sorted(res[m]["ours"])[rounds // 2], sorted(res[m]["fa4"])[rounds // 2]
        print(f"causal={causal} {m}: ours {ms[0]:.4f} ms, fa4 {ms[1]:.4f} ms, ours over fa4 "
              f"{med:.3f}x (rounds {ratios[0]:.3f}-{ratios[-1]:.3f})", flush=True)
    del q, k, v, dout, out, lse, runs
