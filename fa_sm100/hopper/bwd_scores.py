"""The pointwise part of the SM90 backward's MMA role (``bwd_mma.py`` calls these): where each
thread's LSE2 and Delta come from, P = exp2(S * scale_log2 - LSE2) with the causal /
sliding-window / tail mask, and dS = P (dP - Delta). Each function takes the config and acts
on one query block's registers; the mask takes the ``BwdProblem`` (lengths and band).

The accumulators these act on are S and dP (unswapped: rows are queries) or S^T and dP^T
(``sdp_swap_ab``: rows are keys, Note [swapped S/dP] in bwd_mma.py); with ``tile_m`` 80
or 128 the LSE2/Delta values are shuffled between lanes (Note [tile_m 128]) or each thread
loads its own (hdim 128's default, with the dP wait placed by ``_schedule_boundary``, Note
[dP wait placement]). Note [stats with their stage] (bwd_load.py) and Note [stats before the
GEMMs] (bwd_mma.py) say where and when the statistics are read.

Note [softcap in the backward] (``softcap``): the forward's scores were capped, S' = c tanh(S /
c), so P = exp2(t c log2(e) - LSE2) with t = tanh(raw S * softmax_scale / c)
(``fa_sm100.softmax_math``), and the chain rule puts tanh's derivative into dS: dS = P (dP -
Delta) (1 - t^2), scaled by softmax_scale as before. t is formed in S's registers (before the
mask, which writes ``SOFTCAP_MASKED_T`` there instead of -inf: its P is 0 and its 1 - t^2
finite) and stays there until dS; P goes straight from t into the 16-bit fragment the dV GEMM
reads, two scores per packed convert, and dS takes P from those 16 bits. So the registers are
those of the uncapped loop (S, 16-bit P, dP); the capped defaults leave early dV off (at hdim
128 it spilled) and use 64-row query blocks (the 80- and 128-row loops form P late or from a
shuffled layout that this ordering does not cover: ``validate`` refuses them).
"""

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import warpgroup
from cutlass import Float32, Int32, const_expr

from fa_sm100 import softmax_math
from fa_sm100.hopper import probes
from fa_sm100.hopper.common import assume_aligned, rows_cols_view
from fa_sm100.dsl_math import softcap_tanh
from fa_sm100.hopper.fwd_math import cvt_pair


def fragment_coords(frag, view) -> list:
    """(r, c) in the rows/cols ``view`` of each element of ``frag`` in its linear order (both
    static register layouts, read at trace time)."""
    rows, cols = cute.size(view, mode=[0]), cute.size(view, mode=[1])
    where = {int(cute.crd2idx((r, c), view.layout)): (r, c)
             for r in range(rows) for c in range(cols)}
    return [where[int(cute.crd2idx(i, frag.layout))] for i in range(cute.size(frag))]


def query_stat_source(q0: int):
    """Note [tile_m 128]: where the LSE2/Delta value of an S^T column lies, given thread 0's
    query column ``q0`` of it (compile-time; lane l's column is q0 + 2 (l % 4)): in register
    ``slot`` of lane ``lane_base + l % 4``. Inverse of ``held_query``."""
    return (q0 % 64) // 2, 2 * (q0 // 64) + q0 % 2


