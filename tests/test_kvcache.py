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
from fa_sm100.testing import (attention_reference, check_against_reference, cpu_paged_forward,
                              cpu_varlen_forward)

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


def _paged(kc, vc, seed, page=PAGE):
    """The same cache in shuffled pages of ``page`` rows (a few spare pages), its page table,
    and garbage in the table's unused slots."""
    pages_per_seq = math.ceil(CAPACITY / page)
    total = B * pages_per_seq + 5
    table = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    table = table[:B * pages_per_seq].view(B, pages_per_seq).to(torch.int32)
    kp = torch.full((total, page, HK, D), float("nan"), dtype=kc.dtype)
    vp = torch.full((total, page, HK, D), float("nan"), dtype=vc.dtype)
    for i in range(B):
        for j in range(pages_per_seq):
            rows = slice(j * page, min((j + 1) * page, CAPACITY))
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


def run_case(paged, case, device="cpu", varlen_forward=cpu_varlen_forward, paged_forward=None,
             page=PAGE):
    """One call of ``flash_attn_with_kvcache`` (on ``device``, with ``varlen_forward`` and
    ``paged_forward``: the CPU models, or None for the device's kernels; a paged cache with no
    paged forward is gathered; pages of ``page`` rows) checked sequence by sequence."""
    new, causal, window, softcap, splits = case
    lengths = [0, 17, 250] if new else [1, 17, 250]
    q, kc, vc, kn, vn, ref_k, ref_v = (None if t is None else t.to(device)
                                       for t in _cache(lengths, new, seed=len(lengths) + new))
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    cache = dict(k_cache=kc, v_cache=vc)
    if paged:
        kp, vp, table = (t.to(device) for t in _paged(kc.cpu(), vc.cpu(), seed=new, page=page))
        table[0, 1 + 32 // page:] = -7  # sequence 0 uses at most 2 pages: the rest is unread
        cache = dict(k_cache=kp, v_cache=vp, page_table=table)
    out, lse = flash_attn_with_kvcache(q, k=kn, v=vn, cache_seqlens=seqlens, causal=causal,
                                       window_size=window, softcap=softcap, num_splits=splits,
                                       return_softmax_lse=True, varlen_forward=varlen_forward,
                                       paged_forward=paged_forward, **cache)
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


@pytest.mark.parametrize("paged", [False, True, "kernel"],
                         ids=["contiguous", "paged-gathered", "paged-read-by-kernel"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_kvcache_attention_is_each_sequences_own(paged, case):
    run_case(bool(paged), case, paged_forward=cpu_paged_forward if paged == "kernel" else None)


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
    """Shapes, dtypes and options raise ValueError before anything runs; so do bad values
    (lengths, pages) with ``check_values=True``, which reads them to the host first."""
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
        (dict(cache_seqlens=torch.tensor([5, 5, 300], dtype=torch.int32), k=kn, v=vn,
              check_values=True), "capacity"),
        (dict(cache_seqlens=torch.tensor([5, -1, 5], dtype=torch.int32), check_values=True),
         ">= 0"),
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
        call(k_cache=kp, v_cache=vp, page_table=table, k=kn, v=vn, check_values=True)
    assert torch.equal(kc.nan_to_num(), before.nan_to_num()), "nothing was written"


@pytest.mark.parametrize("paged", [False, True, "kernel"],
                         ids=["contiguous", "paged-gathered", "paged-read-by-kernel"])
def test_bad_values_give_nan_for_their_sequence_only(paged):
    """Without ``check_values`` nothing waits for the GPU: a sequence with a bad value (a
    length below 0 or past the capacity with the new tokens, a used page outside the cache)
    gets NaN output and LSE and its new tokens are not written; the others are unaffected,
    attended and appended as usual."""
    lengths = [5, 17, 250]
    q, kc, vc, kn, vn, ref_k, ref_v = _cache(lengths, 1, seed=3)
    cache = dict(k_cache=kc, v_cache=vc)
    if paged:
        kp, vp, table = _paged(kc, vc, seed=3)
        table[2, 0] = kp.shape[0] + 3  # sequence 2 reads a page past the cache
        cache = dict(k_cache=kp, v_cache=vp, page_table=table)
        seqlens = torch.tensor([5, -2, 250], dtype=torch.int32)
        bad = [False, True, True]
    else:
        seqlens = torch.tensor([5, CAPACITY, -1], dtype=torch.int32)
        bad = [False, True, True]
    before = {n: t.clone() for n, t in cache.items() if n != "page_table"}
    out, lse = flash_attn_with_kvcache(
        q, k=kn, v=vn, cache_seqlens=seqlens, num_splits=2, return_softmax_lse=True,
        varlen_forward=cpu_varlen_forward,
        paged_forward=cpu_paged_forward if paged == "kernel" else None, **cache)
    for i, is_bad in enumerate(bad):
        if is_bad:
            assert out[i].isnan().all() and lse[i].isnan().all(), f"sequence {i}: NaN"
            continue
        keys = slice(0, lengths[i] + 1)
        args = (q[i:i + 1], ref_k[i:i + 1, keys], ref_v[i:i + 1, keys])
        ref, _ = attention_reference(*args)
        plain, _ = attention_reference(*args, dtype=torch.bfloat16, upcast=False)
        check_against_reference(out[i:i + 1], ref, plain, atol=1e-3, what=f"sequence {i}")
    if not paged:
        for n, t in before.items():
            changed = (cache[n] != t) & ~(cache[n].isnan() & t.isnan())
            rows = changed.any(-1).any(-1).nonzero()[:, :2].tolist()
            assert rows == [[0, 5]], f"{n}: only sequence 0's new token is written, got {rows}"


@pytest.mark.parametrize("paged", [False, "kernel"], ids=["contiguous", "paged-read-by-kernel"])
@pytest.mark.parametrize("sq,window", [(1, (-1, -1)), (1, (64, -1)), (3, (-1, -1))],
                         ids=["decode", "decode-window", "prefill"])
def test_the_default_call_never_waits_for_the_gpu(monkeypatch, paged, sq, window):
    """Run on meta tensors (shapes, no data): any read of a value on the host (a length, the
    page table) would raise. The checks, the append, the metadata and the merge all stay on
    the device, so a serving loop is not stalled and can be captured in a CUDA graph."""
    from fa_sm100 import kvcache

    monkeypatch.setattr(kvcache, "_STATIC", {})
    launched = []

    def forward(q, *args):
        launched.append(q.shape)
        return (q.new_empty(q.shape[0], q.shape[1], D),
                q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32))

    meta = lambda *s, dtype=torch.bfloat16: torch.empty(*s, device="meta", dtype=dtype)  # noqa
    cache = dict(k_cache=meta(B, 256, HK, D), v_cache=meta(B, 256, HK, D))
    if paged:
        cache = dict(k_cache=meta(40, 64, HK, D), v_cache=meta(40, 64, HK, D),
                     page_table=meta(B, 4, dtype=torch.int32))
    out, lse = flash_attn_with_kvcache(
        meta(B, sq, HQ, D), k=meta(B, 2, HK, D), v=meta(B, 2, HK, D),
        cache_seqlens=meta(B, dtype=torch.int32), num_splits=3, window_size=window,
        return_softmax_lse=True, varlen_forward=forward, paged_forward=forward, **cache)
    assert out.shape == (B, sq, HQ, D) and lse.shape == (B, HQ, sq) and len(launched) == 1
    with pytest.raises(NotImplementedError, match="no data"):  # check_values reads them
        flash_attn_with_kvcache(meta(B, sq, HQ, D), cache_seqlens=meta(B, dtype=torch.int32),
                                check_values=True, varlen_forward=forward,
                                paged_forward=forward, **cache)


def test_sm90_paged_forward_rejects_pages_it_cannot_read():
    """Pages the SM90 kernel's key blocks cannot load whole raise before anything runs."""
    from fa_sm100.hopper.interface import sm90_fwd_paged

    q = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    pages = torch.zeros(8, 16, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    table = torch.zeros(1, 8, dtype=torch.int32)
    used = torch.tensor([100], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of 64"):
        sm90_fwd_paged(q, pages, pages, cu, 4, table, used, 128)
    with pytest.raises(ValueError, match="seqused_k"):
        sm90_fwd_paged(q, pages.new_zeros(2, 64, 2, 64), pages.new_zeros(2, 64, 2, 64), cu, 4,
                       table, None, 128)


def test_a_warm_call_reuses_its_plan(monkeypatch):
    """The checks and decisions that depend on shapes and options run once per (metadata,
    options): a second call with the same metadata only does the call's work, and results
    agree; other options or shapes make their own plan."""
    from fa_sm100 import kvcache
    from fa_sm100.call_plans import PlanTable

    monkeypatch.setattr(kvcache, "_plans", PlanTable())
    built = []
    init = kvcache.KvcachePlan.__init__
    monkeypatch.setattr(kvcache.KvcachePlan, "__init__",
                        lambda self, *a: (built.append(a[11]), init(self, *a))[1])
    q, kc, vc, _, _, _, _ = _cache([5, 17, 250], 0, seed=1)
    call = lambda lens, splits: flash_attn_with_kvcache(  # noqa: E731
        q, kc, vc, cache_seqlens=torch.tensor(lens, dtype=torch.int32), num_splits=splits,
        varlen_forward=cpu_varlen_forward)
    first = call([5, 17, 250], 2)
    again = call([5, 17, 250], 2)
    assert torch.equal(first.nan_to_num(), again.nan_to_num()) and built == [2]
    call([1, 2, 3], 2)  # other values, same metadata: the same plan
    assert built == [2]
    call([5, 17, 250], 3)
    assert built == [2, 3]
