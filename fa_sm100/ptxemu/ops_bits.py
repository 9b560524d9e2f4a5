"""Bit-manipulation instructions: popc, clz, brev, bfe, bfi, prmt (default mode), lop3, and
the packed integer dot products dp2a / dp4a (which LLVM also uses for index arithmetic)."""

from __future__ import annotations

import numpy as np

from .decode import _srcs, _unary, handler, last_type, mods, reader, unsupported, writer
from .values import UINT, numpy_dtype, type_width


def _popc(x):
    bits = x.view(UINT[x.dtype.itemsize * 8])
    return np.array([bin(int(v)).count("1") for v in bits], dtype=x.dtype)


handler("popc")(_unary(_popc))


@handler("clz")
def _clz(ins, k):
    typ = last_type(ins)
    a, wr = reader(ins.operands[1], typ, k), writer(ins.operands[0], "u32")
    wdt = type_width(typ)
    return lambda m, w, idx: wr(m, w, idx, np.array(
        [wdt - int(v).bit_length() for v in a(m, w, idx).view(UINT[wdt])], dtype=np.uint32))


@handler("brev")
def _brev(ins, k):
    typ = last_type(ins)
    a, wr = reader(ins.operands[1], typ, k), writer(ins.operands[0], typ)
    wdt = type_width(typ)
    return lambda m, w, idx: wr(m, w, idx, np.array(
        [int(format(int(v), f"0{wdt}b")[::-1], 2) for v in a(m, w, idx).view(UINT[wdt])],
        dtype=UINT[wdt]))


@handler("bfe")
def _bfe(ins, k):
    typ = last_type(ins)
    wdt = type_width(typ)
    a = reader(ins.operands[1], typ, k)
    pos, ln = reader(ins.operands[2], "u32", k), reader(ins.operands[3], "u32", k)
    wr = writer(ins.operands[0], typ)

    def run(m, w, idx):
        x = a(m, w, idx).view(UINT[wdt]).astype(np.uint64)
        p = np.minimum(pos(m, w, idx).astype(np.uint64) & 0xFF, wdt)
        n = np.minimum(ln(m, w, idx).astype(np.uint64) & 0xFF, wdt)
        field = (x >> np.minimum(p, 63)) & ((np.uint64(1) << np.minimum(n, 63)) - np.uint64(1))
        field = np.where(p >= wdt, 0, field)
        if typ[0] == "s":
            sbit = np.where(n == 0, 0, (field >> np.maximum(n, 1) - 1) & 1)
            field = np.where(sbit == 1, field | (~((np.uint64(1) << n) - np.uint64(1))), field)
        if wdt < 64:
            field = field & np.uint64((1 << wdt) - 1)
        wr(m, w, idx, field.astype(UINT[wdt]).view(numpy_dtype(typ)))
    return run


@handler("bfi")
def _bfi(ins, k):
    typ = last_type(ins)
    wdt = type_width(typ)
    a, b = reader(ins.operands[1], typ, k), reader(ins.operands[2], typ, k)
    pos, ln = reader(ins.operands[3], "u32", k), reader(ins.operands[4], "u32", k)
    wr = writer(ins.operands[0], typ)

    def run(m, w, idx):
        x, y = a(m, w, idx).astype(np.uint64), b(m, w, idx).astype(np.uint64)
        p = pos(m, w, idx).astype(np.uint64) & 0xFF
        n = ln(m, w, idx).astype(np.uint64) & 0xFF
        mask = (((np.uint64(1) << np.minimum(n, 63)) - np.uint64(1)) << np.minimum(p, 63))
        mask = np.where(p >= wdt, 0, mask) & np.uint64((1 << min(wdt, 64)) - 1)
        wr(m, w, idx, ((y & ~mask) | ((x << np.minimum(p, 63)) & mask)).astype(UINT[wdt]))
    return run


