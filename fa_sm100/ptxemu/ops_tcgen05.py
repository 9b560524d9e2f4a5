"""tcgen05: Tensor Memory (128 lanes x 512 columns x 32 bit per CTA) and its instructions:
alloc / dealloc / relinquish_alloc_permit, ld / st (shape 32x32b), wait::ld / wait::st,
mma (kind::f16, A from SMEM or TMEM, cta_group::1 and ::2; M = 128 with cta_group::2 in the
ISA's folded data-path layout) and commit.

Semantics (PTX ISA, tcgen05 sections):
- TMEM addresses are ``lane << 16 | column``; a warp may access only the 32 lanes of its
  quarter (warp id % 4); columns must be allocated. Reading a cell never written is an error.
- Note [tcgen05.ld and wait::ld]. The ISA (tcgen05.wait) says that ``tcgen05.wait::ld``
  "causes the executing thread to block until all prior tcgen05.ld operations issued by the
  executing thread have completed"; its example puts the wait between a load and an MMA that
  writes the same columns, and its cross-thread pattern is ld, wait::ld,
  fence::before_thread_sync, arrive. It does not make the destination registers undefined
  before the wait: they are register results, whose uses the SM issues in order behind the
  data (a warp issues in order, and an instruction that reads a register waits for it). So
  once the warp has read one of a load's registers, the data is back and the load's read of
  TMEM is over, for every instruction after that one and every thread synchronized after it.
  That is the model here: a load's values are in its registers at once; its cells stay
  pending-read until the warp executes ``wait::ld`` or reads one of the load's registers; a
  TMEM write to them meanwhile (``tcgen05.st``, an MMA by any thread, a dealloc) is reported.
  FlashAttention-4's forward relies on exactly this: its softmax writes P over S and arrives
  for the next S without a ``wait::ld``, after computing from S. A load whose registers are
  never read, followed by a write to its cells without a wait, is reported.
- ``tcgen05.mma`` is asynchronous: at issue the D region is marked pending (a ``tcgen05.ld``
  of it before completion is reported) and the A/B shared-memory bytes pending-read until
  completion (a store or a TMA load issued into them meanwhile is reported as a race); MMAs and
  commits of one thread complete in issue order; ``tcgen05.commit`` arrives once on the
  mbarrier(s) when every earlier tcgen05 operation of the thread has completed.
- Shared-memory matrix descriptors and the instruction descriptor are decoded per the ISA
  (canonical K-major / MN-major layouts, swizzle none / 32B / 64B / 128B).
Numerics model (the ISA does not specify the MMA's internal accumulation): the products of one
instruction (K = 16 for kind::f16) are exact, summed in float64 together with the accumulator
and rounded once to float32.
"""

from __future__ import annotations

import numpy as np

from .decode import Op, handler, mods, reader, unsupported, writer
from .memory import CLUSTER_SHIFT, EmulationError
from .ops_mem import add_pending_read, address_reader, remove_pending_read, resolve_shared
from .ops_sync import get_mbarrier
from .ops_tma import swizzle
from .parser import Addr, Vec
from .values import bf16_to_f32
from .waits import AsyncOp, PredWait

LANES, COLS = 128, 512


