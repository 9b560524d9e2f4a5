"""Semantics of the arithmetic, conversion, data-movement and control instructions.

Integer ops wrap modulo 2^width as the ISA specifies; f32 add/sub/mul/fma (scalar and packed
f32x2) are computed exactly and rounded once with the instruction's rounding modifier (.rn
default, .rz, .rm, .rp; values.round_f32); ``.ftz`` flushes f32 subnormal inputs and results.
``ex2.approx``/``lg2.approx``/``rcp.approx``/``rsqrt.approx`` are modelled by the float64 function rounded once to float32: the hardware's
approximations differ from them by a few ulp, which the ISA leaves unspecified.
Synchronisation instructions live in ``ops_sync``; memory in ``ops_mem``.
"""

from __future__ import annotations

import numpy as np

from .decode import (_ERR, _post_float, _srcs, _unary, handler, last_type, mods, reader, types_of,
                     unsupported, writer)
from .memory import EmulationError
from .parser import Pair, Vec
from .values import (UINT, add_f32, bf16_to_f32, f32_to_bf16_rn, f32_to_bf16_rz,
                     f16_to_f32, f32_to_f16_rn, fma_f32, ftz32, mul_f32, numpy_dtype,
                     type_width)

from . import ops_bits, ops_mem, ops_sync, ops_tcgen05, ops_tma  # noqa: F401  (their handlers)



def _is_float(t):
    return t[0] == "f" and t not in ("f32x2",)


def _rnd(md) -> str:
    """The IEEE rounding modifier of a float instruction (default .rn)."""
    modes = [m for m in ("rn", "rz", "rm", "rp") if m in md]
    return modes[0] if modes else "rn"


def _f_add(x, y, md):
    return add_f32(x, y, _rnd(md)) if x.dtype == np.float32 else x + y


def _f_sub(x, y, md):
    return add_f32(x, -y, _rnd(md)) if x.dtype == np.float32 else x - y


def _f_mul(x, y, md):
    return mul_f32(x, y, _rnd(md)) if x.dtype == np.float32 else x * y


# -----------------------------------------------------------------------------------------
# Control


@handler("bra")
def _bra(ins, k):
    target = k.labels[ins.operands[0].name]

    def run(m, w, idx):
        w.pc[idx] = target
        return True
    return run


@handler("ret", "exit")
def _ret(ins, k):
    def run(m, w, idx):
        w.alive[idx] = False
        return True
    return run


@handler("trap")
def _trap(ins, k):
    def run(m, w, idx):
        raise EmulationError("trap executed")
    return run


# -----------------------------------------------------------------------------------------
# Moves and conversions


@handler("mov")
def _mov(ins, k):
    typ = last_type(ins)
    dst, src = ins.operands
    if isinstance(src, Vec):                       # pack {a, b} -> wide register
        n = len(src.items)
        part = f"b{type_width(typ) // n}"
        rd = [reader(o, part, k) for o in src.items]
        wr = writer(dst, typ)

        def pack(m, w, idx):
            acc = np.zeros(len(idx), dtype=np.uint64)
            for i, f in enumerate(rd):
                acc |= f(m, w, idx).astype(np.uint64) << np.uint64(i * type_width(part))
            wr(m, w, idx, acc.astype(UINT[type_width(typ)]))
        return pack
    if isinstance(dst, Vec):                       # unpack wide register -> {a, b}
        n = len(dst.items)
        part = f"b{type_width(typ) // n}"
        rs = reader(src, typ, k)
        wrs = [writer(o, part) for o in dst.items]

        def unpack(m, w, idx):
            v = rs(m, w, idx).view(UINT[type_width(typ)]).astype(np.uint64)
            for i, f in enumerate(wrs):
                f(m, w, idx, ((v >> np.uint64(i * type_width(part))) &
                              np.uint64((1 << type_width(part)) - 1)).astype(UINT[type_width(part)]))
        return unpack
    rs, wr = reader(src, typ, k), writer(dst, typ)

    def move(m, w, idx):
        wr(m, w, idx, rs(m, w, idx))
    return move


