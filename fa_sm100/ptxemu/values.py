"""Typed views of register bits and the IEEE helpers the instruction semantics need.

Registers hold raw bits in an unsigned array of their declared width (PTX registers are
untyped bit containers; ``.b32`` registers carry f32 values as well as ints). An instruction
type (``.f32``, ``.s32``, ``.u64``, ``.bf16``...) only decides how the bits are read.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

UINT = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}
SINT = {8: np.int8, 16: np.int16, 32: np.int32, 64: np.int64}


@lru_cache(maxsize=None)
def type_width(t: str) -> int:
    if t == "pred":
        return 1
    if t in ("bf16x2", "f16x2", "f32x2"):
        return {"bf16x2": 32, "f16x2": 32, "f32x2": 64}[t]
    digits = "".join(c for c in t if c.isdigit())
    if not digits:
        raise ValueError(f"type .{t} has no width")
    return int(digits)


@lru_cache(maxsize=None)
def storage_dtype(t: str):
    if t == "pred":
        return np.bool_
    return UINT[type_width(t)]


@lru_cache(maxsize=None)
def numpy_dtype(t: str):
    """The NumPy dtype values of PTX type ``t`` are computed in."""
    if t == "pred":
        return np.bool_
    w = type_width(t)
    k = t[0]
    if t in ("bf16",):
        return np.uint16          # handled by the bf16 helpers
    if k == "f":
        return {16: np.float16, 32: np.float32, 64: np.float64}[w]
    if k == "s":
        return SINT[w]
    return UINT[w]


def bits_to(t: str, bits: np.ndarray) -> np.ndarray:
    """Raw register bits (any unsigned width) -> values of type ``t`` (truncating/extending)."""
    if t == "pred":
        return bits.astype(np.bool_)
    w = type_width(t)
    u = bits.astype(UINT[w], copy=False) if bits.dtype != np.bool_ else bits.astype(UINT[w])
    dt = numpy_dtype(t)
    return u if dt == u.dtype else u.view(dt)


def to_bits(t: str, values: np.ndarray, reg_dtype) -> np.ndarray:
    """Values of type ``t`` -> bits in a register of ``reg_dtype``. Signed values sign-extend
    when written to a wider register (the ISA's rule for e.g. cvt.s64.s32 results)."""
    if reg_dtype == np.bool_:
        return values.astype(np.bool_)
    if t == "pred":
        return values.astype(reg_dtype)
    w = type_width(t)
    v = np.asarray(values)
    if v.dtype.kind == "f":
        v = v.astype(numpy_dtype(t), copy=False).view(UINT[w])
    elif v.dtype.kind == "b":
        v = v.astype(UINT[w])
    if t[0] == "s" and np.dtype(reg_dtype).itemsize * 8 > w:
        return v.astype(SINT[w]).astype(np.int64).astype(reg_dtype)
    return v.astype(UINT[w], copy=False).astype(reg_dtype, copy=False)


# ---------------------------------------------------------------------------------------
# Floating point helpers


def ftz32(x: np.ndarray) -> np.ndarray:
    """Flush f32 subnormals to sign-preserving zero (.ftz)."""
    sub = (np.abs(x) < np.float32(1.1754944e-38)) & (x != 0)
    if sub.any():
        x = np.where(sub, np.copysign(np.float32(0), x), x).astype(np.float32)
    return x


def round_f32(s: np.ndarray, e: np.ndarray, mode: str = "rn") -> np.ndarray:
    """Round the exact value s + e (s float64, |e| below half an ulp of s) to float32 with
    the PTX rounding modifier ``mode``: rn (nearest even), rz, rm (toward -inf), rp."""
    with np.errstate(all="ignore"):
        r = s.astype(np.float32)
        d = s - r.astype(np.float64)
        if mode == "rn":
            tie = (e != 0) & (d != 0) & np.isfinite(s)
            if tie.any():
                up = np.nextafter(r, np.float32(np.inf))
                dn = np.nextafter(r, np.float32(-np.inf))
                other = np.where(d > 0, up, dn)
                half = np.abs(other.astype(np.float64) - r.astype(np.float64)) / 2
                mid = tie & (np.abs(d) == half) & (np.sign(e) == np.sign(d))
                r = np.where(mid, other, r).astype(np.float32)
            return r
        # sign of (exact - r): d when it is nonzero (|e| is far below one ulp of s), else e
        above = np.where(d != 0, d > 0, e > 0) & np.isfinite(s)
        below = np.where(d != 0, d < 0, e < 0) & np.isfinite(s)
        if mode == "rm":
            return np.where(below, np.nextafter(r, np.float32(-np.inf)), r).astype(np.float32)
        if mode == "rp":
            return np.where(above, np.nextafter(r, np.float32(np.inf)), r).astype(np.float32)
        if mode == "rz":
            away = np.where(r > 0, below, above) & (r != 0)
            return np.where(away, np.nextafter(r, np.float32(0)), r).astype(np.float32)
        raise ValueError(f"rounding mode .{mode}")


def two_sum(a64: np.ndarray, b64: np.ndarray):
    with np.errstate(all="ignore"):
        s = a64 + b64
        bp = s - a64
        e = (a64 - (s - bp)) + (b64 - bp)
        return s, np.where(np.isfinite(s), e, 0.0)


def add_f32(a, b, mode="rn"):
    """f32 a + b rounded once with ``mode`` (the exact sum is s + e in float64)."""
    s, e = two_sum(a.astype(np.float64), b.astype(np.float64))
    return round_f32(s, e, mode)


def mul_f32(a, b, mode="rn"):
    """f32 a * b rounded once with ``mode`` (the product of two f32 is exact in float64)."""
    with np.errstate(all="ignore"):
        p = a.astype(np.float64) * b.astype(np.float64)
    return round_f32(p, np.zeros_like(p), mode)


def fma_f32(a: np.ndarray, b: np.ndarray, c: np.ndarray, mode: str = "rn") -> np.ndarray:
    """Correctly rounded (single rounding) f32 fused multiply-add with rounding ``mode``.

    a*b is exact in f64; the f64 sum s = p + c is corrected with its TwoSum error e, which
    only matters when s lies exactly halfway between two f32 values (rn) or is itself an
    f32 value (directed modes)."""
    with np.errstate(all="ignore"):
        p = a.astype(np.float64) * b.astype(np.float64)
        s, e = two_sum(p, c.astype(np.float64))
        return round_f32(s, e, mode)


def f32_to_bf16_rn(x: np.ndarray) -> np.ndarray:
    """f32 -> bf16 bits, round to nearest even; NaN stays a quiet NaN."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = np.isnan(x)
    out = rounded.astype(np.uint16)
    if nan.any():
        out = np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), out)
    return out


def f32_to_bf16_rz(x: np.ndarray) -> np.ndarray:
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f16_to_f32(bits: np.ndarray) -> np.ndarray:
    return bits.astype(np.uint16).view(np.float16).astype(np.float32)


def f32_to_f16_rn(x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return x.astype(np.float32).astype(np.float16).view(np.uint16)
