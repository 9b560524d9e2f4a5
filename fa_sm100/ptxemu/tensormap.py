"""Decoding of the 128-byte tensor-map descriptors (CUtensorMap) found in kernel parameters.

The CUtensorMap format is opaque in NVIDIA's documentation. CuTe DSL 4.8 does not call
``cuTensorMapEncodeTiled``: its host code builds the descriptor bytes itself, so the
emulator decodes them. The field positions below were established here by compiling TMA
copies with varied dtype, rank (2-5), global shape, strides, box and swizzle and reading the
bytes the DSL's host code wrote (see tests/test_ptxemu_tma.py, which re-checks them against
the shapes they were built from). Bits outside the verified set must hold the values seen
in every sample; anything else is rejected rather than guessed.

    word 0      global address (16-byte aligned)
    word 1      bits 0-3 = 2, bits 4-6 rank - 1, bits 7-10 element type, bits 13-14 swizzle
                (0 none, 1 32B, 2 64B, 3 128B), bits 18-21 seen as 0b0001, 0b0111 and
                0b1001 (no effect modelled: L2 promotion or similar); bits 32-63 stride[1] >> 4
    word 2      stride[2] >> 4 (bits 0-31), stride[3] >> 4 (bits 32-63)
    word 3      stride[4] >> 4 (bits 0-31)
    word 4      dim[0] - 1 (bits 0-31), dim[1] - 1 (bits 32-63)
    word 5      dim[2] - 1, dim[3] - 1
    word 6      dim[4] - 1 (bits 0-31), box[0] - 1 (bits 56-63)
    word 7      box[1..4] - 1 (one byte each)
Strides are in bytes, dimensions and boxes in elements, innermost dimension first.
"""

from __future__ import annotations

import numpy as np

from .capture import TensorMap
from .memory import EmulationError

# element type code -> bytes (codes 0, 6, 7, 10 verified: u8, f16, f32, bf16)
ELEMENT_BYTES = {0: 1, 6: 2, 7: 4, 10: 2}


def decode_tensormap(raw: bytes) -> TensorMap:
    w = [int(x) for x in np.frombuffer(raw[:128], dtype=np.uint64)]
    lo1 = w[1] & 0xFFFFFFFF
    if lo1 & 0xF != 2 or (lo1 >> 11) & 0x3 or (lo1 >> 15) & 0x7 or lo1 >> 22:
        raise EmulationError(f"tensor-map word 1 {w[1]:#x} has bits outside the decoded subset")
    rank = ((lo1 >> 4) & 7) + 1
    code = (lo1 >> 7) & 0xF
    if code not in ELEMENT_BYTES:
        raise EmulationError(f"tensor-map element type code {code} is not decoded")
    half = [w[1] >> 32, w[2] & 0xFFFFFFFF, w[2] >> 32, w[3] & 0xFFFFFFFF]
    strides = tuple(h << 4 for h in half[:rank - 1])
    dims_raw = [w[4] & 0xFFFFFFFF, w[4] >> 32, w[5] & 0xFFFFFFFF, w[5] >> 32,
                w[6] & 0xFFFFFFFF]
    dims = tuple(d + 1 for d in dims_raw[:rank])
    boxes = [w[6] >> 56] + [(w[7] >> (8 * i)) & 0xFF for i in range(4)]
    box = tuple(b + 1 for b in boxes[:rank])
    tm = TensorMap(dtype=code, rank=rank, address=w[0], dims=dims, strides=strides, box=box,
                   element_strides=(1,) * rank, interleave=0, swizzle=(lo1 >> 13) & 3,
                   l2_promotion=0, oob_fill=0)
    tm.elem_size = ELEMENT_BYTES[code]
    return tm