def _round_int(v, md):
    if "rni" in md:
        return np.rint(v)
    if "rzi" in md:
        return np.trunc(v)
    if "rmi" in md:
        return np.floor(v)
    if "rpi" in md:
        return np.ceil(v)
    return np.trunc(v)


@handler("cvt")
def _cvt(ins, k):
    ts = types_of(ins)
    md = mods(ins)
    if len(ts) != 2:
        unsupported(ins, "expected destination and source types")
    dt, st = ts
    dst = ins.operands[0]
    wr = writer(dst, dt)
    if dt in ("bf16x2", "f16x2"):                  # cvt.rn.bf16x2.f32 d, hi, lo
        if st != "f32" or "rn" not in md and "rz" not in md:
            unsupported(ins)
        hi, lo = reader(ins.operands[1], "f32", k), reader(ins.operands[2], "f32", k)
        conv = (f32_to_bf16_rn if "rn" in md else f32_to_bf16_rz) if dt == "bf16x2" else f32_to_f16_rn

        def packed(m, w, idx):
            a, b = conv(hi(m, w, idx)).astype(np.uint32), conv(lo(m, w, idx)).astype(np.uint32)
            wr(m, w, idx, (a << np.uint32(16)) | b)
        return packed
    rs = reader(ins.operands[1], st if st not in ("bf16",) else "b16", k)

    def to_f32(v):
        if st == "bf16":
            return bf16_to_f32(v)
        if st == "f16":
            return v.astype(np.float32)
        return v

    def run(m, w, idx):
        with np.errstate(**_ERR):
            v = to_f32(rs(m, w, idx))
            if dt == "bf16":
                if v.dtype.kind != "f":
                    v = v.astype(np.float32)
                out = f32_to_bf16_rz(v) if "rz" in md else f32_to_bf16_rn(v.astype(np.float32))
            elif dt == "f16":
                out = f32_to_f16_rn(v.astype(np.float32)).view(np.float16)
            elif _is_float(dt):
                if v.dtype.kind == "f" and any(r in md for r in ("rni", "rzi", "rmi", "rpi")):
                    v = _round_int(v, md)
                out = v.astype(numpy_dtype(dt))
                if dt == "f32" and "ftz" in md:
                    out = ftz32(out)
                if "sat" in md:
                    out = np.clip(np.nan_to_num(out, nan=0), 0, 1).astype(out.dtype)
            else:                                 # integer destination
                if v.dtype.kind == "f":
                    v = _round_int(v.astype(np.float64), md)
                    info = np.iinfo(numpy_dtype(dt))
                    v = np.where(np.isnan(v), 0, np.clip(v, info.min, info.max))
                    out = v.astype(numpy_dtype(dt))
                else:
                    if "sat" in md:
                        info = np.iinfo(numpy_dtype(dt))
                        v = np.clip(v.astype(np.int64) if v.dtype != np.uint64 else v,
                                    info.min, info.max)
                    out = v.astype(numpy_dtype(dt))
            wr(m, w, idx, out)
    return run


@handler("cvta")
def _cvta(ins, k):
    from .memory import PARAM_GENERIC_BASE, SHARED_GENERIC_BASE
    md = mods(ins)
    typ = last_type(ins)
    rs, wr = reader(ins.operands[1], typ, k), writer(ins.operands[0], typ)
    if "global" in md:
        return lambda m, w, idx: wr(m, w, idx, rs(m, w, idx))
    if any(s.startswith("shared") for s in md):
        base = np.uint64(SHARED_GENERIC_BASE)
    elif "param" in md:
        base = np.uint64(PARAM_GENERIC_BASE)
    else:
        unsupported(ins, "only the global, shared and param windows are modelled")
    if "to" in md:
        return lambda m, w, idx: wr(m, w, idx, (rs(m, w, idx).astype(np.uint64)
                                              - base).astype(numpy_dtype(typ)))
    return lambda m, w, idx: wr(m, w, idx, (rs(m, w, idx).astype(np.uint64)
                                          + base).astype(numpy_dtype(typ)))


