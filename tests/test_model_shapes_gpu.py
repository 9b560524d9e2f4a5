"""The shapes models train with, through the public path on an SM90 GPU (issue 54 item 3).

Contract: ``flash_attn_func`` and ``backward`` through autograd, the path ``scripts/benchmark.py
--grid models`` times, give O and dq, dk, dv within the STYLE.md rule of float64 autograd of
plain attention: error <= 2 x the error of the same step done plainly in the input precision
+ a small atol (``fa_sm100.testing.check_training_step``). The grid's cells at small sizes:
GQA 4:1 and 8:1 and MQA at head dims 64 and 128, (192, 128) alone and with GQA 4:1 and 8:1,
causal and not, bf16 and fp16; groups that are no power of two (3 and 6 query heads per KV
head); lengths that are multiples of no tile (333, 777, 1000, 1100, ...); seqlen_q != seqlen_k
both ways, causal rows that see no key (O = 0, zero gradients) included. What
tests/test_autograd.py already runs through this path (MHA, GQA 2:1, MQA 4:1 at (192, 128), at
300 x 300) is not repeated. Skips lazily, with the reason, on anything but an sm_90 GPU.
"""

import pytest
import torch

from fa_sm100.testing import check_training_step

pytestmark = pytest.mark.gpu

BF16, FP16 = torch.bfloat16, torch.float16
CASES = [  # (batch, seqlen_q, seqlen_k, heads_q, heads_kv, (head_dim, head_dim_v), causal, dtype)
    # GQA 4:1
    (2, 1000, 1000, 8, 2, (128, 128), True, BF16),
    (1, 777, 1300, 8, 2, (128, 128), False, BF16),
    (2, 1000, 1000, 16, 4, (64, 64), True, BF16),
    (1, 1100, 700, 8, 2, (64, 64), False, FP16),
    # GQA 8:1
    (1, 1000, 1000, 16, 2, (128, 128), True, BF16),
    (2, 640, 333, 16, 2, (128, 128), False, BF16),
    (1, 333, 1000, 16, 2, (64, 64), True, BF16),
    # MQA
    (2, 1000, 1000, 16, 1, (128, 128), True, BF16),
    (1, 700, 900, 8, 1, (64, 64), False, BF16),
    # (192, 128): MHA, GQA 4:1 and 8:1
    (2, 1000, 1000, 4, 4, (192, 128), True, BF16),
    (1, 777, 1100, 4, 4, (192, 128), False, BF16),
    (1, 1000, 1000, 8, 2, (192, 128), True, BF16),
    (1, 600, 600, 16, 2, (192, 128), False, FP16),
    # groups of 3 and 6 query heads per KV head
    (2, 1000, 1000, 6, 2, (128, 128), True, BF16),
    (1, 333, 777, 3, 1, (64, 64), False, BF16),
    (1, 1000, 1000, 12, 2, (128, 128), True, BF16),
    (2, 900, 900, 12, 2, (64, 64), False, BF16),
    (1, 1100, 500, 6, 1, (192, 128), True, BF16),  # causal, 600 rows see no key
]


def _case_id(case):
    b, sq, sk, hq, hk, (d, dv), causal, dtype = case
    dims = f"d{d}" if d == dv else f"d{d}_{dv}"
    return (f"b{b}-q{sq}-k{sk}-h{hq}/{hk}-{dims}-{'causal' if causal else 'full'}-"
            f"{str(dtype)[6:]}")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_training_step_through_the_public_path_matches_float64(sm90_device, case):
    from fa_sm100.interface import flash_attn_func

    b, sq, sk, hq, hk, (d, dv), causal, dtype = case
    g = torch.Generator(device="cuda").manual_seed(sq * 31 + sk + hq)
    q, k, v, dout = (torch.randn(b, s, h, dim, device="cuda", dtype=dtype, generator=g)
                     for s, h, dim in ((sq, hq, d), (sk, hk, d), (sk, hk, dv), (sq, hq, dv)))
    check_training_step(lambda q, k, v: flash_attn_func(q, k, v, causal=causal), q, k, v, dout,
                        causal, what=_case_id(case))
