"""exp2 of a column pair on the FMA pipe (ex2 emulation), with packed f32x2 operations.

The algorithm and its constants are ``fa_sm100.softmax_math``'s (the CPU emulation uses the
same ones): clamp, split x into floor n and fraction f, Horner for 2^f with the degree-3
coefficients, then add n into the exponent field with one integer shift-add.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import arith
from cutlass.cutlass_dsl import T, dsl_user_op

from fa_sm100 import softmax_math


@dsl_user_op
def _f32_as_i32(x: Float32, *, loc=None, ip=None) -> Int32:
    return Int32(arith.bitcast(T.i32(), Float32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def _i32_as_f32(x: Int32, *, loc=None, ip=None) -> Float32:
    return Float32(arith.bitcast(T.f32(), Int32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@cute.jit
def exp2_poly_pair(x: Float32, y: Float32):
    """(2^x, 2^y) for x, y <= softmax_math.EX2_INPUT_MAX, computed without MUFU.EX2."""
    lo = Float32(softmax_math.EX2_CLAMP_MIN)
    xy = (cute.arch.fmax(x, lo), cute.arch.fmax(y, lo))
    # 1.5 * 2^23: adding it (rounding toward -inf) leaves floor(x) in the low mantissa bits.
    magic = (Float32(softmax_math.EX2_FLOOR_MAGIC), Float32(softmax_math.EX2_FLOOR_MAGIC))
    rounded = cute.arch.add_packed_f32x2(xy, magic, rnd="rm")  # floor in the low bits
    floor = cute.arch.sub_packed_f32x2(rounded, magic)
    frac = cute.arch.sub_packed_f32x2(xy, floor)  # in [0, 1]
    c = softmax_math.EX2_POLY_COEFFS
    deg = softmax_math.EX2_POLY_DEGREE
    acc = (Float32(c[deg]), Float32(c[deg]))
    for i in cutlass.range_constexpr(deg - 1, -1, -1):
        acc = cute.arch.fma_packed_f32x2(acc, frac, (Float32(c[i]), Float32(c[i])))
    out0 = _i32_as_f32(_f32_as_i32(acc[0]) + (_f32_as_i32(rounded[0]) << 23))
    out1 = _i32_as_f32(_f32_as_i32(acc[1]) + (_f32_as_i32(rounded[1]) << 23))
    return out0, out1
