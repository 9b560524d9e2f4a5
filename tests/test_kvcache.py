"""``flash_attn_with_kvcache`` on the CPU (fa_sm100/kvcache.py, docs/kvcache.md): the whole
call (new tokens appended in place, a contiguous or a paged cache, pack-GQA and split-KV for
one query token, several query tokens with their causal diagonal) run on the PyTorch model of
the varlen kernel (``fa_sm100.testing.cpu_varlen_forward``), against float64 attention over
each sequence's filled cache under the project's rule; the cache's unfilled rows and unused
page-table slots hold NaN, inf and garbage. Then the split choice and the errors."""

import math

import pytest
import torch

from fa_sm100.kvcache import choose_num_splits, flash_attn_with_kvcache, merge_splits
from fa_sm100.testing import attention_reference, check_against_reference, cpu_varlen_forward

B, CAPACITY, HK, HQ, D, PAGE = 3, 300, 2, 8, 64, 16


def _cache(lengths, new, seed):
    """A contiguous cache with NaN / inf past each sequence's filled rows, the query and the
    new tokens, and the reference cache (new tokens written in)."""
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(torch.bfloat16)  # noqa: E731
    kc, vc = mk(B, CAPACITY, HK, D), mk(B, CAPACITY, HK, D)
    for i, n in enumerate(lengths):
        kc[i, n:], vc[i, n:] = float("nan"), float("inf")
    q = mk(B, new or 1, HQ, D)
    kn, vn = (mk(B, new, HK, D) for _ in range(2)) if new else (None, None)
    ref_k, ref_v = kc.clone(), vc.clone()
    for i, n in enumerate(lengths):
        if new:
            ref_k[i, n:n + new], ref_v[i, n:n + new] = kn[i], vn[i]
    return q, kc, vc, kn, vn, ref_k, ref_v


def _paged(kc, vc, seed):
    """The same cache in shuffled pages of PAGE rows (a few spare pages), its page table, and
    garbage in the table's unused slots."""
    pages_per_seq = math.ceil(CAPACITY / PAGE)
    total = B * pages_per_seq + 5
    table = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    table = table[:B * pages_per_seq].view(B, pages_per_seq).to(torch.int32)
    kp = torch.full((total, PAGE, HK, D), float("nan"), dtype=kc.dtype)
    vp = torch.full((total, PAGE, HK, D), float("nan"), dtype=vc.dtype)
    for i in range(B):
        for j in range(pages_per_seq):
            rows = slice(j * PAGE, min((j + 1) * PAGE, CAPACITY))
            n = rows.stop - rows.start
            kp[table[i, j], :n], vp[table[i, j], :n] = kc[i, rows], vc[i, rows]
    return kp, vp, table


CASES = [  # (new tokens, causal, window, softcap, num_splits)
    (1, True, (-1, -1), 0.0, 1),
    (1, True, (-1, -1), 0.0, 3),
    (1, False, (40, -1), 0.0, 0),
    (1, True, (-1, -1), 5.0, 7),
    (0, False, (-1, 10), 0.0, 2),
    (3, True, (-1, -1), 0.0, 0),
    (3, False, (20, 2), 0.0, 0),
]


CASE_IDS = [f"new{c[0]}c{int(c[1])}w{c[2]}s{c[3]:g}n{c[4]}" for c in CASES]


def run_case(paged, case, device="cpu", varlen_forward=cpu_varlen_forward):
    """One call of ``flash_attn_with_kvcache`` (on ``device``, with ``varlen_forward``: the
    CPU model, or None for the device's kernel) checked sequence by sequence."""
    new, causal, window, softcap, splits = case
    lengths = [0, 17, 250] if new else [1, 17, 250]
    q, kc, vc, kn, vn, ref_k, ref_v = (None if t is None else t.to(device)
                                       for t in _cache(lengths, new, seed=len(lengths) + new))
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    cache = dict(k_cache=kc, v_cache=vc)
    if paged:
        kp, vp, table = (t.to(device) for t in _paged(kc.cpu(), vc.cpu(), seed=new))
        table[0, 3:] = -7  # sequence 0 uses at most 2 pages: the rest is never read
        cache = dict(k_cache=kp, v_cache=vp, page_table=table)
    out, lse = flash_attn_with_kvcache(q, k=kn, v=vn, cache_seqlens=seqlens, causal=causal,
                                       window_size=window, softcap=softcap, num_splits=splits,
                                       return_softmax_lse=True, varlen_forward=varlen_forward,
                                       **cache)
    if not paged and new:
        assert torch.equal(kc[:, :lengths[2] + new].nan_to_num(), ref_k[:, :lengths[2] + new]
                           .nan_to_num()), "new tokens appended in place"
    win = tuple(None if w == -1 else w for w in window)
    for i, n in enumerate(lengths):
        keys = slice(0, n + new)
        args = (q[i:i + 1], ref_k[i:i + 1, keys], ref_v[i:i + 1, keys])
        ref, ref_lse = attention_reference(*args, causal=causal, window=win, softcap=softcap)
        plain, _ = attention_reference(*args, causal=causal, window=win, softcap=softcap,
                                       dtype=torch.bfloat16, upcast=False)
        check_against_reference(out[i:i + 1], ref, plain, atol=1e-3, what=f"sequence {i}")
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse[i:i + 1]), finite)
        assert torch.allclose(lse[i:i + 1][finite].double(), ref_lse[finite], atol=1e-3)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_kvcache_attention_is_each_sequences_own(paged, case):
    run_case(paged, case)


