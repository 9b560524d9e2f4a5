"""Hardware check of the emulation's exp2 models (needs a CUDA GPU and triton; run on the lent one).

The SM100 kernel computes exp2 two ways: MUFU.EX2 (``ex2.approx.ftz.f32``) and the FMA-pipe
polynomial of ``fa_sm100.softmax_math``, issued as packed f32x2 ops. A packed op rounds each
lane exactly like its scalar form, so the scalar PTX sequence below, run on any NVIDIA GPU
(sm_90 here), yields the same bits per element as the kernel's pair path on sm_100:

    max.ftz.f32  a, x, -127            add.rm.ftz.f32 r, a, 1.5*2^23   (floor in low bits)
    sub.rn.ftz.f32 fl, r, 1.5*2^23     sub.rn.ftz.f32 f, a, fl
    fma.rn.ftz.f32 q, c3, f, c2  ...   (Horner, one rounding per step)
    shl.b32 e, bits(r), 23             add.s32 y, bits(q), e

The check compares, bit for bit, the GPU's results with ``emulation.ex2.ex2_poly`` (the CPU
model of that sequence), and measures the GPU's MUFU.EX2 against correctly rounded exp2 and
against ``ex2_sfu``, the emulation's SFU model. MUFU.EX2 is the same instruction on sm_90 and
sm_100 as far as PTX specifies it (``ex2.approx.ftz.f32``); that its last-ulp behaviour matches
on sm_100 is an assumption this check cannot settle.

    python -m fa_sm100.emulation.gpu_ex2 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from fa_sm100 import softmax_math as sm
from fa_sm100.emulation.ex2 import (binade_inputs, ex2_poly, ex2_sfu, exp2_correctly_rounded,
                                    range_inputs, ulp_distance)

_MAGIC_BITS = sm.f32_bits(sm.EX2_FLOOR_MAGIC)  # 0x4B400000


def _imm(bits: int) -> str:
    return f"0f{bits:08X}"


def poly_ptx() -> str:
    """The polynomial path as one inline-PTX block, constants from softmax_math."""
    c = sm.EX2_POLY_COEFFS_BITS
    deg = sm.EX2_POLY_DEGREE
    lines = [
        "{",
        ".reg .f32 a, r, fl, f, q, k;",
        ".reg .b32 qi, ri;",
        "mov.b32 a, $1;",
        f"max.ftz.f32 a, a, {_imm(sm.f32_bits(sm.EX2_CLAMP_MIN))};",
        f"add.rm.ftz.f32 r, a, {_imm(_MAGIC_BITS)};",
        f"sub.rn.ftz.f32 fl, r, {_imm(_MAGIC_BITS)};",
        "sub.rn.ftz.f32 f, a, fl;",
        f"mov.f32 q, {_imm(c[deg])};",
    ]
    for i in range(deg - 1, -1, -1):
        lines += [f"mov.f32 k, {_imm(c[i])};", "fma.rn.ftz.f32 q, q, f, k;"]
    lines += ["mov.b32 qi, q;", "mov.b32 ri, r;", "shl.b32 ri, ri, 23;", "add.s32 $0, qi, ri;", "}"]
    return "\n".join(lines)


def sfu_ptx(op: str = "ex2") -> str:
    """One SFU instruction (``ex2``, ``rcp`` or ``lg2``, ``.approx.ftz.f32``) on a .b32 operand."""
    return f"{{\n.reg .f32 a;\nmov.b32 a, $1;\n{op}.approx.ftz.f32 a, a;\nmov.b32 $0, a;\n}}"


def run_on_gpu(x: torch.Tensor, asm: str) -> torch.Tensor:
    """Run an inline-PTX exp2 on the CUDA device over float32 ``x``; returns float32 on the CPU."""
    from fa_sm100.emulation._ex2_triton import ex2_asm_kernel

    xi = x.contiguous().view(torch.int32).cuda()
    y = torch.empty_like(xi)
    block = 1024
    ex2_asm_kernel[(triton_cdiv(xi.numel(), block),)](xi, y, xi.numel(), ASM=asm, BLOCK=block)
    torch.cuda.synchronize()
    return y.cpu().view(torch.float32)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _positive_normal(y: torch.Tensor) -> torch.Tensor:
    return y >= 2.0**-126


def gpu_ex2_report() -> dict:
    """Bit-compare the polynomial model and measure MUFU.EX2 on the current CUDA device."""
    specials = torch.tensor([0.0, -0.0, 1.0, -1.0, 8.0, -126.0, -126.5, -127.0, -127.5, -200.0,
                             float("-inf"), -1e-9, -0.5, 0.5], dtype=torch.float32)
    sets = {
        "every float32 in (-2, -1]": binade_inputs(0),
        "2^20 evenly spaced in [-126, 8]": range_inputs(-126.0, sm.RESCALE_THRESHOLD_16BIT, 1 << 20),
        "integers -126..127": torch.arange(-126, 128, dtype=torch.float32),
        "specials": specials,
    }
    out = {"device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability()),
           "sets": []}
    for name, x in sets.items():
        poly_gpu = run_on_gpu(x, poly_ptx())
        mufu_gpu = run_on_gpu(x, sfu_ptx("ex2"))
        poly_cpu = ex2_poly(x)
        sfu_cpu = ex2_sfu(x)
        ref = exp2_correctly_rounded(x)
        mismatch = poly_gpu.view(torch.int32) != poly_cpu.view(torch.int32)
        normal = _positive_normal(ref)
        row = dict(
            inputs=name,
            count=int(x.numel()),
            poly_bit_mismatches=int(mismatch.sum()),
            poly_max_ulp_vs_model=int(ulp_distance(poly_gpu[normal], poly_cpu[normal]).max())
            if normal.any() else 0,
            mufu_max_ulp_vs_exact=int(ulp_distance(mufu_gpu[normal], ref[normal]).max())
            if normal.any() else 0,
            mufu_max_ulp_vs_sfu_model=int(ulp_distance(mufu_gpu[normal], sfu_cpu[normal]).max())
            if normal.any() else 0,
            mufu_share_exact=float((mufu_gpu[normal] == ref[normal]).double().mean())
            if normal.any() else 1.0,
            poly_gpu_zero_below_clamp=bool((poly_gpu[x <= sm.EX2_CLAMP_MIN] == 0).all()),
        )
        if mismatch.any():
            i = int(torch.nonzero(mismatch)[0])
            row["first_mismatch"] = dict(x=float(x[i]), gpu=float(poly_gpu[i]), model=float(poly_cpu[i]))
        out["sets"].append(row)
    out["epilogue"] = _epilogue_ops()
    return out


def _epilogue_ops() -> list[dict]:
    """MUFU.RCP and MUFU.LG2 as the correction epilogue uses them (1/row_sum, log2(row_sum)),
    against the exact operations the emulation uses instead, on every float32 in (1, 2] and on
    row sums spread over [1, 2^20]."""
    rows = []
    sets = {"every float32 in (1, 2]": -binade_inputs(0),
            "2^20 evenly spaced in [1, 2^20]": range_inputs(1.0, 2.0**20, 1 << 20)}
    for name, x in sets.items():
        rcp_gpu = run_on_gpu(x, sfu_ptx("rcp"))
        rcp_exact = (1.0 / x.to(torch.float64)).to(torch.float32)
        lg2_gpu = run_on_gpu(x, sfu_ptx("lg2"))
        lg2_exact = torch.log2(x.to(torch.float64))
        top = float(lg2_exact.abs().max())
        result_ulp = torch.finfo(torch.float32).eps * 2.0 ** math.floor(math.log2(top)) if top else 0.0
        rows.append(dict(
            inputs=name, count=int(x.numel()),
            rcp_max_ulp_vs_exact=int(ulp_distance(rcp_gpu, rcp_exact).max()),
            rcp_share_exact=float((rcp_gpu == rcp_exact).double().mean()),
            lg2_max_abs_error=float((lg2_gpu.to(torch.float64) - lg2_exact).abs().max()),
            lg2_result_ulp=float(result_ulp),
        ))
    return rows


def check_report(rep: dict) -> list[str]:
    """The contract of the hardware check; returns the violations (empty when it holds).

    - the polynomial sequence gives exactly the bits of the CPU model, 0 below the clamp;
    - MUFU.EX2 is within 2 ulp of correctly rounded exp2 and of the emulation's SFU model;
    - MUFU.RCP within 2 ulp of 1/x; MUFU.LG2 within 2^-22 plus 2 ulps of its result of log2 x
      (the epilogue ops the emulation takes as exact).
    """
    bad = []
    for r in rep["sets"]:
        if r["poly_bit_mismatches"] != 0:
            bad.append(f"{r['inputs']}: {r['poly_bit_mismatches']} polynomial results differ from the model")
        if r["mufu_max_ulp_vs_exact"] > 2 or r["mufu_max_ulp_vs_sfu_model"] > 2:
            bad.append(f"{r['inputs']}: MUFU.EX2 more than 2 ulp off")
        if not r["poly_gpu_zero_below_clamp"]:
            bad.append(f"{r['inputs']}: polynomial not 0 at or below the clamp")
    for r in rep.get("epilogue", []):
        if r["rcp_max_ulp_vs_exact"] > 2:
            bad.append(f"{r['inputs']}: MUFU.RCP {r['rcp_max_ulp_vs_exact']} ulp off")
        if r["lg2_max_abs_error"] > 2.0**-22 + 2 * r["lg2_result_ulp"]:
            bad.append(f"{r['inputs']}: MUFU.LG2 error {r['lg2_max_abs_error']:.3g}")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="hardware check of the emulation's exp2 models")
    ap.add_argument("--json", help="write the report here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: this check runs on the lent GPU")
        return 2
    rep = gpu_ex2_report()
    print(json.dumps(rep, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rep, fh, indent=1)
    bad = check_report(rep)
    for line in bad:
        print("VIOLATION:", line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
