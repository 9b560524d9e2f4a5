"""exp2 of a column pair on the FMA pipe (ex2 emulation), with packed f32x2 operations.

The algorithm and its constants are ``fa_sm100.softmax_math``'s (the CPU emulation uses the
same ones): clamp, split x into floor n and fraction f, Horner for 2^f with the degree-3
coefficients, then add n into the exponent field with one integer shift-add.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from fa_sm100 import softmax_math
from fa_sm100.dsl_math import f32_bits, f32_from_bits


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
    out0 = f32_from_bits(f32_bits(acc[0]) + (f32_bits(rounded[0]) << 23))
    out1 = f32_from_bits(f32_bits(acc[1]) + (f32_bits(rounded[1]) << 23))
    return out0, out1