# -----------------------------------------------------------------------------------------
# Integer and float arithmetic


def _binary(fn_int, fn_float=None, three_inputs=False):
    """Factory for two-source ops; ``three_inputs`` also accepts ``op d, a, b, c`` (sm_100's
    three-input min/max), applied as op(op(a, b), c). Any other operand count is refused."""
    def factory(ins, k):
        typ = last_type(ins)
        md = mods(ins)
        nsrc = len(ins.operands) - 1
        if nsrc != 2 and not (three_inputs and nsrc == 3):
            unsupported(ins, f"{nsrc} source operands")
        if "xorsign" in md or ("relu" in md and typ != "s32"):
            unsupported(ins, "modifier not modelled")
        if typ in ("f32x2",):
            if nsrc != 2:
                unsupported(ins, f"{nsrc} source operands")
            return _packed_f32x2(ins, k, fn_float)
        if _mixed_f32(ins) and fn_float in _MIXED_OK and nsrc == 2:  # add/sub.f32.bf16 d, a, c
            return _mixed_precision(ins, k, 1, lambda v, md: fn_float(v[0], v[1], md))
        if typ in ("bf16", "bf16x2", "f16x2"):
            unsupported(ins, "16-bit float arithmetic is not modelled yet")
        if "wide" in md:
            src_t = typ
            dst_t = typ[0] + str(2 * type_width(typ))
        else:
            src_t = dst_t = typ
        srcs = _srcs(ins, src_t, k)
        wr = writer(ins.operands[0], dst_t)
        if _is_float(typ):
            if fn_float is None:
                unsupported(ins)

            def runf(m, w, idx):
                with np.errstate(**_ERR):
                    vals = [f(m, w, idx) for f in srcs]
                    if typ == "f32" and "ftz" in md:
                        vals = [ftz32(v) for v in vals]
                    r = fn_float(vals[0], vals[1], md)
                    if len(vals) == 3:
                        r = fn_float(r, vals[2], md)
                        if "NaN" in md:              # NaN if any of the three is NaN
                            r = np.where(np.isnan(vals[0]) | np.isnan(vals[1]) |
                                         np.isnan(vals[2]), np.float32(np.nan), r).astype(r.dtype)
                    wr(m, w, idx, _post_float(ins, typ, r))
            return runf
        wide_t = numpy_dtype(dst_t)

        def runi(m, w, idx):
            with np.errstate(**_ERR):
                vals = [f(m, w, idx).astype(wide_t) for f in srcs]
                r = fn_int(vals[0], vals[1], md, typ)
                if len(vals) == 3:
                    r = fn_int(r, vals[2], md, typ)
                if "relu" in md:  # min/max.relu.s32: a negative result becomes 0
                    r = np.maximum(r, 0).astype(r.dtype)
                wr(m, w, idx, r)
        return runi
    return factory


def _mul_int(x, y, md, typ):
    width = type_width(typ)
    if "hi" in md:
        if width == 64:
            xs = [int(v) for v in x]
            ys = [int(v) for v in y]
            return np.array([((p * q) >> 64) & ((1 << 64) - 1) for p, q in zip(xs, ys)],
                            dtype=np.uint64).view(x.dtype)
        big = np.int64 if typ[0] == "s" else np.uint64
        return ((x.astype(big) * y.astype(big)) >> big(width)).astype(x.dtype)
    return x * y


def _shift_left(x, y, md, typ):
    wdt = type_width(typ)
    y = y.astype(np.uint64)
    big = y >= wdt
    r = x << np.minimum(y, wdt - 1).astype(x.dtype)
    return np.where(big, 0, r).astype(x.dtype)