class Tmem:
    def __init__(self, cta_rank: int):
        self.rank = cta_rank
        self.data = np.zeros((LANES, COLS), dtype=np.uint32)
        self.init = np.zeros((LANES, COLS), dtype=bool)
        self.allocs: dict = {}                 # first column -> columns
        self.relinquished = False
        self.pending: list = []                # (lane0, lane1, col0, col1, kind, owner, desc)

    def allocated(self, col0: int, ncols: int) -> bool:
        return any(c <= col0 and col0 + ncols <= c + n for c, n in self.allocs.items())

    def find_free(self, ncols: int):
        for start in range(0, COLS, ncols):
            if all(start + ncols <= c or c + n <= start for c, n in self.allocs.items()):
                return start
        return None

    def check_access(self, lane0, nlanes, col0, ncols, what, reading, ignore_owner=None):
        if not (0 <= lane0 and lane0 + nlanes <= LANES and 0 <= col0 and col0 + ncols <= COLS):
            raise EmulationError(f"{what}: TMEM lanes [{lane0}, {lane0 + nlanes}) columns "
                                 f"[{col0}, {col0 + ncols}) are outside the TMEM")
        if not self.allocated(col0, ncols):
            raise EmulationError(f"{what}: TMEM columns [{col0}, {col0 + ncols}) of CTA "
                                 f"{self.rank} are not allocated (allocated: "
                                 f"{sorted(self.allocs.items())})")
        for (l0, l1, c0, c1, kind, owner, desc) in self.pending:
            if kind == "ld" and reading:       # a pending read conflicts with writes only
                continue
            if kind != "ld" and owner is not None and owner == ignore_owner:
                continue
            if l0 < lane0 + nlanes and lane0 < l1 and c0 < col0 + ncols and col0 < c1:
                pending = "read" if kind == "ld" else "write"
                raise EmulationError(f"{what}: TMEM lanes [{lane0}, {lane0 + nlanes}) columns "
                                     f"[{col0}, {col0 + ncols}) overlap an asynchronous "
                                     f"{pending} still pending ({desc})")
        if reading and not self.init[lane0:lane0 + nlanes, col0:col0 + ncols].all():
            bad = np.argwhere(~self.init[lane0:lane0 + nlanes, col0:col0 + ncols])[0]
            raise EmulationError(f"{what}: read of uninitialized TMEM lane {lane0 + bad[0]} "
                                 f"column {col0 + bad[1]} (CTA {self.rank})")

    def check_exit(self):
        if self.allocs:
            raise EmulationError(f"CTA {self.rank} exited with TMEM columns still allocated: "
                                 f"{sorted(self.allocs.items())} (first column, count)")


def tmem_of(cta) -> Tmem:
    if cta.tmem is None:
        cta.tmem = Tmem(cta.rank)
    return cta.tmem


def _group(ins) -> int:
    md = mods(ins)
    return 2 if "cta_group::2" in md else 1


def _pair(m, w, group: int) -> list:
    if group == 1:
        return [w.cta]
    lead = w.cta.rank & ~1
    return [m.cta_of_rank(lead), m.cta_of_rank(lead + 1)]


# -----------------------------------------------------------------------------------------
# allocation


@handler("tcgen05")
def _tcgen05(ins, k):
    verb = ins.parts[1]
    table = {"alloc": _alloc, "dealloc": _dealloc, "relinquish_alloc_permit": _relinquish,
             "ld": _ld, "st": _st, "wait::ld": _wait, "wait::st": _wait, "mma": _mma,
             "commit": _commit, "fence::before_thread_sync": _nop,
             "fence::after_thread_sync": _nop}
    f = table.get(verb)
    if f is None:
        unsupported(ins)
    return f(ins, k)


def _nop(ins, k):
    return Op(ins, lambda m, w, idx: None)


def _alloc(ins, k):
    dst = address_reader(ins.operands[0], "shared", k)
    n_r = reader(ins.operands[1], "u32", k)
    where = f"line {ins.line}"

    def run(m, w, idx):
        n = int(n_r(m, w, idx)[0])
        if n < 32 or n > COLS or n & (n - 1):
            raise EmulationError(f"{where}: tcgen05.alloc of {n} columns (must be a power of "
                                 "2 in [32, 512])")
        t = tmem_of(w.cta)
        if t.relinquished:
            raise EmulationError(f"{where}: tcgen05.alloc after relinquish_alloc_permit")
        start = t.find_free(n)
        if start is None:
            w.add_wait(PredWait(lambda: t.find_free(n) is not None,
                                f"tcgen05.alloc {n}: no free TMEM columns"), idx)
            return True
        t.allocs[start] = n
        a = dst(m, w, idx[:1])
        (cta, off, _), = resolve_shared(m, w, a, "shared")
        cta.smem.write(off, np.array([start], dtype=np.uint32).view(np.uint8)[None, :], where)
    return Op(ins, run, collective=True)


def _dealloc(ins, k):
    a_r = reader(ins.operands[0], "u32", k)
    n_r = reader(ins.operands[1], "u32", k)
    where = f"line {ins.line}"

    def run(m, w, idx):
        addr, n = int(a_r(m, w, idx)[0]), int(n_r(m, w, idx)[0])
        t = tmem_of(w.cta)
        col = addr & 0xFFFF
        if t.allocs.get(col) != n:
            raise EmulationError(f"{where}: tcgen05.dealloc of {n} columns at {col} does not "
                                 f"match an allocation {sorted(t.allocs.items())}")
        busy = [p for p in t.pending if p[2] < col + n and col < p[3]]
        if busy:
            raise EmulationError(f"{where}: tcgen05.dealloc while an asynchronous TMEM access "
                                 f"to the columns is pending ({busy[0][6]})")
        del t.allocs[col]
    return Op(ins, run, collective=True)


