"""CuTe SMEM layouts of the SM100 forward, captured while a small function is cross-compiled.

Contract: for the default 2-CTA, head dim 128, bf16 config the layouts print exactly as the
design states (DESIGN.md): sQ ((128,16),1,(4,2),2), sK ((64,16),1,(4,2),6),
sV ((64,16),1,8,6), sO ((8,16),(64,2),(1,2)); the 1-CTA form holds whole K/V tiles per CTA;
K and V share one ring whose stage stride fits the larger tile; and the SMEM bytes of the CuTe
layouts equal the byte budget of ``layouts.smem.SmemPlan``.
"""

import os

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")

from fa_sm100.config import FmhaConfig  # noqa: E402
from layouts.smem import SmemPlan  # noqa: E402

pytestmark = pytest.mark.compile


def capture(cfg):
    """Shapes, stage strides and SMEM bytes of every buffer, read inside a CPU compile."""
    import cutlass.cute as cute

    from layouts import cute_layouts as cl

    out = {}

    @cute.jit
    def probe():
        qk, pv = cl.make_tiled_mmas(cfg)
        lay = cl.make_smem_layouts(cfg, qk, pv)
        out.update(cl.layout_shapes(lay))
        out["kv_stage_stride"] = (lay.sK.outer.stride[-1], lay.sV.outer.stride[-1])
        out["bytes"] = {
            "q": cute.cosize(lay.sQ) * cfg.dtype_bytes,
            "kv": cl.kv_ring_elems(lay) * cfg.dtype_bytes,
            "o": cute.cosize(lay.sO) * cfg.dtype_bytes,
        }

    cute.compile(probe, options="--gpu-arch sm_100a")
    return out


def test_default_2cta_layouts_match_the_design():
    got = capture(FmhaConfig())
    assert got["sQ"] == "((128,16),1,(4,2),2)"
    assert got["sK"] == "((64,16),1,(4,2),6)"
    assert got["sV"] == "((64,16),1,8,6)"
    assert got["sO"] == "((8,16),(64,2),(1,2))"


def test_1cta_layouts_hold_whole_kv_tiles():
    got = capture(FmhaConfig(use_2cta=False, kv_stage=3))
    assert got["sQ"] == "((128,16),1,(4,2),2)"
    assert got["sK"] == "((128,16),1,(4,2),3)"  # all 128 keys of a K tile in one CTA
    assert got["sV"] == "(((64,2),16),1,8,3)"  # all 128 head-dim columns of a V tile
    assert got["sO"] == "((8,16),(64,2),(1,2))"


@pytest.mark.parametrize("cfg", [
    FmhaConfig(),
    FmhaConfig(use_2cta=False, kv_stage=3),
    FmhaConfig(head_dim=192, head_dim_v=128, kv_stage=4),
    FmhaConfig(head_dim=64, head_dim_v=64, q_stage=1, kv_stage=8, dtype="float16"),
], ids=["default", "1cta", "hdim192", "hdim64-q1-fp16"])
def test_layout_bytes_equal_the_smem_plan(cfg):
    """The CuTe buffers take exactly the bytes SmemPlan budgets (so the budget check is real),
    and K and V step through the ring with one common stage stride."""
    got = capture(cfg)
    plan = SmemPlan.for_config(cfg)
    assert got["bytes"]["q"] == plan.q_bytes
    assert got["bytes"]["o"] == plan.o_bytes
    assert got["bytes"]["kv"] == plan.kv_bytes
    k_stride, v_stride = got["kv_stage_stride"]
    assert k_stride == v_stride == plan.kv_stage_bytes // cfg.dtype_bytes