def _lanes(x: np.ndarray, bits: int, signed: bool) -> list:
    """The 32 // bits packed lanes of u32 values, low lane first, as int64."""
    x = x.astype(np.uint32).astype(np.int64)
    out = []
    for i in range(32 // bits):
        v = (x >> (bits * i)) & ((1 << bits) - 1)
        out.append(np.where(v >= 1 << (bits - 1), v - (1 << bits), v) if signed else v)
    return out


@handler("dp2a", "dp4a")
def _dot_packed(ins, k):
    """``dp4a.atype.btype d, a, b, c``: d = c + sum of the 4 byte products of a and b;
    ``dp2a.{lo,hi}.atype.btype d, a, b, c``: d = c + the two 16-bit lanes of a times bytes
    0, 1 (.lo) or 2, 3 (.hi) of b. Bytes and halves are signed for .s32 operands; the sum
    wraps at 32 bits."""
    ts = [t for t in ins.parts[1:] if t in ("u32", "s32")]
    if len(ts) != 2:
        unsupported(ins, "expected two integer operand types")
    a_t, b_t = ts
    md = mods(ins)
    a, b, c = (reader(o, t, k) for o, t in zip(ins.operands[1:], (a_t, b_t, "u32")))
    wr = writer(ins.operands[0], "u32")
    two = ins.parts[0] == "dp2a"
    if two and not ({"lo", "hi"} & md):
        unsupported(ins, "dp2a needs .lo or .hi")
    hi = "hi" in md

    def run(m, w, idx):
        xa = _lanes(a(m, w, idx).view(np.uint32), 16 if two else 8, a_t == "s32")
        xb = _lanes(b(m, w, idx).view(np.uint32), 8, b_t == "s32")
        if two:
            xb = xb[2:] if hi else xb[:2]
        acc = c(m, w, idx).view(np.uint32).astype(np.int64)
        for p, q in zip(xa, xb):
            acc = acc + p * q
        wr(m, w, idx, (acc & 0xFFFFFFFF).astype(np.uint32))
    return run


@handler("prmt")
def _prmt(ins, k):
    md = mods(ins)
    if md - {"b32"}:
        unsupported(ins, "only the default prmt mode is modelled")
    # LLVM feeds undef registers to prmt for bytes no later instruction uses (in the SM90 dQ
    # postprocess, two instructions later: a dp2a.lo that ignores them). Registers carry no
    # per-byte definedness here, so a prmt that really uses a never-written byte is not
    # caught either.
    a, b = (reader(o, "b32", k, undef_ok=True) for o in ins.operands[1:3])
    c = reader(ins.operands[3], "b32", k)
    wr = writer(ins.operands[0], "b32")

    def run(m, w, idx):
        x = a(m, w, idx).astype(np.uint64) | (b(m, w, idx).astype(np.uint64) << np.uint64(32))
        sel = c(m, w, idx).astype(np.uint64)
        out = np.zeros(len(idx), dtype=np.uint64)
        for i in range(4):
            s = (sel >> np.uint64(4 * i)) & np.uint64(0xF)
            byte = (x >> ((s & np.uint64(7)) * np.uint64(8))) & np.uint64(0xFF)
            sign = np.where((byte & np.uint64(0x80)) != 0, np.uint64(0xFF), np.uint64(0))
            byte = np.where((s & np.uint64(8)) != 0, sign, byte)
            out |= byte << np.uint64(8 * i)
        wr(m, w, idx, out.astype(np.uint32))
    return run


@handler("lop3")
def _lop3(ins, k):
    typ = last_type(ins)
    a, b, c = _srcs(ins, typ, k)[:3]
    lut = ins.operands[4].value
    wr = writer(ins.operands[0], typ)

    def run(m, w, idx):
        x, y, z = a(m, w, idx), b(m, w, idx), c(m, w, idx)
        out = np.zeros_like(x)
        for i in range(8):
            if lut >> i & 1:
                tx = x if i & 4 else ~x
                ty = y if i & 2 else ~y
                tz = z if i & 1 else ~z
                out |= tx & ty & tz
        wr(m, w, idx, out)
    return run
