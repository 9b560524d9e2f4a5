"""FlashAttention-4's SM100 forward on the PTX emulator: a kernel this project did not write.

The emulator was built against this project's forward, so a clean run of ours could share our
misunderstandings of the ISA. FA4's forward (``flash_attn.cute.flash_fwd_sm100``, the
``flash-attn-4`` distribution, 4.0.0b36 here) is someone else's production kernel: if the
emulator runs it to the end and the result meets the float64 rule, the emulator's model of
tcgen05, TMA, mbarriers and the 2-CTA pair is the hardware's as far as FA4 relies on it.

``run_fa4_forward`` builds FA4's kernel object as FA4's interface does for a plain dense
problem, compiles it for sm_100a with CPU tensors (``from_dlpack``, without TVM FFI, so the
host code can be captured), runs the host code against the driver stand-in and the kernel on
the emulator. One substitution, as in ``fa_sm100.fa4_compare``: ``HardwareInfo`` (a driver
query) answers a fixed SM count (B200: 148), which FA4's persistent scheduler sizes its grid
with. Nothing in FA4's code is changed.

Which configs FA4 4.0.0b36 compiles and runs here is in tests/test_ptxemu_fa4.py; what it
took (register families inside inline asm, a TMEM A operand with a column offset, tcgen05.ld
results used before wait::ld) is in docs/ptx_emulator.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from fa_sm100.machines import B200_SMS

FA4_NUM_SMS = B200_SMS


class FA4Unavailable(RuntimeError):
    """flash-attn-4 (or what ``import flash_attn.cute`` needs) is not installed."""


@dataclass
class FA4Run:
    out: torch.Tensor
    lse: torch.Tensor
    launch: dict


def _cute(t: torch.Tensor, align: int = 16):
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t, assumed_align=align, enable_tvm_ffi=False).mark_layout_dynamic(
        leading_dim=t.ndim - 1)


def fa4_choices(seqlen_q: int, head_dim: int, head_dim_v: int, causal: bool) -> dict:
    """The kernel options FA4 4.0.0b36's ``_flash_attn_fwd`` picks for a dense problem on
    SM100 (its interface.py): 2-CTA instructions only without a causal mask at head dims
    128 / 192 (v: 128), or at 256; two Q stages when there is more than one 128-row tile
    (and v's head dim is not 256); static persistent scheduling without a causal mask (the
    LPT scheduler otherwise). So FA4 builds no 2-CTA causal kernel below head dim 256."""
    return {
        "use_2cta_instrs": (not causal and head_dim in (128, 192) and head_dim_v == 128)
                           or head_dim == 256,
        "q_stage": 2 if seqlen_q > 128 and head_dim_v != 256 else 1,
        "is_static_persistent": not causal,
    }


def run_fa4_forward(q, k, v, causal: bool = False, softmax_scale: Optional[float] = None,
                    policy: str = "late", seed: int = 0, strict_fences: bool = False) -> FA4Run:
    """FA4's SM100 forward on BSHD CPU tensors (bf16/fp16), emulated, with the options FA4's
    interface picks for the problem (``fa4_choices``). Returns O and LSE as the kernel wrote
    them."""
    try:
        import cuda.bindings.driver as cuda
        import cutlass
        from flash_attn.cute.flash_fwd_sm100 import AuxData, FlashAttentionForwardSm100
    except ImportError as err:
        raise FA4Unavailable(f"FA4's SM100 forward cannot be imported ({err}): pip install "
                             f"flash-attn-4==4.0.0b36 triton einops") from None
    from fa_sm100.fa4_compare import fixed_sm_count

    from .capture import capture_launch, compile_kernel
    from .emulator import emulate

    b, sq, hq, d = q.shape
    hk, dv = k.shape[2], v.shape[3]
    choices = fa4_choices(sq, d, dv, causal)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    out = torch.zeros(b, sq, hq, dv, dtype=q.dtype)
    lse = torch.zeros(b, hq, sq, dtype=torch.float32)
    kernel = FlashAttentionForwardSm100(d, dv, qhead_per_kvhead=hq // hk, is_causal=causal,
                                        m_block_size=128, n_block_size=128, **choices)
    # __call__'s positional parameters: Q, K, V, O, LSE, scale, then every optional input of a
    # varlen / paged / split / sparse problem (None or empty here), then the stream
    args = ([_cute(q), _cute(k), _cute(v), _cute(out), _cute(lse, align=4),
             cutlass.Float32(scale)] + [None] * 10 + [AuxData()] + [None] * 8
            + [cuda.CUstream(0)])
    with fixed_sm_count(FA4_NUM_SMS):
        compiled, ptx = compile_kernel(kernel, args)
        cap = capture_launch(kernel, None, args, compiled=compiled, ptx=ptx)
    emulate(cap, [q, k, v, out, lse], seed=seed, policy=policy, strict_fences=strict_fences)
    rec = cap.launches[0]
    return FA4Run(out=out, lse=lse, launch={"grid": rec.grid, "block": rec.block,
                                             "cluster": rec.cluster, **choices})
