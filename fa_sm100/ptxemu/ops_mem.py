"""Loads, stores and atomics on the param, global, shared (cta and cluster) and generic spaces."""

from __future__ import annotations

import numpy as np

from .decode import handler, last_type, mods, reader, unsupported, writer
from .memory import (CLUSTER_SHIFT, PARAM_GENERIC_BASE, PARAM_GENERIC_END,
                     SHARED_GENERIC_BASE, SHARED_GENERIC_END, EmulationError,
                     from_bytes, to_bytes)
from .parser import Addr, Imm, Reg, Sym
from .values import UINT, numpy_dtype, type_width

SPACES = ("param", "global", "shared", "shared::cta", "shared::cluster", "local", "const")


def space_of(ins) -> str:
    for p in ins.parts[1:]:
        if p in SPACES:
            return "shared" if p == "shared::cta" else p
    return "generic"


def address_reader(opnd, space: str, kernel):
    """Closure (m, w, idx) -> np.int64/uint64 addresses of an ``[base+offset]`` operand."""
    if not isinstance(opnd, Addr):
        raise EmulationError(f"expected an address operand, got {opnd}")
    off = opnd.offset
    base = opnd.base
    if isinstance(base, Sym):
        name = base.name

        def sym(m, w, idx):
            from .decode import symbol_address
            return np.full(len(idx), symbol_address(m, name, w) + off, dtype=np.int64)
        return sym
    if isinstance(base, Imm):
        return lambda m, w, idx: np.full(len(idx), base.value + off, dtype=np.int64)
    if isinstance(base, Reg):
        def reg(m, w, idx):
            r = w.reg(base)[idx]
            return (r.astype(np.uint64) + np.uint64(off & 0xFFFFFFFFFFFFFFFF)).astype(np.uint64) \
                if off >= 0 else r.astype(np.uint64) - np.uint64(-off)
        return reg
    raise EmulationError(f"unsupported address base {base}")


def resolve_shared(m, w, addr: np.ndarray, space: str):
    """Address -> list of (cta, offsets, lane selector) for shared / shared::cluster."""
    addr = addr.astype(np.int64)
    ranks = addr >> CLUSTER_SHIFT
    offs = addr & ((1 << CLUSTER_SHIFT) - 1)
    if space == "shared":
        if (ranks != w.cta.rank).any():
            raise EmulationError(f"shared::cta access at {int(addr[ranks != w.cta.rank][0]):#x}"
                                 f" is in another CTA's window (this is CTA {w.cta.rank})")
        return [(w.cta, offs, None)]
    if (ranks == ranks[0]).all():
        return [(m.cta_of_rank(int(ranks[0])), offs, None)]
    return [(m.cta_of_rank(int(r)), offs[ranks == r], ranks == r) for r in np.unique(ranks)]


def _window(generic: np.ndarray) -> np.ndarray:
    """Generic shared address -> shared window address."""
    return (generic - np.uint64(SHARED_GENERIC_BASE)).astype(np.int64)


def mem_read(m, w, space: str, addr: np.ndarray, width: int, what: str) -> np.ndarray:
    if space == "param":
        out = np.empty((len(addr), width), dtype=np.uint8)
        pb = m.launch.param_bytes
        for i, a in enumerate(addr.astype(np.int64)):
            if a < 0 or a + width > len(pb):
                raise EmulationError(f"{what}: param offset {a} outside the {len(pb)} bytes")
            out[i] = np.frombuffer(pb, dtype=np.uint8, count=width, offset=int(a))
        return out
    if space == "generic":
        a64 = addr.astype(np.uint64)
        if ((a64 >= np.uint64(PARAM_GENERIC_BASE)) & (a64 < np.uint64(PARAM_GENERIC_END))).all():
            return mem_read(m, w, "param", (a64 - np.uint64(PARAM_GENERIC_BASE)).astype(np.int64),
                            width, what)
        sh = (a64 >= np.uint64(SHARED_GENERIC_BASE)) & (a64 < np.uint64(SHARED_GENERIC_END))
        if sh.all():
            return mem_read(m, w, "shared", _window(a64), width, what)
        if not sh.any():
            return m.gmem.read(a64, width, what)
        out = np.empty((len(addr), width), dtype=np.uint8)
        out[sh] = mem_read(m, w, "shared", _window(a64[sh]), width, what)
        out[~sh] = m.gmem.read(a64[~sh], width, what)
        return out
    if space == "global":
        return m.gmem.read(addr.astype(np.uint64), width, what)
    if space in ("shared", "shared::cluster"):
        parts = resolve_shared(m, w, addr, space)
        if len(parts) == 1:
            cta, off, _ = parts[0]
            _check_pending(m, cta, off, width, what)
            return cta.smem.read(off, width, what)
        out = np.empty((len(addr), width), dtype=np.uint8)
        for cta, off, sel in parts:
            _check_pending(m, cta, off, width, what)
            out[sel] = cta.smem.read(off, width, what)
        return out
    raise EmulationError(f"{what}: state space .{space} is not modelled")


