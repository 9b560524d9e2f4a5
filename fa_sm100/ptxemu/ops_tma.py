"""TMA: ``cp.async.bulk.tensor`` loads (global -> shared, with multicast and cta_group::2) and
stores (shared -> global, bulk groups), through the tensor maps recorded at the
``cuTensorMapEncodeTiled`` call; and the per-thread ``cp.async`` copies (global -> shared, 4,
8 or 16 bytes, zero-filled past ``src-size``) with their commit and wait groups.

A load is asynchronous: at issue its destination region is marked pending (a thread that
touches it before the copy lands is an error) and an ``AsyncOp`` is queued; when the
scheduler runs it, the box is gathered from global memory (out-of-bounds elements are
zero-filled), written to shared memory with the tensor map's swizzle applied to the shared
addresses, and ``complete_tx`` of the box's bytes is signalled on the mbarrier. A store reads
its shared source when it runs (the source is pending-read until then: a thread writing it is
an error) and writes only the in-bounds elements.
"""

from __future__ import annotations

import numpy as np

from .capture import TMAP_MAGIC
from .decode import handler, mods, reader, unsupported
from .memory import CLUSTER_SHIFT, PARAM_GENERIC_BASE, EmulationError
from .ops_mem import (add_pending_read, address_reader, check_pending_reads,
                      remove_pending_read, resolve_shared)
from .ops_sync import get_mbarrier
from .parser import TensorRef
from .tensormap import decode_tensormap
from .waits import AsyncOp, PredWait

SWIZZLE_BYTES = {0: 0, 1: 32, 2: 64, 3: 128}


def swizzle(addr: np.ndarray, span: int) -> np.ndarray:
    """CuTe Swizzle<B,4,3> on shared addresses: 16-byte chunk bits 4.. XOR row bits 7.. ."""
    if span == 0:
        return addr
    bits = {32: 1, 64: 2, 128: 3}[span]
    mask = ((1 << bits) - 1) << 7
    return addr ^ ((addr & mask) >> 3)


def tensormap_of(m, w, generic_addr: int, where: str):
    off = int(generic_addr) - PARAM_GENERIC_BASE
    if not 0 <= off <= len(m.launch.param_bytes) - 16:
        raise EmulationError(f"{where}: tensor map address {int(generic_addr):#x} is not a kernel "
                             "parameter (only __grid_constant__ tensor maps are modelled)")
    magic, ident = np.frombuffer(m.launch.param_bytes, dtype=np.uint64, count=2, offset=off)
    if int(magic) == TMAP_MAGIC and int(ident) in m.launch.tensormaps:
        return m.launch.tensormaps[int(ident)]
    cache = m.__dict__.setdefault("tensormap_cache", {})
    if off not in cache:
        if off % 64 or off + 128 > len(m.launch.param_bytes):
            raise EmulationError(f"{where}: parameter offset {off} cannot hold a 64-byte "
                                 "aligned 128-byte tensor map")
        try:
            cache[off] = decode_tensormap(m.launch.param_bytes[off:off + 128])
        except EmulationError as e:
            raise EmulationError(f"{where}: parameter at offset {off}: {e}") from None
    return cache[off]


def box_offsets(tm, coords):
    """Global byte offsets (flattened in box order, innermost fastest) and the in-bounds mask."""
    e = tm.elem_bytes
    if e == 0:
        raise EmulationError(f"tensor-map data type {tm.dtype} is not modelled")
    if tm.interleave != 0:
        raise EmulationError("interleaved tensor maps are not modelled")
    if any(s != 1 for s in tm.element_strides):
        raise EmulationError("tensor maps with element strides != 1 are not modelled")
    strides = (e,) + tuple(tm.strides)
    grids = np.meshgrid(*[np.arange(b) + c for b, c in zip(tm.box[::-1], coords[::-1])],
                        indexing="ij")                   # outermost first
    grids = grids[::-1]                                  # back to innermost first
    off = np.zeros(grids[0].shape, dtype=np.int64)
    ok = np.ones(grids[0].shape, dtype=bool)
    for d, g in enumerate(grids):
        off += g.astype(np.int64) * strides[d]
        ok &= (g >= 0) & (g < tm.dims[d])
    return off.reshape(-1), ok.reshape(-1)


def _smem_byte_index(tm, dst_off: int, nelem: int) -> np.ndarray:
    e = tm.elem_bytes
    span = SWIZZLE_BYTES.get(tm.swizzle)
    if span is None:
        raise EmulationError(f"tensor-map swizzle mode {tm.swizzle} is not modelled")
    if span and tm.box[0] * e > span:
        raise EmulationError(f"box inner dimension {tm.box[0] * e} bytes exceeds the {span}-byte "
                             "swizzle span")
    align = 128 if span else 16
    if dst_off % align:
        raise EmulationError(f"TMA shared-memory address {dst_off:#x} is not {align}-byte "
                             f"aligned{' (required with a swizzle)' if span else ''}")
    lin = dst_off + np.arange(nelem * e, dtype=np.int64)
    return swizzle(lin, span)


