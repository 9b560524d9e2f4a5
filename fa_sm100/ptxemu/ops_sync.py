"""Warp collectives (shfl, vote, elect, redux, bar.warp.sync), CTA barriers, cluster
barriers, mbarriers (phases, pending arrivals, tx-count) and setmaxnreg accounting."""

from __future__ import annotations

import numpy as np

from .decode import Op, handler, last_type, mods, reader, unsupported, writer
from .memory import EmulationError
from .ops_mem import address_reader, resolve_shared, space_of
from .parser import Imm, Pair, Sink
from .values import numpy_dtype
from .waits import BarrierWait, PredWait


def _mask_members(mask_reader):
    def members(w, group):
        idx = np.nonzero(group)[0]
        masks = mask_reader(None, w, idx).astype(np.uint64)
        mask = int(masks[0]) if len(masks) else 0xFFFFFFFF
        return (mask >> np.arange(32, dtype=np.uint64)) & 1 == 1
    return members


def collective(ins, run, mask_operand=None, kernel=None):
    op = Op(ins, run, collective=True)
    if mask_operand is not None:
        op.members = _mask_members(reader(mask_operand, "b32", kernel))
    return op


# -----------------------------------------------------------------------------------------
# Warp collectives


@handler("shfl")
def _shfl(ins, k):
    mode = ins.parts[2] if ins.parts[1] == "sync" else unsupported(ins, "only shfl.sync")
    typ = last_type(ins)
    dst = ins.operands[0]
    wd = writer(dst.first if isinstance(dst, Pair) else dst, typ)
    wp = writer(dst.second, "pred") if isinstance(dst, Pair) else None
    a, b, c = (reader(o, t, k) for o, t in zip(ins.operands[1:4], (typ, "u32", "u32")))

    def run(m, w, idx):
        lane = idx.astype(np.int64)
        av = np.zeros(32, dtype=numpy_dtype(typ))
        av[idx] = a(m, w, idx)
        bv = b(m, w, idx).astype(np.int64) & 31
        cv = c(m, w, idx).astype(np.int64)
        seg = (cv >> 8) & 31
        clamp = cv & 31
        max_lane = (lane & seg) | (clamp & ~seg)
        min_lane = lane & seg
        if mode == "up":
            j = lane - bv
            ok = j >= max_lane
        elif mode == "down":
            j = lane + bv
            ok = j <= max_lane
        elif mode == "bfly":
            j = lane ^ bv
            ok = j <= max_lane
        elif mode == "idx":
            j = min_lane | (bv & ~seg)
            ok = j <= max_lane
        else:
            raise EmulationError(f"shfl mode {mode}")
        j = np.where(ok, j, lane)
        present = np.zeros(32, dtype=bool)
        present[idx] = True
        if not present[j].all():
            raise EmulationError(f"shfl reads lane(s) {sorted(set(j[~present[j]].tolist()))} "
                                 "that are not in the executing set (undefined value)")
        wd(m, w, idx, av[j])
        if wp is not None:
            wp(m, w, idx, ok)
    return collective(ins, run, ins.operands[4], k)


@handler("vote")
def _vote(ins, k):
    md = mods(ins)
    if "sync" not in md:
        unsupported(ins, "only vote.sync")
    kind = next(p for p in ("all", "any", "uni", "ballot") if p in md)
    src = ins.operands[1]
    pr = reader(src, "pred", k)
    wr = writer(ins.operands[0], "b32" if kind == "ballot" else "pred")

    def run(m, w, idx):
        p = pr(m, w, idx)
        if kind == "ballot":
            bits = int(np.sum(np.left_shift(np.uint64(1), idx.astype(np.uint64))[p]))
            wr(m, w, idx, np.full(len(idx), bits & 0xFFFFFFFF, dtype=np.uint32))
        elif kind == "all":
            wr(m, w, idx, np.full(len(idx), bool(p.all())))
        elif kind == "any":
            wr(m, w, idx, np.full(len(idx), bool(p.any())))
        else:
            wr(m, w, idx, np.full(len(idx), bool(p.all() or not p.any())))
    return collective(ins, run, ins.operands[2], k)


