"""Adapter from the protocol model's timing mode (``pipelines.timing``, ``pipelines.timing_bwd``)
to the research tools.

- ``model_timeline`` runs ``simulate_timing`` for one config and turns its intervals into a
  ``Timeline`` of the six chart rows, for CTA 0 of the pair, in ns;
- ``bwd_model_timeline`` does the same for the SM100 backward (``simulate_bwd``: one CTA's
  walk of steps, its five chart rows ``BWD_ROLE_ROWS``, the time per step and the role that
  bounds it);
- ``tile_timer`` gives the ablation the time of one work tile of any length, from four
  simulations per config (linear in the number of K/V blocks, see ``TileTimer``).

The rows: SOFTMAX0/1, CORRECTION and EPILOGUE (the backward's COMPUTE0/1 and DQ) are the
roles' own busy and wait intervals. The MMA row is the tensor core (the ``umma`` unit executing the MMAs the MMA warp issued) drawn
over the MMA warp's waits; the LOAD row likewise is the TMA unit over the load warp's waits.
A wait that overlaps the unit's busy time is shown as busy: the unit is working.
Everything here is MODEL OUTPUT.
"""

from __future__ import annotations

import functools
from typing import Sequence

from fa_sm100.config import FmhaConfig
from fa_sm100.research.timeline import BWD_ROLE_ROWS, ROLE_NAMES, Interval, Timeline

# Units of the timing model whose busy time is shown on a role's row (actor names, with an
# optional "@cta" suffix for per-SM units).
UNIT_ROWS = {"umma": "mma", "tma": "load"}
# Block counts the linear fit of ``tile_timer`` simulates.
FIT_BLOCKS = (4, 8)


def _timing():
    from pipelines import timing

    return timing


def _simulate(cfg: FmhaConfig, n_blocks: int, work_tiles: int, costs=None, programs=None):
    """``simulate_timing``, refusing a run in which the protocol did not complete: a run that
    stalls (a deadlock in the replayed programs) ends early with fewer finished tiles, and
    its times would look like a fast kernel."""
    res = _timing().simulate_timing(cfg, n_blocks, work_tiles, costs, programs=programs)
    done = len(res.tile_end_clk)
    if done < work_tiles:
        raise RuntimeError(
            f"the timing mode finished {done} of {work_tiles} work tiles for {n_blocks} K/V blocks: "
            "the replayed protocol stalled, so there is no timeline to show. "
            "`python -m pipelines.check` names the protocol finding.")
    return res


def _merge(spans):
    out = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _subtract(start: float, end: float, covered) -> list:
    """Pieces of [start, end) not inside any (merged, sorted) span of ``covered``."""
    pieces, pos = [], start
    for a, b in covered:
        if b <= pos or a >= end:
            continue
        if a > pos:
            pieces.append((pos, a))
        pos = max(pos, b)
    if pos < end:
        pieces.append((pos, end))
    return pieces


def chart_role(actor: str) -> str:
    """The chart row of a timing-mode actor: 'compute1@0' -> 'compute1', 'umma' -> 'mma'."""
    name = actor.partition("@")[0]
    return UNIT_ROWS.get(name, name)


def chart_intervals(result, roles: Sequence[str], cta: int = 0) -> tuple[Interval, ...]:
    """The intervals of a timing-mode result (either kernel's) on the chart rows ``roles``,
    CTA ``cta``, in ns."""
    ns = 1.0 / result.costs.clock_ghz
    busy, waits = {r: [] for r in roles}, {r: [] for r in roles}
    for iv in result.intervals:
        name, _, where = iv.actor.partition("@")
        if name in UNIT_ROWS:
            # a unit: "umma" (the pair's one queue) or "tma"/"tma@1" (one engine per SM); the
            # label names the issuing actor when the unit's name does not carry the CTA
            role = UNIT_ROWS[name]
            issuer = _issuer_of(iv.label)
            unit_cta = int(where) if where.isdigit() else (issuer[1] if issuer else None)
            if name != "umma" and unit_cta is not None and unit_cta != cta:
                continue
        else:
            role = name
            if role not in busy or (where.isdigit() and int(where) != cta):
                continue
        (busy if iv.kind == "busy" else waits)[role].append((iv.start, iv.end, iv.label))
    out = []
    for role in roles:
        covered = _merge([(a, b) for a, b, _ in busy[role]])
        for a, b, label in busy[role]:
            out.append(Interval(role, a * ns, b * ns, "busy", label))
        for a, b, label in waits[role]:
            for x, y in _subtract(a, b, covered):
                out.append(Interval(role, x * ns, y * ns, "wait", _pipe_of(label)))
    return tuple(out)


UNITS_NOTE = ("MMA row: tensor core busy over the MMA warp's waits; LOAD row: TMA unit over the "
              "load warp's waits")


def _cost_note(c) -> str:
    scale = (c.scale_umma, c.scale_threads, c.scale_tma)
    cal = ("uncalibrated cost table" if scale == (1.0, 1.0, 1.0) else
           f"cost table scaled x{c.scale_umma:.4f} (calibrated to FA4 B200 1535 TFLOP/s)")
    return f"clock {c.clock_ghz} GHz; {cal}"


