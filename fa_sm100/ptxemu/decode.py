"""Pre-decoding of parsed instructions into executable ``Op`` objects.

Every instruction becomes an ``Op`` whose ``run(machine, warp, lanes)`` applies the guard
predicate, calls the opcode's handler (``ops.HANDLERS``) and advances the PC. Operand
readers and writers are closures built once here, so the hot loop does no string work.
An opcode without a handler raises ``UnsupportedInstruction`` naming the opcode and the
line, when the kernel is decoded (before anything runs).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from fa_sm100.machines import B200_SMS

from .memory import EmulationError
from .parser import Imm, Instr, Not, PtxKernel, Reg, Sink, Special, Sym, Vec
from .values import UINT, bits_to, ftz32, numpy_dtype, to_bits, type_width

HANDLERS: dict = {}          # root opcode -> factory(instr, ctx) -> handler(m, w, idx)


class UnsupportedInstruction(NotImplementedError):
    pass


def handler(*names):
    def deco(fn):
        for n in names:
            HANDLERS[n] = fn
        return fn
    return deco


class Op:
    __slots__ = ("instr", "fn", "collective", "members")

    def __init__(self, instr: Instr, fn, collective=None):
        self.instr = instr
        self.fn = fn
        self.collective = True if collective else None
        self.members = _member_mask if collective else None

    def run(self, m, w, idx):
        ins = self.instr
        if ins.pred is not None:
            p = w.reg(ins.pred)[idx]
            if ins.pred_neg:
                p = ~p
            if not p.all():
                w.pc[idx[~p]] += 1
                idx = idx[p]
                if len(idx) == 0:
                    return
        try:
            handled = self.fn(m, w, idx)
        except EmulationError as e:
            msg = str(e)
            if msg.startswith(f"{w.gid} line"):
                raise
            if msg.startswith(f"line {ins.line}: "):
                msg = msg[len(f"line {ins.line}: "):]
            raise EmulationError(f"{w.gid} line {ins.line} ({ins.text}): {msg}") from None
        if not handled:
            w.pc[idx] += 1


def _member_mask(w, group):
    return np.ones(32, dtype=bool)


def decode_kernel(kernel: PtxKernel) -> list:
    code = []
    for ins in kernel.instrs:
        root = ins.opcode.split(".")[0]
        factory = HANDLERS.get(root)
        if factory is None:
            raise UnsupportedInstruction(f"line {ins.line}: unsupported PTX instruction "
                                         f"{ins.opcode!r} ({ins.text})")
        op = factory(ins, kernel)
        if not isinstance(op, Op):
            op = Op(ins, op)
        code.append(op)
    return code


def unsupported(ins: Instr, why: str = ""):
    raise UnsupportedInstruction(f"line {ins.line}: unsupported PTX instruction "
                                 f"{ins.opcode!r}{': ' + why if why else ''} ({ins.text})")


# -----------------------------------------------------------------------------------------
# Operand access


def reader(opnd, typ: str, kernel: PtxKernel, undef_ok: bool = False) -> Callable:
    """Closure (m, w, idx) -> np.ndarray of ``typ`` values for the lanes ``idx``.

    Reading a register nothing wrote is an error, except with ``undef_ok`` (byte selects: LLVM
    passes undef registers to ``prmt`` for bytes the result's users ignore); such a read gives the
    register's current bits, and since definedness is tracked per register, not per byte, a
    prmt that really uses such a byte goes unnoticed."""
    if isinstance(opnd, Reg):
        name = opnd

        def read_reg(m, w, idx):
            if w.ld_regs and name.name in w.ld_regs:
                ld_data_used(w, name.name)
            r = w.reg(name)
            init = w.reg_init[name.name][idx]
            if not undef_ok and not init.all():
                raise EmulationError(f"register {name.name} is read before it was written "
                                     f"(lanes {idx[~init].tolist()[:8]})")
            return bits_to(typ, r[idx])
        return read_reg
    if isinstance(opnd, Imm):
        val = imm_value(opnd, typ)
        return lambda m, w, idx: np.full(len(idx), val, dtype=val.dtype)
    if isinstance(opnd, Special):
        return _special_reader(opnd.name, typ)
    if isinstance(opnd, Sym):
        name = opnd.name
        return lambda m, w, idx: np.full(len(idx), symbol_address(m, name, w),
                                         dtype=numpy_dtype(typ))
    if isinstance(opnd, Not):
        if typ != "pred":
            raise EmulationError(f"'!' applies to predicates only, not .{typ}")
        inner = reader(opnd.operand, "pred", kernel)
        return lambda m, w, idx: ~inner(m, w, idx)
    if isinstance(opnd, Vec):
        subs = [reader(o, typ, kernel) for o in opnd.items]
        return lambda m, w, idx: np.stack([f(m, w, idx) for f in subs], axis=1)
    raise EmulationError(f"operand {opnd} cannot be read as .{typ}")


def ld_data_used(w, name: str):
    """A register a pending ``tcgen05.ld`` wrote is read: its data has come back, so the load's
    read of TMEM is complete (Note [tcgen05.ld and wait::ld])."""
    tmem, entry = w.ld_regs[name]
    if entry in tmem.pending:
        tmem.pending.remove(entry)
    for other in [n for n, (_, e) in w.ld_regs.items() if e is entry]:
        del w.ld_regs[other]


def writer(opnd, typ: str) -> Callable:
    """Closure (m, w, idx, values) storing ``typ`` values into a register (or a sink)."""
    if isinstance(opnd, Sink):
        return lambda m, w, idx, v: None
    if isinstance(opnd, Reg):
        name = opnd

        def write(m, w, idx, v):
            r = w.reg(name)
            r[idx] = to_bits(typ, v, r.dtype)
            w.reg_init[name.name][idx] = True
            if w.ld_regs:
                w.ld_regs.pop(name.name, None)
        return write
    if isinstance(opnd, Vec):
        subs = [writer(o, typ) for o in opnd.items]

        def write_vec(m, w, idx, v):
            for k, f in enumerate(subs):
                f(m, w, idx, v[:, k])
        return write_vec
    raise EmulationError(f"operand {opnd} is not writable")


def imm_value(opnd: Imm, typ: str) -> np.ndarray:
    dt = numpy_dtype(typ)
    if opnd.is_float_bits == "f32":
        v = np.array([opnd.value], dtype=np.uint32).view(np.float32)[0]
        return np.array(v, dtype=dt) if np.dtype(dt).kind == "f" else np.array(opnd.value).astype(dt)
    if opnd.is_float_bits == "f64":
        v = np.array([opnd.value], dtype=np.uint64).view(np.float64)[0]
        return np.array(v, dtype=dt) if np.dtype(dt).kind == "f" else np.array(opnd.value).astype(dt)
    if typ == "pred":
        return np.array(bool(opnd.value))
    if np.dtype(dt).kind == "f":
        return np.array(float(opnd.value), dtype=dt)
    w = type_width(typ)
    return np.array(int(opnd.value) & ((1 << w) - 1), dtype=UINT[w]).view(dt)


def symbol_address(m, name: str, w=None) -> int:
    """A shared variable's window address (with the CTA's rank bits) or a parameter's
    offset in the parameter space (``mov.b64 %rd, param`` then ``cvta.param``)."""
    from .memory import CLUSTER_SHIFT
    off = m.launch.shared_offsets.get(name)
    if off is not None:
        return off | ((w.cta.rank if w is not None else 0) << CLUSTER_SHIFT)
    if name in m.launch.param_offsets:
        return m.launch.param_offsets[name]
    raise EmulationError(f"unknown symbol {name!r}")


def _special_reader(name: str, typ: str):
    base, _, comp = name.partition(".")
    axis = {"x": 0, "y": 1, "z": 2, "": 0}.get(comp, 0)
    dt = numpy_dtype(typ)

    def full(v):
        return lambda m, w, idx: np.full(len(idx), v(m, w), dtype=np.int64).astype(dt)

    if base == "%tid":
        def tid(m, w, idx):
            bx, by, _ = m.launch.block
            t = w.tid_linear[idx]
            return np.stack([t % bx, (t // bx) % by, t // (bx * by)])[axis].astype(dt)
        return tid
    if base == "%laneid":
        return lambda m, w, idx: idx.astype(dt)
    if base.startswith("%lanemask_"):
        kind = base[len("%lanemask_"):]
        ops = {"eq": lambda l: 1 << l, "lt": lambda l: (1 << l) - 1,
               "le": lambda l: (2 << l) - 1, "gt": lambda l: (0xFFFFFFFF << (l + 1)) & 0xFFFFFFFF,
               "ge": lambda l: (0xFFFFFFFF << l) & 0xFFFFFFFF}[kind]
        return lambda m, w, idx: np.array([ops(int(l)) for l in idx], dtype=np.uint64).astype(dt)
    table: dict = {
        "%ntid": lambda m, w: m.launch.block[axis],
        "%ctaid": lambda m, w: w.cta.ctaid[axis],
        "%nctaid": lambda m, w: m.launch.grid[axis],
        "%warpid": lambda m, w: w.wid,
        "%nwarpid": lambda m, w: len(w.cta.warps),
        "%cluster_ctarank": lambda m, w: w.cta.rank,
        "%cluster_nctarank": lambda m, w: len(m.ctas),
        "%cluster_ctaid": lambda m, w: w.cta.ctaid[axis] % m.launch.cluster[axis],
        "%cluster_nctaid": lambda m, w: m.launch.cluster[axis],
        "%clusterid": lambda m, w: m.cluster_id[axis],
        "%nclusterid": lambda m, w: m.launch.grid[axis] // m.launch.cluster[axis],
        "%is_explicit_cluster": lambda m, w: int(m.launch.cluster != (1, 1, 1)),
        "%dynamic_smem_size": lambda m, w: m.launch.dynamic_smem,
        "%total_smem_size": lambda m, w: w.cta.smem.size,
        "%aggr_smem_size": lambda m, w: w.cta.smem.size,
        "%smid": lambda m, w: w.cta.rank,
        "%nsmid": lambda m, w: B200_SMS,
        "%gridid": lambda m, w: 0,
        "%clock": lambda m, w: w.steps,
        "%clock64": lambda m, w: w.steps,
        "%globaltimer": lambda m, w: w.steps,
        "%globaltimer_lo": lambda m, w: w.steps,
        "%globaltimer_hi": lambda m, w: 0,
    }
    if base not in table:
        raise UnsupportedInstruction(f"special register {name} is not modelled")
    return full(table[base])


# -----------------------------------------------------------------------------------------
# Opcode parsing helpers


TYPES = {"b8", "b16", "b32", "b64", "b128", "u8", "u16", "u32", "u64", "s8", "s16", "s32",
         "s64", "f16", "f16x2", "bf16", "bf16x2", "f32", "f64", "pred", "f32x2", "tf32",
         "e4m3", "e5m2", "e4m3x2", "e5m2x2"}


def types_of(ins: Instr) -> list:
    return [p for p in ins.parts[1:] if p in TYPES]


def last_type(ins: Instr) -> str:
    t = types_of(ins)
    if not t:
        unsupported(ins, "no operand type")
    return t[-1]


def mods(ins: Instr) -> set:
    return set(ins.parts[1:])


# -----------------------------------------------------------------------------------------
# Helpers of the handler factories (ops*.py)

_ERR = dict(all="ignore")  # NumPy float errors: the emulated hardware raises none


def _srcs(ins, typ, kernel, first=1):
    return [reader(o, typ, kernel) for o in ins.operands[first:]]


def _post_float(ins, typ, v):
    md = mods(ins)
    if typ == "f32" and "ftz" in md:
        v = ftz32(v)
    if "sat" in md:
        v = np.where(np.isnan(v), 0, np.clip(v, 0, 1)).astype(v.dtype)
    return v


def _unary(fn_int, fn_float=None):
    def factory(ins, k):
        typ = last_type(ins)
        md = mods(ins)
        a = reader(ins.operands[1], typ, k)
        wr = writer(ins.operands[0], typ)

        def run(m, w, idx):
            with np.errstate(**_ERR):
                x = a(m, w, idx)
                if x.dtype.kind == "f":
                    if fn_float is None:
                        unsupported(ins)
                    if typ == "f32" and "ftz" in md:
                        x = ftz32(x)
                    r = _post_float(ins, typ, np.asarray(fn_float(x)).astype(x.dtype))
                else:
                    r = fn_int(x)
                wr(m, w, idx, r)
        return run
    return factory
