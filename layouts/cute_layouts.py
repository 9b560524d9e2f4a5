"""CuTe builders for the SM100 forward kernel's MMAs and SMEM layouts (sQ, sK, sV, sO, tP).

Everything here runs while a kernel is traced (CuTe layout algebra needs a trace context), so
call these from inside ``@cute.jit`` code. ``layouts.smem.SmemPlan`` is the byte-level budget
of the same buffers; ``tests/test_layouts_cute.py`` captures the shapes printed below in a CPU
compile and checks them against the design.

For the default config (2-CTA, head dim 128, bf16, q_stage 2, kv_stage 6) CuTe prints

    sQ  ((128,16),1,(4,2),2)     A operand of S = Q K^T: 128 rows x 16-wide k-blocks, 8 k-blocks
    sK  ((64,16),1,(4,2),6)      B operand: each CTA of the pair holds 64 of the 128 keys
    sV  ((64,16),1,8,6)          B operand of O = P V, read transposed (head dim contiguous):
                                 each CTA holds 64 of the 128 head-dim columns, 8 k-blocks of keys
    sO  ((8,16),(64,2),(1,2))    the epilogue tile 128 x 128 per Q stage, TMA-store friendly

K and V share one ring of ``kv_stage`` buffers (a stage holds either a K tile or a V tile), so
when their tiles differ in size (head dims (192, 128)) both layouts get the larger stage stride.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass.tensor_utils import LayoutEnum
import cutlass.utils.blackwell_helpers as bw
from cutlass.cute.nvgpu import tcgen05

_DTYPES = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}


def cutlass_dtype(name: str):
    """The cutlass numeric type of a config dtype name ("bfloat16" / "float16")."""
    return _DTYPES[name]


def mma_tiler_qk(cfg) -> tuple[int, int, int]:
    """(M, N, K) of S = Q K^T for the CTA pair: M spans both CTAs under 2-CTA."""
    return (cfg.cta_group * cfg.m_block, cfg.n_block, cfg.head_dim)


def mma_tiler_pv(cfg) -> tuple[int, int, int]:
    """(M, N, K) of O = P V: N is the V head dim, K runs over the n_block keys."""
    return (cfg.cta_group * cfg.m_block, cfg.head_dim_v, cfg.n_block)


def make_tiled_mmas(cfg):
    """The two tcgen05 tiled MMAs: S = Q K^T (both operands in SMEM, K-major) and O = P V
    (P from TMEM, V in SMEM read MN-major). cta_group::2 when ``cfg.use_2cta``."""
    dtype = cutlass_dtype(cfg.dtype)
    group = tcgen05.CtaGroup.TWO if cfg.use_2cta else tcgen05.CtaGroup.ONE
    k_major = cute.nvgpu.OperandMajorMode.K
    mn_major = cute.nvgpu.OperandMajorMode.MN
    qk = bw.make_trivial_tiled_mma(
        dtype, dtype, k_major, k_major, cutlass.Float32, group, mma_tiler_qk(cfg)[:2]
    )
    pv = bw.make_trivial_tiled_mma(
        dtype, dtype, k_major, mn_major, cutlass.Float32, group, mma_tiler_pv(cfg)[:2],
        tcgen05.OperandSource.TMEM,
    )
    return qk, pv


@dataclass(frozen=True)
class SmemLayouts:
    """Composed (swizzled) layouts of every SMEM buffer plus tP, the P operand's layout."""

    sQ: object
    sK: object
    sV: object
    sO: object
    tP: object


def _with_stage_stride(layout, stride):
    outer = layout.outer
    return cute.make_composed_layout(
        layout.inner,
        0,
        cute.make_layout(
            (*outer.shape[:-1], outer.shape[-1]),
            stride=(*outer.stride[:-1], stride),
        ),
    )


