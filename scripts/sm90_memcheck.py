#!/usr/bin/env python
"""Run the SM90 forward on a representative set of problems, for compute-sanitizer.

    compute-sanitizer --tool memcheck --error-exitcode 1 python scripts/sm90_memcheck.py

Covers every head-dim pair, causal and not, MHA/GQA/MQA, seqlens that are not tile multiples
(tail rows and keys), seqlen_q > seqlen_k (rows with no key), the one-tile-per-CTA, static
persistent and dynamic persistent schedules. Small shapes: memcheck slows kernels down a lot.
Each result is also checked against a float32 reference, so a silent wrong answer fails too.
"""

import os
import sys

try:  # first import: keeps scripts/inspect.py from shadowing the standard `inspect`
    import _paths  # noqa: F401
except ImportError:  # loaded as a module (tests): this folder is not on sys.path
    pass

import torch  # noqa: E402

from fa_sm100.hopper.config import select_sm90_fwd_config  # noqa: E402
from fa_sm100.hopper.interface import sm90_fwd  # noqa: E402
from fa_sm100.testing import attention_reference, check_against_reference  # noqa: E402

# (batch, seqlen_q, seqlen_k, heads, heads_kv, hdim, hdim_v, causal, schedule): "tile" = one
# work tile per CTA, "static" = persistent CTAs taking every gridDim.x-th tile, "dynamic" =
# persistent CTAs taking tiles from the global counter (Note [Dynamic tile schedule])
SCHEDULES = {"tile": {"persistent": False},
             "static": {"persistent": True, "dynamic_schedule": False},
             "dynamic": {"persistent": True, "dynamic_schedule": True}}
CASES = [
    (2, 300, 300, 4, 4, 128, 128, False, "tile"),
    (2, 300, 300, 4, 4, 128, 128, True, "static"),
    (1, 17, 1000, 4, 1, 64, 64, True, "tile"),
    (3, 1000, 17, 6, 2, 64, 64, False, "static"),
    (1, 257, 129, 2, 2, 96, 96, True, "tile"),
    (2, 129, 257, 4, 2, 192, 128, False, "static"),
    (1, 200, 333, 2, 1, 256, 256, True, "tile"),
    (1, 1, 1, 2, 2, 256, 256, False, "tile"),
    (4, 1000, 1000, 8, 2, 128, 128, True, "dynamic"),
    (3, 700, 1500, 6, 6, 64, 64, True, "dynamic"),
    (2, 700, 900, 4, 2, 256, 256, True, "dynamic"),  # O staged in Q's buffer
]


def main():
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    for b, sq, sk, h, hk, d, dv, causal, schedule in CASES:
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(b, sk, hk, dv, device="cuda", dtype=torch.bfloat16, generator=gen)
        cfg = select_sm90_fwd_config(d, dv, "bfloat16", causal, **SCHEDULES[schedule])
        out, lse = sm90_fwd(q, k, v, None, causal, (None, None), True, cfg)
        torch.cuda.synchronize()
        ref, ref_lse = attention_reference(q, k, v, causal=causal, dtype=torch.float32)
        plain, _ = attention_reference(q, k, v, causal=causal, dtype=torch.bfloat16, upcast=False)
        check_against_reference(out, ref, plain, atol=1e-3, what=f"O {(b, sq, sk, h, hk, d, dv, causal)}")
        print(f"ok b={b} sq={sq} sk={sk} h={h}/{hk} d={d}/{dv} causal={causal} "
              f"schedule={schedule}", flush=True)


if __name__ == "__main__":
    main()