def thread_ids(w, idx) -> np.ndarray:
    """Cluster-wide ids (CTA rank * 1024 + thread) of lanes ``idx`` of warp ``w``."""
    return w.cta.rank * 1024 + w.tid_linear[np.asarray(idx)]


def mem_write(m, w, space: str, addr: np.ndarray, data: np.ndarray, what: str, writers=None):
    """A generic-proxy store; ``writers``: the storing threads' ids, one per row of ``data``
    (``thread_ids``), which Note [Async proxy] tracks until they fence."""
    if space == "generic":
        a64 = addr.astype(np.uint64)
        sh = (a64 >= np.uint64(SHARED_GENERIC_BASE)) & (a64 < np.uint64(SHARED_GENERIC_END))
        if sh.any():
            mem_write(m, w, "shared", _window(a64[sh]), data[sh], what,
                      None if writers is None else writers[sh])
        if (~sh).any():
            m.gmem.write(a64[~sh], data[~sh], what)
        return
    if space == "global":
        m.gmem.write(addr.astype(np.uint64), data, what)
        return
    if space in ("shared", "shared::cluster"):
        for cta, off, sel in resolve_shared(m, w, addr, space):
            _check_pending(m, cta, off, data.shape[1], what)
            check_pending_reads(cta, off, data.shape[1], what)
            who = writers if writers is None or sel is None else writers[sel]
            cta.smem.write(off, data if sel is None else data[sel], what, who)
        return
    raise EmulationError(f"{what}: stores to .{space} are not modelled")


def _check_pending(m, cta, off, width, what):
    """A region with an asynchronous write in flight (TMA load into SMEM) must not be
    touched by threads until the mbarrier that tracks it completes."""
    pend = getattr(cta, "pending_smem", None)
    if not pend:
        return
    lo, hi = int(off.min()), int(off.max()) + width
    for (a, b, desc) in pend:
        if lo < b and a < hi:
            overlap = ((off < b) & (off + width > a)).any()
            if overlap:
                raise EmulationError(f"{what}: shared memory [{a:#x}, {b:#x}) is accessed while "
                                     f"an asynchronous write to it is pending ({desc})")


def _vec_count(ins) -> int:
    for p in ins.parts:
        if p in ("v2", "v4", "v8"):
            return int(p[1])
    return 1


@handler("ld", "ldu")
def _ld(ins, k):
    typ = last_type(ins)
    space = space_of(ins)
    n = _vec_count(ins)
    width = type_width(typ) // 8 if typ != "pred" else 1
    addr = address_reader(ins.operands[1], space, k)
    wr = writer(ins.operands[0], typ)
    dt = UINT[width * 8]

    def run(m, w, idx):
        a = addr(m, w, idx)
        raw = mem_read(m, w, space, a, width * n, f"ld.{space}")
        vals = np.ascontiguousarray(raw).view(dt).reshape(len(idx), n)
        vals = vals.view(numpy_dtype(typ)) if numpy_dtype(typ) != dt and typ != "bf16" else vals
        wr(m, w, idx, vals if n > 1 else vals[:, 0])
    return run


@handler("st")
def _st(ins, k):
    typ = last_type(ins)
    space = space_of(ins)
    n = _vec_count(ins)
    width = type_width(typ) // 8
    addr = address_reader(ins.operands[0], space, k)
    val = reader(ins.operands[1], typ if typ != "bf16" else "b16", k)
    dt = UINT[width * 8]

    def run(m, w, idx):
        v = val(m, w, idx)
        v = np.ascontiguousarray(v.reshape(len(idx), n))
        data = v.astype(v.dtype, copy=False).view(np.uint8).reshape(len(idx), width * n) \
            if v.dtype.itemsize == width else v.astype(dt).view(np.uint8).reshape(len(idx), width * n)
        mem_write(m, w, space, addr(m, w, idx), data, f"st.{space}", thread_ids(w, idx))
    return run