@handler("prefetch", "prefetchu")
def _prefetch(ins, k):
    if "tensormap" not in mods(ins):
        return lambda m, w, idx: None
    addr = address_reader(ins.operands[0], "generic", k)

    def run(m, w, idx):
        for a in addr(m, w, idx):
            tensormap_of(m, w, int(a), f"line {ins.line}")
    return run


@handler("cp")
def _cp(ins, k):
    md = mods(ins)
    parts = ins.parts
    if parts[1] == "async" and parts[2] != "bulk":
        return _cp_async(ins, k)
    if parts[1:3] != ["async", "bulk"]:
        unsupported(ins, "only cp.async and cp.async.bulk* are modelled")
    if "commit_group" in md:
        return _commit_group(ins)
    if "wait_group" in md:
        return _wait_group(ins, k)
    if "tensor" not in md:
        if len(parts) > 4 and parts[3].startswith("shared") and parts[4] == "global":
            return _bulk_load(ins, k)
        unsupported(ins, "of the non-tensor bulk copies only global -> shared loads are "
                         "modelled")
    if "tile" not in md:
        unsupported(ins, "only the tile load mode is modelled")
    if len(parts) > 5 and parts[5] == "global":
        return _tma_store(ins, k)
    return _tma_load(ins, k)


def _tma_load(ins, k):
    md = mods(ins)
    where = f"line {ins.line}"
    dst = address_reader(ins.operands[0], "shared::cluster", k)
    ref = ins.operands[1]
    if not isinstance(ref, TensorRef):
        unsupported(ins, "expected [tensorMap, {coords}]")
    tmap = reader(ref.tmap, "u64", k)
    coords = [reader(c, "s32", k) for c in ref.coords[0].items] if len(ref.coords) == 1 and \
        hasattr(ref.coords[0], "items") else [reader(c, "s32", k) for c in ref.coords]
    mbar = address_reader(ins.operands[2], "shared::cluster", k)
    multicast = "multicast::cluster" in md
    mask_r = reader(ins.operands[3], "u16", k) if multicast else None
    pair = "cta_group::2" in md

    def run(m, w, idx):
        d_all, t_all, b_all = dst(m, w, idx), tmap(m, w, idx), mbar(m, w, idx)
        c_all = [c(m, w, idx) for c in coords]
        masks = mask_r(m, w, idx) if multicast else None
        for i in range(len(idx)):
            tm = tensormap_of(m, w, int(t_all[i]), where)
            if len(c_all) != tm.rank:
                raise EmulationError(f"{where}: {len(c_all)} coordinates for a rank-{tm.rank} "
                                     "tensor map")
            co = [int(c[i]) for c in c_all]
            d_addr, b_addr = int(d_all[i]), int(b_all[i])
            ranks = ([r for r in range(len(m.ctas)) if int(masks[i]) >> r & 1] if multicast
                     else [d_addr >> CLUSTER_SHIFT])
            off, ok = box_offsets(tm, co)
            nbytes = off.size * tm.elem_bytes
            dst_off = d_addr & ((1 << CLUSTER_SHIFT) - 1)
            targets = []
            for r in ranks:
                cta = m.cta_of_rank(r)
                if multicast or pair:
                    b_rank = ((r & ~1) | ((b_addr >> CLUSTER_SHIFT) & 1)) if pair else r
                else:
                    b_rank = b_addr >> CLUSTER_SHIFT
                b_cluster = (b_rank << CLUSTER_SHIFT) | (b_addr & ((1 << CLUSTER_SHIFT) - 1))
                mb = get_mbarrier(m, w, b_cluster, "shared::cluster", where)
                desc = f"TMA load by {w.gid} (line {ins.line})"
                # the load may land at any time from now on: a read still pending there (an
                # MMA's operand, a TMA store's source) races with it
                check_pending_reads(cta, np.asarray([dst_off]), nbytes, f"{where}: {desc}")
                region = (dst_off, dst_off + nbytes, desc)
                _pending(cta).append(region)
                targets.append((cta, mb, region))
            m.async_ops.append(AsyncOp(
                lambda tm=tm, off=off, ok=ok, targets=targets, dst_off=dst_off, nbytes=nbytes:
                _land(m, tm, off, ok, targets, dst_off, nbytes, where),
                f"TMA load to shared {dst_off:#x} ({nbytes} bytes) issued at line {ins.line}"))
    return run


