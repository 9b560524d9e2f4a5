"""Run the project's SM100 forward kernel (``fa_sm100.sm100``) on the PTX emulator.

``run_forward(cfg, q, k, v, ...)`` cross-compiles ``Sm100Forward(cfg)`` for sm_100a with the
registry's fake arguments, captures the launch through the driver stand-in with the CPU
tensors, executes the PTX on the emulator and returns O and LSE as the kernel wrote them.
``compare(...)`` applies the project's error rule against the float64 reference and counts
the bit-identical elements against the numerics emulation (``fa_sm100.emulation``).

Everything here is emulated: no SM100 code runs on hardware.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from fa_sm100.bands import kernel_window

_COMPILED: dict = {}


@dataclass
class ForwardRun:
    out: torch.Tensor
    lse: Optional[torch.Tensor]
    launch: dict
    compile_s: float
    emulate_s: float
    warp_steps: int
    trace: Optional[list] = field(default=None, repr=False)
    kernel: object = field(default=None, repr=False)


def _to_cute(t: torch.Tensor, dynamic_modes, like):
    """A row-major CPU tensor as the compiled kernel expects it: dynamic batch/sequence
    modes, compact, with the dynamic-stride width of the fake tensor ``like`` it was
    compiled with. ``mark_compact_shape_dynamic`` reads ``stride_order`` outermost mode
    first, (0, 1, ..., n-1) for row-major -- the reverse of ``make_fake_compact_tensor``'s
    convention; it must be explicit because size-1 modes make the deduced order ambiguous."""
    from cutlass.cute.runtime import from_dlpack
    # the stride width must match the compile's fake tensor: with a mismatch the host code
    # packs the stride words differently and the kernel reads wrong strides (seen here as
    # an LSE head stride of 0)
    ct = from_dlpack(t, assumed_align=16,
                     use_32bit_stride=bool(getattr(like, "_use_32bit_stride", False)))
    order = tuple(range(t.dim()))
    for mode in dynamic_modes:
        ct = ct.mark_compact_shape_dynamic(mode=mode, stride_order=order)
    return ct


def compile_forward(cfg, num_heads: int, seqused_k: bool = False):
    """(kernel object, fake args, compiled, PTX) for ``cfg``; cached per process.
    ``seqused_k``: a varlen kernel that takes used key lengths."""
    from fa_sm100.sm100.inspect_entry import fake_arguments
    from fa_sm100.sm100.kernel import Sm100Forward

    from .capture import compile_kernel
    cfg = cfg.kernel_config()  # the window's bounds are launch arguments
    key = (cfg, num_heads, seqused_k)
    if key not in _COMPILED:
        kernel = Sm100Forward(cfg)
        fake = fake_arguments(cfg, num_heads, seqused_k=seqused_k)
        compiled, ptx = compile_kernel(kernel, fake, "sm_100a")
        _COMPILED[key] = (kernel, fake, compiled, ptx)
    return _COMPILED[key]


def run_forward(cfg, q, k, v, softmax_scale: Optional[float] = None, seed: int = 0,
                trace: Optional[list] = None, ptx_edit=None,
                policy: str = "late", strict_fences: bool = False,
                softcap: float = 0.0) -> ForwardRun:
    """Emulate the compiled SM100 forward on BSHD CPU tensors (bf16/fp16).

    ``seed`` and ``policy`` choose the schedule (Note [Schedule policies] in machine.py).

    ``ptx_edit(ptx) -> ptx`` may rewrite the kernel's PTX before it runs (tests use it to
    remove a synchronisation and check that the emulator reports the consequence)."""
    import cuda.bindings.driver as cuda
    import cutlass

    from .capture import capture_launch
    from .emulator import emulate

    if cfg.softcap != (softcap > 0):
        raise ValueError(f"softcap={softcap} with config.softcap={cfg.softcap}: a softcapped "
                         "config takes the cap (> 0), any other config 0")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous CPU tensor")
    b, sq, hq, d = q.shape
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    t0 = time.perf_counter()
    kernel, fake, compiled, ptx = compile_forward(cfg, hq)
    t1 = time.perf_counter()
    out = torch.zeros(b, sq, hq, v.shape[3], dtype=q.dtype)
    lse = torch.zeros(b, hq, sq, dtype=torch.float32) if cfg.write_lse else None
    real = (_to_cute(q, (0, 1), fake[0]), _to_cute(k, (0, 1), fake[1]),
            _to_cute(v, (0, 1), fake[2]), _to_cute(out, (0, 1), fake[3]),
            _to_cute(lse, (0, 2), fake[4]) if lse is not None else None,
            cutlass.Float32(scale), cutlass.Float32(softcap),
            *(cutlass.Int32(w) for w in kernel_window(cfg.causal, (cfg.window_left,
                                                                   cfg.window_right), sq,
                                                      k.shape[1])),
            None, None, None, None, cutlass.Int32(0), cuda.CUstream(0))
    cap = capture_launch(kernel, fake, real, compiled=compiled, ptx=ptx)
    if ptx_edit is not None:
        from .parser import parse_ptx
        cap.ptx = ptx_edit(cap.ptx)
        cap.module = parse_ptx(cap.ptx)
    rec = cap.launches[0]
    t2 = time.perf_counter()
    buffers = [q, k, v, out] + ([lse] if lse is not None else [])
    machine = emulate(cap, buffers, seed=seed, trace=trace, policy=policy,
                      strict_fences=strict_fences)
    t3 = time.perf_counter()
    steps = sum(w.steps for c in machine.ctas for w in c.warps)
    return ForwardRun(out=out, lse=lse, compile_s=t1 - t0, emulate_s=t3 - t2,
                      warp_steps=steps, trace=trace, kernel=cap.kernel,
                      launch={"grid": rec.grid, "block": rec.block, "cluster": rec.cluster,
                              "dynamic_smem": rec.dynamic_smem,
                              "regs_at_launch": cap.launch_regs})


def run_forward_varlen(cfg, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                       seqused_k=None, window=(None, None), softmax_scale=None, seed: int = 0,
                       softcap: float = 0.0, page_table=None) -> ForwardRun:
    """Emulate the compiled SM100 varlen forward (``cfg.varlen``, fa_sm100.varlen) on packed
    CPU tensors: q (total_q, h, d), k / v (total_k, h_kv, d / dv), int32 offsets. ``window``:
    the problem's (left, right), None unbounded (with ``cfg.causal``: bands.kernel_window with
    the varlen bound). O is poisoned with NaN first (rows the kernel does not write stay NaN),
    LSE likewise; returns them as the kernel wrote them, O (total_q, h, dv), LSE (h, total_q).
    A paged config (``cfg.page_size``): k / v are the cache's pages (pages, page_size, h_kv,
    d / dv), ``page_table`` (batch, pages per sequence) int32 names each sequence's, and
    ``seqused_k`` its length (cu_seqlens_k is then unread)."""
    import cuda.bindings.driver as cuda
    import cutlass

    from fa_sm100.varlen import VARLEN_UNBOUNDED

    from .capture import capture_launch
    from .emulator import emulate

    if not cfg.varlen:
        raise ValueError("run_forward_varlen needs a varlen config (cfg.varlen)")
    d = q.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    t0 = time.perf_counter()
    kernel, fake, compiled, ptx = compile_forward(cfg, q.shape[1], seqused_k is not None)
    t1 = time.perf_counter()
    q4, k4, v4 = (t.unsqueeze(0).contiguous() for t in (q, k, v))
    out = torch.full((1, q.shape[0], q.shape[1], v.shape[-1]), float("nan"), dtype=q.dtype)
    lse = (torch.full((1, q.shape[1], q.shape[0]), float("nan"), dtype=torch.float32)
           if cfg.write_lse else None)
    if cfg.page_size:  # the pages as packed rows
        if page_table is None or seqused_k is None:
            raise ValueError("a paged config needs page_table and seqused_k")
        k4, v4 = (t.reshape(1, -1, *t.shape[2:]).contiguous() for t in (k, v))
    # fresh copies: views into a larger buffer may start off the 16-byte alignment
    ints = [t.clone() for t in (cu_seqlens_q, cu_seqlens_k)
            + (() if seqused_k is None else (seqused_k,))]
    cu = [_to_cute(t, (0,), f) for t, f in zip(ints, fake[9:12])]
    pages = None
    if cfg.page_size:
        table = page_table.flatten().clone()
        ints.append(table)
        pages = _to_cute(table, (0,), fake[12])
    real = (_to_cute(q4, (0, 1), fake[0]), _to_cute(k4, (0, 1), fake[1]),
            _to_cute(v4, (0, 1), fake[2]), _to_cute(out, (0, 1), fake[3]),
            _to_cute(lse, (0, 2), fake[4]) if lse is not None else None,
            cutlass.Float32(scale), cutlass.Float32(softcap),
            *(cutlass.Int32(w) for w in kernel_window(cfg.causal, window, VARLEN_UNBOUNDED,
                                                      VARLEN_UNBOUNDED)),
            *cu, *([None] if seqused_k is None else []), pages, cutlass.Int32(max_seqlen_q),
            cuda.CUstream(0))
    cap = capture_launch(kernel, fake, real, compiled=compiled, ptx=ptx)
    t2 = time.perf_counter()
    buffers = [q4, k4, v4, out] + ([lse] if lse is not None else []) + ints
    machine = emulate(cap, buffers, seed=seed)
    t3 = time.perf_counter()
    steps = sum(w.steps for c in machine.ctas for w in c.warps)
    rec = cap.launches[0]
    return ForwardRun(out=out[0], lse=lse[0] if lse is not None else None, compile_s=t1 - t0,
                      emulate_s=t3 - t2, warp_steps=steps, kernel=cap.kernel,
                      launch={"grid": rec.grid, "block": rec.block, "cluster": rec.cluster,
                              "dynamic_smem": rec.dynamic_smem,
                              "regs_at_launch": cap.launch_regs})


def explore_delays(cfg, q, k, v, softmax_scale: Optional[float] = None, limit: int = 16,
                   ptx_edit=None) -> list:
    """The bounded systematic search of Note [Schedule policies]: run the forward once per
    schedule ``delay:N``, N = 0 .. limit - 1 (everything completes as early as possible except
    the N-th asynchronous operation issued, held until nothing else can move). Returns
    ``[(N, ForwardRun or the EmulationError)]``; the caller judges the runs."""
    from .memory import EmulationError

    out = []
    for n in range(limit):
        try:
            out.append((n, run_forward(cfg, q, k, v, softmax_scale, ptx_edit=ptx_edit,
                                       policy=f"delay:{n}")))
        except EmulationError as err:
            out.append((n, err))
    return out


def compare(run: ForwardRun, cfg, q, k, v, softmax_scale=None) -> dict:
    """Error rule against float64 (O and LSE) and bit equality with the numerics emulation."""
    from fa_sm100.emulation import emulate_sm100_fwd
    from fa_sm100.testing import attention_reference, check_against_reference, max_abs_error

    causal = cfg.causal
    ref, ref_lse = attention_reference(q, k, v, softmax_scale, causal=causal)
    plain, plain_lse = attention_reference(q, k, v, softmax_scale, causal=causal,
                                           dtype=q.dtype, upcast=False)
    res = {"err": max_abs_error(run.out, ref), "plain_err": max_abs_error(plain, ref)}
    rule = []
    try:
        check_against_reference(run.out, ref, plain, what="O")
    except AssertionError as e:
        rule.append(str(e))
    if run.lse is not None:
        res["lse_err"] = max_abs_error(run.lse, ref_lse)
        res["plain_lse_err"] = max_abs_error(plain_lse, ref_lse)
        try:
            check_against_reference(run.lse, ref_lse, plain_lse, atol=1e-4, what="LSE")
        except AssertionError as e:
            rule.append(str(e))
    res["rule_ok"] = not rule
    res["rule_failures"] = rule
    emu_out, emu_lse = emulate_sm100_fwd(q, k, v, softmax_scale, causal=causal, config=cfg)
    same = run.out.view(torch.int16) == emu_out.view(torch.int16)
    res["bit_identical_fraction"] = float(same.float().mean())
    diff = (run.out.float() - emu_out.float()).abs()
    res["max_diff_vs_numerics_emulation"] = float(diff.max())
    if run.lse is not None:
        res["lse_bit_identical_fraction"] = float(
            (run.lse.view(torch.int32) == emu_lse.view(torch.int32)).float().mean())
    return res