def convert(result, title: str, overrides: Sequence[str] = (), cta: int = 0) -> Timeline:
    """A ``pipelines.timing.Timeline`` -> the chart ``Timeline`` (CTA ``cta``, ns)."""
    ns = 1.0 / result.costs.clock_ghz
    out = chart_intervals(result, ROLE_NAMES, cta)
    cfg = result.cfg
    c = result.costs
    notes = (
        f"timing model: pipelines/timing.py, {result.n_blocks} K/V blocks x {result.work_tiles} "
        f"work tiles, CTA {cta} of {cfg.cta_group}; {_cost_note(c)}; "
        f"rescale taken on {100 * c.rescale_fraction(cfg):.0f}% of blocks",
        UNITS_NOTE,
    )
    per_tile = result.steady_tile_clk * ns
    return Timeline(title, tuple(out), per_tile, (0.0, result.total_clk * ns), tuple(overrides), notes,
                    tile_rows=cfg.m_block * cfg.q_stage)


def _issuer_of(label: str):
    """'sKV (load@1)' -> ('load', 1): the actor that issued a unit's work, if the label says."""
    if label.endswith(")") and "(" in label:
        who = label[label.rindex("(") + 1:-1]
        role, _, cta = who.partition("@")
        if cta.isdigit():
            return role, int(cta)
    return None


def _pipe_of(label: str) -> str:
    """'wait s_p_o[stage 0, round 3]' -> 's_p_o' (the pipeline a wait blocks on)."""
    words = label.split()
    if len(words) >= 2 and words[0] in ("wait", "acquire"):
        return words[1].split("[")[0]
    return label


SOURCES = ("design", "kernel")


def role_programs(cfg: FmhaConfig, source: str = "design"):
    """The role programs the timing mode replays: the DESIGN.md protocol written with the
    pipeline classes (``design``, the timing mode's default) or the SM100 kernel's own
    recording, taken while cross-compiling it (``kernel``, seconds per config)."""
    if source == "design":
        return None
    if source == "kernel":
        from pipelines.kernel_source import kernel_recording

        return kernel_recording(cfg).programs
    raise ValueError(f"--source {source!r}: choose one of {SOURCES}")


def model_timeline(cfg: FmhaConfig, title: str, overrides: Sequence[str] = (), n_blocks: int = 8,
                   work_tiles: int = 2, costs=None, source: str = "design") -> Timeline:
    """Simulate ``cfg`` with the timing mode and return the chart timeline (MODEL OUTPUT)."""
    programs = role_programs(cfg, source)
    result = _simulate(cfg, n_blocks, work_tiles, costs, programs)
    tl = convert(result, title, overrides)
    src = ("protocol: pipelines/design.py (the design's role programs)" if source == "design" else
           "protocol: recorded from the SM100 kernel's own code while cross-compiling it")
    return Timeline(tl.title, tl.intervals, tl.time_per_tile, tl.span, tl.overrides,
                    tl.notes + (src,), tl.tile_rows)


def bwd_model_timeline(cfg, title: str, overrides: Sequence[str] = (), steps: int = 8,
                       costs=None) -> Timeline:
    """Simulate one CTA's walk of ``steps`` steps of the SM100 backward's ``cfg`` (its recorded
    protocol, ``pipelines.timing_bwd``) and return the chart timeline (MODEL OUTPUT)."""
    from pipelines import timing_bwd

    res = timing_bwd.simulate_bwd(cfg, steps, costs)
    ns = 1.0 / res.costs.clock_ghz
    labels = dict(BWD_ROLE_ROWS)
    crit = ", ".join(f"{labels.get(chart_role(a), a)} {v * ns:.0f}"
                     for a, v in sorted(res.critical_per_step().items(), key=lambda kv: -kv[1]))
    notes = (
        f"timing model: pipelines/timing_bwd.py, one CTA's walk of {steps} steps (query blocks x "
        f"query heads against its key block); {_cost_note(res.costs)}",
        f"critical path per step, ns: {crit}",
        UNITS_NOTE,
        "protocol: recorded from the SM100 backward's own code while cross-compiling it",
    )
    return Timeline(title, chart_intervals(res, [r for r, _ in BWD_ROLE_ROWS]), res.total_clk * ns,
                    (0.0, res.total_clk * ns), tuple(overrides), notes, tile_rows=cfg.m_block * steps,
                    role_rows=BWD_ROLE_ROWS, step_time=res.step_clk * ns,
                    bound_by=chart_role(res.bound_by))


def _sim_key(cfg: FmhaConfig) -> FmhaConfig:
    """Persistence acts through how tiles are strung together (``ablation.problem_time``), not
    inside one simulated CTA, so configs that differ only in it share their simulations."""
    return cfg.replace(persistent=True)