@handler("elect")
def _elect(ins, k):
    dst = ins.operands[0]
    wd = writer(dst.first, "b32") if isinstance(dst, Pair) else writer(Sink(), "b32")
    wp = writer(dst.second if isinstance(dst, Pair) else dst, "pred")
    mask = reader(ins.operands[1], "b32", k)

    def run(m, w, idx):
        mk = int(mask(m, w, idx)[0])
        members = [int(i) for i in idx if mk >> int(i) & 1]
        leader = members[0] if members else -1     # the ISA does not fix which; lowest here
        wd(m, w, idx, np.full(len(idx), max(leader, 0), dtype=np.uint32))
        wp(m, w, idx, idx == leader)
    return collective(ins, run, ins.operands[1], k)


@handler("redux")
def _redux(ins, k):
    typ = last_type(ins)
    kind = ins.parts[2]
    a = reader(ins.operands[1], typ, k)
    wr = writer(ins.operands[0], typ)
    fns = {"add": np.sum, "min": np.min, "max": np.max,
           "and": np.bitwise_and.reduce, "or": np.bitwise_or.reduce,
           "xor": np.bitwise_xor.reduce}

    def run(m, w, idx):
        v = a(m, w, idx)
        r = fns[kind](v.astype(np.int64) if kind == "add" else v)
        wr(m, w, idx, np.full(len(idx), r).astype(numpy_dtype(typ)))
    return collective(ins, run, ins.operands[2], k)


@handler("activemask")
def _activemask(ins, k):
    wr = writer(ins.operands[0], "b32")

    def run(m, w, idx):
        bits = int(np.sum(np.left_shift(np.uint64(1), idx.astype(np.uint64))))
        wr(m, w, idx, np.full(len(idx), bits, dtype=np.uint32))
    return run


# -----------------------------------------------------------------------------------------
# Barriers


@handler("bar", "barrier")
def _bar(ins, k):
    md = mods(ins)
    if "warp" in md:                              # bar.warp.sync membermask
        return collective(ins, lambda m, w, idx: None, ins.operands[0], k)
    if "red" in md:
        unsupported(ins, "barrier reductions are not modelled")
    if "cluster" in md:
        return _cluster_barrier(ins, "arrive" in md)
    arrive_only = "arrive" in md
    if not arrive_only and "sync" not in md:
        unsupported(ins)
    if ins.operands:
        bid = reader(ins.operands[0], "u32", k)
    else:
        def bid(m, w, idx):
            return np.zeros(len(idx), np.uint32)
    cnt = reader(ins.operands[1], "u32", k) if len(ins.operands) > 1 else None
    aligned = "aligned" in md or ins.parts[0] == "bar"

    def run(m, w, idx):
        b = int(bid(m, w, idx)[0])
        expected = int(cnt(m, w, idx)[0]) if cnt is not None else w.cta.nthreads
        bar = w.cta.barrier(b)
        gen = bar.generation
        bar.arrive(len(idx), expected, f"line {ins.line}")
        w.pc[idx] += 1
        if not arrive_only and bar.generation == gen:
            w.add_wait(BarrierWait(bar, gen, at=f"line {ins.line}: {ins.text}"), idx)
        return True
    return Op(ins, run, collective=True) if aligned else Op(ins, run)


