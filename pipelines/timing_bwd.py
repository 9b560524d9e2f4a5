"""Timing mode of the SM100 backward: its recorded protocol, replayed with the forward's costs.

``simulate_bwd(cfg, steps)`` replays the role programs recorded while the backward kernel is
traced (``pipelines.kernel_source.kernel_recording``: a cross-compile, seconds per config,
cached) for one CTA's walk of ``steps`` steps (query blocks x query heads of the group, against
the CTA's key block). The replay is the forward's (``timing.Replay``), the costs are the
forward's ``CostTable``; only the prices of the backward's accesses are here. It returns a
``BwdTimeline``: per-role busy and wait intervals, the tensor core's and the TMA engine's busy
intervals, the time per step in the steady state and of the whole CTA, and which role bounds
the step. ``problem_time`` turns walk times into the time of a whole problem. It is a model,
not a measurement: nothing here ran on an SM100 GPU.

What each recorded access costs (per SM, in clocks; under 2-CTA, Note [Backward 2-CTA] in
fa_sm100/sm100/bwd_config.py, a pair's MMA runs on both SMs' tensor cores, each doing one
CTA's share, which is the 1-CTA MMA's FLOPs: one tensor-core queue for the pair):

============================  ===========================================================
UMMA write of S, dP, dV,      2 M N K FLOP on the tensor core, M N K from the config
dK, dQ                        (``BWD_MMAS``); the operand reads cost nothing of their own
TMA write of sK, sV, sQ, sdO, the bytes of the buffer's tile (``PipelineSpec.buffer_tx``)
sLSE2, sDelta                 at the TMA rate, landing after the TMA latency
compute read of S, dP         TMEM load of the warpgroup's query columns (float32)
compute read of sLSE2, sDelta one float32 per query column per warp (an SMEM broadcast)
compute write of P<h>         x scale_log2 - LSE2 (FMA), exp2 (MUFU), 16-bit convert, the
                              causal / band mask, softcap's tanh, then TMEM store
compute write of dS<h>        P (dP - Delta), 16-bit convert, TMEM store
compute write of sdS          SMEM store of the warpgroup's 16-bit dS; under 2-CTA the
                              warpgroup whose query rows the peer owns stores over the
                              SM-to-SM network instead (``dsmem_bytes_per_clk``)
compute read of dV, dK        the epilogue: TMEM load, scale and convert (FMA), st.global
dq read of dQ                 TMEM load, red.global.add of every float32 (``red_bytes_per_clk``):
                              m_block x head_dim, half of it per CTA under 2-CTA
============================  ===========================================================

The compute warpgroups share the SM's MUFU, FMA pipe, TMEM and SMEM ports; the dQ adds and
the dK / dV stores share its path to L2 ("gmem"). A step ends when the dQ warps have handed
its dQ to L2; ``BwdTimeline.step_clk`` is the mean time between step ends.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass, field
from typing import Callable, Optional

from fa_sm100.bands import kernel_window, q_block_range
from pipelines.check import trip_bindings
from pipelines.kernel_source import kernel_recording
from pipelines.model import ProtocolModel
from pipelines.program import Op
from pipelines.spec import BWD_PIPELINES, table_of
from pipelines.timing import CostTable, Replay, RoleIntervals

# The five MMAs of a step (Note [Backward MMA order] in fa_sm100/sm100/bwd_mma.py): the TMEM
# region each one writes -> (label, the config fields giving its M, N, K).
BWD_MMAS = {
    "S": ("S^T = K Q^T", ("n_block", "m_block", "head_dim")),
    "dP": ("dP^T = V dO^T", ("n_block", "m_block", "head_dim_v")),
    "dV": ("dV += P^T dO", ("n_block", "head_dim_v", "m_block")),
    "dK": ("dK += dS^T Q", ("n_block", "head_dim", "m_block")),
    "dQ": ("dQ = dS K", ("m_block", "head_dim", "n_block")),
}
# Walk lengths the linear fit of ``walk_clk`` simulates (shorter walks are simulated directly).
FIT_STEPS = (8, 12)
# A step ends when CTA 0's dQ warps have handed its dQ to L2 (their one access per step).
STEP_END_ACTOR, STEP_END_LABEL = "dq@0", "dQ -> red.global.add"


def mma_shape(cfg, region: str) -> tuple[int, int, int]:
    """(M, N, K) of the MMA that writes TMEM ``region``."""
    if region not in BWD_MMAS:
        raise ValueError(f"no backward MMA writes {region!r} (MMAs: {sorted(BWD_MMAS)})")
    return tuple(int(getattr(cfg, f)) for f in BWD_MMAS[region][1])


def flops_per_step(cfg) -> float:
    """The five MMAs of one step."""
    total = 0.0
    for region in BWD_MMAS:
        m, n, k = mma_shape(cfg, region)
        total += 2.0 * m * n * k
    return total


@dataclass
class BwdTimeline(RoleIntervals):
    """One CTA's modelled walk: intervals (actor, busy/wait), ``step_end_clk`` (when each
    step's dQ left the dQ warps), the whole CTA's ``total_clk`` (epilogue included)."""

    cfg: object
    steps: int
    intervals: list = field(default_factory=list)
    total_clk: float = 0.0
    step_end_clk: list = field(default_factory=list)
    costs: CostTable = field(default_factory=CostTable)
    critical: list = field(default_factory=list)  # indices of ``intervals``: the critical path

    def _window(self) -> tuple[float, float, int]:
        """(start, end, steps) of the steady state: from the first step's end to the last's
        (the whole run when there is one step)."""
        e = self.step_end_clk
        return (e[0], e[-1], len(e) - 1) if len(e) >= 2 else (0.0, self.total_clk, 1)

    @property
    def step_clk(self) -> float:
        """Mean clocks per step in the steady state."""
        lo, hi, n = self._window()
        return (hi - lo) / n

    def busy_per_step(self) -> dict:
        """Actor -> clocks it is busy per step in the steady state (the units ``umma`` and
        ``tma@0`` included). None exceeds ``step_clk``: an actor runs one thing at a time."""
        lo, hi, n = self._window()
        out: dict = {}
        for iv in self.intervals:
            if iv.kind == "busy":
                part = min(iv.end, hi) - max(iv.start, lo)
                if part > 0:
                    out[iv.actor] = out.get(iv.actor, 0.0) + part / n
        return out

    def critical_per_step(self) -> dict:
        """Actor -> clocks per step it spends on the critical path (the chain of busy
        intervals, each the cause of the next one's start, that ends with the last step), and
        "latency": the rest (barrier wake-ups, TMA latency, issue). They sum to ``step_clk``."""
        lo, hi, n = self._window()
        out: dict = {}
        for k in self.critical:
            iv = self.intervals[k]
            part = min(iv.end, hi) - max(iv.start, lo)
            if part > 0:
                out[iv.actor] = out.get(iv.actor, 0.0) + part / n
        out["latency"] = (hi - lo) / n - sum(out.values())
        return out

    @property
    def bound_by(self) -> str:
        """The actor with the most time per step on the critical path: the step cannot be
        shorter than its work there, whatever the other roles overlap."""
        crit = {a: v for a, v in self.critical_per_step().items() if a != "latency"}
        return max(crit, key=crit.get)

    def top_waits(self, actor: str) -> list[tuple[str, float]]:
        """(what it waits for, clocks per step) of ``actor`` in the steady state, longest first."""
        lo, hi, n = self._window()
        acc: dict = {}
        for iv in self.intervals:
            part = min(iv.end, hi) - max(iv.start, lo)
            if iv.actor == actor and iv.kind == "wait" and part > 0:
                pipe = iv.label.split()[1].split("[")[0]
                acc[pipe] = acc.get(pipe, 0.0) + part / n
        return sorted(acc.items(), key=lambda kv: -kv[1])

    @property
    def tflops(self) -> float:
        """Whole-GPU MMA TFLOP/s with every SM in this steady state."""
        secs = self.step_clk / (self.costs.clock_ghz * 1e9)
        return flops_per_step(self.cfg) * self.costs.num_sms / secs / 1e12

    def to_dict(self) -> dict:
        return {
            "config": dataclasses.asdict(self.cfg),
            "steps": self.steps,
            "total_clk": self.total_clk,
            "step_clk": self.step_clk,
            "step_end_clk": list(self.step_end_clk),
            "bound_by": self.bound_by,
            "critical_per_step_clk": self.critical_per_step(),
            "busy_per_step_clk": self.busy_per_step(),
            "tflops": self.tflops,
            "busy_fraction": self.busy_fraction(),
            "costs": dataclasses.asdict(self.costs),
            "intervals": [dataclasses.asdict(iv) for iv in self.intervals],
        }


class _BwdSim(Replay):
    """The backward's prices (the table in the module docstring)."""

    def __init__(self, cfg, model: ProtocolModel, costs: CostTable):
        super().__init__(model, costs)
        self.cfg = cfg

    def _cols(self, op: Op) -> int:
        """Query columns a compute warpgroup's access covers: its recorded range (S, dP, sLSE2,
        sDelta, sdS), or its half of P^T / dS^T (16-bit values, two per TMEM column)."""
        if op.cols is not None:
            return op.cols[1] - op.cols[0]
        return self.m.plan[op.region].cols * 4 // self.cfg.dtype_bytes

    def _elems(self, op: Op) -> int:
        """Scores of the warpgroup's access: every key row (TMEM lane) times its columns."""
        return self.cfg.n_block * self._cols(op)

    def thread_cost(self, a, op: Op, t: float) -> tuple[float, str]:
        c, cfg = self.c, self.cfg
        k, cta, reg = c.scale_threads, a.cta, op.region
        if reg in ("S", "dP"):
            end = self.use("tmem", t, k * self._elems(op) * 4 / c.tmem_bytes_per_clk, cta)
            return end, f"{'S^T' if reg == 'S' else 'dP^T'} -> regs"
        if reg in ("sLSE2", "sDelta"):
            nbytes = self._cols(op) * 4 * a.warps
            return self.use("smem", t, k * nbytes / c.smem_bytes_per_clk, cta), f"{reg[1:]} <- SMEM"
        if reg in ("P0", "P1"):
            elems = self._elems(op)
            ops = (c.bwd_p_ops_per_elem + (c.mask_ops_per_elem if cfg.causal or cfg.is_local else 0.0)
                   + (c.softcap_ops_per_elem if cfg.softcap else 0.0))
            ex2 = 2 if cfg.softcap else 1
            end = max(self.use("mufu", t, k * elems * ex2 / c.mufu_ex2_per_clk, cta),
                      self.use("fma", t, k * elems * ops / c.fma_per_clk, cta))
            end = self.use("tmem", end, k * elems * cfg.dtype_bytes / c.tmem_bytes_per_clk, cta)
            return end, "exp2, P^T -> TMEM"
        if reg in ("dS0", "dS1"):
            elems = self._elems(op)
            end = self.use("fma", t, k * elems * c.bwd_ds_ops_per_elem / c.fma_per_clk, cta)
            end = self.use("tmem", end, k * elems * cfg.dtype_bytes / c.tmem_bytes_per_clk, cta)
            return end, "dS^T -> TMEM"
        if reg == "sdS":
            # the warpgroup's half of the queries for its CTA's keys (under 2-CTA the
            # recorded columns are those keys' place in the pair's buffer)
            nbytes = k * cfg.n_block * (cfg.m_block // 2) * cfg.dtype_bytes
            if op.cta is not None and op.cta != cta:  # the 2-CTA exchange: into the peer
                return self.use("dsmem", t, nbytes / c.dsmem_bytes_per_clk, cta), "dS -> peer SMEM"
            return self.use("smem", t, nbytes / c.smem_bytes_per_clk, cta), "dS -> SMEM"
        if reg in ("dV", "dK"):  # the epilogue: this warpgroup's accumulator, row by row
            elems = cfg.n_block * (cfg.head_dim_v if reg == "dV" else cfg.head_dim)
            end = self.use("tmem", t, k * elems * 4 / c.tmem_bytes_per_clk, cta)
            end = self.use("fma", end, k * elems / c.fma_per_clk, cta)
            end = self.use("gmem", end, c.scale_tma * elems * cfg.dtype_bytes / c.tma_bytes_per_clk, cta)
            return end, f"{reg} -> global"
        if reg == "dQ":
            elems = cfg.m_block * cfg.head_dim // cfg.cta_group  # this CTA's share
            end = self.use("tmem", t, k * elems * 4 / c.tmem_bytes_per_clk, cta)
            end = self.use("gmem", end, c.scale_tma * elems * 4 / c.red_bytes_per_clk, cta)
            return end, STEP_END_LABEL
        raise ValueError(f"{a.name}: the backward's timing model has no price for {op.describe()}")

    def umma_cost(self, op: Op) -> float:
        if op.mode != "w":
            return 0.0
        m, n, k = mma_shape(self.cfg, op.region)
        return self.c.scale_umma * 2 * m * n * k / self.c.umma_flop_per_clk

    def umma_label(self, op: Op, actor: str) -> str:
        return f"{BWD_MMAS[op.region][0]} ({actor})"


def simulate_bwd(cfg, steps: int, costs: Optional[CostTable] = None,
                 programs: Optional[dict] = None) -> BwdTimeline:
    """One CTA's walk of ``steps`` steps for the SM100 backward's ``cfg`` (a model).
    ``programs``: the recorded role programs (default: the kernel's recording of ``cfg``)."""
    cfg = cfg.validate()
    if table_of(cfg) is not BWD_PIPELINES:
        raise ValueError("simulate_bwd times the SM100 backward (an Sm100BwdConfig); the "
                         "forward's model is pipelines.timing.simulate_timing")
    if steps < 1:
        raise ValueError(f"steps={steps}: a walk has at least one step")
    costs = costs or CostTable()
    if programs is None:
        programs = kernel_recording(cfg).programs
    model = ProtocolModel(cfg, programs, trip_bindings(cfg, steps, 1))
    sim = _BwdSim(cfg, model, costs)
    times = sim.run()
    ends = [k for k, iv in enumerate(sim.tl)
            if iv.kind == "busy" and (iv.actor, iv.label) == (STEP_END_ACTOR, STEP_END_LABEL)]
    if len(ends) < steps:
        raise RuntimeError(f"the timing mode finished {len(ends)} of {steps} steps: the "
                           "replayed protocol stalled (pipelines.check.check_config on these "
                           "programs names the finding)")
    total = max([*times, *sim.free.values()])
    return BwdTimeline(cfg, steps, sim.tl, total, [sim.tl[k].end for k in ends], costs,
                       sim.critical_path(ends[-1]))


def walk_steps(cfg, seqlen_q: int, seqlen_k: int, window=(None, None)) -> list[int]:
    """Steps of each key block's CTA (one KV head): the query blocks ``bands.q_block_range``
    gives with the kernel's bounds (``Sm100Backward._problem``), times the group's heads.
    Under 2-CTA both CTAs of a pair walk the band of the pair's keys (the grid holds whole
    pairs)."""
    if window != (None, None) and not cfg.is_local:
        raise ValueError(f"window {window}: the config has no window (local=false)")
    left, right = kernel_window(cfg.causal, window, seqlen_q, seqlen_k)
    g = cfg.cta_group
    keys = g * cfg.n_block  # keys of a work tile: a CTA's, or its pair's
    out = []
    for tile in range(-(-seqlen_k // keys)):
        lo, hi = q_block_range(tile * keys, keys, cfg.m_block, seqlen_q, seqlen_k, left, right)
        out += [max(hi - lo, 0) * cfg.qhead_per_kvhead] * g
    return out


def walk_clk(cfg, costs: Optional[CostTable] = None, programs: Optional[dict] = None) -> Callable:
    """steps -> modelled clocks of one CTA's walk. Walks up to the longer of ``FIT_STEPS`` are
    simulated; longer ones extend the line through the two (every step adds the same work to
    every role once the pipeline is full; a test checks the line against a simulation). A CTA
    without a step costs nothing here (the kernel skips its loads and MMAs)."""
    cache: dict = {}

    def clk(steps: int) -> float:
        if steps <= 0:
            return 0.0
        s0, s1 = FIT_STEPS
        for s in ((steps,) if steps <= s1 else FIT_STEPS):
            if s not in cache:
                cache[s] = simulate_bwd(cfg, s, costs, programs).total_clk
        if steps <= s1:
            return cache[steps]
        return cache[s0] + (cache[s1] - cache[s0]) / (s1 - s0) * (steps - s0)

    return clk


@dataclass(frozen=True)
class BwdProblemTime:
    """The modelled main kernel of one problem: CTAs in launch order, each on the SM that
    frees first (one CTA per SM: the backward takes all of its SMEM)."""

    total_clk: float
    ctas: int
    steps: int
    flops: float
    costs: CostTable

    @property
    def us(self) -> float:
        return self.total_clk / self.costs.clock_ghz / 1e3

    @property
    def tflops(self) -> float:
        """MMA FLOPs the walks execute (causal: only the visited blocks) per second."""
        return self.flops / (self.us * 1e-6) / 1e12 if self.total_clk else 0.0


def problem_time(cfg, seqlen_q: int, seqlen_k: int, batch: int = 1, heads_kv: int = 1,
                 window=(None, None), costs: Optional[CostTable] = None,
                 programs: Optional[dict] = None) -> BwdProblemTime:
    """The main kernel's modelled time for a problem: grid (key block, KV head, batch), the
    key block fastest, as ``Sm100Backward`` launches it (preprocess and postprocess apart)."""
    costs = costs or CostTable()
    per_block = walk_steps(cfg, seqlen_q, seqlen_k, window)
    clk = walk_clk(cfg, costs, programs)
    sms = [0.0] * costs.num_sms
    for _ in range(batch * heads_kv):
        for steps in per_block:
            heapq.heappush(sms, heapq.heappop(sms) + clk(steps))
    steps = sum(per_block) * batch * heads_kv
    return BwdProblemTime(max(sms), batch * heads_kv * len(per_block), steps,
                          steps * flops_per_step(cfg), costs)


def main(argv=None) -> int:
    """``python -m pipelines.timing_bwd [--set f=v ...] [--steps 16] [--seqlen N --batch B
    --heads H] [--calibrate TFLOPS] [--json OUT]``: the modelled step and CTA times of the SM100
    backward, the role that bounds the step, each role's busy clocks per step, and with
    ``--seqlen`` the main kernel's time for that problem."""
    import argparse
    import json
    import sys

    ap = argparse.ArgumentParser(prog="python -m pipelines.timing_bwd", description=main.__doc__)
    ap.add_argument("--set", action="append", default=[], metavar="field=value",
                    help="Sm100BwdConfig field (the problem's default config otherwise)")
    ap.add_argument("--steps", type=int, default=16, help="steps of the CTA's walk")
    ap.add_argument("--seqlen", type=int, default=0, help="also time a problem of this seqlen")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16, help="query heads of the problem")
    ap.add_argument("--calibrate", type=float, metavar="TFLOPS",
                    help="first scale the cost table so the forward's default config reaches "
                         "this TFLOP/s (CostTable.calibrate)")
    ap.add_argument("--json", metavar="OUT", help="write the walk's timeline (intervals included)")
    args = ap.parse_args(argv)
    try:
        from fa_sm100.config import FmhaConfig
        from fa_sm100.sm100.bwd_inspect_entry import make_config

        cfg = make_config(args.set)
        if args.heads % cfg.qhead_per_kvhead:
            raise ValueError(f"--heads {args.heads} is not a multiple of qhead_per_kvhead="
                             f"{cfg.qhead_per_kvhead}")
        costs = CostTable()
        if args.calibrate:
            costs = costs.calibrate(args.calibrate, FmhaConfig())
        tl = simulate_bwd(cfg, args.steps, costs)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ghz = costs.clock_ghz
    bound = tl.bound_by
    print(f"modelled (not measured): {tl.step_clk:.0f} clk per step ({tl.step_clk / ghz / 1e3:.3f} "
          f"us), {tl.total_clk:.0f} clk for a CTA of {args.steps} steps "
          f"({tl.total_clk / ghz / 1e3:.2f} us), {tl.tflops:.0f} TFLOP/s in the steady state")
    crit = sorted(tl.critical_per_step().items(), key=lambda kv: -kv[1])
    print(f"  bound by {bound}; critical path per step: "
          + ", ".join(f"{actor} {clk:.0f}" for actor, clk in crit) + " clk")
    for actor, clk in sorted(tl.busy_per_step().items()):
        print(f"  {actor:14} busy {clk:7.0f} clk per step ({clk / tl.step_clk:6.1%})")
    if args.seqlen:
        p = problem_time(cfg, args.seqlen, args.seqlen, args.batch,
                         args.heads // cfg.qhead_per_kvhead, costs=costs)
        print(f"  problem seqlen {args.seqlen}, batch {args.batch}, {args.heads} heads: {p.ctas} "
              f"CTAs, {p.steps} steps, {p.us:.1f} us, {p.tflops:.0f} TFLOP/s (main kernel)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(tl.to_dict(), f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