@functools.lru_cache(maxsize=1024)
def _total_ns(cfg: FmhaConfig, n: int, work_tiles: int, costs) -> float:
    """Simulated ns of ``work_tiles`` tiles of ``n`` blocks (configs and cost tables are frozen
    dataclasses, so equal inputs share one simulation per process)."""
    res = _simulate(cfg, n, work_tiles, costs)
    return res.total_clk / res.costs.clock_ghz


class TileTimer:
    """ns of one work tile of ``n`` K/V blocks, alone (``steady=False``: pipeline fill and
    drain exposed) or as one more tile of a persistent CTA (``steady=True``).

    From the simulated totals at work_tiles 1 and 2: alone(n) = total(n, 1), steady(n) =
    total(n, 2) - total(n, 1). Both are linear in n once the pipeline is full (each K/V block
    adds the same work to every role), so each is fitted at ``FIT_BLOCKS`` and extended
    linearly; tests check the fit against a direct simulation.
    """

    def __init__(self, costs=None):
        self.costs = costs
        self._fits: dict = {}
        self.simulations = 0

    def total_ns(self, cfg: FmhaConfig, n: int, work_tiles: int) -> float:
        self.simulations += 1
        return _total_ns(_sim_key(cfg), n, work_tiles, self.costs)

    def _fit(self, cfg: FmhaConfig):
        key = _sim_key(cfg)
        if key not in self._fits:
            pts = {}
            for n in FIT_BLOCKS:
                one = self.total_ns(key, n, 1)
                two = self.total_ns(key, n, 2)
                pts[n] = (one, two - one)
            (n0, n1) = FIT_BLOCKS
            fit = []
            for k in (0, 1):
                slope = (pts[n1][k] - pts[n0][k]) / (n1 - n0)
                fit.append((pts[n0][k] - slope * n0, slope))
            self._fits[key] = tuple(fit)
        return self._fits[key]

    def __call__(self, cfg: FmhaConfig, n: int, steady: bool) -> float:
        if n < 1:
            raise ValueError(f"a work tile visits at least one K/V block, got {n}")
        a, b = self._fit(cfg)[1 if steady else 0]
        return a + b * n


def tile_timer(costs=None) -> TileTimer:
    return TileTimer(costs)


def timer_factory(base_costs=None):
    """scale -> TileTimer with every UMMA, thread and TMA duration multiplied by ``scale``
    (``CostTable.scaled``, the timing mode's calibration hook; latencies stay as they are)."""
    timing = _timing()
    base = base_costs or timing.CostTable()

    def make(scale: float) -> TileTimer:
        return TileTimer(base.scaled(umma=scale, threads=scale, tma=scale))

    return make


def cost_table(items: Sequence[str] = ()):
    """The timing mode's default ``CostTable`` with ``--cost field=value`` overrides applied,
    e.g. ``["mufu_ex2_per_clk=64"]``; ValueError names an unknown field or a bad value."""
    import dataclasses

    timing = _timing()
    base = timing.CostTable()
    fields = {f.name: f for f in dataclasses.fields(base) if not f.name.startswith("scale_")}
    changes = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip()
        if name == "num_sms":
            raise ValueError("--cost num_sms: the SM count is a config field (FmhaConfig.num_sms), "
                             "which sizes the persistent grid; the cost table describes one SM")
        if not sep or name not in fields:
            raise ValueError(f"--cost {item!r}: expected field=value with field one of "
                             f"{sorted(n for n in fields if n != 'num_sms')}")
        kind = type(getattr(base, name))
        try:
            value = kind(float(text)) if kind is int else kind(text)
        except ValueError:
            raise ValueError(f"--cost {item!r}: {text!r} is not a number") from None
        if not value > 0 and not name.startswith("rescale_fraction"):
            raise ValueError(f"--cost {item!r}: must be > 0")
        changes[name] = value
    return dataclasses.replace(base, **changes)


def calibrated_costs(base_costs=None):
    """(Calibration, cost table) after ``ablation.calibrate``: ``base_costs`` (default table)
    scaled so that the default config reproduces the published FA4 B200 figure."""
    from fa_sm100.research import ablation

    cal, timer = ablation.calibrate(timer_factory(base_costs))
    return cal, timer.costs


def cost_table_summary(costs=None) -> list[str]:
    """The cost table's values and where each comes from (for the printed calibration)."""
    timing = _timing()
    costs = costs or timing.CostTable()
    lines = []
    for name, src in getattr(timing, "COST_SOURCES", {}).items():
        if hasattr(costs, name):
            lines.append(f"{name} = {getattr(costs, name)}: {src}")
    return lines


def simulate_raw(cfg: FmhaConfig, n_blocks: int, work_tiles: int, costs=None):
    """The timing mode's own result (for tests that compare against the adapter)."""
    return _simulate(cfg, n_blocks, work_tiles, costs)


__all__ = ["model_timeline", "bwd_model_timeline", "tile_timer", "timer_factory", "TileTimer", "convert",
           "cost_table", "calibrated_costs", "cost_table_summary", "simulate_raw"]