def _shift_right(x, y, md, typ):
    wdt = type_width(typ)
    y = np.minimum(y.astype(np.uint64), wdt - 1 if typ[0] == "s" else wdt).astype(np.uint64)
    if typ[0] == "s":
        return (x >> y.astype(x.dtype)).astype(x.dtype)
    u = x.view(UINT[wdt]) if x.dtype.kind == "i" else x
    r = np.where(y >= wdt, 0, u >> np.minimum(y, wdt - 1).astype(u.dtype))
    return r.astype(u.dtype)


def _minmax(fn):
    def f(x, y, md, *rest):
        if x.dtype.kind == "f":
            r = fn(x, y)                           # fmin/fmax: NaN only if both are NaN
            if "NaN" in md:
                r = np.where(np.isnan(x) | np.isnan(y), np.float32(np.nan), r)
            return r.astype(x.dtype)
        return fn(x, y)
    return f


_MIXED_OK = (_f_add, _f_sub)  # the float ops with a mixed-precision .f32.{bf16,f16} form
handler("add")(_binary(lambda x, y, md, t: x + y, _f_add))
handler("sub")(_binary(lambda x, y, md, t: x - y, _f_sub))
handler("mul")(_binary(_mul_int, _f_mul))
handler("min")(_binary(_minmax(np.minimum), _minmax(np.fmin), three_inputs=True))
handler("max")(_binary(_minmax(np.maximum), _minmax(np.fmax), three_inputs=True))
# PTX: copysign.f32 d, a, b is b's magnitude with a's sign
handler("copysign")(_binary(None, lambda a, b, md: np.copysign(b, a).astype(b.dtype)))
handler("and")(_binary(lambda x, y, md, t: x & y))
handler("or")(_binary(lambda x, y, md, t: x | y))
handler("xor")(_binary(lambda x, y, md, t: x ^ y))
handler("shl")(_binary(_shift_left))
handler("shr")(_binary(_shift_right))
def _div_int(x, y, md, t):
    """Integer division truncating toward zero; division by zero gives 0 (the ISA leaves it
    unspecified)."""
    safe = np.where(y == 0, 1, y)
    q = x // safe if t[0] == "u" else np.fix(x / safe)
    return np.where(y == 0, 0, q).astype(x.dtype)


def _rem_int(x, y, md, t):
    return np.where(y == 0, 0, np.fmod(x, np.where(y == 0, 1, y))).astype(x.dtype)


handler("div")(_binary(_div_int, lambda x, y, md: x / y))
handler("rem")(_binary(_rem_int))


def _packed_f32x2(ins, k, fn):
    """add/sub/mul/fma .f32x2 on b64 registers that hold two f32 (low half = element 0)."""
    md = mods(ins)
    rs = [reader(o, "b64", k) for o in ins.operands[1:]]
    wr = writer(ins.operands[0], "b64")

    def split(v):
        return v.view(np.uint64).astype(np.uint64).view(np.uint32).reshape(-1, 2).view(np.float32)

    def run(m, w, idx):
        parts = [split(np.ascontiguousarray(f(m, w, idx))) for f in rs]
        with np.errstate(**_ERR):
            if "ftz" in md:
                parts = [ftz32(p) for p in parts]
            r = fn(*parts, md) if fn is not None else fma_f32(*parts, mode=_rnd(md))
            if "ftz" in md:
                r = ftz32(r)
        wr(m, w, idx, np.ascontiguousarray(r.astype(np.float32)).view(np.uint64).reshape(-1))
    return run


def _mixed_f32(ins):
    """The 16-bit source type of sm_100's mixed-precision float forms (``fma.rn.f32.bf16 d, a,
    b, c``, ``add.f32.f16 d, a, c``: the 16-bit sources widened exactly, the arithmetic and
    rounding those of f32), or None for a single-type instruction."""
    ts = types_of(ins)
    if len(ts) == 2 and ts[0] == "f32" and ts[1] in ("bf16", "f16"):
        return ts[1]
    return None


