"""Round 32: FA4's SM90 backward on two small problems, to run under compute-sanitizer's
racecheck beside ours (run_fa4_racecheck.sh): does the peer, built on the same CUTLASS DSL
pipelines, draw the same kind of report?"""
import torch

from fa_sm100.hopper.bwd_bench import _fa4_backward, _fa4_fn

fa4, why = _fa4_fn()
assert fa4 is not None, why
gen = torch.Generator(device="cuda").manual_seed(0)
for b, s, h, d, causal in ((2, 300, 4, 128, True), (1, 2048, 2, 128, False)):
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
                     for _ in range(4))
    grads = _fa4_backward(fa4, q, k, v, dout, causal)()
    torch.cuda.synchronize()
    print(f"fa4 bwd b={b} s={s} h={h} d={d} causal={causal}: finite={all(g.isfinite().all().item() for g in grads)}", flush=True)
