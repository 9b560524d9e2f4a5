"""Scalar DSL math that both kernel families use: float32 bit casts and the softcap tanh.

The arithmetic and its constants are ``fa_sm100.softmax_math``'s (one source of truth, with
the torch models the emulation and the tests use); this module is its CuTe-DSL form.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import arith, llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from fa_sm100 import softmax_math


@dsl_user_op
def f32_bits(x, *, loc=None, ip=None) -> Int32:
    """The bits of a float32 as an int32 (no conversion)."""
    return Int32(arith.bitcast(T.i32(), Float32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def f32_from_bits(x, *, loc=None, ip=None) -> Float32:
    """The float32 whose bits are the int32 ``x``."""
    return Float32(arith.bitcast(T.f32(), Int32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def fma_rn(a, b, c, *, loc=None, ip=None) -> Float32:
    """a * b + c rounded once (PTX ``fma.rn.f32``): written out, so neither LLVM nor ptxas
    decides which multiply-adds fuse, and the PTX emulator and ``softcap_tanh_model`` round
    as the hardware does."""
    return Float32(llvm.inline_asm(
        T.f32(), [Float32(v).ir_value(loc=loc, ip=ip) for v in (a, b, c)],
        "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", has_side_effects=False,
        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@cute.jit
def softcap_tanh(x: Float32) -> Float32:
    """tanh(x) to float32 accuracy with one MUFU.EX2 and no division (``softmax_math``'s TANH_*
    steps, modelled by ``softcap_tanh_model``): eleven FMA-pipe instructions beside the one
    MUFU op, so a softcapped softmax issues two MUFU ops per score (this exp2 and its own)
    rather than three."""
    e = cute.math.exp2(cute.arch.fmax(x, -x) * Float32(softmax_math.TANH_EX2_SCALE),
                       fastmath=True)
    y = e + Float32(1.0)
    a, b = softmax_math.TANH_RECIP_SEED
    r = fma_rn(Float32(-b), y, Float32(a))
    for _ in cutlass.range_constexpr(softmax_math.TANH_NEWTON_STEPS):
        r = fma_rn(r, fma_rn(-y, r, Float32(1.0)), r)
    magnitude = fma_rn(Float32(2.0), r, Float32(-1.0))
    return f32_from_bits((f32_bits(magnitude) & Int32(0x7FFFFFFF))
                         | (f32_bits(x) & Int32(-0x80000000)))