def _widened_reader(opnd, src_t, k):
    """Reader of a 16-bit float operand as exact float32 values."""
    bits = reader(opnd, "b16", k)
    widen = bf16_to_f32 if src_t == "bf16" else f16_to_f32
    return lambda m, w, idx: widen(bits(m, w, idx))


def _mixed_precision(ins, k, n16: int, fn):
    """``op.f32.{bf16,f16} d, s...``: the first ``n16`` sources are 16-bit floats, the rest
    f32; ``fn(values, md)`` computes the float32 result."""
    src_t = _mixed_f32(ins)
    md = mods(ins)
    if any(p in md for p in ("sat", "relu", "ftz")):
        unsupported(ins, "modifier not modelled with mixed precision")
    srcs = [(_widened_reader(o, src_t, k) if i < n16 else reader(o, "f32", k))
            for i, o in enumerate(ins.operands[1:])]
    wr = writer(ins.operands[0], "f32")

    def run(m, w, idx):
        with np.errstate(**_ERR):
            wr(m, w, idx, fn([f(m, w, idx) for f in srcs], md))
    return run


@handler("fma", "mad")
def _fma(ins, k):
    typ = last_type(ins)
    md = mods(ins)
    if typ == "f32x2":
        return _packed_f32x2(ins, k, None)
    if _mixed_f32(ins):  # a * b of two widened 16-bit values is exact in f32: one rounding
        return _mixed_precision(ins, k, 2, lambda v, md: fma_f32(v[0], v[1], v[2], mode=_rnd(md)))
    if typ in ("bf16", "f16", "bf16x2", "f16x2"):
        unsupported(ins, "16-bit float arithmetic is not modelled yet")
    if _is_float(typ):
        a, b, c = _srcs(ins, typ, k)
        wr = writer(ins.operands[0], typ)

        def runf(m, w, idx):
            x, y, z = a(m, w, idx), b(m, w, idx), c(m, w, idx)
            if typ == "f32" and "ftz" in md:
                x, y, z = ftz32(x), ftz32(y), ftz32(z)
            if typ == "f32":
                r = fma_f32(x, y, z, mode=_rnd(md))
            else:
                r = (x * y + z).astype(x.dtype)
            wr(m, w, idx, _post_float(ins, typ, r))
        return runf
    wide = "wide" in md
    dst_t = typ[0] + str(2 * type_width(typ)) if wide else typ
    a, b = _srcs(ins, typ, k)[:2]
    c = reader(ins.operands[3], dst_t, k)
    wr = writer(ins.operands[0], dst_t)
    dtp = numpy_dtype(dst_t)

    def runi(m, w, idx):
        with np.errstate(**_ERR):
            x, y = a(m, w, idx).astype(dtp), b(m, w, idx).astype(dtp)
            prod = _mul_int(x, y, md, typ) if "hi" in md else x * y
            wr(m, w, idx, prod + c(m, w, idx))
    return runi


# -----------------------------------------------------------------------------------------
# Comparisons and selects

_CMP = {
    "eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
    "gt": np.greater, "ge": np.greater_equal, "lo": np.less, "ls": np.less_equal,
    "hi": np.greater, "hs": np.greater_equal,
}


def _compare(cmp, x, y):
    if cmp in _CMP:
        r = _CMP[cmp](x, y)
        if cmp == "ne" and x.dtype.kind == "f":   # ordered not-equal
            r &= ~(np.isnan(x) | np.isnan(y))
        return r
    if cmp == "num":
        return ~(np.isnan(x) | np.isnan(y))
    if cmp == "nan":
        return np.isnan(x) | np.isnan(y)
    if cmp.endswith("u") and cmp[:-1] in _CMP:
        return _CMP[cmp[:-1]](x, y) | np.isnan(x) | np.isnan(y)
    raise EmulationError(f"unknown comparison {cmp}")