def _cluster_barrier(ins, arrive: bool):
    """barrier.cluster.arrive / .wait: every thread of every CTA of the cluster arrives once
    per phase; wait blocks until the phase the thread arrived in has completed."""
    where = f"line {ins.line}"

    def run(m, w, idx):
        total = sum(c.nthreads for c in m.ctas)
        if arrive:
            if (w.cluster_gen[idx] == m.cluster_generation).any():
                raise EmulationError(f"{where}: barrier.cluster.arrive twice in one phase")
            w.cluster_gen[idx] = m.cluster_generation
            m.cluster_arrived += len(idx)
            if m.cluster_arrived == total:
                m.cluster_arrived = 0
                m.cluster_generation += 1
            return None
        gens = w.cluster_gen[idx]
        if (gens < 0).any():
            raise EmulationError(f"{where}: barrier.cluster.wait without a prior arrive")
        g = int(gens.max())
        w.cluster_gen[idx] = -1
        w.pc[idx] += 1
        if m.cluster_generation <= g:
            w.add_wait(PredWait(lambda: m.cluster_generation > g,
                                lambda: (f"barrier.cluster.wait ({m.cluster_arrived}/{total} "
                                         "threads arrived)"),
                                at=f"line {ins.line}: {ins.text}"), idx)
        return True
    return Op(ins, run, collective="aligned" in ins.parts)


# -----------------------------------------------------------------------------------------
# mbarrier


class MBarrier:
    def __init__(self, count: int, where: str):
        if not 0 < count < (1 << 20):
            raise EmulationError(f"{where}: mbarrier.init count {count} out of range")
        self.expected = count
        self.pending = count
        self.tx = 0
        self.phase = 0

    def arrive(self, n: int, where: str):
        self.pending -= n
        if self.pending < 0:
            raise EmulationError(f"{where}: more arrivals than the mbarrier's count "
                                 f"{self.expected} in phase {self.phase}")
        self._maybe_complete()

    def expect_tx(self, n: int):
        self.tx += n

    def complete_tx(self, n: int, where: str):
        self.tx -= n
        self._maybe_complete()

    def _maybe_complete(self):
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.expected

    def phase_done(self, parity: int) -> bool:
        """try_wait.parity semantics: true once the phase with this parity has completed."""
        return (self.phase & 1) != (parity & 1)


def get_mbarrier(m, w, addr_val, space, where) -> MBarrier:
    (cta, off, _), = resolve_shared(m, w, np.asarray([addr_val]), space)
    mb = cta.mbarriers.get(int(off[0]))
    if mb is None:
        raise EmulationError(f"{where}: mbarrier at shared {int(off[0]):#x} of CTA {cta.rank} "
                             "is used before mbarrier.init")
    return mb