def _bulk_load(ins, k):
    """``cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [dst], [src], size,
    [mbar]``: ``size`` contiguous bytes of global memory land in this CTA's shared memory at
    some later time and complete ``size`` transaction bytes on the mbarrier (as a TMA load)."""
    where = f"line {ins.line}"
    dst = address_reader(ins.operands[0], "shared::cluster", k)
    src = address_reader(ins.operands[1], "global", k)
    size = reader(ins.operands[2], "u32", k)
    mbar = address_reader(ins.operands[3], "shared::cluster", k)

    def run(m, w, idx):
        d_all, s_all, n_all, b_all = dst(m, w, idx), src(m, w, idx), size(m, w, idx), mbar(m, w, idx)
        for i in range(len(idx)):
            d_addr, s_addr, n = int(d_all[i]), int(s_all[i]), int(n_all[i])
            if n % 16 or d_addr % 16 or s_addr % 16:
                raise EmulationError(f"{where}: a bulk copy of {n} bytes from {s_addr:#x} to "
                                     f"{d_addr:#x}: size and both addresses must be multiples "
                                     "of 16")
            cta = m.cta_of_rank(d_addr >> CLUSTER_SHIFT)
            d_off = d_addr & ((1 << CLUSTER_SHIFT) - 1)
            mb = get_mbarrier(m, w, int(b_all[i]), "shared::cluster", where)
            desc = f"bulk load by {w.gid} (line {ins.line})"
            check_pending_reads(cta, np.asarray([d_off]), n, f"{where}: {desc}")
            region = (d_off, d_off + n, desc)
            _pending(cta).append(region)

            def land(cta=cta, d_off=d_off, n=n, s_addr=s_addr, mb=mb, region=region):
                _pending(cta).remove(region)
                data = m.gmem.read(np.asarray([s_addr], dtype=np.uint64), n, f"{where} (bulk load)")
                cta.smem.write(np.asarray([d_off]), data.reshape(1, n), f"{where} (bulk load)")
                mb.complete_tx(n, where)
            m.async_ops.append(AsyncOp(land, f"bulk load to shared {d_off:#x} ({n} bytes) "
                                             f"issued at line {ins.line}"))
    return run


def _cp_async(ins, k):
    """``cp.async.{ca,cg}.shared{::cta}.global [dst], [src], cp-size{, src-size}``, and its
    ``commit_group`` / ``wait_group N`` / ``wait_all``: each copy lands asynchronously (its
    destination pending until then, as a TMA load's); a thread's copies are grouped at each
    commit and ``wait_group N`` waits until all its groups but the N most recent have landed
    (``_wait_group``)."""
    md = mods(ins)
    if "commit_group" in md:
        return _commit_group(ins, "cp_async_groups")
    if "wait_group" in md or "wait_all" in md:
        return _wait_group(ins, k, "cp_async_groups", "cp.async")
    if "mbarrier" in md:
        unsupported(ins, "cp.async.mbarrier.arrive is not modelled")
    where = f"line {ins.line}"
    dst = address_reader(ins.operands[0], "shared", k)
    src = address_reader(ins.operands[1], "global", k)
    size = reader(ins.operands[2], "u32", k)
    src_size = reader(ins.operands[3], "u32", k) if len(ins.operands) > 3 else size

    def run(m, w, idx):
        d_all, s_all = dst(m, w, idx), src(m, w, idx)
        n_all, z_all = size(m, w, idx), src_size(m, w, idx)
        for i, lane in enumerate(idx):
            n, z, s_addr = int(n_all[i]), int(z_all[i]), int(s_all[i])
            if n not in (4, 8, 16) or (".cg" in ins.text and n != 16):
                raise EmulationError(f"{where}: cp.async of {n} bytes ({ins.text})")
            (cta, doff, _), = resolve_shared(m, w, np.asarray([d_all[i]]), "shared")
            d0 = int(doff[0])
            if d0 % n or s_addr % n:
                raise EmulationError(f"{where}: cp.async of {n} bytes from {s_addr:#x} to shared "
                                     f"{d0:#x}: both must be {n}-byte aligned")
            region = (d0, d0 + n, f"cp.async by {w.gid} lane {int(lane)} (line {ins.line})")
            _pending(cta).append(region)

            def land(cta=cta, d0=d0, n=n, z=z, s_addr=s_addr, region=region):
                _pending(cta).remove(region)
                data = np.zeros((1, n), dtype=np.uint8)
                if z:
                    data[:, :z] = m.gmem.read(np.asarray([s_addr], dtype=np.uint64), z,
                                              f"{where} (cp.async)")
                cta.smem.write(np.asarray([d0]), data, f"{where} (cp.async)")
            op = AsyncOp(land, f"cp.async to shared {d0:#x} ({n} bytes) issued at line {ins.line}")
            m.async_ops.append(op)
            _group_state(w, int(lane), "cp_async_groups")["open"].append(op)
    return run


