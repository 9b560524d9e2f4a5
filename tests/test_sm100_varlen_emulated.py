"""The SM100 varlen forward's own PTX on the CPU PTX emulator (fa_sm100.ptxemu): EMULATED, not
run on Blackwell hardware.

A small packed batch (a zero-length sequence, one shorter than a tile, a sequence without
keys, keys longer than queries and the reverse) through ``run_forward_varlen`` with O and LSE
poisoned with NaN: every row of every sequence meets the project's error rule against the
float64 reference of that sequence alone, rows without keys are O = 0 and LSE = -inf, and O is
bit-identical to the numerics emulation (``emulate_sm100_varlen``, each sequence as a batch-1
problem with the kernel's switches). Causal and not, with ``seqused_k`` in the second, whose
unused keys hold NaN and inf (``fa_sm100.adversarial.poison_unused_keys``).
"""

import math

import pytest
import torch

pytest.importorskip("cutlass")

from fa_sm100.adversarial import poison_unused_keys  # noqa: E402
from fa_sm100.config import select_config  # noqa: E402
from fa_sm100.testing import attention_reference, check_against_reference  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.compile]

CASES = {
    # name: (query lengths, key lengths, seqused_k, causal, --set)
    "causal_2cta": ([0, 5, 130, 40], [3, 0, 200, 40], None, True, {}),
    "used_keys_1cta": ([70, 0, 9, 20], [150, 16, 0, 80], [100, 16, 0, 33], False,
                       dict(use_2cta=False, q_stage=1)),
}


def _cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)