def make_smem_layouts(cfg, tiled_mma_qk, tiled_mma_pv) -> SmemLayouts:
    """sQ (q_stage), sK/sV (kv_stage, one shared ring), sO (q_stage) and tP (q_stage)."""
    dtype = cutlass_dtype(cfg.dtype)
    tiler_qk, tiler_pv = mma_tiler_qk(cfg), mma_tiler_pv(cfg)
    sQ = bw.make_smem_layout_a(tiled_mma_qk, tiler_qk, dtype, cfg.q_stage)
    sK = bw.make_smem_layout_b(tiled_mma_qk, tiler_qk, dtype, cfg.kv_stage)
    sV = bw.make_smem_layout_b(tiled_mma_pv, tiler_pv, dtype, cfg.kv_stage)
    tP = bw.make_smem_layout_a(tiled_mma_pv, tiler_pv, dtype, cfg.q_stage)
    if cfg.head_dim != cfg.head_dim_v:
        # One ring for K and V: a stage must hold the larger of the two tiles.
        stage_stride = max(
            cute.size(cute.select(sK.outer, mode=[0, 1, 2])),
            cute.size(cute.select(sV.outer, mode=[0, 1, 2])),
        )
        sK = _with_stage_stride(sK, stage_stride)
        sV = _with_stage_stride(sV, stage_stride)
    sO = bw.make_smem_layout_epi(
        dtype, LayoutEnum.ROW_MAJOR, (cfg.m_block, cfg.head_dim_v), cfg.q_stage
    )
    return SmemLayouts(sQ=sQ, sK=sK, sV=sV, sO=sO, tP=tP)


def kv_ring_elems(layouts: SmemLayouts) -> int:
    """Elements of the whole K/V ring (sK and sV alias it; the larger extent wins)."""
    return max(cute.cosize(layouts.sK), cute.cosize(layouts.sV))


def layout_shapes(layouts: SmemLayouts) -> dict[str, str]:
    """The printed shape of each SMEM buffer, as CuTe writes it (for tests and reports)."""
    return {
        name: str(getattr(layouts, name).outer.shape).replace(" ", "")
        for name in ("sQ", "sK", "sV", "sO")
    }


# ------------------------------------------------------------------------------- backward
#
# The SM100 backward's five MMAs (fa_sm100/sm100/bwd_mma.py), 1-CTA, M = the 128 keys of the
# work tile except for dQ:
#
#     S^T  = K Q^T     A sK (K-major)          B sQ  (K-major)    (n_block, m_block, d)
#     dP^T = V dO^T    A sV (K-major)          B sdO (K-major)    (n_block, m_block, dv)
#     dV  += P^T dO    A P^T (TMEM)            B sdO (MN-major)   (n_block, dv, m_block)
#     dK  += dS^T Q    A dS^T (TMEM)           B sQ  (MN-major)   (n_block, d, m_block)
#     dQ   = dS K      A sdS (MN-major)        B sK  (MN-major)   (m_block, d, n_block)
#
# Q, dO and K are each read by two MMAs in two major modes from ONE SMEM buffer: the K-major
# layout of a (rows, d) tile and the MN-major layout of its (d, rows) transpose that CUTLASS
# builds for these tilers put every element at the same offset (the same swizzle atom, atoms
# tiled rows-first). For head dim 128 CuTe prints sQ ((128,16),1,(4,2)):((64,1),0,(16,8192))
# and sQt (((64,2),16),1,8):(((1,8192),64),0,1024), both S<3,4,3>: (q, d) -> 64 q + d mod 64
# + 8192 (d div 64) either way; tests/test_sm100_bwd_emulated.py runs dK = dS^T Q and
# dQ = dS K through these views at head dims 64, 96 and 128.
#
# 2-CTA (``cfg.use_2cta``, Note [Backward 2-CTA] in fa_sm100/sm100/bwd_config.py): every MMA
# is cta_group::2 over the pair's 2 n_block keys. M splits between the CTAs' TMEM lanes or A
# operands, N between their B operands, so the layouts below are one CTA's:
#
#     S^T, dP^T   (2n, m, d)   A sK / sV: the CTA's n keys     B sQ / sdO: m / 2 query rows
#     dV, dK      (2n, d, m)   A P^T / dS^T in its TMEM         B sdOt / sQt: d / 2 x m queries
#     dQ          (m, d, 2n)   A sdS: m / 2 queries x 2n keys   B sKt: d / 2 x 2n keys
#
# A CTA's half of Q's rows (S^T) and its half of Q's columns (dK) are different bytes, so sQt,
# sdOt and sKt are buffers of their own there, loaded by TMA beside sQ, sdO and sK.


