"""Register-level pieces of the SM90 forward consumer: the P operand view, masking, softmax.

The accumulator of one m64nNk16 WGMMA holds, per thread, the value mode ``(2, 2, N/8)``:
two adjacent columns, two rows 8 apart, and N/8 column groups of 8. Its rows are the thread's
``lane / 4`` (+8) within the warp's 16 rows, so a row's values live in the 4 threads of a quad
and row statistics need two shuffles (``threads_in_group=4``).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from fa_sm100 import softmax_math
from fa_sm100.dsl_math import f32_bits, f32_from_bits
from fa_sm100.hopper import probes
from fa_sm100.softmax_math import LN_2


def operand_a_view(acc: cute.Tensor) -> cute.Tensor:
    """View an S accumulator ``((2, 2, V), M, N)`` as the RS-WGMMA A fragment ``((2, 2, 2), M, (V/2, N))``.

    One k16 slice of the A operand is two adjacent 8-column groups of the accumulator, so the
    linear element order is unchanged: P can be converted element by element.
    """
    c = cute.make_layout(acc.layout.shape)  # compact: strides count fragment elements
    groups = c.shape[0][2]
    assert groups % 2 == 0, "n_block must be a multiple of 16"
    view = cute.make_layout(
        ((2, 2, 2), c.shape[1], (groups // 2, c.shape[2])),
        stride=((c.stride[0][0], c.stride[0][1], c.stride[0][2]), c.stride[1],
                (2 * c.stride[0][2], c.stride[2])),
    )
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, view))


@cute.jit
def apply_mask(
    s_rc: cute.Tensor,  # (ROWS, COLS) rows/cols view of the S accumulator
    coord_rc: cute.Tensor,  # (ROWS, COLS) this thread's (row, col) coordinates in the tile
    coord0_rc: cute.Tensor,  # (ROWS, COLS) thread 0's coordinates (compile-time columns)
    row_base: Int32,  # first query row of the tile
    col_base: Int32,  # first key of the tile
    seqlen_k: Int32,
    right_edge: Int32,  # row r sees keys <= r + right_edge (causal: seqlen_k - seqlen_q)
    left_edge,  # row r sees keys >= r + left_edge (Int32, read only with mask_left)
    mask_seqlen: cutlass.Constexpr[bool],
    mask_right: cutlass.Constexpr[bool],
    mask_left: cutlass.Constexpr[bool] = False,
):
    """Set S to -inf where the key is past seqlen_k or outside the row's band: right of its
    right edge (the causal diagonal, or a window's) and, with ``mask_left``, left of its left
    edge (``fa_sm100.bands``).

    A thread's column c is its own first column plus thread 0's column c, which the tracer
    knows as a constant. The thread's first column is therefore taken off the limits once per
    row, and each element is one compare of a constant against a limit per bound.
    """
    # Column-limit technique as in FlashAttention-4 (BSD-3), flash_attn/cute/mask.py.
    thr_col = coord_rc[0, 0][1]
    col_limit_seqlen = seqlen_k - col_base - thr_col
    for r in cutlass.range_constexpr(cute.size(s_rc, mode=[0])):
        limit = col_limit_seqlen
        if const_expr(mask_right or mask_left):
            row = row_base + coord_rc[r, 0][0]
        if const_expr(mask_right):
            limit_right = row + right_edge + 1 - col_base - thr_col
            if const_expr(mask_seqlen):
                limit = cutlass.min(limit, limit_right)
            else:
                limit = limit_right
        if const_expr(mask_left):
            low = row + left_edge - col_base - thr_col  # columns below it are masked
            for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
                col = coord0_rc[0, c][1]
                s_rc[r, c] = Float32(cutlass.select_((col >= limit) | (col < low), -Float32.inf,
                                                     s_rc[r, c]))
        else:
            for c in cutlass.range_constexpr(cute.size(s_rc, mode=[1])):
                # A select, not a branch: one ISETP + FSEL per element.
                s_rc[r, c] = Float32(cutlass.select_(coord0_rc[0, c][1] >= limit, -Float32.inf,
                                                     s_rc[r, c]))


# exp2 on the FMA pipe, technique as in FlashAttention-4 (BSD-3), flash_attn/cute/utils.py;
# the constants and the rounding rule are fa_sm100.softmax_math's (EX2_*).


@dsl_user_op
def _add_round_down(a, b, *, loc=None, ip=None) -> Float32:
    """``a + b`` in float32, rounded toward -inf (PTX ``add.rm.f32``)."""
    return Float32(llvm.inline_asm(
        T.f32(), [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
        "add.rm.f32 $0, $1, $2;", "=f,f,f", has_side_effects=False, is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def exp2_on_fma_pipe(x: Float32) -> Float32:
    """2^x without MUFU.EX2, one element at a time (Hopper has no packed f32x2 math).

    x >= EX2_CLAMP_MIN after the clamp. ``floor_in_bits`` = x + EX2_FLOOR_MAGIC rounded down
    is a float whose low mantissa bits hold floor(x) as an integer; subtracting the magic
    again gives floor(x) exactly, so ``frac`` = x - floor(x) lies in [0, 1). The degree-3
    polynomial (Horner) gives 2^frac in [1, 2); shifting the bits of ``floor_in_bits`` up by
    the 23 mantissa bits adds floor(x) to its exponent.
    """
    x = cute.arch.fmax(x, Float32(softmax_math.EX2_CLAMP_MIN))
    magic = Float32(softmax_math.EX2_FLOOR_MAGIC)
    floor_in_bits = _add_round_down(x, magic)
    frac = x - (floor_in_bits - magic)
    coeffs = softmax_math.EX2_POLY_COEFFS
    pow2_frac = Float32(coeffs[softmax_math.EX2_POLY_DEGREE])
    for i in cutlass.range_constexpr(softmax_math.EX2_POLY_DEGREE - 1, -1, -1):
        pow2_frac = pow2_frac * frac + Float32(coeffs[i])
    return f32_from_bits(f32_bits(pow2_frac) + (f32_bits(floor_in_bits) << 23))


def _max_tree(vals: list) -> Float32:
    """max of a list of Float32 as a balanced tree of ``fmax`` (FMNMX; log2(n) deep)."""
    while len(vals) > 1:
        paired = [cute.arch.fmax(vals[i], vals[i + 1]) for i in range(0, len(vals) - 1, 2)]
        vals = paired + vals[len(vals) - len(vals) % 2:]
    return vals[0]


@cute.jit
def quad_max(x: Float32) -> Float32:
    """max over the 4 threads of a quad (one accumulator row): two butterfly shuffles, each
    followed by one FMNMX."""
    for offset in cutlass.range_constexpr(2, 0, -1):  # 2, then 1
        x = cute.arch.fmax(x, cute.arch.shuffle_sync_bfly(x, offset=offset))
    return x


@cute.jit
def row_max_of(s_rc: cute.Tensor, r: cutlass.Constexpr[int], init) -> Float32:
    """max of row r of a rows/cols view, and of ``init`` unless None, reduced over the quad.

    Plain ``fmax`` (FMNMX) throughout. ``TensorSSA.reduce(MAX)`` lowers to the NaN-propagating
    FMNMX.NAN and ``cute.arch.warp_reduction_max`` on its result to FSETP.NAN + FSETP.GTU +
    FSEL per shuffle: two more dependent instructions per shuffle on the path from the QK
    GEMM's wait to the first exp2 (FlashAttention-4 reduces with plain fmax too). A max is
    exact, so for S without NaN the result is bit-identical; a NaN in S is skipped by the max
    instead of propagated, and still reaches the row's sum and output through its exp2."""
    vals = [s_rc[r, c] for c in range(cute.size(s_rc, mode=[1]))]
    if const_expr(init is not None):
        vals.append(init)
    return quad_max(_max_tree(vals))


@cute.jit
def online_softmax_step(
    s_rc: cute.Tensor,  # (ROWS, COLS) S on entry, exp2-scaled P (float32) on exit
    row_max: cute.Tensor,  # (ROWS,) running max of raw scores
    row_sum: cute.Tensor,  # (ROWS,) this thread's partial running sum
    row_scale: cute.Tensor,  # (ROWS,) out: factor to rescale O by
    scale_log2: Float32,
    is_first: cutlass.Constexpr[bool],
    ex2_emu_fraction: cutlass.Constexpr[float] = 0.0,
    rescale_threshold: cutlass.Constexpr[float] = 0.0,
):
    """One online-softmax step over a KV tile: update max and sum, exponentiate S in place.

    With ``ex2_emu_fraction`` > 0 the columns ``softmax_math.ex2_emulated_mask`` picks (by
    pairs, spread along the thread's row) use ``exp2_on_fma_pipe``; the rest MUFU.EX2. With
    ``rescale_threshold`` > 0 a row keeps its max unless ``softmax_math.rescale_needed`` says
    it grew by more (one FSEL): its factor is then exactly 1 and P of this tile may exceed 1
    (Note [Rescale threshold] in fwd_consumer.py)."""
    for r in cutlass.range_constexpr(cute.size(s_rc, mode=[0])):
        vals = s_rc[r, None].load()
        cur = row_max_of(s_rc, r, None if is_first else row_max[r])
        prev = row_max[r]
        if const_expr(rescale_threshold > 0.0 and not is_first):
            grew = softmax_math.rescale_needed((cur - prev) * scale_log2,
                                               Float32(rescale_threshold))
            cur = Float32(cutlass.select_(grew, cur, prev))
        row_max[r] = cur
        # A row with every key masked so far keeps max -inf: exponentiate against 0 instead.
        safe = cur
        if cur == -Float32.inf:
            safe = Float32(0.0)
        if const_expr(ex2_emu_fraction > 0.0):
            n_cols = cute.size(s_rc, mode=[1])
            on_fma = softmax_math.ex2_emulated_mask(n_cols, ex2_emu_fraction)
            s_rc[r, None].store(vals * scale_log2 - safe * scale_log2)
            for c in cutlass.range_constexpr(n_cols):
                if const_expr(on_fma[c]):
                    s_rc[r, c] = exp2_on_fma_pipe(s_rc[r, c])
                else:
                    s_rc[r, c] = cute.math.exp2(s_rc[r, c], fastmath=True)
            p = s_rc[r, None].load()
        else:
            p = cute.math.exp2(vals * scale_log2 - safe * scale_log2, fastmath=True)
        if const_expr(is_first):
            row_scale[r] = Float32(1.0)
            row_sum[r] = p.reduce(cute.ReductionOp.ADD, Float32(0.0), 0)
        else:
            scale = cute.math.exp2((prev - safe) * scale_log2, fastmath=True)
            row_scale[r] = scale
            row_sum[r] = p.reduce(cute.ReductionOp.ADD, row_sum[r] * scale, 0)
        s_rc[r, None].store(p)


@cute.jit
def finalize_softmax(
    row_max: cute.Tensor,
    row_sum: cute.Tensor,
    row_scale: cute.Tensor,  # out: 1 / row sum (0 for a row with no visible key)
    lse: cute.Tensor,  # out: natural-log LSE (-inf for a row with no visible key)
    scale_log2: Float32,
):
    for r in cutlass.range_constexpr(cute.size(row_sum)):
        total = cute.arch.warp_reduction_sum(row_sum[r], threads_in_group=4)
        inv = Float32(0.0)
        row_lse = -Float32.inf
        if total > Float32(0.0):
            inv = cute.arch.rcp_approx(total)
            row_lse = (row_max[r] * scale_log2 + cute.math.log2(total, fastmath=True)) * LN_2
        row_scale[r] = inv
        lse[r] = row_lse


@cute.jit
def rescale_rows(acc_rc: cute.Tensor, row_scale: cute.Tensor):
    """Multiply row r of a rows/cols accumulator view by row_scale[r]."""
    for r in cutlass.range_constexpr(cute.size(acc_rc, mode=[0])):
        acc_rc[r, None].store(acc_rc[r, None].load() * row_scale[r])


@cute.jit
def rescale_o(acc_rc: cute.Tensor, row_scale: cute.Tensor, skip_ones: cutlass.Constexpr[bool]):
    """O's rescale by the last softmax step's factors. With ``skip_ones`` the warp votes and
    multiplies only if one of its rows needs it (``softmax_math.correction_needed``: a factor
    below 1, 0 included: Note [Correction vote]); a factor of 1 changes nothing. A row whose
    keys were all masked so far has the factor 0 here and an O row of 0, which stays 0."""
    if const_expr(skip_ones):
        needs = cutlass.Boolean(False)
        for r in cutlass.range_constexpr(cute.size(row_scale)):
            if const_expr(probes.active("correction_vote") == "skip_zero"):
                needs = needs | ((row_scale[r] < Float32(1.0)) & (row_scale[r] > Float32(0.0)))
            else:
                needs = needs | softmax_math.correction_needed(row_scale[r])
        if cute.arch.vote_any_sync(needs):
            rescale_rows(acc_rc, row_scale)
    else:
        rescale_rows(acc_rc, row_scale)


@dsl_user_op
def cvt_pair(lo, hi, to_bf16: bool, *, loc=None, ip=None) -> Int32:
    """Two float32 -> one 32-bit register holding two 16-bit values (``lo`` in the low half)."""
    kind = "bf16x2" if to_bf16 else "f16x2"
    return Int32(llvm.inline_asm(
        T.i32(),
        [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
        f"cvt.rn.{kind}.f32 $0, $1, $2;",
        "=r,f,f",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    ))


@cute.jit
def convert_to(dst: cute.Tensor, src: cute.Tensor):
    """dst (16-bit) <- src (float32), same linear element order.

    Writes whole 32-bit registers (one packed convert per pair), so a WGMMA that reads ``dst``
    as its A operand needs no repacking between its instructions.
    """
    dst_pairs = cute.recast_tensor(dst, Int32)
    to_bf16 = dst.element_type is cutlass.BFloat16
    for i in cutlass.range(cute.size(dst_pairs), unroll_full=True):
        dst_pairs[i] = cvt_pair(src[2 * i], src[2 * i + 1], to_bf16)
