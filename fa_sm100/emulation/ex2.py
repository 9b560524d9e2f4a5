"""The kernel's two exp2 paths in float32 torch, and the polynomial's accuracy report.

``ex2_poly`` follows the FMA-pipe sequence of ``fa_sm100.softmax_math`` bit for bit: clamp,
floor, fraction, Horner with FMAs, integer add into the exponent field (whose result is not
flushed: for x in (-127, -126) it is the subnormal the bits spell). An FMA (one rounding of
``a * b + c``) is modelled by evaluating in float64, where the product of two float32 values is
exact, and rounding once to float32; this could differ from a true FMA only when the float64
sum lands on a float32 rounding tie (double rounding). Checked on an H200 (``gpu_ex2``): the
model gave the GPU's bits on all 9.4 million inputs tried (every fraction on the 2^-23 grid,
2^20 points over [-126, 8], integers and specials).

``ex2_sfu`` models MUFU.EX2 (``ex2.approx.ftz.f32``) as correctly rounded exp2 (float64,
rounded once to float32; platform-independent, and the PTX emulator's model too) with
subnormal results flushed to zero. Measured on an H200, MUFU.EX2 is within 2 ulp of that
(exactly rounded for ~40% of inputs): hundreds of times below the polynomial's error and the
bf16 rounding of P.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fa_sm100 import softmax_math as sm

_MIN_NORMAL_BITS = 0x00800000  # bit pattern of 2^-126, the smallest normal float32


def _flush_subnormal(y: torch.Tensor) -> torch.Tensor:
    bits = y.view(torch.int32)
    return torch.where((bits >= 0) & (bits < _MIN_NORMAL_BITS), torch.zeros_like(y), y)


def ex2_poly(x: torch.Tensor) -> torch.Tensor:
    """exp2 by the degree-3 polynomial path, elementwise on a float32 tensor (-inf gives 0)."""
    if x.dtype != torch.float32:
        raise ValueError(f"ex2_poly takes float32, got {x.dtype}")
    xc = torch.clamp(x, min=sm.EX2_CLAMP_MIN)
    n = torch.floor(xc)
    frac = (xc - n).to(torch.float64)  # xc - n is computed (and rounded) in float32 first
    coeffs = sm.EX2_POLY_COEFFS
    q = torch.full_like(frac, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        q = (q * frac + c).to(torch.float32).to(torch.float64)  # one FMA: exact product, 1 rounding
    q32 = q.to(torch.float32).contiguous()
    bits = q32.view(torch.int32) + (n.to(torch.int32) << 23)
    return bits.view(torch.float32)


def ex2_sfu(x: torch.Tensor) -> torch.Tensor:
    """exp2 as the SFU computes it (modelled: correctly rounded), subnormal results flushed."""
    if x.dtype != torch.float32:
        raise ValueError(f"ex2_sfu takes float32, got {x.dtype}")
    return _flush_subnormal(torch.exp2(x.to(torch.float64)).to(torch.float32).contiguous())


def ex2_mixed(x: torch.Tensor, emulated_cols: torch.Tensor) -> torch.Tensor:
    """exp2 of a (..., n_cols) float32 tile: the polynomial where ``emulated_cols`` (n_cols,) is
    True, the SFU elsewhere, as one softmax thread does across its row."""
    if not bool(emulated_cols.any()):
        return ex2_sfu(x)
    if bool(emulated_cols.all()):
        return ex2_poly(x)
    cols = torch.nonzero(emulated_cols).flatten()
    out = ex2_sfu(x)
    out[..., cols] = ex2_poly(x[..., cols].contiguous())
    return out


def exp2_correctly_rounded(x: torch.Tensor) -> torch.Tensor:
    """fp32 exp2 rounded once from float64 (the accuracy yardstick for both paths)."""
    return torch.exp2(x.to(torch.float64)).to(torch.float32)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in float32 ulps, for positive finite float32 tensors (bit patterns are monotone)."""
    return (a.contiguous().view(torch.int32).to(torch.int64)
            - b.contiguous().view(torch.int32).to(torch.int64)).abs()