@handler("mbarrier")
def _mbarrier(ins, k):
    verb = ins.parts[1]
    md = mods(ins)
    space = space_of(ins)
    if space == "generic":
        unsupported(ins, "generic-address mbarrier operations are not modelled")
    where = f"line {ins.line}"
    if verb == "init":
        addr = address_reader(ins.operands[0], space, k)
        cnt = reader(ins.operands[1], "u32", k)

        def init(m, w, idx):
            a, c = addr(m, w, idx), cnt(m, w, idx)
            for ai, ci in zip(a, c):
                (cta, off, _), = resolve_shared(m, w, np.asarray([ai]), space)
                cta.mbarriers[int(off[0])] = MBarrier(int(ci), where)
                cta.smem.write(off, np.zeros((1, 8), np.uint8), where)
        return init
    if verb == "inval":
        addr = address_reader(ins.operands[0], space, k)

        def inval(m, w, idx):
            for ai in addr(m, w, idx):
                (cta, off, _), = resolve_shared(m, w, np.asarray([ai]), space)
                cta.mbarriers.pop(int(off[0]), None)
        return inval
    if verb in ("arrive", "arrive_drop"):
        expect = "expect_tx" in md
        state_w = writer(ins.operands[0], "b64")
        addr = address_reader(ins.operands[1], space, k)
        extra = reader(ins.operands[2], "u32", k) if len(ins.operands) > 2 else None

        def arrive(m, w, idx):
            a = addr(m, w, idx)
            ex = extra(m, w, idx) if extra is not None else None
            states = np.zeros(len(idx), dtype=np.uint64)
            for i, ai in enumerate(a):
                mb = get_mbarrier(m, w, ai, space, where)
                states[i] = mb.phase
                if expect:
                    mb.expect_tx(int(ex[i]))
                    mb.arrive(1, where)
                else:
                    mb.arrive(int(ex[i]) if ex is not None else 1, where)
                if verb == "arrive_drop":
                    mb.expected -= 1
            state_w(m, w, idx, states)
        return arrive
    if verb in ("expect_tx", "complete_tx"):
        addr = address_reader(ins.operands[0], space, k)
        n = reader(ins.operands[1], "u32", k)

        def tx(m, w, idx):
            for ai, ni in zip(addr(m, w, idx), n(m, w, idx)):
                mb = get_mbarrier(m, w, ai, space, where)
                if verb == "expect_tx":
                    mb.expect_tx(int(ni))
                else:
                    mb.complete_tx(int(ni), where)
        return tx
    if verb in ("try_wait", "test_wait"):
        parity = "parity" in md
        wp = writer(ins.operands[0], "pred")
        addr = address_reader(ins.operands[1], space, k)
        st = reader(ins.operands[2], "u32" if parity else "b64", k)
        blocking = verb == "try_wait"

        def wait(m, w, idx):
            a, s = addr(m, w, idx), st(m, w, idx)
            done = np.zeros(len(idx), dtype=bool)
            mbs = []
            for i, ai in enumerate(a):
                mb = get_mbarrier(m, w, ai, space, where)
                mbs.append(mb)
                done[i] = mb.phase_done(int(s[i])) if parity else mb.phase > int(s[i])
            if blocking and not done.all():
                # try_wait may suspend: the lanes sleep until their phase completes, then
                # execute the try_wait again (same result as spinning, but detectable)
                lanes = idx[~done]
                pend = [(mb, int(si)) for mb, si, d in zip(mbs, s, done) if not d]
                mb0, p0 = pend[0]
                w.add_wait(PredWait(
                    (lambda: mb0.phase_done(p0)) if parity else (lambda: mb0.phase > p0),
                    lambda: (f"mbarrier.try_wait on phase parity {p0} (barrier at phase "
                             f"{mb0.phase}, {mb0.pending} arrivals and {mb0.tx} tx bytes "
                             "pending)")), lanes)
                ok = idx[done]
                wp(m, w, ok, np.ones(len(ok), dtype=bool))
                w.pc[ok] += 1
                return True
            wp(m, w, idx, done)
        return wait
    unsupported(ins)


# -----------------------------------------------------------------------------------------
# setmaxnreg


@handler("setmaxnreg")
def _setmaxnreg(ins, k):
    inc = "inc" in mods(ins)
    n = ins.operands[0].value if isinstance(ins.operands[0], Imm) else unsupported(ins)
    if not 24 <= n <= 256 or n % 8:
        raise EmulationError(f"line {ins.line}: setmaxnreg count {n} must be in [24, 256] "
                             "and a multiple of 8")

    def run(m, w, idx):
        cta = w.cta
        pool = getattr(cta, "reg_alloc", None)
        if pool is None:
            per_thread = _launch_regs(m)
            pool = cta.reg_alloc = {ww.wid: per_thread for ww in cta.warps}
        cur = pool[w.wid]
        if inc and n < cur or not inc and n > cur:
            raise EmulationError(f"setmaxnreg.{'inc' if inc else 'dec'} to {n} from {cur} "
                                 "registers per thread")
        need = (n - cur) * 32
        total = sum(pool.values()) * 32
        if inc and total + need > m.register_file:
            # inc blocks until other warps have released enough registers
            def room(pool=pool, need=need):
                return sum(pool.values()) * 32 + need <= m.register_file
            w.add_wait(PredWait(room, f"setmaxnreg.inc {n}: register file exhausted"), idx)
            return True
        pool[w.wid] = n
        w.maxnreg = n
    return collective(ins, run)


def _launch_regs(m) -> int:
    """Registers per thread at launch: the cubin's count when the capture has it, otherwise
    the largest multiple of 8 that fits the CTA in the register file."""
    if m.launch.launch_regs:
        return m.launch.launch_regs
    threads = int(np.prod(m.launch.block))
    return min(256, (m.register_file // threads) // 8 * 8)