def _pending(cta) -> list:
    if not hasattr(cta, "pending_smem"):
        cta.pending_smem = []
    return cta.pending_smem


def _land(m, tm, off, ok, targets, dst_off, nbytes, where):
    e = tm.elem_bytes
    data = np.zeros((off.size, e), dtype=np.uint8)
    if ok.any():
        data[ok] = m.gmem.read(np.uint64(tm.address) + off[ok].astype(np.uint64), e,
                               f"{where} (TMA load)")
    flat = data.reshape(-1)
    index = _smem_byte_index(tm, dst_off, off.size)
    for cta, mb, region in targets:
        _pending(cta).remove(region)
        cta.smem.write(index, flat[:, None], f"{where} (TMA load)")
        mb.complete_tx(nbytes, where)


def _tma_store(ins, k):
    where = f"line {ins.line}"
    ref = ins.operands[0]
    tmap = reader(ref.tmap, "u64", k)
    coords = [reader(c, "s32", k) for c in (ref.coords[0].items if len(ref.coords) == 1 and
                                             hasattr(ref.coords[0], "items") else ref.coords)]
    src = address_reader(ins.operands[1], "shared", k)

    def run(m, w, idx):
        t_all, s_all = tmap(m, w, idx), src(m, w, idx)
        c_all = [c(m, w, idx) for c in coords]
        for i, lane in enumerate(idx):
            tm = tensormap_of(m, w, int(t_all[i]), where)
            co = [int(c[i]) for c in c_all]
            off, ok = box_offsets(tm, co)
            (cta, soff, _), = resolve_shared(m, w, np.asarray([s_all[i]]), "shared")
            s0 = int(soff[0])
            nbytes = off.size * tm.elem_bytes
            cta.smem.check_async_read(s0, s0 + nbytes, f"{where}: TMA store source")
            region = add_pending_read(cta, s0, s0 + nbytes,
                                      f"TMA store by {w.gid} (line {ins.line}) reading it")

            def land(tm=tm, off=off, ok=ok, cta=cta, s0=s0, region=region):
                remove_pending_read(cta, region)
                index = _smem_byte_index(tm, s0, off.size)
                flat = cta.smem.read(index, 1, f"{where} (TMA store source)").reshape(-1, tm.elem_bytes)
                if ok.any():
                    m.gmem.write(np.uint64(tm.address) + off[ok].astype(np.uint64), flat[ok],
                                 f"{where} (TMA store)")
            op = AsyncOp(land, f"TMA store from shared {s0:#x} issued at line {ins.line}")
            m.async_ops.append(op)
            _bulk_state(w, int(lane))["open"].append(op)
    return run


def _group_state(w, lane: int, kind: str) -> dict:
    """A lane's open (uncommitted) ops and committed groups of one kind (bulk stores,
    ``cp.async`` copies)."""
    if not hasattr(w, kind):
        setattr(w, kind, {})
    return getattr(w, kind).setdefault(lane, {"open": [], "committed": []})


def _bulk_state(w, lane: int) -> dict:
    return _group_state(w, lane, "bulk_groups")


def _commit_group(ins, kind="bulk_groups"):
    def run(m, w, idx):
        for lane in idx:
            st = _group_state(w, int(lane), kind)
            st["committed"].append(st["open"])
            st["open"] = []
    return run


def _wait_group(ins, k, kind="bulk_groups", what="cp.async.bulk"):
    """``wait_group N``: wait until every group the thread committed, but the N most recent,
    has completed (groups may complete out of order; ``wait_all``: N = 0, uncommitted copies
    included)."""
    wait_all = "wait_all" in mods(ins)
    n_r = None if wait_all else reader(ins.operands[0], "u32", k)

    def run(m, w, idx):
        n = 0 if wait_all else int(n_r(m, w, idx)[0])
        states = [_group_state(w, int(lane), kind) for lane in idx]
        if wait_all:  # the uncommitted copies as a group (once: the wait re-runs this)
            for st in states:
                if st["open"]:
                    st["committed"].append(st["open"])
                    st["open"] = []

        def older(st):  # every group but the n most recent must have completed
            return st["committed"][:max(len(st["committed"]) - n, 0)]

        def settled():
            return all(op.done for st in states for g in older(st) for op in g)
        if not settled():
            w.add_wait(PredWait(settled, f"{what}.wait_group {n}: older copies in flight"), idx)
            return True
        for st in states:  # the n most recent stay, in order, done or not
            st["committed"] = st["committed"][len(older(st)):]
    return run