def held_query(lane: int, slot: int) -> int:
    """Note [tile_m 128]: the query (within the block) whose LSE2/Delta lane ``lane`` holds in
    register ``slot``: 2 lane + {0, 1}, and 64 more for slots 2, 3 (``_shuffled_stats``)."""
    return 2 * lane + slot % 2 + 64 * (slot // 2)


@cute.jit
def _query_stat(cfg, stat, r, c, tScS0):
    """The statistic of the query of accumulator element (r, c) (compile-time r, c)."""
    if const_expr(not cfg.sdp_swap_ab):
        return stat[r]
    if const_expr(not cfg.shuffled_stats):
        return stat[c]
    # Note [tile_m 128]: this thread's query column is q0 + 2 (lane % 4), q0 = thread 0's column
    lane_base, slot = query_stat_source(tScS0[0, c][1])
    if const_expr(probes.active("stats") == "unshuffled"):  # Note [cost probes]
        return stat[slot]
    return cute.arch.shuffle_sync(stat[slot], lane_base + cute.arch.lane_idx() % 4)


@cute.jit
def exp2_rows(cfg, S, lse, scale_log2, tScS0, m_block, seqlen_q):
    """P = exp2(S * scale_log2 - LSE2) in place. Blocks of 80 / 128 rows: columns outer (one
    shuffle per column with ``stats_shuffle``), and with ``dp_wait_after`` >= 0 a block
    boundary after that many exp2s (Note [dP wait placement]; ``m_block``, ``seqlen_q``:
    the warp-uniform values its branch compares). Rows outer, the unshuffled blocks'
    order of an earlier version, the boundary made ptxas serialize every WGMMA (34 groups)."""
    rows, cols = cute.size(S, mode=[0]), cute.size(S, mode=[1])
    if const_expr(cfg.wide_query_block):
        split = cfg.dp_wait_after
        for c in cutlass.range_constexpr(cols):
            lse_q = _query_stat(cfg, lse, 0, c, tScS0)
            for r in cutlass.range_constexpr(rows):
                if const_expr(c * rows + r == split):
                    _schedule_boundary(m_block, seqlen_q)
                S[r, c] = cute.math.exp2(S[r, c] * scale_log2 - lse_q, fastmath=True)
        if const_expr(split >= rows * cols):
            _schedule_boundary(m_block, seqlen_q)
    else:
        for r in cutlass.range_constexpr(rows):
            for c in cutlass.range_constexpr(cols):
                S[r, c] = cute.math.exp2(S[r, c] * scale_log2
                                         - _query_stat(cfg, lse, r, c, tScS0), fastmath=True)


@cute.jit
def _schedule_boundary(m_block, seqlen_q):
    """Note [dP wait placement]: a branch on warp-uniform values whose condition never
    holds (a query block's index is below the query count) around the wait for dP^T,
    which would be right if it ran: ptxas keeps what was issued before it before it, and
    the wait after it. Not ``m_block == -1``: where the sweep starts at a block >= 0
    (causal), LLVM proves that false and drops the branch."""
    if m_block == seqlen_q:
        warpgroup.wait_group(0)


@cute.jit
def ds_rows(cfg, dP, P, dpsum, tScS0, capped=None):
    """dS = P (dP - Delta) in place of dP (tile_m 80 / 128: columns outer, one shuffle per
    column; ``P`` may be the 16-bit P^T, Note [tile_m 128]). ``capped``: t of a softcapped
    kernel, whose derivative 1 - t^2 multiplies dS (Note [softcap in the backward])."""
    if const_expr(capped is not None):
        for r in cutlass.range_constexpr(cute.size(dP, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(dP, mode=[1])):
                t = capped[r, c]
                ds = P[r, c].to(Float32) * (dP[r, c] - _query_stat(cfg, dpsum, r, c, tScS0))
                dP[r, c] = ds * (Float32(1.0) - t * t)  # P = 0 where masked: 0 * finite
    elif const_expr(cfg.shuffled_stats):
        for c in cutlass.range_constexpr(cute.size(dP, mode=[1])):
            d_q = _query_stat(cfg, dpsum, 0, c, tScS0)
            for r in cutlass.range_constexpr(cute.size(dP, mode=[0])):
                dP[r, c] = P[r, c].to(Float32) * (dP[r, c] - d_q)
    else:
        for r in cutlass.range_constexpr(cute.size(dP, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(dP, mode=[1])):
                dP[r, c] = P[r, c] * (dP[r, c] - _query_stat(cfg, dpsum, r, c, tScS0))


@cute.jit
def query_stats(cfg, block, thr_sdp, sdp_shape, tScS):
    """This thread's LSE2 or Delta values (``block``, see ``stat_block``), one per
    accumulator row (per column with ``sdp_swap_ab``), in registers (tile_m 64)."""
    if const_expr(cfg.sdp_swap_ab):
        stats = cute.make_rmem_tensor(cute.size(tScS, mode=[1]), Float32)
        stats.store(_column_stats(block, thr_sdp, sdp_shape).load())
    else:
        stats = cute.make_rmem_tensor(cute.size(tScS, mode=[0]), Float32)
        rows = cute.make_tensor(block, cute.make_layout(cfg.tile_m))
        for r in cutlass.range_constexpr(cute.size(tScS, mode=[0])):
            stats[r] = rows[tScS[r, 0][0]]
    return stats


@cute.jit
def block_stats(cfg, block, thr_sdp, sdp_shape, tScS):
    """This thread's LSE2 or Delta values of one query block (``block``, see
    ``stat_block``) as ``_query_stat`` reads them: 4 per lane to shuffle
    (``shuffled_stats``, Note [tile_m 128]) or its own rows' / columns' values."""
    if const_expr(cfg.shuffled_stats):
        stats = _shuffled_stats(cfg, block)
    else:
        stats = query_stats(cfg, block, thr_sdp, sdp_shape, tScS)
    return stats


@cute.jit
def stat_block(cfg, mStat_cur, sStat, m_block, stage):
    """Pointer to the tile_m values (LSE2 or Delta) of query block ``m_block``: the SMEM
    stage the load warp filled (``stats_smem``; its mbarrier has been waited on), else the
    block in global memory. Either starts 16-byte aligned."""
    if const_expr(cfg.stats_smem):
        return sStat[None, stage].iterator
    return mStat_cur.iterator + m_block * cfg.tile_m


@cute.jit
def _shuffled_stats(cfg, block):
    """LSE2 or Delta of one query block (``block``, see ``stat_block``) as Note [tile_m 128]
    distributes them: lane l holds queries 2 l + {0, 1} and 64 + 2 l + {0, 1} (4 registers,
    two 64-bit loads); ``_query_stat`` shuffles a query's value to the lanes that use it.
    With tile_m 80 only lanes 0-7 load the second pair (queries 64-79): the others would
    read past the block."""
    lane = cute.arch.lane_idx()
    held = cute.make_rmem_tensor(cute.make_layout((2, 2)), Float32)
    base = assume_aligned(block + 2 * lane, 8)
    src = cute.make_tensor(base, cute.make_layout((2, 2), stride=(1, 64)))
    cute.autovec_copy(src[None, 0], held[None, 0])
    if const_expr(cfg.tile_m == 128):
        cute.autovec_copy(src[None, 1], held[None, 1])
    else:
        held[0, 1] = Float32(0.0)
        held[1, 1] = Float32(0.0)
        if 2 * lane < cfg.tile_m - 64:
            cute.autovec_copy(src[None, 1], held[None, 1])
    return held


@cute.jit
def _column_stats(block, thr_sdp, sdp_shape):
    """This thread's per-query values (LSE2 or Delta) of one query block (``block``, see
    ``stat_block``) in the column order of its S^T accumulator (``sdp_swap_ab``).

    The view broadcasts the query block's values over the keys (stride 0) and is
    partitioned like the accumulator. The block starts 16-byte aligned (rows padded to
    a multiple of tile_m, base 16-byte aligned), which lets adjacent columns load as one
    64-bit access."""
    base = assume_aligned(block)
    view = cute.make_tensor(base, cute.make_layout(sdp_shape, stride=(0, 1)))
    return rows_cols_view(thr_sdp.partition_C(view))[0, None]


@cute.jit
def block_needs_mask(cfg, prob, m_block, n_block):
    """Whether any element of the (m_block, n_block) tile lies outside the band or past
    seqlen_k (uniform per CTA and iteration; most blocks need no mask). ``prob``: the
    ``BwdProblem`` (lengths and band)."""
    left, right = prob.band
    seqlen_q, seqlen_k = prob.seqlen_q, prob.seqlen_k
    off = seqlen_k - seqlen_q
    col_min = n_block * cfg.tile_n
    col_max = col_min + cfg.tile_n - 1
    row_min = m_block * cfg.tile_m
    need = col_max >= seqlen_k
    if const_expr(right is not None):
        need = need | (col_max > row_min + off + right)
    if const_expr(left is not None):
        need = need | (col_min < row_min + cfg.tile_m - 1 + off - left)
    return need


@cute.jit
def mask(cfg, prob, S, tScS, tScS0, m_block, n_block):
    """Set S to -inf outside the causal/sliding-window band and past seqlen_k (with
    ``sdp_swap_ab`` S^T: the keys are its rows, the queries its columns).

    A thread's (query, key) coordinates are thread 0's (``tScS0``, compile-time) plus its
    own offset, the same for all its elements. The offsets, the block origin and the band
    edges fold into three limits computed once, so each element compares compile-time
    constants (its key, and key minus query, of thread 0) against them: an ``ISETP`` or
    two and one ``FSEL``."""
    left, right = prob.band
    seqlen_q, seqlen_k = prob.seqlen_q, prob.seqlen_k
    q_mode, k_mode = (1, 0) if cfg.sdp_swap_ab else (0, 1)
    d_q = tScS[0, 0][q_mode] - tScS0[0, 0][q_mode]  # this thread's offsets
    d_k = tScS[0, 0][k_mode] - tScS0[0, 0][k_mode]
    # In thread 0's coordinates (k0, q0) of an element, with this thread's origin folded in:
    key_origin = n_block * cfg.tile_n + d_k
    diag = m_block * cfg.tile_m + d_q - key_origin + (seqlen_k - seqlen_q)  # k0 - q0 there
    limit_tail = seqlen_k - key_origin  # masked where k0 >= limit_tail (past seqlen_k)
    limit_right = diag + (right if const_expr(right is not None) else 0)
    limit_left = diag - (left if const_expr(left is not None) else 0)
    for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
            k0 = tScS0[r, c][k_mode]
            k_minus_q = k0 - tScS0[r, c][q_mode]
            out = k0 >= limit_tail
            if const_expr(right is not None):
                out = out | (k_minus_q > limit_right)  # right of the band
            if const_expr(left is not None):
                out = out | (k_minus_q < limit_left)  # left of the band
            S[r, c] = Float32(cutlass.select_(out, _masked_score(cfg), S[r, c]))


def _masked_score(cfg):
    """What a masked score becomes: -inf, or with ``softcap`` (S holds t = tanh(...) until
    dS) ``SOFTCAP_MASKED_T``, whose P is 0 and whose 1 - t^2 is finite."""
    if const_expr(cfg.softcap):
        return Float32(softmax_math.SOFTCAP_MASKED_T)
    return -Float32.inf


@cute.jit
def softcap_rows(S, softcap_k):
    """S = tanh(S * softcap_k) in place (``fa_sm100.softmax_math``, Note [softcap in the
    backward])."""
    for r in cutlass.range_constexpr(cute.size(S, mode=[0])):
        for c in cutlass.range_constexpr(cute.size(S, mode=[1])):
            S[r, c] = softcap_tanh(S[r, c] * softcap_k)


@cute.jit
def softcap_p(cfg, rP, acc_S, S, lse, scale_log2, tScS0):
    """P = exp2(t * scale_log2 - LSE2) into the 16-bit fragment ``rP`` (``acc_S``'s layout;
    ``S`` its rows/cols view), t kept for dS (Note [softcap in the backward]). Two
    elements at a time into one packed register, as ``convert_to`` writes them."""
    rc = fragment_coords(acc_S, S)
    pairs = cute.recast_tensor(rP, Int32)
    to_bf16 = rP.element_type is cutlass.BFloat16
    for i in cutlass.range_constexpr(cute.size(pairs)):
        p = [cute.math.exp2(S[r, c] * scale_log2 - _query_stat(cfg, lse, r, c, tScS0),
                            fastmath=True) for r, c in rc[2 * i:2 * i + 2]]
        pairs[i] = cvt_pair(p[0], p[1], to_bf16)
