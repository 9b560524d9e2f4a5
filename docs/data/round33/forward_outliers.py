"""Round 33: do the forwards that feed the backward benchmark give O / LSE outliers?

The round's grid failed ours and FA4's backward alike at hdim 128 causal 1k (the same dq
error), while cuDNN, which runs its own forward, passed. Ours was fed O and LSE from FA4's
forward, and FA4's backward uses its own; a forward outlier would explain both. Per seed,
the grid's cell (b 16, s 1024, h 16, d 128, causal), every (batch, head): O and LSE of FA4's
forward and of ours (sm90_fwd) against a float32 reference, as the margin
err(O) / (2 err(bf16 rounding of the reference O) + 1e-3 max|O|) (> 1 flagged), and the
largest LSE error.

python docs/data/round33/forward_outliers.py SEEDS
"""
import math
import sys

import torch

from fa_sm100.hopper import bwd_bench
from fa_sm100.hopper.interface import sm90_fwd

seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 20
b, s, h, d = 16, 1024, 16, 128
fa4, why = bwd_bench._fa4_fn()
assert fa4 is not None, why
mask = torch.ones(s, s, dtype=torch.bool, device="cuda").tril()
worst = {"fa4": [], "ours": []}
for seed in range(seeds):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))  # (b, h, s, d)
    sc = (qf @ kf.transpose(-1, -2)) / math.sqrt(d)
    sc = sc.masked_fill(~mask, float("-inf"))
    lse_ref = torch.logsumexp(sc, -1)  # (b, h, s)
    o_ref = torch.softmax(sc, -1) @ vf  # (b, h, s, d)
    del sc
    round_err = (o_ref.to(torch.bfloat16).float() - o_ref).abs().amax(dim=(-1, -2))  # (b, h)
    bound = 2 * round_err + 1e-3 * o_ref.abs().amax(dim=(-1, -2))
    with torch.no_grad():
        outs = {"fa4": fa4(q, k, v, causal=True, return_lse=True),
                "ours": sm90_fwd(q, k, v, causal=True, return_lse=True)}
    line = [f"seed {seed:3d}"]
    for name, (o, lse) in outs.items():
        lse = lse if lse.shape == (b, h, s) else lse.permute(0, 2, 1)
        err = (o.float().transpose(1, 2) - o_ref).abs().amax(dim=(-1, -2))
        margin = err / bound
        i = int(margin.argmax())
        worst[name].append(float(margin.max()))
        lse_err = float((lse.float() - lse_ref).abs().max())
        line.append(f"{name}: O margin {float(margin.max()):.3f} at (b {i // h}, h {i % h}), "
                    f"{int((margin > 1).sum())} heads > 1, LSE err {lse_err:.2e}")
    print(" | ".join(line), flush=True)
for name, ms in worst.items():
    ms = sorted(ms)
    print(f"{name}: worst O margin per seed, median {ms[len(ms) // 2]:.3f}, highest {ms[-1]:.3f}")
