"""The softmax arithmetic shared by the SM100 kernel and its CPU emulation (one source of truth).

The SM100 forward kernel (``fa_sm100.sm100``) and the numerics emulation
(``fa_sm100.emulation``) both import this module; neither restates a constant defined here.

Units. The kernel works in log2 units: the softmax warps fold ``softmax_scale * log2(e)`` into one
factor (``softmax_scale_log2``) and compute ``p = exp2(s * scale_log2 - m * scale_log2)`` with
one FMA per element, where ``s`` is the raw Q.K^T score and ``m`` the (possibly stale) row max
in raw score units. The row max threshold below is therefore in log2 units. Only the LSE
written to global memory is converted to natural-log units: ``lse = (m * scale_log2 +
log2(row_sum)) * ln(2)``.

exp2 on two pipes (``ex2_emu_fraction``). Most elements use the SFU instruction (MUFU.EX2).
A compile-time selection of column pairs (``ex2_emulated_mask``) is computed on the FMA pipe
instead, with packed f32x2 operations on the two columns of a pair::

    x  = max(x, EX2_CLAMP_MIN)             # -127: the result is then +0 or subnormal
    n  = floor(x)                          # e.g. add 1.5 * 2^23 rounding down, subtract back
    f  = x - n                             # float32; f in [0, 1], exact except that a tiny
                                           # negative x rounds f up to 1 (q covers f = 1)
    q  = ((c3 * f + c2) * f + c1) * f + c0 # Horner, one FMA (round to nearest) per step
    y  = bits(q) + (n << 23)               # integer add into the exponent field: q * 2^n

``c0..c3`` are ``EX2_POLY_COEFFS``; ``fit_ex2_polynomial`` recomputes them (see its docstring for
the derivation). The largest relative error of ``q`` against ``2^f`` is about 8.6e-5 (~2^-13.5,
up to ~1440 float32 ulps near f = 1 where the ulp is smallest relative to the value), far
below the 2^-9 relative rounding of the bf16 P that consumes it.

Rescale rule (``rescale_needed``). When a K/V tile raises a row max by ``growth`` (log2
units), the kernel rescales O and the row sum only if ``growth > rescale_threshold``; otherwise
it keeps the stale max, so P values of later tiles may exceed 1 by up to ``2^threshold``
(256 for the default 8.0, representable in bf16 and fp16). The final ``1/row_sum`` divides the
common factor out exactly. ``rescale_threshold = 0`` tracks every increase of the max.
"""

from __future__ import annotations

import math
import struct

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)

# ---------------------------------------------------------------------------------------------
# exp2 polynomial

EX2_POLY_DEGREE = 3
# Float32 bit patterns of c0..c3 (lowest degree first): the output of fit_ex2_polynomial(3)
# rounded to float32. tests/test_softmax_math.py re-fits them and checks these patterns.
EX2_POLY_COEFFS_BITS = (0x3F800000, 0x3F31F32C, 0x3E691BC5, 0x3D9DD553)
# Inputs below this are clamped: with n = -127 the result's biased exponent field is 0, so
# x = -127 gives exactly +0 and x in (-127, -126) the subnormal (q - 1) * 2^-126 the bits spell
# (not 2^x, but below 2^-126 and irrelevant to a softmax).
EX2_CLAMP_MIN = -127.0
# floor(x) on the FMA pipe: adding 1.5 * 2^23 with rounding toward -inf leaves floor(x) in the
# low mantissa bits (for |x| < 2^22), and subtracting it back (round to nearest) gives floor(x)
# as a float. Shifting the sum's bits left by 23 puts floor(x) into the exponent field.
EX2_FLOOR_MAGIC = 1.5 * 2.0**23
# The kernel's inputs are at most +rescale_threshold (stale row max); the polynomial path is
# exact in its structure up to this bound (exponent field 127 + 127 = 254 < 255).
EX2_INPUT_MAX = 127.0
# Bound on |q(f) - 2^f| / 2^f over f in [0, 1) in exact arithmetic, from the fit below.
EX2_POLY_REL_ERROR_BOUND = 8.6e-5