def test_splits_merge_to_one_softmax():
    """Partial attentions over disjoint key chunks, merged by LSE, are the attention over all
    the keys; an empty chunk (LSE -inf) changes nothing; no keys at all gives 0 / -inf."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 4, 2, 16, generator=g, dtype=torch.float64) for _ in range(3))
    k, v = torch.randn(1, 30, 2, 16, generator=g, dtype=torch.float64), torch.randn(
        1, 30, 2, 16, generator=g, dtype=torch.float64)
    parts = [attention_reference(q, k[:, a:b], v[:, a:b]) for a, b in ((0, 7), (7, 25), (25, 30))]
    out = torch.stack([o for o, _ in parts], 1)  # (b, splits, rows, h, d)
    lse = torch.stack([l.transpose(1, 2) for _, l in parts], 1)  # (b, splits, rows, h)
    empty = torch.full_like(lse[:, :1], -math.inf)
    merged, merged_lse = merge_splits(torch.cat([out, out[:, :1] * 0], 1),
                                      torch.cat([lse, empty], 1))
    ref, ref_lse = attention_reference(q, k, v)
    assert torch.allclose(merged.double(), ref, atol=1e-12)
    assert torch.allclose(merged_lse, ref_lse.transpose(1, 2), atol=1e-12)
    none, none_lse = merge_splits(out * 0, torch.full_like(lse, -math.inf))
    assert not none.any() and torch.isneginf(none_lse).all()


def test_the_split_choice_fills_the_machine_and_keeps_chunks_long():
    assert choose_num_splits(132, 132, 8192) == 1  # one wave already
    for tiles, keys in ((32, 8192), (8, 65536), (4, 4096), (100, 2048)):
        s = choose_num_splits(tiles, 132, keys)
        assert 1 <= s and keys / s >= 256
        assert tiles * s >= min(0.8 * 132, tiles * keys // 256) or s == keys // 256
    assert choose_num_splits(8, 132, 300) == 1  # too few keys to cut


def test_bad_kvcache_inputs_raise_before_anything_runs():
    q, kc, vc, kn, vn, _, _ = _cache([5, 5, 5], 1, seed=0)
    seqlens = torch.tensor([5, 5, 5], dtype=torch.int32)
    call = lambda **kw: flash_attn_with_kvcache(  # noqa: E731
        **{**dict(q=q, k_cache=kc, v_cache=vc, cache_seqlens=seqlens,
                  varlen_forward=cpu_varlen_forward), **kw})
    before = kc.clone()
    for kw, message in [
        (dict(rotary_cos=torch.zeros(1)), "rotary_cos"),
        (dict(alibi_slopes=torch.zeros(1)), "alibi"),
        (dict(k=kn), "together"),
        (dict(cache_seqlens=seqlens.long()), "int32"),
        (dict(cache_seqlens=torch.tensor([5, 5, 300], dtype=torch.int32), k=kn, v=vn),
         "capacity"),
        (dict(cache_seqlens=torch.tensor([5, -1, 5], dtype=torch.int32)), ">= 0"),
        (dict(num_splits=-1), "num_splits"),
        (dict(k_cache=kc[:2], v_cache=vc[:2]), "batch"),
        (dict(k_cache=kc[:, :, :, :32], v_cache=vc), "head dim"),
        (dict(page_table=torch.zeros(3, 4, dtype=torch.int32),
              block_table=torch.zeros(3, 4, dtype=torch.int32)), "once"),
    ]:
        with pytest.raises(ValueError, match=message):
            call(**kw)
    kp, vp, table = _paged(kc, vc, seed=0)
    table[1, 0] = kp.shape[0]  # a page past the cache, in a slot sequence 1 uses
    with pytest.raises(ValueError, match="outside the cache"):
        call(k_cache=kp, v_cache=vp, page_table=table, k=kn, v=vn)
    assert torch.equal(kc.nan_to_num(), before.nan_to_num()), "nothing was written"
