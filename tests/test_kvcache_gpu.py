"""``flash_attn_with_kvcache`` on an SM90 GPU: the CPU tests' cases (tests/test_kvcache.py:
contiguous and paged caches whose unfilled rows hold NaN and inf, new tokens appended, one
query token with pack-GQA and 1 to 7 splits, several query tokens with their causal diagonal,
windows, softcap) with the varlen kernel, each sequence against float64 under the rule.
Skips off SM90 with the reason."""

import pytest
import torch

from test_kvcache import CASE_IDS, CASES, run_case

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("paged,page", [(False, 16), (True, 16), (True, 64), (True, 128)],
                         ids=["contiguous", "paged16-gathered", "paged64-kernel",
                              "paged128-kernel"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_kvcache_on_the_gpu(sm90_device, paged, page, case):
    """Pages of 64 and 128 keys are read by the kernel itself (``sm90_fwd_paged``), pages of
    16 gathered first."""
    run_case(paged, case, device="cuda", varlen_forward=None, page=page)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_shapes_of_the_benchmark(sm90_device, dtype):
    """The decode benchmark's shape (32 query heads on 4 KV heads, hdim 128, page 64) at a
    small size: paged (read by the kernel) and contiguous both meet the rule against float64."""
    from fa_sm100.kvcache import flash_attn_with_kvcache
    from fa_sm100.testing import attention_reference, check_against_reference

    g = torch.Generator(device="cuda").manual_seed(2)
    b, cap, hk, hq, d, page = 4, 2048, 4, 32, 128, 64
    lens = torch.tensor([2048, 1, 700, 1500], dtype=torch.int32, device="cuda")
    kc, vc = (torch.randn(b, cap, hk, d, device="cuda", dtype=dtype, generator=g)
              for _ in range(2))
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=dtype, generator=g)
    table = torch.arange(b * cap // page, dtype=torch.int32, device="cuda").view(b, -1)
    kp, vp = (c.view(b * cap // page, page, hk, d) for c in (kc, vc))
    out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens)
    paged = flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, page_table=table)
    for i, n in enumerate(lens.tolist()):
        args = (q[i:i + 1], kc[i:i + 1, :n], vc[i:i + 1, :n])
        ref, _ = attention_reference(*args)
        plain, _ = attention_reference(*args, dtype=dtype, upcast=False)
        for got, what in ((out, "contiguous"), (paged, "paged")):
            check_against_reference(got[i:i + 1], ref, plain, atol=1e-3,
                                    what=f"{what} sequence {i}")
