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
