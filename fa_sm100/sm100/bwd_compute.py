"""Backward compute role (warps 0-7, two warpgroups): P and dS of every step, then dK and dV.

Thread t of warpgroup h owns TMEM lane t (key ``n_block * 128 + t``) and the query columns
[64h, 64h + 64) of S^T and dP^T, so it needs no shuffles and the two warpgroups never touch
the same TMEM column.

Consumes  S^T_j and dP^T_j (``bwd_s_dp`` full), LSE2_j and Delta_j (``bwd_lse``), sdS free
          (``bwd_ds`` empty: the previous dQ MMA completed), the final dK, dV (``bwd_dkv``).
Produces  P^T_j and dS^T_j (16-bit) in TMEM over the columns of S^T / dP^T it has read
          (TmemPlan.for_backward: Ph, dSh), dS_j in SMEM (the dQ MMA's A operand; under 2-CTA
          in the sdS of the pair's CTA h, Note [Backward 2-CTA] in bwd_config.py), then dV
          (warpgroup 0) and dK (warpgroup 1) of the key block in global memory.

Per step, with x = S^T scale_log2 (log2 units):

    P  = exp2(x - LSE2)          0 where the causal mask or the window hides the key
    dS = P (dP - Delta)          (the softmax scale goes into dK here and dq in the postprocess)

A padding query row (past seqlen_q) has LSE2 = +inf, so P = 0 and dS = 0 there, and so has a
row whose band holds no key (LSE = -inf: the preprocess writes LSE2 = +inf). A key past
seqlen_k has a zero K and V row and its dK / dV row is not stored, but its score is 0, not
-inf: left unmasked its P = exp2(-LSE2) is inf for a row whose every score lies 128 log2
units below 0, and dQ's sum over keys gets inf x 0 = NaN (the adversarial ``shift_down``
cases). So its P is masked to 0: by the causal limit (the last query row sees keys up to
seqlen_k - 1), by the band (``band_columns``), and otherwise by the key-tail mask of the
warps that hold such keys (the last key block's).

Windows (``cfg.local``): the work tile visits only the query blocks whose band reaches its
keys (``Sm100Backward._problem``, ``bands.q_block_range``). Each thread's key sees the query
columns [lo, hi] of its half (``band_columns``, two subtractions per step); a warp whose 32
keys see all 64 columns takes the loop without a mask, one whose block crosses an edge of the
band (or holds a key past seqlen_k) the loop with two compares and a select per score. The
mask zeroes P after the exp2, so it needs no -inf score and holds for capped scores too.

Note [softcap in the SM100 backward] (``cfg.softcap``): the forward's scores were capped, so
P = exp2(t scale_log2 - LSE2) with t = tanh(raw S softcap_k), scale_log2 = c log2(e) and
softcap_k = softmax_scale / c (``fa_sm100.softmax_math``, the SM90 backward's Note [softcap in
the backward]), and the chain rule puts tanh's derivative into dS: dS = P (dP - Delta)
(1 - t^2), scaled by softmax_scale as before. The registers that held S^T keep the float32
P (1 - t^2) once P is in its 16-bit copy, so dS = that (dP - Delta) takes the uncapped loop's
registers (S^T, 16-bit P, dP^T) and no t is kept. A masked P is 0, and t is finite, so the
product is 0 without a special masked value.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import tcgen05

from fa_sm100.config import WARPGROUP_WARPS
from fa_sm100.dsl_math import softcap_tanh
from fa_sm100.sm100.bwd_load import step_head_block
from fa_sm100.sm100.mma import advance
from pipelines import record

CHUNK = 32  # columns per tcgen05.ld (32-bit) / per tcgen05.st of 16-bit pairs (16 columns)


@dataclass(frozen=True)
class HalfViews:
    """One warpgroup's TMEM copies: S^T / dP^T half loads, P^T / dS^T half stores."""

    thr_load: object
    tS: cute.Tensor  # (regs, 1, chunks) of S^T's half
    tdP: cute.Tensor
    coords: cute.Tensor  # (key row, query column within the half) of each register
    thr_store: object
    tP: cute.Tensor  # (regs, 1, chunks) of the P^T region (16-bit pairs as 32-bit columns)
    tdS: cute.Tensor
    store_shape: object  # registers of one stored chunk


def _columns(acc, start, cols):
    """Columns [start, start + cols) of a (128 lanes, n) TMEM accumulator view."""
    return cute.make_tensor(acc.iterator + start,
                            cute.composition(acc.layout, cute.make_layout((128, cols))))


