"""Shared helpers for numerics checks: the float64 reference and the project's error rule.

The rule (STYLE.md): a kernel's error against a float64 reference may be at most about twice
the error of the same computation done in the input precision by a plain implementation,
plus a small absolute slack for outputs that are near zero.
"""

from __future__ import annotations

import math

import torch

from fa_sm100 import softmax_math


def attention_reference(q, k, v, softmax_scale=None, causal=False, window=(None, None),
                        dtype=torch.float64, upcast=True, softcap=0.0):
    """Plain attention on BSHD tensors (batch, seqlen, heads, head_dim) in ``dtype``.

    GQA/MQA: query head h reads K/V head h // (heads_q // heads_kv). Causal masking is aligned
    bottom-right (query i sees keys j <= i + seqlen_k - seqlen_q), as flash-attn does; a
    sliding window (left, right) keeps keys in [i' - left, i' + right] with i' that aligned
    index. Fully masked rows give O = 0 and LSE = -inf. ``softcap`` > 0 caps the scaled scores
    (``attention_scores``). Returns (out, lse) with lse shaped (batch, heads, seqlen_q) in
    natural-log units.
    """
    s = attention_scores(q, k, softmax_scale, causal, window, dtype, upcast, softcap)
    vf = (v.to(dtype) if upcast else v).repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    p = torch.nan_to_num(p, nan=0.0)  # fully masked rows: exp(-inf - -inf)
    if not upcast:
        p = p.to(q.dtype)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vf)
    return out, lse


def attention_mixed(q, k, v, softmax_scale=None, causal=False, window=(None, None),
                    softcap=0.0):
    """Plain attention as tensor cores do it: 16-bit operands, float32 products and sums.

    S = Q K^T and its softmax in float32, P rounded to the input dtype before P V (float32
    sums), O rounded to the input dtype; LSE in float32. No tiling, no online rescale: the
    second plain baseline of the adversarial rule (``fa_sm100.adversarial``), which unlike the
    all-16-bit ``attention_reference(..., upcast=False)`` stays accurate when scores are large.
    """
    s = attention_scores(q, k, softmax_scale, causal, window, dtype=torch.float32,
                         softcap=softcap)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - m)
    row_sum = p.sum(-1)
    vf = v.to(torch.float32).repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    o = torch.einsum("bhqk,bkhd->bqhd", p.to(q.dtype).to(torch.float32), vf)
    inv = torch.where(row_sum > 0, 1.0 / row_sum, torch.zeros_like(row_sum))
    out = (o * inv.permute(0, 2, 1).unsqueeze(-1)).to(q.dtype)
    lse = torch.where(row_sum > 0, m.squeeze(-1) + torch.log(row_sum),
                      torch.full_like(row_sum, float("-inf")))
    return out, lse


def attention_mixed_grads(q, k, v, dout, softmax_scale=None, causal=False,
                          window=(None, None), softcap=0.0):
    """(dq, dk, dv) as a tensor-core backward computes them, plainly: float32 scores and
    P = exp(S - LSE), dV = P16^T dO, dP = dO V^T, Delta = rowsum(dO * O16) from the 16-bit
    output, dS = P (dP - Delta) rounded to 16 bits before dQ = dS K and dK = dS^T Q, float32
    sums, results in the input dtype; GQA's dK / dV summed over a group's query heads. The
    mixed-precision baseline of the adversarial gradient rule (``attention_mixed``'s partner):
    autograd of a float32 softmax keeps dS in float32, which no 16-bit GEMM does. With
    ``softcap`` dS takes tanh's derivative, 1 - (S_capped / softcap)^2."""
    dtype = q.dtype
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
    out, lse = attention_mixed(q, k, v, softmax_scale, causal, window, softcap)
    s = attention_scores(q, k, softmax_scale, causal, window, dtype=torch.float32,
                         softcap=softcap)
    p = torch.nan_to_num(torch.exp(s - lse.unsqueeze(-1)), nan=0.0)
    g = q.shape[2] // k.shape[2]
    kf, vf = (t.to(torch.float32).repeat_interleave(g, dim=2) for t in (k, v))
    do = dout.to(torch.float32)
    dv = torch.einsum("bhqk,bqhd->bkhd", p.to(dtype).to(torch.float32), do)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, vf)
    delta = (do * out.to(torch.float32)).sum(-1).permute(0, 2, 1)
    ds = p * (dp - delta.unsqueeze(-1))
    if softcap:
        t = torch.nan_to_num(s / softcap, neginf=0.0)  # masked: P = 0 there anyway
        ds = ds * (1.0 - t * t)
    ds = ds.to(dtype).to(torch.float32)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kf) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q.to(torch.float32)) * scale
    dk, dv = (t.unflatten(2, (k.shape[2], g)).sum(3) for t in (dk, dv))
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)