@handler("setp")
def _setp(ins, k):
    parts = ins.parts
    cmp = parts[1]
    typ = last_type(ins)
    md = mods(ins)
    a, b = reader(ins.operands[1], typ, k), reader(ins.operands[2], typ, k)
    bool_op = next((p for p in ("and", "or", "xor") if p in md), None)
    c = None
    if bool_op:
        c = reader(ins.operands[3], "pred", k)
    dst = ins.operands[0]
    wp = writer(dst.first if isinstance(dst, Pair) else dst, "pred")
    wq = writer(dst.second, "pred") if isinstance(dst, Pair) else None
    def run(m, w, idx):
        with np.errstate(**_ERR):
            x, y = a(m, w, idx), b(m, w, idx)
            if typ == "f32" and "ftz" in md:
                x, y = ftz32(x), ftz32(y)
            r = _compare(cmp, x, y)
            q = ~r
            if bool_op:
                cv = c(m, w, idx)
                f = {"and": np.logical_and, "or": np.logical_or, "xor": np.logical_xor}[bool_op]
                r, q = f(r, cv), f(q, cv)
            wp(m, w, idx, r)
            if wq is not None:
                wq(m, w, idx, q)
    return run


@handler("selp")
def _selp(ins, k):
    typ = last_type(ins)
    a, b = reader(ins.operands[1], typ, k), reader(ins.operands[2], typ, k)
    c = reader(ins.operands[3], "pred", k)
    wr = writer(ins.operands[0], typ)
    return lambda m, w, idx: wr(m, w, idx, np.where(c(m, w, idx), a(m, w, idx), b(m, w, idx)))


@handler("slct")
def _slct(ins, k):
    ts = types_of(ins)
    a, b = reader(ins.operands[1], ts[0], k), reader(ins.operands[2], ts[0], k)
    c = reader(ins.operands[3], ts[1], k)
    wr = writer(ins.operands[0], ts[0])
    return lambda m, w, idx: wr(m, w, idx, np.where(c(m, w, idx) >= 0, a(m, w, idx), b(m, w, idx)))


@handler("fence", "membar", "griddepcontrol")
def _fence(ins, k):
    """Memory is sequentially consistent here, so fences order nothing further, except
    ``fence.proxy.async`` (Note [Async proxy]): it makes the executing threads' generic stores
    to shared memory visible to the async proxy (TMA, tcgen05), in every CTA of the cluster
    (``.shared::cta`` and ``.shared::cluster`` alike: the model does not narrow the scope).
    ``fence.proxy.async.global`` orders global memory only and leaves shared memory as is."""
    if ins.opcode.startswith("fence.proxy.async") and ".global" not in ins.opcode:
        from .ops_mem import thread_ids

        def run(m, w, idx):
            ids = thread_ids(w, idx)
            for c in m.ctas:
                c.smem.fence_proxy_async(ids)
        return run
    return lambda m, w, idx: None


@handler("pmevent", "nanosleep")
def _nop(ins, k):
    return lambda m, w, idx: None


handler("neg")(_unary(lambda x: (0 - x).astype(x.dtype), lambda x: -x))
handler("abs")(_unary(lambda x: np.abs(x).astype(x.dtype), np.abs))
handler("not")(_unary(lambda x: ~x))
handler("cnot")(_unary(lambda x: (x == 0).astype(x.dtype)))
handler("ex2")(_unary(None, lambda x: np.exp2(x.astype(np.float64)).astype(np.float32)))
handler("lg2")(_unary(None, lambda x: np.log2(x.astype(np.float64)).astype(np.float32)))
handler("rcp")(_unary(None, lambda x: np.float32(1) / x))
handler("sqrt")(_unary(None, np.sqrt))
handler("rsqrt")(_unary(None, lambda x: (1.0 / np.sqrt(x.astype(np.float64))).astype(np.float32)))
handler("sin")(_unary(None, np.sin))
handler("cos")(_unary(None, np.cos))
