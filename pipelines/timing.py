"""Timing mode: replay the protocol with a cost table of a B200-class SM.

``simulate_timing(cfg, n_blocks, work_tiles)`` runs the same flattened role programs the
protocol model checks (pipelines/design.py by default), gives every access a cost from
``CostTable`` and returns a ``Timeline``: per-role busy and wait intervals, the UMMA and TMA
units' busy intervals, the time per work tile and the implied whole-GPU TFLOP/s. It is a
model, not a measurement: nothing here ran on an SM100 GPU.

Costs (all per SM, in clocks; ``CostTable`` holds the numbers, ``COST_SOURCES`` where they
come from). What each recorded access costs:

=============================  ===========================================================
UMMA write of S<i>             S = Q K^T: 2 x rows x n_block x head_dim FLOP on the tensor core
UMMA read of P<i> (cols a..b)  the PV K-chunks reading those columns (split P: two parts)
softmax read of S<i>           TMEM load of S + row max (FMA pipe)
softmax write of P<i>          scale/subtract (packed FMA), exp2 on MUFU and, for the
                               emulated fraction, the degree-3 polynomial on the FMA pipe,
                               row sum, bf16 convert, TMEM store -- for those columns
correction O read+write        rescale O in TMEM (run-time branch "rescale", taken for the
                               ``rescale_fraction`` of blocks that the threshold lets through)
correction final O, sO write   TMEM load, normalize, convert, SMEM store
TMA write (sQ, sKV)            latency + bytes / TMA bandwidth (one TMA engine per SM)
epilogue read of sO            TMA store of the O tile, waited before the release
=============================  ===========================================================

Shared resources: the UMMA unit (in order), MUFU (shared by both softmax warpgroups), the
FMA pipe (softmax + correction), TMEM port, TMA engine. A step that needs a resource starts
when it is free (first come, first served in simulated time).

The replay itself (``Replay``: waits, arrivals, units, resources) is the same for the SM100
backward, whose prices and step times are in pipelines/timing_bwd.py; both read this
module's ``CostTable``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from fa_sm100.config import FmhaConfig
from pipelines.model import ProtocolModel
from pipelines.program import Op

# Where each cost-table value comes from (the assumptions are ours and stated as such).
COST_SOURCES = {
    "clock_ghz": "B200 boost clock ~1.9 GHz (brief / NVIDIA B200 product material)",
    "num_sms": "148 SMs on B200",
    "umma_flop_per_clk": "2.25 PFLOP/s dense BF16 per B200 / (148 SMs x 1.9 GHz) = 8001 "
                         "-> 8192 FLOP/clk/SM, i.e. one 128x256x16 UMMA per 128 clocks",
    "mufu_ex2_per_clk": "MUFU.EX2: 16 per clock per SM. FA3 (Shah et al. 2024) gives H100 3.9 "
                        "TFLOP/s of special functions = 16/clk/SM; assumed unchanged on B200, "
                        "which is why FA4 emulates part of exp2 on the FMA pipe. (The brief's "
                        "alternative, 16/clk per quadrant = 64/clk/SM, is one CostTable field.)",
    "fma_per_clk": "128 FP32 lanes per SM (32 per quadrant); packed FFMA2/FMUL2/FADD2 "
                   "(sm_100) do two per lane, so 256 per clock for packed ops (assumption: "
                   "the kernel's elementwise math is packed)",
    "ex2_poly_ops": "degree-3 polynomial + range reduction + exponent insert: ~6 FP32 ops per "
                    "element (assumption, counted from fa_sm100/softmax_math.py's scheme)",
    "softmax_ops_per_elem": "scale-subtract FMA, max, add, convert: ~4 FP32 ops per element "
                            "(assumption)",
    "tmem_bytes_per_clk": "tcgen05.ld/st: assumed 4096 B/clk per SM (32 lanes x 32 bit x 4 "
                          "quadrants per 16 columns/clk; not published)",
    "smem_bytes_per_clk": "128 B/clk per SM shared-memory bandwidth (Hopper/Blackwell figure)",
    "tma_latency_clk": "~1000 clocks from TMA issue to mbarrier completion for an L2 hit "
                       "(assumption; HBM misses are slower)",
    "tma_bytes_per_clk": "64 B/clk per SM from L2 (assumption; 8 TB/s HBM / 148 SMs is only "
                         "~28 B/clk, K/V tiles are L2 hits shared by many CTAs); the backward's "
                         "dK / dV rows leave through st.global at this SM-L2 rate too",
    "wait_latency_clk": "mbarrier try_wait wake-up ~20 clocks (assumption)",
    "mask_ops_per_elem": "causal / sliding-window masking of the blocks that cross the "
                         "diagonal: index compare + select, ~2 FP32-pipe ops per element "
                         "(assumption); applied to the first ceil(rows of the pair's tile / "
                         "n_block) blocks each softmax warpgroup visits per work tile; the "
                         "backward's compute warps pay it on every step of a causal walk (they "
                         "compare every score) and, as an upper bound, of a windowed one",
    "issue_clk": "issuing one UMMA / TMA / commit from one thread: ~8 clocks (assumption)",
    "bwd_p_ops_per_elem": "backward P = exp2(S scale_log2 - LSE2): one FMA and the 16-bit "
                          "convert per score beside its MUFU.EX2 (fa_sm100/sm100/bwd_compute.py)",
    "bwd_ds_ops_per_elem": "backward dS = P (dP - Delta): subtract, multiply, 16-bit convert "
                           "per score (fa_sm100/sm100/bwd_compute.py)",
    "softcap_ops_per_elem": "a capped score (backward model only): softcap_tanh's eleven "
                            "FMA-pipe instructions beside one more MUFU.EX2 "
                            "(fa_sm100/dsl_math.py), and the two of dS's factor 1 - t^2",
    "red_bytes_per_clk": "red.global.add.f32 of the backward's dQ: assumed half the SM's "
                         "L2 load rate (tma_bytes_per_clk), as each reduction reads and writes "
                         "its L2 line; the dQ warps wait while the L2 takes the adds "
                         "(not published)",
    "dsmem_bytes_per_clk": "st.shared::cluster into the other CTA of a pair (the 2-CTA "
                           "backward's dS exchange): the SM-to-SM network's rate is not "
                           "published; assumed a quarter of the SM's own shared-memory rate "
                           "(smem_bytes_per_clk), shared by the SM's stores to its peer",
    "rescale_fraction": "share of blocks whose row max grows past the threshold: 1.0 with "
                        "threshold 0 (warp vote: some row moves almost every block), ~0.05 "
                        "with threshold 8.0 (assumption, random scores)",
}


@dataclass(frozen=True)
class CostTable:
    clock_ghz: float = 1.9
    num_sms: int = 148
    umma_flop_per_clk: float = 8192.0
    mufu_ex2_per_clk: float = 16.0
    fma_per_clk: float = 256.0
    ex2_poly_ops: float = 6.0
    softmax_ops_per_elem: float = 4.0
    mask_ops_per_elem: float = 2.0
    tmem_bytes_per_clk: float = 4096.0
    smem_bytes_per_clk: float = 128.0
    tma_latency_clk: float = 1000.0
    tma_bytes_per_clk: float = 64.0
    wait_latency_clk: float = 20.0
    issue_clk: float = 8.0
    bwd_p_ops_per_elem: float = 2.0
    bwd_ds_ops_per_elem: float = 3.0
    softcap_ops_per_elem: float = 13.0
    red_bytes_per_clk: float = 32.0
    dsmem_bytes_per_clk: float = 32.0
    rescale_fraction_threshold0: float = 1.0
    rescale_fraction_thresholded: float = 0.05
    # calibration: every duration on a resource is multiplied by its scale
    scale_umma: float = 1.0
    scale_threads: float = 1.0
    scale_tma: float = 1.0

    def scaled(self, umma: float = 1.0, threads: float = 1.0, tma: float = 1.0) -> "CostTable":
        """A copy with durations multiplied (the ablation tool's fitting hook)."""
        return dataclasses.replace(self, scale_umma=self.scale_umma * umma,
                                   scale_threads=self.scale_threads * threads,
                                   scale_tma=self.scale_tma * tma)

    def calibrate(self, target_tflops: float, cfg: Optional[FmhaConfig] = None, n_blocks: int = 64,
                  work_tiles: int = 4, resources=("umma", "threads", "tma"), iters: int = 12,
                  rel_tol: float = 1e-3) -> "CostTable":
        """Scale the durations of ``resources`` by one common factor so the predicted whole-GPU
        TFLOP/s of ``cfg`` matches ``target_tflops`` (e.g. FA4's published 1535 TFLOP/s,
        hdim 128, seqlen 8k, non-causal, B200: n_blocks = 8192 / 128 = 64; a few work tiles
        per CTA, as a batch x heads grid of that size gives a persistent kernel)."""
        cfg = cfg or FmhaConfig()
        if target_tflops <= 0:
            raise ValueError(f"calibrate: target {target_tflops} TFLOP/s must be positive")

        def predict(f):
            t = self.scaled(**{r: f for r in resources})
            return simulate_timing(cfg, n_blocks, work_tiles, t).tflops

        # Predicted TFLOP/s falls roughly as 1 / scale: fixed-point iterations converge fast.
        f = 1.0
        for _ in range(iters):
            got = predict(f)
            if abs(got - target_tflops) <= rel_tol * target_tflops:
                return self.scaled(**{r: f for r in resources})
            f *= got / target_tflops
        raise ValueError(f"calibrate: no scale of {resources} reaches {target_tflops} TFLOP/s "
                         f"(last prediction {got:.1f} at scale {f:.3f})")

    def rescale_fraction(self, cfg: FmhaConfig) -> float:
        return self.rescale_fraction_threshold0 if cfg.rescale_threshold == 0 else self.rescale_fraction_thresholded


@dataclass
class Interval:
    actor: str
    kind: str  # "busy" | "wait"
    start: float
    end: float
    label: str


class RoleIntervals:
    """What both kernels' timelines (``Timeline`` here, ``timing_bwd.BwdTimeline``) derive from
    their ``intervals`` and ``total_clk``."""

    def busy_fraction(self) -> dict:
        out = {}
        for iv in self.intervals:
            if iv.kind == "busy":
                out[iv.actor] = out.get(iv.actor, 0.0) + iv.end - iv.start
        return {k: v / self.total_clk for k, v in out.items()} if self.total_clk else out

    def by_actor(self) -> dict:
        out = {}
        for iv in self.intervals:
            out.setdefault(iv.actor, []).append(iv)
        return out


@dataclass
class Timeline(RoleIntervals):
    cfg: FmhaConfig
    n_blocks: int
    work_tiles: int
    intervals: list = field(default_factory=list)
    total_clk: float = 0.0
    tile_end_clk: list = field(default_factory=list)  # when each work tile's output left
    costs: CostTable = field(default_factory=CostTable)

    @property
    def time_per_tile_clk(self) -> float:
        return self.total_clk / max(self.work_tiles, 1)

    @property
    def steady_tile_clk(self) -> float:
        """Mean clocks between consecutive work tiles' outputs (the persistent steady state;
        the whole run when there is one tile)."""
        e = self.tile_end_clk
        return (e[-1] - e[0]) / (len(e) - 1) if len(e) >= 2 else self.total_clk

    @property
    def flops_per_tile(self) -> float:
        rows = self.cfg.m_block * self.cfg.q_stage
        return 2.0 * rows * self.n_blocks * self.cfg.n_block * (self.cfg.head_dim + self.cfg.head_dim_v)

    @property
    def tflops(self) -> float:
        """Whole-GPU TFLOP/s with every SM running ``work_tiles`` tiles like this one
        (``time_per_tile_clk``: pipeline fill and drain included)."""
        secs = self.time_per_tile_clk / (self.costs.clock_ghz * 1e9)
        return self.flops_per_tile * self.costs.num_sms / secs / 1e12

    def to_dict(self) -> dict:
        """JSON-able form for the timeline and ablation tools."""
        return {
            "config": dataclasses.asdict(self.cfg),
            "n_blocks": self.n_blocks,
            "work_tiles": self.work_tiles,
            "total_clk": self.total_clk,
            "time_per_tile_clk": self.time_per_tile_clk,
            "steady_tile_clk": self.steady_tile_clk,
            "tile_end_clk": list(self.tile_end_clk),
            "tflops": self.tflops,
            "busy_fraction": self.busy_fraction(),
            "costs": dataclasses.asdict(self.costs),
            "intervals": [dataclasses.asdict(iv) for iv in self.intervals],
        }


class Replay:
    """The replay engine of the timing mode, shared by the forward's model and the backward's
    (pipelines/timing_bwd.py): it runs the flattened role programs of a ``ProtocolModel`` in
    simulated time and keeps per-actor busy/wait intervals. A subclass prices the accesses
    (``thread_cost``, ``umma_cost``, ``umma_label``); everything else is common: an actor
    always runs its own next operation, the one furthest behind in time first; a wait ends
    when its barrier phase completed (the latest arrival of the phase, a UMMA commit once
    every earlier MMA finished, a TMA copy once its bytes landed) plus the wake-up latency;
    a shared resource serves requests first come, first served (``use``)."""

    def __init__(self, model: ProtocolModel, costs: CostTable):
        self.m, self.c = model, costs
        # per-SM resources, keyed (resource, cta); the pair's UMMA queue is one ("umma", 0)
        self.free = {}
        self.done = {}  # (barrier key, phase) -> completion time
        self.arr_time = {}  # barrier key -> latest arrival time in the current phase
        self.tl: list[Interval] = []
        # Causes, for the critical path: pred[k] is the index in ``tl`` of the busy interval
        # whose end let busy interval k start (None: the start of the run, or a wait's row).
        self.pred: list[Optional[int]] = []
        self.cause = {}  # actor index -> the interval its current time follows from
        self.last_on = {}  # (unit, cta) -> its latest busy interval
        self.arr_node = {}  # barrier key -> the interval behind the phase's latest arrival
        self.done_node = {}  # (barrier key, phase) -> the interval that completed it

    def _add(self, iv: Interval, pred: Optional[int]) -> int:
        self.tl.append(iv)
        self.pred.append(pred)
        return len(self.tl) - 1

    def _unit_pred(self, unit: tuple, start: float, cause: Optional[int]) -> Optional[int]:
        """What a unit's next job waits for: the unit's previous job when it is still busy at
        ``start``, else what the issuing actor's time follows from."""
        return self.last_on.get(unit) if self.free.get(unit, 0.0) > start else cause

    def use(self, res: str, start: float, dur: float, cta: int = 0) -> float:
        s = max(start, self.free.get((res, cta), 0.0))
        self.free[(res, cta)] = s + dur
        return s + dur

    def thread_cost(self, a, op: Op, t: float) -> tuple[float, str]:
        """(end time, label) of the threads' access ``op`` of actor ``a`` started at ``t``."""
        raise NotImplementedError

    def umma_cost(self, op: Op) -> float:
        """Tensor-core clocks of the MMA whose access ``op`` is (0: an operand read)."""
        raise NotImplementedError

    def umma_label(self, op: Op, actor: str) -> str:
        return f"{op.region} ({actor})"

    def run(self) -> list[float]:
        """Replay every actor to its end; returns each actor's finishing time."""
        model, costs = self.m, self.c
        st = model.initial()
        times = [0.0] * len(model.actors)
        while True:
            acts = [a for a in model.enabled(st) if a[0] == "actor"]
            if not acts and not (st.umma_q or st.tma):
                break
            if not acts:  # drain the asynchronous units (their times are already fixed)
                model.apply(st, model.enabled(st)[0])
                continue
            i = min((a[1] for a in acts), key=lambda j: times[j])
            times[i] = self._step(st, i, times[i])
        return times

    def _step(self, st, i: int, t: float) -> float:
        """Run actor ``i``'s next operation from time ``t``; returns the actor's new time."""
        model, costs = self.m, self.c
        a = model.actors[i]
        op = a.ops[st.pcs[i]]
        cause = self.cause.get(i)
        tgt = model._wait_target(a, op) if op.kind in ("wait", "acquire") else None
        if tgt is not None:
            ready = self.done.get(tgt, 0.0)
            if ready > t:
                self._add(Interval(a.name, "wait", t, ready, op.describe()), None)
                t = ready + costs.wait_latency_clk
                cause = self.done_node.get(tgt)
        before = dict(st.bars)
        tma_done, tma_node = t, None
        if op.kind == "access" and op.unit == "umma":
            dur = self.umma_cost(op)
            t += costs.issue_clk
            if dur:
                unit = ("umma", 0)
                pred = self._unit_pred(unit, t, cause)
                end = self.use("umma", t, dur)
                self.last_on[unit] = self._add(
                    Interval("umma", "busy", end - dur, end, self.umma_label(op, a.name)), pred)
        elif op.kind == "access" and op.unit == "tma":
            dur = costs.scale_tma * model._tma_bytes(op) / costs.tma_bytes_per_clk
            unit = ("tma", a.cta)
            pred = self._unit_pred(unit, t + costs.issue_clk, cause)
            end = self.use("tma", t + costs.issue_clk, dur, a.cta)
            tma_node = self._add(Interval(f"tma@{a.cta}", "busy", end - dur, end,
                                          f"{op.region} ({a.name})"), pred)
            self.last_on[unit] = tma_node
            tma_done = end + costs.scale_tma * costs.tma_latency_clk
            t += costs.issue_clk
        elif op.kind == "access":
            end, label = self.thread_cost(a, op, t)
            cause = self._add(Interval(a.name, "busy", t, end, label), cause)
            t = end
        elif op.kind in ("commit", "release") and op.arrive == "umma":
            t += costs.issue_clk
        n_tma = len(st.tma)
        model.apply(st, ("actor", i))
        self._note_arrivals(st, before, t, cause)
        if op.kind == "access" and op.unit == "tma" and len(st.tma) > n_tma:
            key, nb, rnd, vc, who = st.tma[-1]
            st.tma = st.tma[:-1]
            before = dict(st.bars)
            model._complete_tx(st, key, nb, rnd, vc, who)
            self._note_arrivals(st, before, tma_done, tma_node)
        while st.umma_q:  # a commit arrives when every earlier UMMA has finished
            before = dict(st.bars)
            model.apply(st, ("umma", 0))
            unit = ("umma", 0)
            when = max(self.free.get(unit, 0.0), t)
            self._note_arrivals(st, before, when, self._unit_pred(unit, t, cause))
        self.cause[i] = cause
        return t

    def _note_arrivals(self, st, before: dict, when: float, node: Optional[int] = None) -> None:
        """Barriers that changed got an arrival at ``when`` (following from interval ``node``);
        completed phases get the latest arrival time of the phase as their completion time."""
        for key, val in st.bars.items():
            old = before.get(key)
            if old == val:
                continue
            if when >= self.arr_time.get(key, 0.0):
                self.arr_node[key] = node
            self.arr_time[key] = max(self.arr_time.get(key, 0.0), when)
            for p in range(old[0] if old else 0, val[0]):
                self.done[(key, p)] = self.arr_time[key]
                self.done_node[(key, p)] = self.arr_node.get(key)
            if old is None or val[0] != old[0]:
                self.arr_time[key] = 0.0 if val[1] == self.m.expected[key] and not val[2] else when
                self.arr_node[key] = None if self.arr_time[key] == 0.0 else node

    def critical_path(self, last: int) -> list[int]:
        """The chain of busy intervals that ends with interval ``last``, each one the cause of
        the next one's start, first to last."""
        path = []
        k: Optional[int] = last
        while k is not None:
            path.append(k)
            k = self.pred[k]
        return path[::-1]


class _Sim(Replay):
    """The forward's prices (the table in the module docstring)."""

    def __init__(self, cfg: FmhaConfig, model: ProtocolModel, costs: CostTable, n_blocks: int):
        super().__init__(model, costs)
        self.cfg = cfg
        self.tile_ends: list[float] = []
        self.p_cols = cfg.n_block * cfg.dtype_bytes // 4
        self.n_blocks = n_blocks
        self.s_reads: dict = {}  # actor -> S reads so far (to find the masked blocks)
        tile_rows = cfg.m_block * cfg.q_stage * cfg.cta_group
        self.masked_blocks = (-(-tile_rows // cfg.n_block)) if (cfg.causal or cfg.is_local) else 0
        self.masked_blocks = min(self.masked_blocks, n_blocks)

    def thread_cost(self, a, op: Op, t: float) -> tuple[float, str]:
        """End time of a thread access of actor ``a`` starting at ``t``."""
        c, cfg = self.c, self.cfg
        k = c.scale_threads
        rows, n, dv = cfg.m_block, cfg.n_block, cfg.head_dim_v
        reg = op.region
        if reg.startswith("S") and op.mode == "r":
            seen = self.s_reads.get(a.name, 0)
            self.s_reads[a.name] = seen + 1
            ops = 1.0 + (c.mask_ops_per_elem if seen % self.n_blocks < self.masked_blocks else 0.0)
            end = self.use("tmem", t, k * rows * n * 4 / c.tmem_bytes_per_clk, a.cta)
            label = "S -> regs, mask, row max" if ops > 1.0 else "S -> regs, row max"
            return self.use("fma", end, k * rows * n * ops / c.fma_per_clk, a.cta), label
        if reg.startswith("P") and op.mode == "w":
            lo, hi = op.cols or (0, self.p_cols)
            elems = rows * n * (hi - lo) / self.p_cols
            f = cfg.ex2_emu_fraction
            sfu = k * elems * (1 - f) / c.mufu_ex2_per_clk
            fma = k * elems * (c.softmax_ops_per_elem + f * c.ex2_poly_ops) / c.fma_per_clk
            end = max(self.use("mufu", t, sfu, a.cta), self.use("fma", t, fma, a.cta))
            return self.use("tmem", end, k * elems * 2 / c.tmem_bytes_per_clk, a.cta), "exp2, P -> TMEM"
        if reg.startswith("O"):
            end = self.use("tmem", t, k * rows * dv * 4 / c.tmem_bytes_per_clk, a.cta)
            if op.mode == "w":
                return self.use("fma", end, k * rows * dv / c.fma_per_clk, a.cta), "rescale O"
            return end, "O -> regs"
        if reg == "sO":
            if a.role == "epilogue":
                nbytes = rows * dv * cfg.dtype_bytes
                end = self.use("tma", t, c.scale_tma * nbytes / c.tma_bytes_per_clk, a.cta)
                if a.cta == 0:
                    self.tile_ends.append(end)
                return end + c.scale_tma * c.tma_latency_clk / 4, "TMA store O"
            end = self.use("fma", t, k * rows * dv / c.fma_per_clk, a.cta)
            return self.use("smem", end, k * rows * dv * cfg.dtype_bytes / c.smem_bytes_per_clk, a.cta), "O -> SMEM"
        return t + k * 16, f"{reg} {op.mode}"

    def umma_cost(self, op: Op) -> float:
        cfg, c = self.cfg, self.c
        rows = cfg.m_block  # per SM: 2-CTA splits M=256 over the pair
        if op.region.startswith("S") and op.mode == "w":
            return c.scale_umma * 2 * rows * cfg.n_block * cfg.head_dim / c.umma_flop_per_clk
        if op.region.startswith("P") and op.mode == "r":
            lo, hi = op.cols or (0, self.p_cols)
            frac = (hi - lo) / self.p_cols
            return c.scale_umma * frac * 2 * rows * cfg.n_block * cfg.head_dim_v / c.umma_flop_per_clk
        return 0.0


def simulate_timing(cfg: FmhaConfig, n_blocks: int, work_tiles: int = 2,
                    costs: Optional[CostTable] = None, programs: Optional[dict] = None) -> Timeline:
    """Per-role busy/wait intervals and the time per work tile for ``cfg`` (a model)."""
    cfg = cfg.validate()
    if n_blocks < 1 or work_tiles < 1:
        raise ValueError(f"n_blocks={n_blocks}, work_tiles={work_tiles}: both must be >= 1")
    costs = costs or CostTable()
    if programs is None:
        from pipelines.design import design_recording

        programs = design_recording(cfg).programs
    frac = costs.rescale_fraction(cfg)

    def policy(cond, k):
        return int((k + 1) * frac) > int(k * frac) if cond == "rescale" else True

    model = ProtocolModel(cfg, programs, {"n_blocks": n_blocks, "work_tiles": work_tiles}, policy)
    sim = _Sim(cfg, model, costs, n_blocks)
    times = sim.run()
    total = max([*times, *sim.free.values(), *sim.tile_ends] or [0.0])
    ends = sorted(sim.tile_ends)
    per_tile = [ends[k] for k in range(cfg.q_stage - 1, len(ends), cfg.q_stage)]
    return Timeline(cfg, n_blocks, work_tiles, sim.tl, total, per_tile, costs)


def main(argv=None) -> int:
    """``python -m pipelines.timing [--set f=v ...] [--n-blocks 64] [--work-tiles 4]
    [--calibrate TFLOPS]``: print the modelled time per tile and each role's busy share."""
    import argparse
    import sys

    from fa_sm100.config import config_from_overrides

    ap = argparse.ArgumentParser(prog="python -m pipelines.timing", description=main.__doc__)
    ap.add_argument("--set", action="append", default=[], metavar="field=value")
    ap.add_argument("--n-blocks", type=int, default=64)
    ap.add_argument("--work-tiles", type=int, default=4)
    ap.add_argument("--calibrate", type=float, metavar="TFLOPS",
                    help="first fit the cost table to this TFLOP/s for the default config")
    ap.add_argument("--json", metavar="OUT", help="write the timeline (intervals included)")
    args = ap.parse_args(argv)
    try:
        cfg = config_from_overrides(args.set)
        costs = CostTable()
        if args.calibrate:
            costs = costs.calibrate(args.calibrate, FmhaConfig(), args.n_blocks, args.work_tiles)
        tl = simulate_timing(cfg, args.n_blocks, args.work_tiles, costs)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"modelled (not measured): {tl.time_per_tile_clk:.0f} clk per work tile, "
          f"{tl.time_per_tile_clk / costs.clock_ghz / 1e3:.2f} us, {tl.tflops:.0f} TFLOP/s "
          f"(scale umma {costs.scale_umma:.3f}, threads {costs.scale_threads:.3f}, tma {costs.scale_tma:.3f})")
    for actor, frac in sorted(tl.busy_fraction().items()):
        print(f"  {actor:14} busy {frac:6.1%}")
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(tl.to_dict(), f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