_ATOM_OPS = {
    "add": lambda a, b: a + b, "min": np.minimum, "max": np.maximum, "and": lambda a, b: a & b,
    "or": lambda a, b: a | b, "xor": lambda a, b: a ^ b, "exch": lambda a, b: b,
    "inc": lambda a, b: np.where(a >= b, 0, a + 1).astype(a.dtype),
}


@handler("atom", "red")
def _atom(ins, k):
    """Atomics run lane by lane in lane order (any order is a valid serialization). A vector
    reduction (``red.global.add.v4.f32``) adds each element into its own word."""
    typ = last_type(ins)
    space = space_of(ins)
    is_red = ins.parts[0] == "red"
    op = next((p for p in ins.parts[1:] if p in _ATOM_OPS or p == "cas"), None)
    if op is None:
        unsupported(ins)
    nvec = next((int(p[1:]) for p in ins.parts[1:] if p in ("v2", "v4", "v8")), 1)
    if nvec > 1 and (not is_red or op == "cas"):
        unsupported(ins, "vector atomics are modelled for red only")
    width = type_width(typ) // 8
    a_op = ins.operands[0] if is_red else ins.operands[1]
    addr = address_reader(a_op, space, k)
    srcs = [reader(o, typ, k) for o in ins.operands[(1 if is_red else 2):]]
    wr = None if is_red else writer(ins.operands[0], typ)
    dt = numpy_dtype(typ)

    def run(m, w, idx):
        a = addr(m, w, idx)
        vals = [np.asarray(f(m, w, idx)) for f in srcs]
        old_all = np.empty(len(idx), dtype=dt)
        for i in range(len(idx)):
            one = a[i:i + 1]
            raw = mem_read(m, w, space, one, width * nvec, f"{ins.parts[0]}.{space}")
            old = np.ascontiguousarray(raw).view(dt).reshape(-1)
            if op == "cas":
                new = np.where(old == vals[0][i:i + 1], vals[1][i:i + 1], old)
            else:
                val = vals[0][i].reshape(-1) if nvec > 1 else vals[0][i:i + 1]
                with np.errstate(all="ignore"):
                    new = np.asarray(_ATOM_OPS[op](old, val)).astype(dt)
            mem_write(m, w, space, one, to_bytes(new.reshape(1, -1), dt), f"{ins.parts[0]}.{space}",
                      thread_ids(w, idx[i:i + 1]))
            old_all[i] = old[0]
        if wr is not None:
            wr(m, w, idx, old_all)
    return run


@handler("mapa")
def _mapa(ins, k):
    md = mods(ins)
    if "shared::cluster" not in md:
        unsupported(ins, "only mapa.shared::cluster is modelled")
    typ = last_type(ins)
    a = reader(ins.operands[1], typ, k)
    r = reader(ins.operands[2], "u32", k)
    wr = writer(ins.operands[0], typ)

    def run(m, w, idx):
        off = a(m, w, idx).astype(np.int64) & ((1 << CLUSTER_SHIFT) - 1)
        rank = r(m, w, idx).astype(np.int64)
        if (rank >= len(m.ctas)).any():
            raise EmulationError(f"mapa to CTA rank {int(rank.max())} outside the cluster")
        wr(m, w, idx, ((rank << CLUSTER_SHIFT) | off).astype(numpy_dtype(typ)))
    return run


# -----------------------------------------------------------------------------------------
# Shared memory an asynchronous operation has yet to read (TMA stores, MMA operands)


def _pending_reads(cta) -> list:
    if not hasattr(cta, "pending_smem_reads"):
        cta.pending_smem_reads = []
    return cta.pending_smem_reads


def add_pending_read(cta, lo: int, hi: int, desc: str):
    """Shared bytes [lo, hi) that an asynchronous operation (a TMA store, an MMA's operand)
    will read before it completes; returns the region for ``remove_pending_read``."""
    region = (lo, hi, desc, "read")
    _pending_reads(cta).append(region)
    return region


def remove_pending_read(cta, region):
    _pending_reads(cta).remove(region)


def check_pending_reads(cta, off, width, what):
    """Shared memory an asynchronous operation has not read yet (a TMA store's source, an
    MMA's operands from issue to completion) must not be overwritten, by threads or by a TMA
    load issued meanwhile."""
    pend = getattr(cta, "pending_smem_reads", None)
    if not pend:
        return
    for (a, b, desc, _) in pend:
        if ((off < b) & (off + width > a)).any():
            raise EmulationError(f"{what}: shared memory [{a:#x}, {b:#x}) is overwritten while "
                                 f"an asynchronous read of it is pending ({desc})")