def attention_scores(q, k, softmax_scale=None, causal=False, window=(None, None),
                     dtype=torch.float64, upcast=True, softcap=0.0):
    """The scaled scores S (batch, heads, seqlen_q, seqlen_k) of ``attention_reference``, -inf
    where masked; K's heads repeated for GQA/MQA. ``softcap`` > 0 caps them first:
    S = softcap * tanh(S / softcap)."""
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if hq % hk:
        raise ValueError(f"query heads {hq} not divisible by kv heads {hk}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    qf, kf = (q.to(dtype), k.to(dtype)) if upcast else (q, k)
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf.repeat_interleave(hq // hk, dim=2)) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    mask = attention_mask(sq, sk, causal, window, device=q.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s


def attention_mask(sq, sk, causal=False, window=(None, None), device="cpu"):
    """Boolean (sq, sk) mask of visible keys, or None when every key is visible."""
    left, right = window if window is not None else (None, None)
    if causal:
        right = 0 if right is None else min(right, 0)
    if left is None and right is None:
        return None
    i = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)
    j = torch.arange(sk, device=device).unsqueeze(0)
    mask = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if right is not None:
        mask &= j <= i + right
    if left is not None:
        mask &= j >= i - left
    return mask


def attention_reference_grads(q, k, v, dout, causal=False, window=(None, None),
                              dtype=torch.float64, upcast=True, softcap=0.0):
    """O, LSE and (dq, dk, dv) of ``attention_reference`` computed in ``dtype``, by autograd
    with output gradient ``dout`` (float64 and upcast: the reference of a gradient check; the
    input dtype without upcast: its "plain" baseline)."""
    qs, ks, vs = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out, lse = attention_reference(qs, ks, vs, causal=causal, window=window, dtype=dtype,
                                   upcast=upcast, softcap=softcap)
    out.backward(dout.to(dtype))
    return out.detach(), lse.detach(), (qs.grad, ks.grad, vs.grad)


def check_training_step(attention, q, k, v, dout, causal=False, window=(None, None),
                        softcap=0.0, what=""):
    """One training step's numerics: ``attention(q, k, v)`` on leaf copies, then
    ``backward(dout)``; O and (dq, dk, dv) against float64 autograd of ``attention_reference``
    (``causal``, ``window`` as (left, right) with None unbounded, ``softcap``) under the rule
    (``check_against_reference``; gradients with ``grad_atol``), the plain baseline being the
    same step in the input precision. Returns O."""
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = attention(qg, kg, vg)
    out.backward(dout)
    ref_out, _, ref = attention_reference_grads(q, k, v, dout, causal, window, softcap=softcap)
    plain_out, _, plain = attention_reference_grads(q, k, v, dout, causal, window, q.dtype,
                                                    upcast=False, softcap=softcap)
    check_against_reference(out.detach(), ref_out, plain_out, atol=1e-3, what=f"O {what}")
    for name, x, r, p in zip(("dq", "dk", "dv"), (qg.grad, kg.grad, vg.grad), ref, plain):
        assert x is not None and x.shape == r.shape, f"{name} {what}: missing or misshaped"
        check_against_reference(x, r, p, atol=grad_atol(r), what=f"{name} {what}")
    return out


def relative_error(x, ref) -> float:
    """max |x - ref| / max(|ref|, tiny) over the tensor, in float64."""
    x, ref = x.to(torch.float64), ref.to(torch.float64)
    return float((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def max_abs_error(x, ref) -> float:
    x, ref = x.to(torch.float64), ref.to(torch.float64)
    finite = torch.isfinite(ref)
    if not torch.equal(finite, torch.isfinite(x)):
        return float("inf")
    if not finite.any():
        return 0.0
    return float((x[finite] - ref[finite]).abs().max())


def check_against_reference(out, ref64, plain, atol=1e-5, factor=2.0, what="output"):
    """Assert the project's rule: err(out) <= factor * err(plain) + atol, no NaN anywhere.

    ``ref64`` is the float64 reference, ``plain`` the same computation in the input precision.
    Returns (err, plain_err) for reporting.
    """
    if torch.isnan(out).any():
        raise AssertionError(f"{what}: NaN in the result")
    err = max_abs_error(out, ref64)
    plain_err = max_abs_error(plain, ref64)
    if not err <= factor * plain_err + atol:
        raise AssertionError(
            f"{what}: max error {err:.3e} exceeds {factor} x plain low-precision error "
            f"{plain_err:.3e} + atol {atol:.1e}"
        )
    return err, plain_err


def grad_atol(ref) -> float:
    """The atol of a gradient check: 1e-3 of the reference gradient's largest magnitude, and at
    least check_against_reference's default 1e-5. The floor matters when the reference is
    exactly 0: with one visible key dQ is (dS = P (dP - Delta) cancels), and a FlashAttention
    backward's Delta = rowsum(O dO) and dP = dO V^T, two sums in different orders, leave
    ~1e-7-1e-6 there that autograd's sum(P dP) does not; no relative atol passes that."""
    return max(1e-3 * float(ref.abs().max()), 1e-5)


def growing_row_max_inputs(shape, head_dims, dtype, gen, device="cpu", growth_log2=40.0):
    """Random q, k, v (BSHD) whose row maxes grow while a kernel walks the keys last to first:
    the scores get a bonus of ``w_i * ramp_j * growth_log2`` in log2 units (the softmax's
    exp2 argument), with ``ramp_j`` rising as a cube from 0 at the last key to 1 at the first
    and ``w_i`` cycling over 0, 1/15, ..., 1 every 16 query rows. Within each 16 rows (one
    warp's rows of a 64-row WGMMA tile) some rows' maxes jump by many log2 units from one KV
    tile to the next, some creep, some stay: the cases of a rescale threshold
    (``rescale_events`` counts them)."""
    b, sq, sk, hq, hk = shape
    d, dv = head_dims
    q = torch.randn(b, sq, hq, d, device=device, dtype=dtype, generator=gen)
    k = torch.randn(b, sk, hk, d, device=device, dtype=dtype, generator=gen)
    v = torch.randn(b, sk, hk, dv, device=device, dtype=dtype, generator=gen)
    scale_log2 = math.log2(math.e) / math.sqrt(d)
    w = (torch.arange(sq, device=device) % 16).to(torch.float32) / 15
    ramp = ((sk - 1 - torch.arange(sk, device=device)) / max(sk - 1, 1)).to(torch.float32) ** 3
    a = 4.0  # q's share of the product, k's is growth / (a * scale_log2) at the first key
    q[..., 0] = (a * w)[None, :, None].to(dtype)
    k[..., 0] = (ramp * growth_log2 / (a * scale_log2))[None, :, None].to(dtype)
    return q, k, v


def rescale_events(q, k, n_block, causal, threshold, softmax_scale=None):
    """How often the rescale rule (``softmax_math.rescale_needed``) fires on these inputs when
    the KV tiles of ``n_block`` keys are taken last to first, per (batch, head, row): returns
    (moved, kept), the steps where a row's max grew by more than ``threshold`` log2 units (O
    rescaled) and those where it grew by at most that (stale max kept). float64 scores; a
    coverage check for tests, not a model of the kernel's rounding."""
    s = attention_scores(q, k, softmax_scale, causal) * softmax_math.LOG2_E  # log2 units
    b, hq, sq, sk = s.shape
    tiles = -(-sk // n_block)
    s = torch.nn.functional.pad(s, (0, tiles * n_block - sk), value=float("-inf"))
    tile_max = s.reshape(b, hq, sq, tiles, n_block).amax(-1)
    moved = kept = 0
    m = tile_max[..., tiles - 1]
    for t in range(tiles - 2, -1, -1):
        grow = torch.maximum(m, tile_max[..., t]) - m
        move = softmax_math.rescale_needed(grow, threshold)  # NaN (-inf - -inf): no move
        moved += int(move.sum())
        kept += int(((grow > 0) & ~move).sum())
        m = torch.where(move, m + grow, m)
    return moved, kept


def cpu_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       seqused_k, softmax_scale, causal, window_size, softcap, return_lse,
                       config=None):
    """The varlen forward's signature (``flash_attn_varlen_func``'s kernels) on CPU tensors:
    the PyTorch model of the kernels' arithmetic per sequence (``fa_sm100.autograd``), for
    testing what is built on the varlen forward (``fa_sm100.kvcache``) without a GPU."""
    from fa_sm100.autograd import varlen_fwd_impl
    from fa_sm100.validation import check_softmax_scale, normalize_window

    left, right = normalize_window(window_size)
    out, lse = varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                               max_seqlen_k, check_softmax_scale(softmax_scale, q.shape[-1]),
                               causal, left, right, softcap, -1)
    return (out, lse) if return_lse else out


def cpu_paged_forward(q, k_pages, v_pages, cu_seqlens_q, max_seqlen_q, page_table, seqused_k,
                      max_seqlen_k, softmax_scale, causal, window_size, softcap, return_lse,
                      config=None):
    """The paged forward's signature (``sm90_fwd_paged``, ``sm100_fwd_paged``) on CPU tensors:
    each sequence's pages in its table row's order, then ``cpu_varlen_forward``; for testing
    what is built on a forward that reads the pages itself (``fa_sm100.kvcache``)."""
    import torch

    n, per = page_table.shape
    rows = per * k_pages.shape[1]  # keys of one table row
    table = page_table.long().clamp(0, k_pages.shape[0] - 1)  # slots past seqused: unread
    keys, values = (p[table].reshape(n * rows, *p.shape[2:]) for p in (k_pages, v_pages))
    cu_k = torch.arange(n + 1, dtype=torch.int32) * rows
    return cpu_varlen_forward(q, keys, values, cu_seqlens_q, cu_k, max_seqlen_q, max_seqlen_k,
                              seqused_k, softmax_scale, causal, window_size, softcap,
                              return_lse, config)
