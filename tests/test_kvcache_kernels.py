"""The KV-cache call's two small kernels (fa_sm100/kvcache_kernels.py) cross-compiled and run
on the PTX emulator: ``KvcachePrepare`` equals the CPU model of ``flash_attn_with_kvcache``
(``kvcache._prepare`` on CPU tensors: ``bad_sequences`` and the chunks' used keys) on
lengths and page tables with bad values in them; ``SplitCombine`` meets a float64 merge of
the same partial results (chunks without keys, rows without any key, a bad sequence)."""

import math

import pytest
import torch

cutlass = pytest.importorskip("cutlass")

from fa_sm100 import kvcache  # noqa: E402
from fa_sm100.kvcache_kernels import (KvcachePrepare, SplitCombine, combine_arguments,  # noqa: E402
                                      prepare_arguments)
from fa_sm100.ptxemu import capture_launch, emulate  # noqa: E402
from fa_sm100.ptxemu.sm100_run import _to_cute as to_cute  # noqa: E402

pytestmark = pytest.mark.compile


def _run(host, fake, tensors, scalars=()):
    """``host`` captured for sm_100a with ``fake`` arguments and run on the emulator over the
    CPU ``tensors`` (None stays None; the modes the fake tensor leaves to run time marked so)
    and int32 ``scalars``."""
    import cuda.bindings.driver as cuda

    real = [None if t is None else to_cute(t, tuple(i for i, n in enumerate(like.shape)
                                                    if not isinstance(n, int)), like)
            for t, like in zip(tensors, fake)]
    cap = capture_launch(host, fake, (*real, *(cutlass.Int32(v) for v in scalars),
                                      cuda.CUstream(0)))
    emulate(cap, [t for t in tensors if t is not None])


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_prepare_kernel_equals_the_model(paged):
    g = torch.Generator().manual_seed(4)
    b, slots, page, pages, capacity, new, splits, chunk = 70, 6, 64, 40, 384, 2, 3, 128
    seqlens = torch.randint(-3, capacity + 3, (b,), generator=g, dtype=torch.int32)
    seqlens[:4] = torch.tensor([0, capacity - new, capacity - new + 1, -1])
    table = torch.randint(-2, pages + 2, (b, slots), generator=g, dtype=torch.int32)
    used = torch.full((b, splits), -9, dtype=torch.int32)
    bad = torch.full((b,), -9, dtype=torch.int32)
    hk, group, d = 2, 3, 64  # one token's pack-GQA rows are made by the same launch
    q = torch.randn(b, 1, hk * group, d, generator=g).to(torch.bfloat16)
    packed = torch.zeros(b * splits * group, hk, d, dtype=torch.bfloat16)
    _run(KvcachePrepare(paged, group, d),
         prepare_arguments(paged, cutlass.BFloat16, d, env_stream=False),
         (seqlens, table if paged else None, used, bad, q.view(b, hk * group, d), packed),
         (new, capacity, chunk, page, pages))
    want_used, want_bad, want_packed = kvcache._prepare(
        seqlens, table if paged else None, splits, chunk, new, capacity, page, pages, q, hk)
    assert torch.equal(used, want_used)
    assert torch.equal(bad, want_bad.int())
    assert torch.equal(packed, want_packed)
    assert 0 < int(bad.sum()) < b  # both kinds of sequence are in the test


def test_combine_kernel_meets_a_float64_merge():
    g = torch.Generator().manual_seed(5)
    b, splits, group, hk, dv = 3, 4, 2, 3, 64
    rows = b * splits * group
    part = torch.randn(rows, hk, dv, generator=g).to(torch.bfloat16)
    part_lse = torch.randn(hk, rows, generator=g, dtype=torch.float32) * 4
    part_lse[:, 0:group] = -math.inf  # sequence 0's first chunk has no key
    part_lse[:, splits * group:2 * splits * group] = -math.inf  # sequence 1: none at all
    bad = torch.tensor([0, 0, 1], dtype=torch.int32)
    out = torch.full((b, hk * group, dv), 3.0).to(torch.bfloat16)
    lse = torch.full((b, hk * group), 3.0)
    _run(SplitCombine(splits, group, dv),
         combine_arguments(cutlass.BFloat16, dv, env_stream=False),
         (part, part_lse, bad, out, lse))
    parts = part.double().view(b, splits, group, hk, dv)
    lses = part_lse.double().view(hk, b, splits, group).permute(1, 2, 3, 0)
    ref, ref_lse = kvcache.merge_splits(parts, lses)  # float64 throughout
    ref = ref.transpose(1, 2).reshape(b, hk * group, dv)
    ref_lse = ref_lse.transpose(1, 2).reshape(b, hk * group)
    # sequence 0: one rounding to bf16 (half an ulp: 2^-9 relative) over float64
    assert torch.allclose(out[0].double(), ref[0], rtol=2 ** -8, atol=1e-6)
    assert torch.allclose(lse[0].double(), ref_lse[0], rtol=1e-6)
    assert not out[1].any() and torch.isneginf(lse[1]).all()  # no key anywhere: 0, -inf
    assert out[2].isnan().all() and lse[2].isnan().all()  # a bad sequence