def _f32_from_bits(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def f32_bits(value: float) -> int:
    """The float32 bit pattern of ``value`` (rounded to nearest float32)."""
    return struct.unpack("<I", struct.pack("<f", value))[0]


EX2_POLY_COEFFS: tuple[float, ...] = tuple(_f32_from_bits(b) for b in EX2_POLY_COEFFS_BITS)
"""c0..c3 as Python floats, each exactly a float32 value (c0 == 1.0)."""


def fit_ex2_polynomial(degree: int = EX2_POLY_DEGREE, grid: int = 20001, iterations: int = 20):
    """Recompute the exp2 coefficients: minimax relative error on [0, 1] with c0 fixed to 1.

    Derivation. We want q(f) ~ 2^f on f in [0, 1) minimizing max |q(f) - 2^f| / 2^f: the
    kernel multiplies q by 2^n exactly, so the relative error of q is the relative error of the
    whole exp2. c0 is pinned to 1 so that q(0) == 1 exactly: integer inputs, in particular the
    row max element itself (x = 0), give exact powers of two, and the jump between f -> 1 of
    one binade and f = 0 of the next is only the error at f = 1. With c0 fixed the error
    e(f) = (1 + c1 f + ... + cd f^d - 2^f) / 2^f has d free coefficients, so the best
    approximation equioscillates on d + 1 points (Chebyshev alternation). The Remez exchange
    solves, on a reference set {f_i},

        c1 f_i + ... + cd f_i^d - (-1)^i E 2^f_i = 2^f_i - 1,     i = 0..d,

    for (c1..cd, E), then moves the reference to the extrema of e(f) on a dense grid, until
    the extrema are level. For degree 3 this converges to max |e| ~ 8.56e-5 with the
    alternation points near f = 0.10, 0.45, 0.83 and 1.0.

    Returns (coefficients c0..cd as float64, max relative error on the grid).
    """
    import numpy as np

    if degree < 1:
        raise ValueError(f"degree={degree}: must be >= 1")
    f = np.linspace(0.0, 1.0, grid)
    target = np.exp2(f)
    ref = np.linspace(0.0, 1.0, degree + 2)[1:]  # d + 1 points, excluding f = 0 where e(0) = 0
    coeffs = None
    err = None
    for _ in range(iterations):
        a = np.zeros((degree + 1, degree + 1))
        b = np.zeros(degree + 1)
        for i, x in enumerate(ref):
            a[i, :degree] = [x**k for k in range(1, degree + 1)]
            a[i, degree] = (-1.0) ** i * 2.0**x
            b[i] = 2.0**x - 1.0
        sol = np.linalg.solve(a, b)
        coeffs = np.concatenate([[1.0], sol[:degree]])
        err = (np.polynomial.polynomial.polyval(f, coeffs) - target) / target
        # Extrema of e on the grid (interior turning points and the end f = 1), merged so that
        # signs alternate, keeping the largest of each run; then the d + 1 largest in a row.
        turning = np.nonzero(np.diff(np.sign(np.diff(err))) != 0)[0] + 1
        cand = [int(i) for i in turning] + [grid - 1]
        merged: list[int] = []
        for i in cand:
            if merged and np.sign(err[merged[-1]]) == np.sign(err[i]):
                if abs(err[i]) > abs(err[merged[-1]]):
                    merged[-1] = i
            else:
                merged.append(i)
        while len(merged) > degree + 1:
            if abs(err[merged[0]]) < abs(err[merged[-1]]):
                merged.pop(0)
            else:
                merged.pop()
        if len(merged) < degree + 1:
            break
        ref = f[merged]
    return tuple(float(c) for c in coeffs), float(np.abs(err).max())


def ex2_poly_eval(frac: float) -> float:
    """q(frac) with float64 arithmetic (documentation and tests; the kernel uses float32 FMAs)."""
    out = EX2_POLY_COEFFS[-1]
    for c in reversed(EX2_POLY_COEFFS[:-1]):
        out = out * frac + c
    return out


# ---------------------------------------------------------------------------------------------
# Which elements use the polynomial


def emulated_pair_count(n_pairs: int, fraction: float) -> int:
    """Column pairs per row computed by the polynomial: round(fraction * n_pairs), halves up."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"ex2_emu_fraction={fraction}: must lie in [0, 1]")
    return int(math.floor(fraction * n_pairs + 0.5))


def ex2_emulated_pairs(n_cols: int, fraction: float) -> tuple[int, ...]:
    """Indices of the column pairs (2k, 2k+1) whose exp2 runs on the FMA pipe.

    The row of ``n_cols`` scores one softmax thread holds is processed by pairs (packed f32x2
    operations). ``E = emulated_pair_count(n_cols // 2, fraction)`` pairs are emulated, spread
    evenly along the row so that SFU and FMA work interleave all the way through the unrolled
    loop: with P = n_cols // 2 pairs, pair k is emulated when the line ``(k * E + P // 2) / P``
    crosses an integer between k and k + 1 (a Bresenham pattern shifted by half a stride, so
    the emulated pairs sit mid-way in their stride rather than at its end). This gives exactly
    E pairs, one per stride of P / E pairs when E divides P: for n_cols = 128 and fraction
    0.125, pairs 3, 11, 19, ..., 59 (columns 6-7, 22-23, ..., 118-119). The pattern is a pure
    function of two compile-time values, so the kernel unrolls it with ``const_expr``.
    """
    if n_cols <= 0 or n_cols % 2:
        raise ValueError(f"n_cols={n_cols}: must be a positive even number (columns go by pairs)")
    pairs = n_cols // 2
    count = emulated_pair_count(pairs, fraction)
    if count == 0:
        return ()
    offset = pairs // 2
    return tuple(
        k for k in range(pairs) if ((k + 1) * count + offset) // pairs != (k * count + offset) // pairs
    )


def ex2_emulated_mask(n_cols: int, fraction: float) -> tuple[bool, ...]:
    """Per column of a row: True where exp2 is the FMA-pipe polynomial, False for MUFU.EX2.

    Both columns of a pair share one value (see ``ex2_emulated_pairs`` for the placement).
    ``fraction`` is ``FmhaConfig.ex2_emu_fraction``; 0 gives all False, 1 all True.
    """
    chosen = set(ex2_emulated_pairs(n_cols, fraction))
    return tuple((c // 2) in chosen for c in range(n_cols))


# ---------------------------------------------------------------------------------------------
# Logit softcapping

# ``softcap`` c > 0 replaces each scaled score s by c * tanh(s / c) (Gemma 2, flash-attn). The
# kernels fold it into the raw score r = Q.K^T: t = tanh(r * softcap_k) with softcap_k =
# softmax_scale / c, and the softmax then runs on t with scale_log2 = c * log2(e) in place of
# softmax_scale * log2(e), so the row max, the rescale rule and LSE = (m * scale_log2 +
# log2(sum)) * ln 2 are unchanged. The backward multiplies dS by tanh's derivative 1 - t^2.
#
# tanh to float32 accuracy with one exp2 (MUFU.EX2) and no division (MUFU.TANH is off by up to
# 2^-11 relative, which c = 30 turns into 1.5e-2 of a logit, far outside the float64 rule for
# LSE; a division would be a second MUFU op):
#
#     e  = exp2(|x| * TANH_EX2_SCALE)          # exp(-2|x|), in (0, 1]
#     y  = 1 + e                               # in (1, 2]
#     r  = TANH_RECIP_SEED[0] - TANH_RECIP_SEED[1] * y     # |1 - y r| <= 1/17
#     r += r * (1 - y r), TANH_NEWTON_STEPS times          # 1/17 -> 2^-8.2 -> 2^-16.4 -> 2^-32
#     t  = copysign(2 r - 1, x)                # (1 - e) / (1 + e) = tanh(|x|)
#
# Its error is absolute, a few float32 ulps of 1 (1 - e loses the low bits of a small |x|),
# which c scales to about 1e-6 of a logit at c = 30.
# The backward keeps t in S's registers until dS = P (dP - Delta) (1 - t^2), so a masked score
# cannot be -inf there (1 - inf^2 times P = 0 is NaN): it is this, whose P is exactly 0 and
# whose 1 - t^2 (about -2^120) stays finite.
SOFTCAP_MASKED_T = -(2.0**60)
TANH_EX2_SCALE = -2.0 * LOG2_E
TANH_RECIP_SEED = (24.0 / 17.0, 8.0 / 17.0)
TANH_NEWTON_STEPS = 3


def softcap_factors(softmax_scale: float, softcap: float) -> tuple[float, float]:
    """(softcap_k, scale_log2) of a softcapped kernel: the raw score's factor inside tanh and
    the softmax's log2 factor outside it (c * log2(e))."""
    return softmax_scale / softcap, softcap * LOG2_E


def softcap_tanh_model(x, exp2=None):
    """The kernels' tanh (above) on a float32 torch tensor, ``exp2`` (default torch's) for
    MUFU.EX2, with the roundings the compiled code makes: each multiply-add is one FMA (the
    product exact in float64, one rounding to float32), the scale one FMUL, 1 + e one FADD.
    What the numerics emulation and the tests compare against."""
    import torch

    f32, f64 = torch.float32, torch.float64

    def fma(a, b, c):  # a * b + c rounded once (float32 products are exact in float64)
        return (a.to(f64) * b.to(f64) + c.to(f64)).to(f32)

    x = x.to(f32)
    exp2 = torch.exp2 if exp2 is None else exp2
    e = exp2(x.abs() * torch.tensor(TANH_EX2_SCALE, dtype=f32))
    y = e + 1.0
    one = torch.ones_like(y)
    r = fma(torch.full_like(y, -TANH_RECIP_SEED[1]), y, torch.full_like(y, TANH_RECIP_SEED[0]))
    for _ in range(TANH_NEWTON_STEPS):
        r = fma(r, fma(-y, r, one), r)
    return torch.copysign(fma(torch.full_like(r, 2.0), r, -one), x)


# Row max, rescale, split P

# The reference design's threshold for 16-bit inputs (log2 units): the stale max may lag the
# true max by up to this much, so P <= 2^8 = 256, which bf16 and fp16 both hold.
RESCALE_THRESHOLD_16BIT = 8.0


def softmax_scale_log2(softmax_scale: float) -> float:
    """The factor the kernel multiplies raw scores by: softmax_scale * log2(e).

    The kernel forms it in float32 (float32 scale times float32 ``LOG2_E``); the emulation does
    the same. This float64 value is for documentation and host-side checks.
    """
    return softmax_scale * LOG2_E


def rescale_needed(growth_log2, threshold):
    """The correction rule: rescale O and the row sum iff the max grew by more than threshold.

    ``growth_log2 = (m_new - m_old) * scale_log2`` where ``m_old`` is the max the row's O and
    row sum are currently expressed against (possibly stale) and ``m_new = max(m_old, tile
    max)``. When this is False the row keeps ``m_old`` (no rescale, factor 1); when True the
    row moves to ``m_new`` and O and the row sum are multiplied by ``exp2(-growth_log2)``.
    ``threshold == 0`` rescales on every increase (growth 0 would be a factor of exactly 1).
    A row whose old max is -inf (all keys masked so far) has growth +inf and always rescales
    (by 0, which clears nothing that is not already 0).

    Works unchanged on Python floats, DSL ``Float32`` values (inside ``@cute.jit``, where it
    becomes a run-time branch condition) and torch tensors (elementwise).
    """
    return growth_log2 > threshold


def correction_needed(acc_scale):
    """The correction vote's question for one row: must O's row be multiplied by its factor?

    Note [Correction vote]
        After each K/V block the softmax hands every row a factor: 1 when the row keeps its max
        (or has seen no key yet), ``exp2((m_old - m_new) * scale_log2)`` when it moves. A warp
        multiplies its rows of O only when this predicate holds for at least one of them (the
        vote); then every row of the warp is multiplied by its own factor, and a factor of 1
        changes nothing. The predicate is ``factor < 1`` and a factor of exactly 0 counts: it is
        what exp2 gives when the max jumps by more than about 149 log2 units (float32
        underflow, and the approximate exp2 flushes below 2^-126), and the row's stale O must
        then be cleared, or it keeps full weight against the new max. A tile's first block is
        never rescaled: its PV MMA overwrites O (SM100) or O starts at 0 (Hopper). After it, a
        row that had seen no key (every key so far masked) has the factor 0 too, and an O row
        of exactly 0 (P = 0), which a factor of 0 or 1 leaves 0. Both forwards and the numerics
        emulation apply this one predicate.

    Works on Python floats, DSL ``Float32`` values and torch tensors (elementwise).
    """
    return acc_scale < 1.0


def rescale_threshold_log2(threshold: float) -> float:
    """``FmhaConfig.rescale_threshold`` as the kernel compares it: already in log2 units.

    The config states the threshold in the kernel's units (log2 of the factor by which P may
    exceed 1), so this is the identity after a check; it exists so that no caller converts it.
    """
    threshold = float(threshold)
    if not threshold >= 0.0:
        raise ValueError(f"rescale_threshold={threshold}: must be >= 0 (log2 units)")
    return threshold


# Largest threshold whose P (up to 2^threshold before the final 1 / row sum) the 16-bit P type
# holds: float16's largest finite value is 65504 < 2^16; bfloat16's exponent reaches 2^127.
P_MAX_LOG2 = {"float16": 15.0, "bfloat16": 127.0}


def check_rescale_threshold(threshold: float, dtype: str) -> float:
    """``rescale_threshold_log2(threshold)``, and ValueError unless ``2^threshold``, the largest
    P a stale max allows, is finite in ``dtype`` (the P operand's 16-bit type)."""
    threshold = rescale_threshold_log2(threshold)
    if threshold > P_MAX_LOG2[dtype]:
        raise ValueError(
            f"rescale_threshold={threshold}: P may reach 2^threshold before the final "
            f"1 / row sum, and {dtype} holds at most 2^{P_MAX_LOG2[dtype]:g}"
        )
    return threshold


def max_p_value(threshold: float) -> float:
    """The largest P (before the final 1/row_sum) a stale max allows: 2^threshold."""
    return 2.0**threshold


def p_split_columns(n_block: int, split_p: bool, split_p_col: int) -> tuple[tuple[int, int], ...]:
    """Column ranges [start, stop) of P in arrival order: the early part and the late part.

    With split P the softmax stores columns [0, split_p_col) and signals s_p_o (the PV MMAs
    of those columns may start), then stores [split_p_col, n_block) and signals p_lastsplit.
    Without it, one range. The PV MMAs still accumulate the columns in ascending K order, so
    the split changes when they issue, not what they compute.
    """
    if not split_p:
        return ((0, n_block),)
    if not 0 < split_p_col < n_block:
        raise ValueError(f"split_p_col={split_p_col}: must lie strictly inside (0, {n_block})")
    return ((0, split_p_col), (split_p_col, n_block))