def _relinquish(ins, k):
    def run(m, w, idx):
        tmem_of(w.cta).relinquished = True
    return Op(ins, run, collective=True)


# -----------------------------------------------------------------------------------------
# ld / st / wait


def _shape(ins):
    md = mods(ins)
    if "32x32b" not in md:
        unsupported(ins, "only the 32x32b shape is modelled")
    if "pack::16b" in md or "unpack::16b" in md:
        unsupported(ins, "pack::16b / unpack::16b are not modelled")
    rep = next((p for p in ins.parts if p.startswith("x") and p[1:].isdigit()), None)
    if rep is None:
        unsupported(ins, "missing .num")
    return int(rep[1:])


def _quarter(w, addr: int, where: str):
    lane0, col = addr >> 16 & 0xFFFF, addr & 0xFFFF
    if lane0 != 32 * (w.wid % 4):
        raise EmulationError(f"{where}: warp {w.wid} may access TMEM lanes "
                             f"[{32 * (w.wid % 4)}, {32 * (w.wid % 4) + 32}), not lane {lane0}")
    return lane0, col


def _ld(ins, k):
    n = _shape(ins)
    dst = ins.operands[0]
    if not isinstance(dst, Vec) or len(dst.items) != n:
        unsupported(ins, f"expected {n} destination registers")
    wr = writer(dst, "b32")
    a_r = reader(ins.operands[1].base if isinstance(ins.operands[1], Addr) else ins.operands[1],
                 "u32", k)
    off = ins.operands[1].offset if isinstance(ins.operands[1], Addr) else 0
    names = [r.name for r in dst.items]
    where = f"line {ins.line}"

    def run(m, w, idx):
        addr = int(a_r(m, w, idx)[0]) + off
        lane0, col = _quarter(w, addr, where)
        t = tmem_of(w.cta)
        t.check_access(lane0, 32, col, n, where, reading=True, ignore_owner=None)
        wr(m, w, idx, t.data[lane0 + idx, col:col + n])
        entry = (lane0, lane0 + 32, col, col + n, "ld", w.gid,
                 f"tcgen05.ld by {w.gid} at line {ins.line} not yet waited")
        t.pending.append(entry)
        for name in names:
            w.ld_regs[name] = (t, entry)
    return Op(ins, run, collective=True)


def _st(ins, k):
    n = _shape(ins)
    src = ins.operands[1]
    if not isinstance(src, Vec) or len(src.items) != n:
        unsupported(ins, f"expected {n} source registers")
    rd = reader(src, "b32", k)
    a_r = reader(ins.operands[0].base, "u32", k)
    off = ins.operands[0].offset
    where = f"line {ins.line}"

    def run(m, w, idx):
        addr = int(a_r(m, w, idx)[0]) + off
        lane0, col = _quarter(w, addr, where)
        t = tmem_of(w.cta)
        t.check_access(lane0, 32, col, n, where, reading=False, ignore_owner=w.gid)
        vals = rd(m, w, idx)
        t.data[lane0 + idx, col:col + n] = vals
        t.init[lane0 + idx, col:col + n] = True
        t.pending.append((lane0, lane0 + 32, col, col + n, "st", w.gid,
                          f"tcgen05.st by {w.gid} at line {ins.line} not yet waited"))
    return Op(ins, run, collective=True)


def _wait(ins, k):
    kind = ins.parts[1].split("::")[1]

    def run(m, w, idx):
        t = tmem_of(w.cta)
        t.pending = [p for p in t.pending if not (p[4] == kind and p[5] == w.gid)]
        if kind == "ld":
            w.ld_regs.clear()
    return Op(ins, run, collective=True)


# -----------------------------------------------------------------------------------------
# mma


SWIZZLE_MODES = {0: 0, 2: 128, 4: 64, 6: 32}