ULP_BUCKETS = ((0, 0), (1, 1), (2, 3), (4, 15), (16, 63), (64, 255), (256, 1023), (1024, None))


@dataclass
class Ex2Accuracy:
    """Accuracy of one exp2 path against correctly rounded float32 exp2 on a set of inputs."""

    path: str
    inputs: str
    count: int
    max_rel_error: float
    max_ulp: int
    mean_ulp: float
    ulp_histogram: dict  # "lo-hi" ulps -> share of inputs
    worst_input: float

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def measure_ex2(path: str, x: torch.Tensor, inputs: str) -> Ex2Accuracy:
    """Compare ``ex2_poly`` or ``ex2_sfu`` with correctly rounded exp2 on ``x`` (float32).

    Inputs whose exact result is below the smallest normal float32 are excluded (both paths
    flush those to zero by design).
    """
    fn = {"poly": ex2_poly, "sfu": ex2_sfu}[path]
    x = x[x >= -126.0]
    ref = exp2_correctly_rounded(x)
    got = fn(x)
    rel = ((got.to(torch.float64) - torch.exp2(x.to(torch.float64))).abs()
           / torch.exp2(x.to(torch.float64)))
    ulps = ulp_distance(got, ref)
    hist = {}
    for lo, hi in ULP_BUCKETS:
        sel = ulps >= lo if hi is None else (ulps >= lo) & (ulps <= hi)
        key = f"{lo}" if lo == hi else (f">={lo}" if hi is None else f"{lo}-{hi}")
        hist[key] = float(sel.double().mean())
    worst = int(torch.argmax(rel))
    return Ex2Accuracy(
        path=path,
        inputs=inputs,
        count=int(x.numel()),
        max_rel_error=float(rel.max()),
        max_ulp=int(ulps.max()),
        mean_ulp=float(ulps.double().mean()),
        ulp_histogram=hist,
        worst_input=float(x[worst]),
    )


def binade_inputs(lo_exp: int = 0) -> torch.Tensor:
    """Every float32 in (-2^(lo_exp+1), -2^lo_exp]: for lo_exp = 0 that is (-2, -1], 2^23 values
    whose fractions x - floor(x) are every multiple of 2^-23 in [0, 1) exactly once."""
    base = sm.f32_bits(-(2.0**lo_exp))  # sign bit set: bits grow with magnitude
    bits = torch.arange(base, base + (1 << 23), dtype=torch.int64).to(torch.int32)
    return bits.view(torch.float32)


def range_inputs(lo: float, hi: float, count: int) -> torch.Tensor:
    """``count`` evenly spaced float32 inputs over [lo, hi]."""
    return torch.linspace(lo, hi, count, dtype=torch.float64).to(torch.float32)


def ex2_report(threshold: float = sm.RESCALE_THRESHOLD_16BIT, dense: int = 1 << 20) -> list[dict]:
    """The polynomial's accuracy over the kernel's input range (the SFU model is correctly
    rounded by construction; MUFU.EX2 itself is measured by ``gpu_ex2`` on a GPU).

    The kernel feeds exp2 with x = (s - m) * scale_log2 <= threshold (stale max), clamped at
    -127, so the range is [-126, threshold]. Two input sets: every float32 of (-2, -1] (all
    fractions on the 2^-23 grid: exhaustive for the polynomial's error, which depends on the
    fraction only) and ``dense`` evenly spaced inputs over [-126, threshold].
    """
    out = []
    sets = (("every float32 in (-2, -1]", binade_inputs(0)),
            (f"{dense} evenly spaced in [-126, {threshold:g}]", range_inputs(-126.0, threshold, dense)))
    for name, x in sets:
        out.append(measure_ex2("poly", x, name).as_dict())
    return out