def make_half_views(cfg, h: int, tidx, tmem) -> HalfViews:
    half = cfg.m_block // 2
    p_cols = half * cfg.dtype_bytes // 4
    plan = tmem.plan
    s_acc = tmem.tS[(None, None), 0, 0]
    dp_acc = tmem.tdP[(None, None), 0, 0]
    s_half, dp_half = _columns(s_acc, h * half, half), _columns(dp_acc, h * half, half)
    load_atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(CHUNK)),
                                    Float32)
    thr_load = tcgen05.make_tmem_copy(load_atom, s_half).get_slice(tidx)
    p_region = _columns(s_acc, plan.offset(f"P{h}") - plan.offset("S"), p_cols)
    ds_region = _columns(dp_acc, plan.offset(f"dS{h}") - plan.offset("dP"), p_cols)
    store_atom = cute.make_copy_atom(
        tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(CHUNK // 2)), Float32)
    thr_store = tcgen05.make_tmem_copy(store_atom, p_region).get_slice(tidx)
    return HalfViews(
        thr_load=thr_load, tS=thr_load.partition_S(s_half), tdP=thr_load.partition_S(dp_half),
        coords=thr_load.partition_D(cute.make_identity_tensor((128, half))),
        thr_store=thr_store, tP=thr_store.partition_D(p_region),
        tdS=thr_store.partition_D(ds_region),
        store_shape=thr_store.partition_S(
            cute.make_identity_tensor((128, p_cols)))[None, None, 0].shape)


@cute.jit
def _store_pairs(cfg, v: HalfViews, vals: cute.Tensor, dst: cute.Tensor, dtype):
    """The 16-bit values of ``vals`` (the half's columns) into TMEM ``dst``, a chunk at a time."""
    for c in cutlass.range_constexpr(cute.size(dst.shape[2])):
        packed = cute.make_rmem_tensor(v.store_shape, Float32)
        pairs = cute.make_tensor(cute.recast_ptr(packed.iterator, dtype=dtype),
                                 cute.make_layout(CHUNK))
        for i in cutlass.range_constexpr(CHUNK):
            pairs[i] = vals[c * CHUNK + i]
        cute.copy(v.thr_store, packed, dst[None, None, c])


@dataclass(frozen=True)
class BandColumns:
    """The query columns [lo, hi] of a warpgroup's half that this thread's key sees in one step
    (none past seqlen_k), and ``edge``: whether some key of the thread's warp misses one."""

    lo: Int32
    hi: Int32
    edge: object  # Boolean, the same for the 32 lanes of a warp


@cute.jit
def band_columns(cfg, prob, key: Int32, first_q: Int32) -> BandColumns:
    """Query q sees key j iff q' - left <= j <= q' + right, q' = q + seqlen_k - seqlen_q
    (``fa_sm100.bands``, bounds from ``bands.kernel_window``): column c = q - first_q of the
    half is seen iff lo <= c <= hi. Both limits grow with the key, so the warp's first key
    (``key`` - lane) and last (+ 31) decide whether a score of its 32 x 64 block is masked."""
    half = cfg.m_block // 2
    left, right = prob.window
    diag = key - (prob.seqlen_k - prob.seqlen_q) - first_q  # the key's diagonal, as a column
    lo = diag - right
    hi = diag + left
    lane = cute.arch.lane_idx()
    warp_last_key = key - lane + 31
    edge = ((lo - lane + 31 > 0) | (hi - lane < half - 1)
            | (warp_last_key >= prob.seqlen_k))
    if key >= prob.seqlen_k:
        hi = Int32(-1)
    return BandColumns(lo=lo, hi=hi, edge=edge)


@cute.jit
def scores_to_p(cfg, h: cutlass.Constexpr, v: HalfViews, smem, prob, rS: cute.Tensor,
                rP16: cute.Tensor, index: Int32, key: Int32, first_q: Int32, band, dtype,
                tail: cutlass.Constexpr = False):
    """P of the half's 64 scores: into ``rP16`` (16-bit, the dV MMA's operand) and ``rS``
    (float32, dS's factor: P, or with softcap P (1 - t^2), Note [softcap in the SM100
    backward]). Masked: the causal diagonal (``cfg.causal`` without a window), the band's
    columns ``band`` (a ``BandColumns``; None: no key of the warp is masked), and with
    ``tail`` a key past seqlen_k."""
    half = cfg.m_block // 2
    shift = prob.seqlen_k - prob.seqlen_q
    for i in cutlass.range_constexpr(cute.size(rS)):
        col = v.coords[i][1]
        x = rS[i]
        if cutlass.const_expr(cfg.softcap):
            x = softcap_tanh(x * prob.softcap_k)  # t
        p = cute.math.exp2(x * prob.scale_log2 - smem.sLSE2[h * half + col, index],
                           fastmath=True)
        if cutlass.const_expr(cfg.causal and not cfg.is_local):
            # the causal limit: query q sees this key iff key <= q + seqlen_k - seqlen_q
            p = p if key <= first_q + col + shift else Float32(0.0)
        if cutlass.const_expr(band is not None):
            p = p if (band.lo <= col) & (band.hi >= col) else Float32(0.0)
        if cutlass.const_expr(tail):
            p = p if key < prob.seqlen_k else Float32(0.0)
        if cutlass.const_expr(cfg.softcap):
            rP16[i] = p.to(dtype)
            rS[i] = p * (Float32(1.0) - x * x)
        else:
            rS[i] = p
            rP16[i] = p.to(dtype)


@cute.jit
def compute_step(cfg, h: cutlass.Constexpr, v: HalfViews, smem, pipes, prob, step: Int32,
                 index: Int32, phase: Int32, one_phase: Int32, key: Int32, dtype):
    """P and dS of step ``step`` for this thread's key row and its warpgroup's 64 queries."""
    half = cfg.m_block // 2
    _, m = step_head_block(cfg, prob, step)
    cols = (h * half, h * half + half)  # this warpgroup's query columns of S^T, dP^T, sdS
    pipes.bwd_lse.consumer_wait(index, phase)
    pipes.bwd_s_dp.consumer_wait(0, one_phase)
    record.access("S", "r", cols=cols)
    record.access("sLSE2", "r", stage_of="bwd_lse", cols=cols)
    rS = cute.make_rmem_tensor(v.coords.shape, Float32)
    cute.copy(v.thr_load, v.tS, rS)
    cute.arch.fence_view_async_tmem_load()  # S^T is in registers before P overwrites it
    first_q = m * cfg.m_block + h * half
    rP16 = cute.make_rmem_tensor(cute.size(rS), dtype)
    if cutlass.const_expr(cfg.is_local):
        band = band_columns(cfg, prob, key, first_q)
        if band.edge:
            scores_to_p(cfg, h, v, smem, prob, rS, rP16, index, key, first_q, band, dtype)
        else:
            scores_to_p(cfg, h, v, smem, prob, rS, rP16, index, key, first_q, None, dtype)
    elif cutlass.const_expr(cfg.causal):  # the causal limit masks keys past seqlen_k
        scores_to_p(cfg, h, v, smem, prob, rS, rP16, index, key, first_q, None, dtype)
    elif key - cute.arch.lane_idx() + 31 >= prob.seqlen_k:  # a warp of the last key block
        scores_to_p(cfg, h, v, smem, prob, rS, rP16, index, key, first_q, None, dtype, True)
    else:
        scores_to_p(cfg, h, v, smem, prob, rS, rP16, index, key, first_q, None, dtype)
    record.access(f"P{h}", "w")
    _store_pairs(cfg, v, rP16, v.tP, dtype)
    record.access("dP", "r", cols=cols)
    record.access("sDelta", "r", stage_of="bwd_lse", cols=cols)
    rdP = cute.make_rmem_tensor(v.coords.shape, Float32)
    cute.copy(v.thr_load, v.tdP, rdP)
    cute.arch.fence_view_async_tmem_load()
    rdS16 = cute.make_rmem_tensor(cute.size(rS), dtype)
    for i in cutlass.range_constexpr(cute.size(rS)):
        col = v.coords[i][1]
        rdS16[i] = (rS[i] * (rdP[i] - smem.sDelta[h * half + col, index])).to(dtype)
    pipes.bwd_lse.consumer_release(index)
    pipes.bwd_ds.producer_acquire(0, one_phase ^ 1)  # the previous dQ MMA has read sdS
    record.access(f"dS{h}", "w")
    _store_pairs(cfg, v, rdS16, v.tdS, dtype)
    # dS_j as the dQ MMA's A operand (queries contiguous): this key's 64 queries of the half
    row = key - prob.n_block * cfg.n_block
    if cutlass.const_expr(cfg.use_2cta):
        # Note [Backward 2-CTA]: CTA h's sdS holds query rows [64h, 64h + 64) over the pair's
        # keys; this CTA's keys are the pair rank's n_block of them (the other warpgroup's
        # stores go to the peer CTA through shared::cluster)
        record.access("sdS", "w", cols=(0, cfg.n_block), cols_per_cta=cfg.n_block, cta=h)
        k = prob.n_block % cfg.cta_group * cfg.n_block + row
        sdS_h = cute.make_tensor(cute.arch.map_dsmem_ptr(smem.sdS.iterator, h), smem.sdS.layout)
        cute.autovec_copy(rdS16, sdS_h[(None, k % 16), 0, k // 16])
        cute.arch.fence_view_async_tmem_store()
        # st.shared::cluster -> the MMA's async-proxy reads, in either CTA of the pair
        cute.arch.fence_proxy("async.shared", space="cluster")
    else:
        record.access("sdS", "w", cols=cols)
        cute.autovec_copy(rdS16, smem.sdS[((None, h), row % 16), 0, row // 16])
        cute.arch.fence_view_async_tmem_store()
        cute.arch.fence_view_async_shared()  # st.shared -> the MMA's async-proxy reads
    pipes.bwd_s_dp.consumer_release(0, note="S^T, dP^T read")
    pipes.bwd_ds.producer_commit(0, note="P^T, dS^T, dS")


def lane_reader(acc, cols: int, chunk: int, tidx):
    """(copy slice, TMEM source (regs, 1, chunks), register partition) that read columns
    [0, cols) of this thread's lane of a (128 lanes, n) accumulator, ``chunk`` columns per
    tcgen05.ld (the dK / dV epilogue here, dQ in bwd_dq.py)."""
    atom = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(chunk)), Float32)
    region = _columns(acc, 0, cols)
    thr = tcgen05.make_tmem_copy(atom, region).get_slice(tidx)
    return thr, thr.partition_S(region), thr.partition_D(cute.make_identity_tensor((128, cols)))


@cute.jit
def _store_rows(cfg, acc, cols: cutlass.Constexpr, out_row, tidx, scale, store: bool, dtype):
    """One TMEM accumulator row (this thread's lane) times ``scale`` into ``out_row``."""
    thr, src, regs = lane_reader(acc, cols, CHUNK, tidx)
    for c in cutlass.range_constexpr(cols // CHUNK):
        r = cute.make_rmem_tensor(regs[None, None, c].shape, Float32)
        cute.copy(thr, src[None, None, c], r)
        cute.arch.fence_view_async_tmem_load()
        out = cute.make_rmem_tensor(CHUNK, dtype)
        out.store((r.load() * scale).to(dtype))
        if store:
            cute.autovec_copy(out, cute.make_tensor(out_row.iterator + c * CHUNK,
                                                    cute.make_layout(CHUNK)))


@cute.jit
def compute(cfg, tmem, smem, mdK, mdV, pipes, prob):
    """Warpgroup h (0 or 1) of the compute role: every step, then its half of the epilogue."""
    tidx = cute.arch.thread_idx()[0] % 128
    wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4
    key = prob.n_block * cfg.n_block + tidx
    dtype = smem.sQ.element_type
    b, hk = prob.batch, prob.head_kv
    in_range = key < prob.seqlen_k
    for h in cutlass.range_constexpr(2):
        if wg == h:
            # each warpgroup is an actor of the protocol model (its own steps and arrivals)
            with record.part(f"compute{h}", WARPGROUP_WARPS):
                v = make_half_views(cfg, h, tidx, tmem)
                index = Int32(0)
                phase = Int32(0)
                one_phase = Int32(0)
                with record.loop("steps"):
                    for step in cutlass.range(prob.iters, unroll=1):
                        compute_step(cfg, h, v, smem, pipes, prob, step, index, phase, one_phase,
                                     key, dtype)
                        one_phase = one_phase ^ 1
                        index, phase = advance(index, phase, cfg.q_stage)
                row_key = cutlass.min(key, prob.seqlen_k - 1)  # a valid address for every lane
                if prob.iters > 0:
                    pipes.bwd_dkv.consumer_wait(0, Int32(0))
                    if cutlass.const_expr(h == 0):
                        record.access("dV", "r")
                        _store_rows(cfg, tmem.tdV[(None, None), 0, 0], cfg.head_dim_v,
                                    mdV[b, row_key, hk, None], tidx, Float32(1.0), in_range, dtype)
                    else:
                        record.access("dK", "r")
                        _store_rows(cfg, tmem.tdK[(None, None), 0, 0], cfg.head_dim,
                                    mdK[b, row_key, hk, None], tidx, prob.softmax_scale, in_range,
                                    dtype)
                    pipes.bwd_dkv.consumer_release(0)
                else:  # no query sees the key block (seqlen_q = 0): zero gradients
                    if in_range:
                        out = mdV if cutlass.const_expr(h == 0) else mdK
                        zero = cute.make_rmem_tensor(out.shape[3], dtype)
                        zero.fill(0.0)
                        cute.autovec_copy(zero, out[b, row_key, hk, None])
