"""Round 33: the grid's inputs for hdim 128 causal 1k as the unseeded grid drew them.

Before this round, ``bwd_bench.bench_cell`` drew q, k, v, dout from torch's global CUDA
generator, whose seed is torch's fixed default in a fresh process; the grid draws hdim 64's
ten cells (four tensors each), hdim 128 1k non-causal, then hdim 128 1k causal. This draws the
same shapes in the same order (variant "plain"; variant "cudnn": also running the cuDNN SDPA
forward and one backward per cell, in case those advance the generator), then checks ours
and FA4 on the last cell as the grid does, five times, and for the checked heads prints each
gradient's margin err / (2 err(plain) + atol) against the float32 reference, and dq's against
a float64 reference as well.

python docs/data/round33/replay_failed_cell.py plain|cudnn
"""
import sys

import torch

from fa_sm100.hopper import bwd_bench
from fa_sm100.hopper.bwd_interface import sm90_bwd
from fa_sm100.testing import grad_atol, max_abs_error

variant = sys.argv[1] if len(sys.argv) > 1 else "plain"
TOKENS, HIDDEN = 16384, 2048


def draw(b, s, h, d):
    return tuple(torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))


for s in (1024, 2048, 4096, 8192, 16384):
    for causal in (False, True):
        q, k, v, dout = draw(TOKENS // s, s, HIDDEN // 64, 64)
        if variant == "cudnn":
            bwd_bench._cudnn_backward(q, k, v, dout, causal)()
        del q, k, v, dout
q, k, v, dout = draw(16, 1024, 16, 128)  # hdim 128 1k non-causal
if variant == "cudnn":
    bwd_bench._cudnn_backward(q, k, v, dout, False)()
q, k, v, dout = draw(16, 1024, 16, 128)  # hdim 128 1k causal: the cell that failed
causal = True
fa4, why = bwd_bench._fa4_fn()
assert fa4 is not None, why
with torch.no_grad():
    out, lse = fa4(q, k, v, causal=causal, return_lse=True)
lse = (lse if lse.shape == (16, 16, 1024) else lse.permute(0, 2, 1)).float().contiguous()
ref = bwd_bench.reference_grads(q, k, v, dout, causal, torch.float32)
ref64 = bwd_bench.reference_grads(q, k, v, dout, causal, torch.float64)
plain = bwd_bench.reference_grads(q, k, v, dout, causal, torch.bfloat16)
fa4_run = bwd_bench._fa4_backward(fa4, q, k, v, dout, causal)
for attempt in range(5):
    for name, grads in (("ours", sm90_bwd(dout, q, k, v, out, lse, causal=causal)),
                        ("fa4", fa4_run())):
        line = [f"attempt {attempt} {name}: check {bwd_bench.check_grads(grads, ref, plain)}"]
        for (kh, qh, want), (_, _, w64), (_, _, base) in zip(ref, ref64, plain):
            got = (grads[0][0, :, qh], grads[1][0, :, kh], grads[2][0, :, kh])
            for t, x, r, r64, p in zip(("dq", "dk", "dv"), got, want, w64, base):
                m = max_abs_error(x, r) / (2 * max_abs_error(p, r) + grad_atol(r))
                m64 = max_abs_error(x, r64) / (2 * max_abs_error(p, r64) + grad_atol(r64))
                line.append(f"{t} kv{kh} {m:.3f}/{m64:.3f}")
        print(" | ".join(line), flush=True)