def decode_idesc(idesc: int, where: str) -> dict:
    if idesc & 0x4:
        raise EmulationError(f"{where}: sparse tcgen05.mma is not modelled")
    d = {
        "dtype": (idesc >> 4) & 3, "atype": (idesc >> 7) & 7, "btype": (idesc >> 10) & 7,
        "neg_a": (idesc >> 13) & 1, "neg_b": (idesc >> 14) & 1,
        "a_mn_major": (idesc >> 15) & 1, "b_mn_major": (idesc >> 16) & 1,
        "n": ((idesc >> 17) & 0x3F) << 3, "m": ((idesc >> 24) & 0x1F) << 4,
    }
    if d["dtype"] != 1:
        raise EmulationError(f"{where}: only an f32 accumulator is modelled (idesc dtype "
                             f"{d['dtype']})")
    if d["atype"] not in (0, 1) or d["btype"] not in (0, 1):
        raise EmulationError(f"{where}: A/B types {d['atype']}/{d['btype']} are not f16/bf16")
    return d


def decode_sdesc(desc: int, where: str) -> dict:
    if (desc >> 46) & 7 != 1:
        raise EmulationError(f"{where}: shared-memory descriptor {desc:#x} lacks the fixed "
                             "constant 0b001 in bits 46-48")
    if (desc >> 49) & 7:
        raise EmulationError(f"{where}: descriptor base offset != 0 is not modelled")
    if (desc >> 52) & 1:
        raise EmulationError(f"{where}: absolute leading-dimension mode is not modelled")
    sw = (desc >> 61) & 7
    if sw not in SWIZZLE_MODES:
        raise EmulationError(f"{where}: descriptor swizzle mode {sw} is not modelled")
    return {"start": (desc & 0x3FFF) << 4, "lbo": ((desc >> 16) & 0x3FFF) << 4,
            "sbo": ((desc >> 32) & 0x3FFF) << 4, "span": SWIZZLE_MODES[sw]}


