"""WGMMA from shared-memory descriptors built by hand: the forward's QK GEMM with ``raw_qk_desc``.

Note [Raw QK descriptors]
~~~~~~~~~~~~~~~~~~~~~~~~~
A WGMMA reads an SMEM operand through a 64-bit descriptor. For the K-major, 128-byte swizzled
tiles of Q and K (16-bit elements, head dims that are multiples of 64) it is

    bits  0-13  start address / 16          bits 32-45  SBO / 16 = 1024 / 16 (8 rows of 128 B)
    bits 16-29  LBO / 16 = 1 (unused here)  bits 62-63  1 = 128-byte swizzle

so the high word is one constant and every k-step of 16 elements only moves the start address:
by 32 bytes within a 64-column swizzle atom, and by rows x 128 bytes to the next atom. The
DSL's fragments add each k-step's offset to the whole 64-bit descriptor, and in the persistent
main loop ptxas neither keeps those descriptors nor the constant high word: per KV tile it
rebuilds K's base descriptor from the SMEM address and, per k-step, adds with carry into both
words and re-materialises the high word of A and B (about 60 uniform-datapath instructions of
the 445 at hdim 64). Here the low words are 32-bit sums (an SMEM address below 256 KiB cannot
carry into the high word) and the WGMMA is issued by inline PTX with the two descriptors, as
CUTLASS's C++ atoms do; the accumulator is the same register fragment in the same order (the
PTX fragment of m64nNk16: register i holds row lane/4 + 8 (i/2 mod 2), column 2 (lane mod 4) +
(i mod 2) + 8 (i/4) of the warp's 16 rows), so the softmax reads it unchanged.
"""

from __future__ import annotations

from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

SWIZZLE_BYTES = 128  # the swizzle atom's row: 64 16-bit elements
CORE_GROUP_BYTES = 8 * SWIZZLE_BYTES  # SBO: eight rows of the atom
K_STEP = 16  # elements of K per WGMMA
ELEMENT_BYTES = 2
DESC_UNIT = 16  # descriptor addresses and offsets count 16-byte units
LAYOUT_SWIZZLE_128B = 1
DESC_HI = (LAYOUT_SWIZZLE_128B << 30) | (CORE_GROUP_BYTES // DESC_UNIT)
DESC_LO_LBO = 1 << 16  # LBO = 16 bytes (ignored for swizzled K-major operands)
SMEM_ADDRESS_MASK = (1 << 18) - 1  # the 14-bit field holds address bits 4-17


def k_step_offset(k: int, rows: int) -> int:
    """Descriptor offset (16-byte units) of k-step ``k`` in a K-major tile of ``rows`` rows:
    four k-steps per 64-column swizzle atom, the atoms one after another (rows x 128 B)."""
    per_atom = SWIZZLE_BYTES // (K_STEP * ELEMENT_BYTES)
    atom, within = divmod(k, per_atom)
    return (atom * rows * SWIZZLE_BYTES + within * K_STEP * ELEMENT_BYTES) // DESC_UNIT


def desc_lo(smem_address) -> Int32:
    """The low word of the descriptor of a tile at ``smem_address`` (bytes, 1024-aligned)."""
    return ((Int32(smem_address) & SMEM_ADDRESS_MASK) >> 4) | DESC_LO_LBO


@dsl_user_op
def _desc(lo, *, loc=None, ip=None) -> Int64:
    """The 64-bit descriptor (``DESC_HI``, ``lo``) as one value for the ``l`` constraint."""
    return (Int64(DESC_HI) << 32) | (Int64(lo) & 0xFFFFFFFF)


@dsl_user_op
def wgmma_ss(acc, lo_a, lo_b, accumulate: bool, n: int, ab_type: str, *, loc=None,
             ip=None) -> None:
    """One ``wgmma.mma_async`` m64 x ``n`` x 16, float32 += ``ab_type`` x ``ab_type``, both
    operands K-major in SMEM at descriptor low words ``lo_a`` and ``lo_b``. ``acc`` is the
    thread's accumulator fragment (``n`` / 2 float32, PTX register order); with
    ``accumulate`` False it is overwritten (scale-d = 0). The caller fences, commits and
    waits as for any WGMMA."""
    regs = n // 2
    ops = [_desc(lo_a, loc=loc, ip=ip).ir_value(loc=loc, ip=ip),
           _desc(lo_b, loc=loc, ip=ip).ir_value(loc=loc, ip=ip)]
    d = ", ".join(f"${i}" for i in range(regs))
    scale_d = 1 if accumulate else 0
    asm = (f"{{\n.reg .pred p;\nsetp.ne.b32 p, {scale_d}, 0;\n"
           f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ab_type}.{ab_type} "
           f"{{{d}}}, ${regs}, ${regs + 1}, p, 1, 1, 0, 0;\n}}")
    constraints = ",".join(["=f"] * regs + ["l", "l"])
    if accumulate:  # the accumulator in, tied to the outputs
        ops += [Float32(acc[i]).ir_value(loc=loc, ip=ip) for i in range(regs)]
        constraints += "," + ",".join(str(i) for i in range(regs))
    res = llvm.inline_asm(llvm.StructType.get_literal([T.f32()] * regs), ops, asm, constraints,
                          has_side_effects=True, is_align_stack=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    for i in range(regs):
        acc[i] = Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip))


PTX_TYPES = {"bfloat16": "bf16", "float16": "f16"}
