"""The emulated machine: CTAs of a cluster, warps with per-lane program counters, a seeded
scheduler, and the waits (barriers, mbarrier phases, warp convergence) threads block on.

Execution model (independent thread scheduling): every lane has its own PC. A warp step
picks the runnable lanes (alive, not waiting) at one PC -- a random one, seeded, when the
warp has diverged -- and executes that instruction for all of them at once with NumPy. A
warp-collective instruction (``.sync``/``.aligned``: shfl, vote, elect, bar.warp.sync,
tcgen05) runs only when every lane of its member mask stands at it; until then those lanes
wait. The scheduler picks a runnable warp at random (seeded) and runs it for a random
quantum, so different seeds interleave warps differently. When no lane of any warp can run
and no asynchronous operation is pending, the run stops with a deadlock report that names
each warp's blocked instruction.

When asynchronous operations (TMA copies, MMAs, commits) complete is the schedule's other
half, chosen by ``policy`` (Note [Schedule policies]):

- ``"random"``: between warp quanta a ready operation completes with probability 1/4 (and
  one always does when no warp can move);
- ``"late"``: an operation completes only when no warp can move, one at a time: every wait
  is tested against the latest completion the program allows (a barrier whose expected
  byte count is too small completes before the rest of its data has landed);
- ``"early"``: every ready operation completes right after the warp quantum that issued it;
- ``"delay:N"``: ``"early"``, except the N-th operation issued (0-based), which completes
  only when no warp can move. ``sm100_run.explore_delays`` runs N = 0, 1, ...: a bounded
  systematic search (every single-operation delay) rather than a sample.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from . import ops  # noqa: F401  (registers every instruction handler)
from .decode import decode_kernel
from .memory import EmulationError, GlobalMemory, SharedMemory, RESERVED_SMEM
from .parser import PtxKernel, Reg
from .values import storage_dtype
from .waits import PredWait, Wait

WARP = 32
FULL = np.ones(WARP, dtype=bool)


@dataclass
class Launch:
    """Everything a kernel launch needs: the kernel, its geometry and parameter bytes."""
    kernel: PtxKernel
    grid: tuple
    block: tuple
    cluster: tuple = (1, 1, 1)
    dynamic_smem: int = 0
    param_bytes: bytes = b""
    param_offsets: dict = field(default_factory=dict)   # param name -> byte offset
    tensormaps: dict = field(default_factory=dict)      # descriptor id -> TensorMap
    static_smem: int = 0
    shared_offsets: dict = field(default_factory=dict)  # shared variable -> window address
    launch_regs: Optional[int] = None                   # registers per thread at launch


class NamedBarrier:
    def __init__(self, bid: int):
        self.bid = bid
        self.arrived = 0
        self.expected: Optional[int] = None
        self.generation = 0

    def arrive(self, n: int, expected: int, where: str):
        if self.expected is None:
            self.expected = expected
        elif self.expected != expected:
            raise EmulationError(f"{where}: barrier {self.bid} used with thread count "
                                 f"{expected} while {self.expected} are expected")
        self.arrived += n
        if self.arrived > self.expected:
            raise EmulationError(f"{where}: barrier {self.bid}: {self.arrived} threads arrived, "
                                 f"only {self.expected} expected")
        if self.arrived == self.expected:
            self.arrived, self.expected = 0, None
            self.generation += 1


class Warp:
    def __init__(self, cta, wid: int, nthreads: int, kernel: PtxKernel):
        self.cta, self.wid = cta, wid
        self.gid = f"cta{cta.rank}.warp{wid}"
        self.pc = np.zeros(WARP, dtype=np.int64)
        self.alive = np.zeros(WARP, dtype=bool)
        self.alive[:max(0, min(WARP, nthreads - wid * WARP))] = True
        self.tid_linear = wid * WARP + np.arange(WARP)
        self.waits: list = []                       # [(Wait, lane mask)]
        self.regs: dict = {}
        self.reg_init: dict = {}                    # register -> lanes written so far
        self.kernel = kernel
        self.steps = 0
        self.maxnreg: Optional[int] = None          # from setmaxnreg
        self.cluster_gen = np.full(WARP, -1, dtype=np.int64)   # barrier.cluster arrivals
        # Note [tcgen05.ld and wait::ld]: destination register -> (TMEM, pending-read entry)
        # of a tcgen05.ld whose read has not been seen to complete
        self.ld_regs: dict = {}
        # Note [tcgen05 thread-sync fences] (strict mode): a wait not yet followed by
        # fence::after_thread_sync; the line of a tcgen05.ld / st not yet followed by
        # fence::before_thread_sync
        self.after_sync_unfenced = False
        self.before_sync_unfenced: Optional[int] = None

    def reg(self, r: Reg) -> np.ndarray:
        arr = self.regs.get(r.name)
        if arr is None:
            arr = np.zeros(WARP, dtype=storage_dtype(self.kernel_type(r.name)))
            self.regs[r.name] = arr
            self.reg_init[r.name] = np.zeros(WARP, dtype=bool)
        return arr

    def kernel_type(self, name: str) -> str:
        types = self.kernel.reg_types
        t = types.get(name)
        if t is None and "." in name:          # "tmp@7.3": register 3 of an inner family
            t = types.get(name[:name.rindex(".") + 1] + "<>")
        if t is None and "@" not in name:      # "%r12": register 12 of a top-level family
            t = types.get(name.rstrip("0123456789") + "<>")
        if t is None:
            raise EmulationError(f"register {name} is not declared")
        return t

    def runnable_mask(self) -> np.ndarray:
        if not self.waits:
            return self.alive
        blocked = np.zeros(WARP, dtype=bool)
        keep = []
        for w, m in self.waits:
            if w.ready():
                continue
            keep.append((w, m))
            blocked |= m
        self.waits = keep
        return self.alive & ~blocked

    def add_wait(self, wait: Wait, lanes: np.ndarray):
        m = np.zeros(WARP, dtype=bool)
        m[lanes] = True
        self.waits.append((wait, m))


class CTA:
    def __init__(self, machine, rank: int, ctaid: tuple, launch: Launch):
        self.machine, self.rank, self.ctaid = machine, rank, ctaid
        nthreads = int(np.prod(launch.block))
        self.nthreads = nthreads
        smem_size = RESERVED_SMEM + launch.static_smem + launch.dynamic_smem
        self.smem = SharedMemory(smem_size, rank)
        self.mbarriers: dict = {}
        self.barriers: dict = {}
        self.tmem = None                            # created by the tcgen05 model on demand
        nwarps = (nthreads + WARP - 1) // WARP
        self.warps = [Warp(self, w, nthreads, launch.kernel) for w in range(nwarps)]

    def barrier(self, bid: int) -> NamedBarrier:
        b = self.barriers.get(bid)
        if b is None:
            b = self.barriers[bid] = NamedBarrier(bid)
        return b


class Machine:
    """Runs one cluster's worth of CTAs at a time (clusters run one after another)."""

    def __init__(self, launch: Launch, gmem: GlobalMemory, seed: int = 0,
                 max_steps: int = 2_000_000, trace: Optional[list] = None,
                 policy: str = "random", strict_fences: bool = False):
        self.policy, self.delayed = parse_policy(policy)
        self.strict_fences = strict_fences             # Note [tcgen05 thread-sync fences]
        self.async_issued = 0                          # asynchronous operations numbered so far
        self.launch = launch
        self.gmem = gmem
        self.rng = np.random.default_rng(seed)
        self.max_steps = max_steps
        self.trace = trace
        self.code = decode_kernel(launch.kernel)
        self.async_ops: list = []                      # pending asynchronous operations
        self.cluster_index = -1
        self.register_file = 64 * 1024

    # -- geometry --------------------------------------------------------------------
    def run(self):
        gx, gy, gz = self.launch.grid
        cx, cy, cz = self.launch.cluster
        if gx % cx or gy % cy or gz % cz:
            raise ValueError(f"grid {self.launch.grid} is not a multiple of the cluster "
                             f"{self.launch.cluster}")
        for kz in range(gz // cz):
            for ky in range(gy // cy):
                for kx in range(gx // cx):
                    ctas = []
                    for z in range(cz):
                        for y in range(cy):
                            for x in range(cx):
                                rank = x + cx * (y + cy * z)
                                ctaid = (kx * cx + x, ky * cy + y, kz * cz + z)
                                ctas.append(CTA(self, rank, ctaid, self.launch))
                    self.cluster_id = (kx, ky, kz)
                    self.cluster_index += 1
                    self._run_cluster(ctas)

    def _run_cluster(self, ctas):
        self.ctas = ctas
        self.cluster_arrived = 0
        self.cluster_generation = 0
        warps = [w for c in ctas for w in c.warps]
        steps = 0
        while True:
            live = [w for w in warps if w.alive.any()]
            if not live and not self.async_ops:
                break
            if not live:
                raise EmulationError("every thread exited with asynchronous operations still "
                                     "pending: " + ", ".join(o.what for o in self.async_ops))
            order = self.rng.permutation(len(live)) if live else []
            progressed = False
            for i in order:
                w = live[i]
                quantum = int(self.rng.integers(1, 48))
                n = self._run_warp(w, quantum)
                steps += n
                if n:
                    progressed = True
                    break
            if self.async_ops and self._complete_async(stuck=not progressed):
                progressed = True
            if not progressed:
                raise EmulationError(self._deadlock_report(live))
            if steps > self.max_steps:
                raise EmulationError(f"step limit {self.max_steps} reached (livelock?); "
                                     + self._deadlock_report(live))
        self._check_exit(ctas)

    def _complete_async(self, stuck: bool) -> bool:
        """Complete asynchronous operations as the policy says; True if any completed."""
        for op in self.async_ops:                      # number them in issue order
            if op.serial is None:
                op.serial, self.async_issued = self.async_issued, self.async_issued + 1
        ready = [op for op in self.async_ops if op.ready()]
        if self.policy in ("early", "delay"):
            now = [op for op in ready if op.serial != self.delayed]
            if not now and stuck:
                now = ready                            # the delayed one, once nothing else moves
            for op in now:
                self._finish(op)
            return bool(now)
        if not ready or not (stuck or (self.policy == "random" and self.rng.random() < 0.25)):
            return False
        self._finish(ready[int(self.rng.integers(len(ready)))])
        return True

    def _finish(self, op):
        self.async_ops.remove(op)
        op.run()
        op.done = True

    def _run_warp(self, w: Warp, quantum: int) -> int:
        code = self.code
        done = 0
        while done < quantum:
            run = w.runnable_mask()
            if not run.any():
                return done
            pcs = w.pc[run]
            pc = int(pcs.min())
            if pc != int(pcs.max()):
                # diverged lanes: any group may go first under independent thread scheduling
                choices = np.unique(pcs)
                pc = int(choices[self.rng.integers(len(choices))])
            group = run & (w.pc == pc)
            if pc >= len(code):
                raise EmulationError(f"{w.gid}: fell off the end of the kernel")
            op = code[pc]
            if op.collective is not None:
                need = op.members(w, group) & w.alive
                if not (w.pc[need] == pc).all() or not run[need].all():
                    # not converged yet: these lanes wait until every member stands here
                    w.add_wait(PredWait(lambda w=w, need=need, pc=pc:
                                        bool((w.pc[need] == pc).all()),
                                        f"waiting for lanes {_lanes(np.nonzero(need)[0])} to "
                                        f"converge at line {op.instr.line}"),
                               np.nonzero(group)[0])
                    continue
            idx = np.nonzero(group)[0]
            if self.trace is not None:
                self.trace.append((self.cluster_index, w.gid, pc, len(idx)))
            if self.strict_fences:
                _tcgen05_fence_check(w, op.instr)
            op.run(self, w, idx)
            w.steps += 1
            done += 1
        return done

    # -- checks ----------------------------------------------------------------------
    def _deadlock_report(self, live) -> str:
        lines = ["deadlock: no thread can make progress"]
        if self.async_ops:
            lines.append("  pending asynchronous operations: "
                         + ", ".join(o.what for o in self.async_ops))
        for w in live:
            pcs = sorted(set(int(p) for p in w.pc[w.alive]))
            for pc in pcs:
                lanes = np.nonzero(w.alive & (w.pc == pc))[0]
                waits = [ww for ww, m in w.waits if m[lanes].any()]
                why = [ww.why for ww in waits]
                ins = self.launch.kernel.instrs[pc] if pc < len(self.launch.kernel.instrs) else None
                text = f"line {ins.line}: {ins.text}" if ins else "end"
                at = [ww.at for ww in waits if ww.at]
                if at:
                    text = at[0]
                lines.append(f"  {w.gid} lanes {_lanes(lanes)} blocked at {text}"
                             f" ({'; '.join(why) or 'runnable'})")
        return "\n".join(lines)

    def _check_exit(self, ctas):
        for c in ctas:
            if c.tmem is not None:
                c.tmem.check_exit()
            for b in c.barriers.values():
                if b.arrived:
                    raise EmulationError(f"CTA {c.rank}: exited with {b.arrived} threads "
                                         f"still arrived at barrier {b.bid}")

    # -- helpers used by the ops --------------------------------------------------------
    def cta_of_rank(self, rank: int) -> CTA:
        if not 0 <= rank < len(self.ctas):
            raise EmulationError(f"CTA rank {rank} is outside the cluster of {len(self.ctas)}")
        return self.ctas[rank]


# Note [tcgen05 thread-sync fences]. The ISA's canonical patterns order tcgen05 operations
# across threads with a thread sync between two fences: the producer issues
# ``tcgen05.fence::before_thread_sync`` after its tcgen05.ld / st and before it arrives (a
# ``tcgen05.commit`` does this implicitly), and the consumer issues
# ``tcgen05.fence::after_thread_sync`` after its wait and before its tcgen05 operations.
# ``strict_fences`` checks those two rules per warp. It is off by default: neither this
# project's SM100 forward nor FlashAttention-4's emits the fences, and both run correctly as
# far as the other checks see, so the strict mode reports a rule of the ISA that production
# kernels do not follow, not a wrong result (docs/ptx_emulator.md).
_SYNC_WAITS = ("mbarrier.try_wait", "mbarrier.test_wait", "bar.sync", "barrier.sync",
               "barrier.cluster.wait")
_SYNC_ARRIVES = ("mbarrier.arrive", "bar.arrive", "barrier.arrive", "bar.sync", "barrier.sync",
                 "barrier.cluster.arrive")
_TCGEN05_DATA = ("tcgen05.ld", "tcgen05.st", "tcgen05.mma", "tcgen05.cp")


def _tcgen05_fence_check(w, ins):
    op = ins.opcode
    if op.startswith("tcgen05.fence::after_thread_sync"):
        w.after_sync_unfenced = False
    elif op.startswith("tcgen05.fence::before_thread_sync") or op.startswith("tcgen05.commit"):
        w.before_sync_unfenced = None
    elif op.startswith(_TCGEN05_DATA):
        if w.after_sync_unfenced:
            raise EmulationError(f"{w.gid} line {ins.line} ({ins.text}): a tcgen05 operation "
                                 "after a thread sync without tcgen05.fence::after_thread_sync "
                                 "(strict fences)")
        if op.startswith(("tcgen05.ld", "tcgen05.st")):
            w.before_sync_unfenced = ins.line
    if op.startswith(_SYNC_ARRIVES) and w.before_sync_unfenced:
        raise EmulationError(f"{w.gid} line {ins.line} ({ins.text}): a thread sync after the "
                             f"tcgen05.ld / st at line {w.before_sync_unfenced} without "
                             "tcgen05.fence::before_thread_sync (strict fences)")
    if op.startswith(_SYNC_WAITS):
        w.after_sync_unfenced = True


POLICIES = ("random", "late", "early")


def parse_policy(policy: str):
    """``(kind, delayed serial)`` of a schedule policy: "random", "late", "early" or
    "delay:N"; ValueError for anything else."""
    if policy in POLICIES:
        return policy, None
    kind, _, n = policy.partition(":")
    if kind == "delay" and n.isdigit():
        return "delay", int(n)
    raise ValueError(f"schedule policy {policy!r}: expected one of {POLICIES} or delay:N")


def _lanes(lanes) -> str:
    lanes = list(int(x) for x in lanes)
    if lanes == list(range(lanes[0], lanes[-1] + 1)):
        return f"{lanes[0]}-{lanes[-1]}" if len(lanes) > 1 else str(lanes[0])
    return ",".join(map(str, lanes))
