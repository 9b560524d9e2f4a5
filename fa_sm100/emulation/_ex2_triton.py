"""Triton kernel that runs one inline-PTX exp2 sequence elementwise (imported only on a GPU).

Kept apart from ``gpu_ex2`` so that importing the emulation never imports triton.
"""

import triton
import triton.language as tl


@triton.jit
def ex2_asm_kernel(x_ptr, y_ptr, n, ASM: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < n
    x = tl.load(x_ptr + offs, mask=live, other=0)  # int32 bit patterns of float32 inputs
    y = tl.inline_asm_elementwise(ASM, "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1)
    tl.store(y_ptr + offs, y, mask=live)