@pytest.mark.parametrize("name", list(CASES))
def test_emulated_varlen_kernel(name):
    from fa_sm100.emulation import emulate_sm100_varlen
    from fa_sm100.ptxemu.sm100_run import run_forward_varlen

    lens_q, lens_k, used, causal, sets = CASES[name]
    h, hk, d = 2, 1, 64
    cfg = select_config(head_dim=d, seqlen_q=max(lens_q), seqlen_k=max(lens_k), causal=causal,
                        qhead_per_kvhead=h // hk, varlen=True, **sets)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(sum(lens_q), h, d, generator=g).to(torch.bfloat16)
    k = torch.randn(sum(lens_k), hk, d, generator=g).to(torch.bfloat16)
    v = torch.randn(sum(lens_k), hk, d, generator=g).to(torch.bfloat16)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    used_t = None if used is None else torch.tensor(used, dtype=torch.int32)
    if used_t is not None:  # the unused keys hold NaN and inf: they must not reach O
        assert poison_unused_keys(k, v, cu_k, used_t) > 0
    run = run_forward_varlen(cfg, q, k, v, cu_q, cu_k, max(lens_q), used_t)
    assert not run.out.isnan().any() and not run.lse.isnan().any(), "a row was not written"
    scale = 1.0 / math.sqrt(d)
    for i, sq in enumerate(lens_q):
        sk = (used or lens_k)[i]
        rows = slice(int(cu_q[i]), int(cu_q[i]) + sq)
        if sq == 0:
            continue
        o, lse = run.out[rows].unsqueeze(0), run.lse[:, rows].unsqueeze(0)
        if sk == 0:
            assert not o.any() and torch.isneginf(lse).all(), f"sequence {i} has no keys"
            continue
        keys = slice(int(cu_k[i]), int(cu_k[i]) + sk)
        qi, ki, vi = q[rows].unsqueeze(0), k[keys].unsqueeze(0), v[keys].unsqueeze(0)
        ref, ref_lse = attention_reference(qi, ki, vi, scale, causal=causal)
        plain, _ = attention_reference(qi, ki, vi, scale, causal=causal, dtype=torch.bfloat16,
                                       upcast=False)
        check_against_reference(o, ref, plain, atol=1e-3, what=f"O of sequence {i}")
        empty = torch.isneginf(ref_lse)
        assert torch.equal(torch.isneginf(lse), empty), f"LSE -inf rows of sequence {i}"
        assert torch.allclose(lse[~empty], ref_lse[~empty].float(), atol=1e-4, rtol=1e-5)
    emu_out, emu_lse = emulate_sm100_varlen(q, k, v, cu_q, cu_k, used_t, causal=causal,
                                            config=cfg)
    assert torch.equal(run.out.view(torch.int16), emu_out.view(torch.int16)), (
        "O differs from the numerics emulation")


PAGED_CASES = {
    # name: (query lengths, used keys, causal, --set); pages of 128 keys, shuffled
    "paged_1cta": ([5, 70, 0], [200, 130, 17], True, {}),
    "paged_2cta": ([5, 200], [256, 129], False, {}),
}


@pytest.mark.parametrize("name", list(PAGED_CASES))
def test_emulated_paged_kernel(name):
    """A paged cache (``page_size``: 128-key pages in shuffled order, named by a page table):
    the kernel's own PTX reads each key block from its page, and the rows of a page past the
    sequence's keys (NaN and inf here) load as zeros. Every sequence meets the float64 rule,
    and O is bit-identical to the numerics emulation of the same sequences stored
    contiguously."""
    from fa_sm100.emulation import emulate_sm100_varlen
    from fa_sm100.ptxemu.sm100_run import run_forward_varlen

    lens_q, used, causal, sets = PAGED_CASES[name]
    h, hk, d, page = 2, 1, 64, 128
    per_seq = max(-(-n // page) for n in used)
    n_pages = len(used) * per_seq + 2  # two pages nobody uses
    cfg = select_config(head_dim=d, seqlen_q=max(lens_q), seqlen_k=max(used), causal=causal,
                        qhead_per_kvhead=h // hk, varlen=True, page_size=page, **sets)
    g = torch.Generator().manual_seed(8)
    q = torch.randn(sum(lens_q), h, d, generator=g).to(torch.bfloat16)
    keys = [torch.randn(n, hk, d, generator=g).to(torch.bfloat16) for n in used]
    values = [torch.randn(n, hk, d, generator=g).to(torch.bfloat16) for n in used]
    table = torch.randperm(n_pages, generator=g)[:len(used) * per_seq].view(len(used), per_seq)
    table = table.to(torch.int32)
    k_pages = torch.full((n_pages, page, hk, d), float("nan")).to(torch.bfloat16)
    v_pages = torch.full((n_pages, page, hk, d), float("inf")).to(torch.bfloat16)
    for i, n in enumerate(used):
        for j in range(n):
            k_pages[table[i, j // page], j % page] = keys[i][j]
            v_pages[table[i, j // page], j % page] = values[i][j]
    cu_q = _cu(lens_q)
    used_t = torch.tensor(used, dtype=torch.int32)
    run = run_forward_varlen(cfg, q, k_pages, v_pages, cu_q, cu_q, max(lens_q), used_t,
                             page_table=table)
    assert not run.out.isnan().any(), "a row was not written, or a page's tail leaked"
    scale = 1.0 / math.sqrt(d)
    for i, sq in enumerate(lens_q):
        rows = slice(int(cu_q[i]), int(cu_q[i]) + sq)
        if sq == 0:
            continue
        qi, ki, vi = q[rows].unsqueeze(0), keys[i].unsqueeze(0), values[i].unsqueeze(0)
        ref, _ = attention_reference(qi, ki, vi, scale, causal=causal)
        plain, _ = attention_reference(qi, ki, vi, scale, causal=causal, dtype=torch.bfloat16,
                                       upcast=False)
        check_against_reference(run.out[rows].unsqueeze(0), ref, plain, atol=1e-3,
                                what=f"O of sequence {i}")
    emu_out, _ = emulate_sm100_varlen(q, torch.cat(keys), torch.cat(values), cu_q, _cu(used),
                                      None, causal=causal, config=cfg)
    assert torch.equal(run.out.view(torch.int16), emu_out.view(torch.int16)), (
        "O differs from the numerics emulation")


def _emulated_paged_forward(q, k_pages, v_pages, cu_seqlens_q, max_seqlen_q, page_table,
                            seqused_k, max_seqlen_k, softmax_scale, causal, window_size, softcap,
                            return_lse):
    """``sm100_fwd_paged``'s arguments, run as the SM100 kernel's PTX on the emulator."""
    from fa_sm100.ptxemu.sm100_run import run_forward_varlen

    h, hk, d = q.shape[1], k_pages.shape[2], q.shape[2]
    cfg = select_config(head_dim=d, seqlen_q=max_seqlen_q, seqlen_k=max_seqlen_k,
                        causal=causal, qhead_per_kvhead=h // hk, varlen=True,
                        page_size=k_pages.shape[1])
    run = run_forward_varlen(cfg, q, k_pages, v_pages, cu_seqlens_q, cu_seqlens_q,
                             max_seqlen_q, seqused_k, window=window_size,
                             softmax_scale=softmax_scale, softcap=softcap,
                             page_table=page_table)
    return run.out, run.lse


@pytest.mark.parametrize("new,splits", [(1, 2), (3, 0)], ids=["decode_2_splits", "prefill_3"])
def test_emulated_kvcache_reads_its_pages(new, splits):
    """``flash_attn_with_kvcache`` on a paged cache through the SM100 kernel's own page reads
    (``paged_forward``: its PTX on the emulator): new tokens appended through the page table,
    one query token split into page-aligned chunks with pack-GQA, or several with their causal
    diagonal; each sequence against float64 over its filled cache, page tails holding NaN."""
    from fa_sm100.kvcache import flash_attn_with_kvcache

    b, page, hq, hk, d = 2, 128, 4, 2, 64
    lengths = [200 - new, 77]
    per_seq = 2
    g = torch.Generator().manual_seed(3)
    table = torch.randperm(b * per_seq + 1, generator=g)[:b * per_seq].view(b, per_seq)
    table = table.to(torch.int32)
    k_pages = torch.full((b * per_seq + 1, page, hk, d), float("nan")).to(torch.bfloat16)
    v_pages = torch.full((b * per_seq + 1, page, hk, d), float("nan")).to(torch.bfloat16)
    keys = [torch.randn(n, hk, d, generator=g).to(torch.bfloat16) for n in lengths]
    values = [torch.randn(n, hk, d, generator=g).to(torch.bfloat16) for n in lengths]
    for i, n in enumerate(lengths):
        for j in range(n):
            k_pages[table[i, j // page], j % page] = keys[i][j]
            v_pages[table[i, j // page], j % page] = values[i][j]
    q = torch.randn(b, new, hq, d, generator=g).to(torch.bfloat16)
    kn, vn = (torch.randn(b, new, hk, d, generator=g).to(torch.bfloat16) for _ in range(2))
    out = flash_attn_with_kvcache(q, k_pages, v_pages, k=kn, v=vn,
                                  cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
                                  page_table=table, causal=True, num_splits=splits,
                                  paged_forward=_emulated_paged_forward)
    for i, n in enumerate(lengths):
        ki = torch.cat([keys[i], kn[i]]).unsqueeze(0)
        vi = torch.cat([values[i], vn[i]]).unsqueeze(0)
        ref, _ = attention_reference(q[i:i + 1], ki, vi, causal=True)
        plain, _ = attention_reference(q[i:i + 1], ki, vi, causal=True, dtype=torch.bfloat16,
                                       upcast=False)
        check_against_reference(out[i:i + 1], ref, plain, atol=1e-3, what=f"sequence {i}")