def bwd_tilers(cfg) -> dict[str, tuple[int, int, int]]:
    """(M, N, K) of each backward MMA (across the CTA pair under 2-CTA)."""
    m, n, d, dv = cfg.m_block, cfg.n_block * cfg.cta_group, cfg.head_dim, cfg.head_dim_v
    return {"S": (n, m, d), "dP": (n, m, dv), "dV": (n, dv, m), "dK": (n, d, m), "dQ": (m, d, n)}


@dataclass(frozen=True)
class BwdMmas:
    S: object
    dP: object
    dV: object
    dK: object
    dQ: object


def make_bwd_tiled_mmas(cfg) -> BwdMmas:
    """The five tcgen05 tiled MMAs of the backward (see the table above)."""
    dtype = cutlass_dtype(cfg.dtype)
    k_major = cute.nvgpu.OperandMajorMode.K
    mn_major = cute.nvgpu.OperandMajorMode.MN
    group = tcgen05.CtaGroup.TWO if cfg.use_2cta else tcgen05.CtaGroup.ONE
    t = bwd_tilers(cfg)

    def mma(a_major, b_major, name, a_src=None):
        extra = () if a_src is None else (a_src,)
        return bw.make_trivial_tiled_mma(dtype, dtype, a_major, b_major, cutlass.Float32, group,
                                         t[name][:2], *extra)

    tmem = tcgen05.OperandSource.TMEM
    return BwdMmas(S=mma(k_major, k_major, "S"), dP=mma(k_major, k_major, "dP"),
                   dV=mma(k_major, mn_major, "dV", tmem), dK=mma(k_major, mn_major, "dK", tmem),
                   dQ=mma(mn_major, mn_major, "dQ"))


@dataclass(frozen=True)
class BwdSmemLayouts:
    """sK, sV (one tile); sQ / sdO as the S^T / dP^T B operand and sQt / sdOt as the dK / dV
    B operand over the same bytes (q_stage stages); sKt (sK's bytes as dQ's B operand); sdS
    (dQ's A operand); tP / tdS (the TMEM A operands' layouts)."""

    sK: object
    sV: object
    sQ: object
    sQt: object
    sdO: object
    sdOt: object
    sKt: object
    sdS: object
    tP: object
    tdS: object


def make_bwd_smem_layouts(cfg, mmas: BwdMmas) -> BwdSmemLayouts:
    dtype = cutlass_dtype(cfg.dtype)
    t = bwd_tilers(cfg)

    def one(layout):
        return cute.slice_(layout, (None, None, None, 0))

    # 1-CTA: sQt / sdOt / sKt are views of sQ / sdO / sK's bytes; 2-CTA: buffers of their own,
    # sQt and sdOt of one stage (the bwd_qt pipeline)
    qt_stages = 1 if cfg.use_2cta else cfg.q_stage
    return BwdSmemLayouts(
        sK=one(bw.make_smem_layout_a(mmas.S, t["S"], dtype, 1)),
        sV=one(bw.make_smem_layout_a(mmas.dP, t["dP"], dtype, 1)),
        sQ=bw.make_smem_layout_b(mmas.S, t["S"], dtype, cfg.q_stage),
        sQt=bw.make_smem_layout_b(mmas.dK, t["dK"], dtype, qt_stages),
        sdO=bw.make_smem_layout_b(mmas.dP, t["dP"], dtype, cfg.q_stage),
        sdOt=bw.make_smem_layout_b(mmas.dV, t["dV"], dtype, qt_stages),
        sKt=one(bw.make_smem_layout_b(mmas.dQ, t["dQ"], dtype, 1)),
        sdS=one(bw.make_smem_layout_a(mmas.dQ, t["dQ"], dtype, 1)),
        tP=one(bw.make_smem_layout_a(mmas.dV, t["dV"], dtype, 1)),
        tdS=one(bw.make_smem_layout_a(mmas.dK, t["dK"], dtype, 1)),
    )
