"""Run the project's SM100 backward main kernel (``fa_sm100.sm100.bwd_kernel``) on the PTX
emulator.

``run_backward(cfg, q, k, v, dout)`` cross-compiles ``Sm100Backward(cfg)`` for sm_100a, makes
the preprocess's rows on the CPU (LSE2 = LSE log2(e) of the float64 reference forward, Delta =
rowsum(O dO) with O rounded to the input dtype, float32, padded as the preprocess pads them:
LSE2 = +inf and Delta = 0 past seqlen_q and on rows that see no key: the numerics emulation's
``emulation.backward.preprocess_rows``), executes the kernel's PTX on the emulator and returns
dq (= scale x the float32 accumulator, rounded as the postprocess rounds it), dk and dv as the
kernel wrote them. The preprocess and postprocess kernels are the Hopper ones
(tests/test_sm90_bwd_prepost_emulated.py runs them on the emulator).

Everything here is emulated: no SM100 code runs on hardware.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass

import torch

from fa_sm100.bands import kernel_window
from fa_sm100.emulation.backward import preprocess_rows
from fa_sm100.ptxemu.sm100_run import _to_cute

_COMPILED: dict = {}


@dataclass
class BackwardRun:
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor
    dq_acc: torch.Tensor
    # a deterministic config's dQ semaphores after the run (batch, heads, query blocks), else
    # None (Note [Deterministic dQ] in fa_sm100/sm100/bwd_dq.py)
    dq_sem: object
    launch: dict
    compile_s: float
    emulate_s: float
    # (key block, KV head, batch) -> the steps its CTA ran (query blocks x group heads): its
    # load warp's bulk copies of LSE2 and Delta, two a step
    steps: dict


class _ExecutionCounts:
    """A trace sink for ``emulate``: counts the executions of each (CTA, instruction) instead of
    keeping the trace (the emulator appends (cluster index, warp "cta<rank>.warp<w>", pc,
    lanes); a CTA is its cluster's index and its rank there)."""

    def __init__(self):
        self.by_pc = Counter()

    def append(self, event):
        rank = int(event[1][3:event[1].index(".")])
        self.by_pc[(event[0], rank), event[2]] += 1


def _steps_per_cta(counts: _ExecutionCounts, machine, grid, cluster=(1, 1, 1)) -> dict:
    """(key block, KV head, batch) -> steps, from the stats' bulk copies (not the tensor
    copies, whose number per tile depends on the head dim's swizzle boxes). Clusters of
    (cx, 1, 1) CTAs (the 2-CTA backward): the emulator runs cluster k's rank r as CTA x =
    k cx + r of its row."""
    copies = Counter()
    for (cta, pc), n in counts.by_pc.items():
        op = machine.code[pc].instr.opcode
        if op.startswith("cp.async.bulk.") and not op.startswith("cp.async.bulk.tensor"):
            copies[cta] += n
    gx, gy, gz = grid
    cx = cluster[0]
    if tuple(cluster[1:]) != (1, 1):
        raise ValueError(f"cluster {cluster}: only clusters along x are counted")
    steps = {}
    for i in range(gx // cx * gy * gz):
        kx, y, z = i % (gx // cx), i // (gx // cx) % gy, i // (gx // cx * gy)
        for r in range(cx):
            steps[kx * cx + r, y, z] = copies[i, r] // 2
    return steps


def compile_backward(cfg, num_heads: int):
    from fa_sm100.sm100.bwd_inspect_entry import fake_arguments
    from fa_sm100.sm100.bwd_kernel import Sm100Backward

    from .capture import compile_kernel
    key = (cfg, num_heads)
    if key not in _COMPILED:
        kernel = Sm100Backward(cfg)
        fake = fake_arguments(cfg, num_heads)
        compiled, ptx = compile_kernel(kernel, fake, "sm_100a")
        _COMPILED[key] = (kernel, fake, compiled, ptx)
    return _COMPILED[key]


def run_backward(cfg, q, k, v, dout, softmax_scale=None, seed: int = 0, policy: str = "late",
                 window=(None, None), softcap: float = 0.0) -> BackwardRun:
    """Emulate the compiled SM100 backward on contiguous BSHD CPU tensors (bf16/fp16).
    ``seed`` / ``policy``: the emulator's schedule (``machine`` Note [Schedule policies]).
    ``window``: the problem's (left, right), None unbounded (a windowed ``cfg.local`` kernel
    takes ``bands.kernel_window`` of it); ``softcap``: the cap of a ``cfg.softcap`` kernel."""
    import cuda.bindings.driver as cuda
    import cutlass

    from .capture import capture_launch
    from .emulator import emulate

    for name, t in (("q", q), ("k", k), ("v", v), ("dout", dout)):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous CPU tensor")
    want = {"bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.dtype]
    if any(t.dtype != want for t in (q, k, v, dout)):
        raise ValueError(f"the config is {cfg.dtype}, the inputs "
                         f"{sorted({str(t.dtype) for t in (q, k, v, dout)})}")
    if cfg.local != (tuple(window) != (None, None)) or cfg.softcap != (softcap > 0):
        raise ValueError(f"window={window}, softcap={softcap} with config.local={cfg.local}, "
                         f"config.softcap={cfg.softcap}: the config says whether there are")
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    t0 = time.perf_counter()
    kernel, fake, compiled, ptx = compile_backward(cfg, h)
    t1 = time.perf_counter()
    lse2, delta = preprocess_rows(q, k, v, dout, scale, cfg.causal, cfg.m_block, window,
                                  softcap)
    left, right = kernel_window(cfg.causal, window, sq, sk) if cfg.local else (0, 0)
    dq_acc = torch.zeros(b, h, lse2.shape[2], d, dtype=torch.float32)
    # NaN where the kernel must write: a row it leaves shows up
    dk = torch.full((b, sk, hk, d), float("nan"), dtype=q.dtype)
    dv = torch.full((b, sk, hk, v.shape[3]), float("nan"), dtype=q.dtype)
    tensors = [q, k, v, dout, lse2, delta, dq_acc, dk, dv]
    modes = [(0, 1)] * 4 + [(0, 2)] * 3 + [(0, 1)] * 2
    dq_sem = sem_cute = None
    if cfg.deterministic:  # zeroed, as the preprocess zeroes them
        dq_sem = torch.zeros(b, h, lse2.shape[2] // cfg.m_block, dtype=torch.int32)
        sem_cute = _to_cute(dq_sem, (0, 2), fake[9])
    real = (*(_to_cute(t, m, f) for t, m, f in zip(tensors, modes, fake)), sem_cute,
            cutlass.Float32(scale), cutlass.Float32(softcap), cutlass.Int32(left),
            cutlass.Int32(right), cuda.CUstream(0))
    cap = capture_launch(kernel, fake, real, compiled=compiled, ptx=ptx)
    t2 = time.perf_counter()
    counts = _ExecutionCounts()
    machine = emulate(cap, tensors + ([dq_sem] if cfg.deterministic else []), seed=seed,
                      policy=policy, trace=counts)
    t3 = time.perf_counter()
    dq = (dq_acc[:, :, :sq] * scale).permute(0, 2, 1, 3).to(q.dtype).contiguous()
    rec = cap.launches[0]
    return BackwardRun(dq=dq, dk=dk, dv=dv, dq_acc=dq_acc, dq_sem=dq_sem, compile_s=t1 - t0, emulate_s=t3 - t2,
                       steps=_steps_per_cta(counts, machine, rec.grid, rec.cluster),
                       launch={"grid": rec.grid, "block": rec.block,
                               "dynamic_smem": rec.dynamic_smem,
                               "regs_at_launch": cap.launch_regs})