def operand_bytes(sd: dict, rows: int, kdim: int, esize: int, mn_major: bool) -> np.ndarray:
    """Shared byte address of element (row, k) of a canonical-layout operand, swizzled."""
    r = np.arange(rows)[:, None]
    kk = np.arange(kdim)[None, :]
    span, lbo, sbo = sd["span"], sd["lbo"], sd["sbo"]
    t = 16 // esize                                  # elements per 16 bytes
    if not mn_major:                                 # rows = M or N, contiguous along K
        if span == 0:
            off = (r % 8) * 16 + (r // 8) * sbo + (kk % t) * esize + (kk // t) * lbo
        else:
            off = (r % 8) * span + (r // 8) * sbo + kk * esize
    else:                                            # contiguous along M or N
        if span == 0:
            off = (r % t) * esize + (r // t) * sbo + (kk % 8) * 16 + (kk // 8) * lbo
        else:
            per = span // esize                       # elements of one swizzle row
            off = (r % per) * esize + (r // per) * lbo + (kk % 8) * span + (kk // 8) * sbo
    return swizzle(sd["start"] + off, span)


def _mma(ins, k):
    md = mods(ins)
    if "kind::f16" not in md:
        unsupported(ins, "only kind::f16 is modelled")
    if any(p.startswith(("block_scale", "ws")) for p in ins.parts):
        unsupported(ins)
    ops = ins.operands
    group = _group(ins)
    d_r = reader(ops[0].base, "u32", k)
    a_tmem = isinstance(ops[1], Addr)
    a_r = reader(ops[1].base if a_tmem else ops[1], "u32" if a_tmem else "u64", k)
    b_r = reader(ops[2], "u64", k)
    i_r = reader(ops[3], "u32", k)
    rest = ops[4:]
    mask_r = None
    if rest and isinstance(rest[0], Vec):
        mask_r = reader(rest[0], "u32", k)
        rest = rest[1:]
    en_r = reader(rest[0], "pred", k)
    if len(rest) > 1:
        unsupported(ins, "scale-input-d is not modelled")
    where = f"line {ins.line}"

    def run(m, w, idx):
        for i in idx:
            one = np.array([i])
            a_val = int(a_r(m, w, one)[0]) + (ops[1].offset if a_tmem else 0)
            issue(m, w, int(d_r(m, w, one)[0]) + ops[0].offset, a_val,
                  int(b_r(m, w, one)[0]), int(i_r(m, w, one)[0]),
                  mask_r(m, w, one)[0] if mask_r is not None else None,
                  bool(en_r(m, w, one)[0]), int(i))

    def issue(m, w, d_addr, a_val, b_desc, idesc, lane_mask, accumulate, lane):
        ctas = _pair(m, w, group)
        if group == 2 and w.cta.rank & 1:
            raise EmulationError(f"{where}: cta_group::2 MMA issued by the odd CTA of the pair")
        d = decode_idesc(idesc, where)
        m_cta = d["m"] // group
        # Note [M = 128 with cta_group::2]: the ISA's data-path layout for it (dense A) gives
        # each CTA 64 rows of D, folded into all 128 lanes: row r, column c of the CTA's
        # (64, N) tile lies in lane r + 64 (c div N/2), column c mod N/2 (N/2 columns used)
        folded = group == 2 and m_cta == 64
        if m_cta != 128 and not folded:
            raise EmulationError(f"{where}: M = {d['m']} with cta_group::{group} is not modelled "
                                 "(128 rows per CTA are, and 64 with cta_group::2)")
        if folded and (a_tmem or (lane_mask is not None and any(int(v) for v in lane_mask))):
            raise EmulationError(f"{where}: M = 128 with cta_group::2 is modelled with A in "
                                 "shared memory and no disabled output lanes only")
        if folded:
            lane_mask = None
        n, kdim, esize = d["n"], 16, 2
        d_lanes, d_cols = (2 * m_cta, n // 2) if folded else (m_cta, n)
        d_lane, d_col = d_addr >> 16 & 0xFFFF, d_addr & 0xFFFF
        bsd = decode_sdesc(b_desc, where)
        b_rows = n // group
        b_idx = operand_bytes(bsd, b_rows, kdim, esize, bool(d["b_mn_major"]))
        if a_tmem:
            a_lane, a_col = a_val >> 16 & 0xFFFF, a_val & 0xFFFF
            a_idx = None
        else:
            asd = decode_sdesc(a_val, where)
            a_idx = operand_bytes(asd, m_cta, kdim, esize, bool(d["a_mn_major"]))
        desc = f"tcgen05.mma by {w.gid} at line {ins.line}"
        issuer = f"{w.gid}:{lane}"            # MMAs of one thread complete in order
        regions, reads = [], []
        for c in ctas:
            t = tmem_of(c)
            # accumulating into a D an earlier MMA of this thread still writes is ordered;
            # its cells count as written
            t.check_access(d_lane, d_lanes, d_col, d_cols, where, reading=False,
                           ignore_owner=issuer)
            if accumulate and not _written(t, d_lane, d_lanes, d_col, d_cols, issuer):
                t.check_access(d_lane, d_lanes, d_col, d_cols, where, reading=True,
                               ignore_owner=issuer)
            if a_tmem:
                t.check_access(a_lane, m_cta, a_col, kdim // 2, where, reading=True,
                               ignore_owner=issuer)
            for ix in ([b_idx] if a_idx is None else [a_idx, b_idx]):
                _check_no_tma(c, ix, where)
                c.smem.check_async_read(int(ix.min()), int(ix.max()) + esize,
                                        f"{where}: MMA operand")
                # the operand is read at some time before completion: pending until then
                reads.append((c, add_pending_read(c, int(ix.min()), int(ix.max()) + esize,
                                                  f"operand of {desc}")))
            reg = (d_lane, d_lane + d_lanes, d_col, d_col + d_cols, "mma", issuer, desc)
            t.pending.append(reg)
            regions.append((t, reg))

        def complete():
            bs = [_gather(c, b_idx, esize, where) for c in ctas]
            b_mat = _to_f64(np.concatenate(bs, axis=0), d["btype"])        # (N, K)
            for g, c in enumerate(ctas):
                t = tmem_of(c)
                if a_tmem:
                    words = t.data[a_lane:a_lane + m_cta, a_col:a_col + kdim // 2]
                    halves = np.stack([words & 0xFFFF, words >> 16], axis=-1).reshape(m_cta, kdim)
                    a_mat = _to_f64(halves.astype(np.uint16), d["atype"])
                else:
                    a_mat = _to_f64(_gather(c, a_idx, esize, where), d["atype"])
                if d["neg_a"]:
                    a_mat = -a_mat
                bm = -b_mat if d["neg_b"] else b_mat
                prod = a_mat @ bm.T                                        # exact products
                if folded:  # Note [M = 128 with cta_group::2]
                    prod = np.concatenate([prod[:, :d_cols], prod[:, d_cols:]], axis=0)
                cur = t.data[d_lane:d_lane + d_lanes, d_col:d_col + d_cols].view(np.float32)
                acc = prod + (cur.astype(np.float64) if accumulate else 0.0)
                out = acc.astype(np.float32).view(np.uint32)
                rows = np.ones(d_lanes, dtype=bool)
                if lane_mask is not None:
                    bits = np.concatenate([(np.uint64(v) >> np.arange(32, dtype=np.uint64)) & 1
                                           for v in lane_mask]).astype(bool)
                    rows = ~bits[g * m_cta:(g + 1) * m_cta] if len(bits) >= (g + 1) * m_cta \
                        else ~bits[:m_cta]
                t.data[d_lane:d_lane + d_lanes, d_col:d_col + d_cols][rows] = out[rows]
                t.init[d_lane:d_lane + d_lanes, d_col:d_col + d_cols][rows] = True
            for t, reg in regions:
                t.pending.remove(reg)
            for c, region in reads:
                remove_pending_read(c, region)

        _enqueue(m, w, lane, complete, f"{desc} ({d['m']}x{n}x16)")

    return Op(ins, run)


def _written(t, lane0, nlanes, col0, ncols, issuer) -> bool:
    """Every cell is initialized or covered by a pending MMA of ``issuer``."""
    cover = t.init[lane0:lane0 + nlanes, col0:col0 + ncols].copy()
    for (l0, l1, c0, c1, kind, owner, _d) in t.pending:
        if kind == "mma" and owner == issuer:
            a0, a1 = max(l0, lane0) - lane0, min(l1, lane0 + nlanes) - lane0
            b0, b1 = max(c0, col0) - col0, min(c1, col0 + ncols) - col0
            if a0 < a1 and b0 < b1:
                cover[a0:a1, b0:b1] = True
    return bool(cover.all())


def _check_no_tma(cta, index, where):
    pend = getattr(cta, "pending_smem", None)
    if not pend:
        return
    lo, hi = int(index.min()), int(index.max()) + 2
    for (a, b, desc) in pend:
        if a < hi and lo < b:
            raise EmulationError(f"{where}: MMA operand in shared [{lo:#x}, {hi:#x}) while "
                                 f"an asynchronous write to it is pending ({desc})")


def _gather(cta, index: np.ndarray, esize: int, where: str) -> np.ndarray:
    flat = index.reshape(-1)
    raw = cta.smem.read(flat, esize, f"{where} (MMA operand)")
    return np.ascontiguousarray(raw).view(np.uint16).reshape(index.shape)


def _to_f64(bits: np.ndarray, typ: int) -> np.ndarray:
    if typ == 1:
        return bf16_to_f32(bits).astype(np.float64)
    return bits.view(np.float16).astype(np.float64)


def _enqueue(m, w, lane, fn, what):
    key = (w.gid, lane)
    last = getattr(m, "tc_last", None)
    if last is None:
        last = m.tc_last = {}
    prev = last.get(key)
    op = AsyncOp(fn, what, after=[prev] if prev is not None and not prev.done else [])
    last[key] = op
    m.async_ops.append(op)
    return op


def _commit(ins, k):
    md = mods(ins)
    if "mbarrier::arrive::one" not in md:
        unsupported(ins)
    bar = address_reader(ins.operands[0], "shared::cluster", k)
    multicast = "multicast::cluster" in md
    mask_r = reader(ins.operands[1], "u16", k) if multicast else None
    where = f"line {ins.line}"

    def run(m, w, idx):
        for i in idx:
            one = np.array([i])
            addr = int(bar(m, w, one)[0])
            if multicast:
                mask = int(mask_r(m, w, one)[0])
                ranks = [r for r in range(len(m.ctas)) if mask >> r & 1]
                off = addr & ((1 << CLUSTER_SHIFT) - 1)
                targets = [(r << CLUSTER_SHIFT) | off for r in ranks]
            else:
                targets = [addr]
            mbs = [get_mbarrier(m, w, t, "shared::cluster", where) for t in targets]

            def arrive(mbs=mbs):
                for mb in mbs:
                    mb.arrive(1, where)
            _enqueue(m, w, int(i), arrive, f"tcgen05.commit by {w.gid} at line {ins.line}")
    return Op(ins, run)
