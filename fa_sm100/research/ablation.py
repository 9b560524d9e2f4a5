"""The ablation matrix of the SM100 forward's switches: predicted by the model, or measured.

Switches (default value first): q_stage {2, 1}, use_2cta {on, off}, split_p {on, off},
ex2_emu_fraction {0.125, 0}, rescale_threshold {8, 0}, persistent {on, off}: 64 combinations.
kv_stage is not a free switch here: each combination takes as many K/V stages as its SMEM
budget holds (``select_config``), which is what the kernel does by default.

Without an SM100 GPU every number is MODEL OUTPUT. The timing mode of the protocol model
gives the time of one work tile; ``problem_time`` turns tile times into the time of a whole
problem (tiles per cluster, persistent striding or non-persistent waves, the LPT order of
causal tiles, exactly as ``fa_sm100.sm100.scheduler`` assigns them); ``calibrate`` scales the
cost table once (one factor on every duration) so that the default config reproduces
FlashAttention-4's published B200 figure (hdim 128, seqlen 8k, batch 4, 16 heads, non-causal
forward: 1535 TFLOP/s), and every other point is reported with that one scale, with the
distance to each other published point (causal: 1418 TFLOP/s).

On an SM100 GPU, ``measure`` times ``fa_sm100.sm100.interface.sm100_fwd`` instead.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from fa_sm100.config import FmhaConfig, config_from_overrides
from fa_sm100.research.timeline import MODEL_LABEL

# (field, values): the default first.
SWITCHES: tuple[tuple[str, tuple], ...] = (
    ("q_stage", (2, 1)),
    ("use_2cta", (True, False)),
    ("split_p", (True, False)),
    ("ex2_emu_fraction", (0.125, 0.0)),
    ("rescale_threshold", (8.0, 0.0)),
    ("persistent", (True, False)),
)
SWITCH_NAMES = tuple(name for name, _ in SWITCHES)


@dataclass(frozen=True)
class Problem:
    """One attention forward problem (BSHD, MHA)."""

    batch: int = 4
    heads: int = 16
    seqlen_q: int = 8192
    seqlen_k: int = 8192
    head_dim: int = 128
    causal: bool = False

    def flops(self) -> float:
        """FLOPs as FlashAttention's benchmarks count them: 4 b h sq sk d, halved when causal."""
        f = 4.0 * self.batch * self.heads * self.seqlen_q * self.seqlen_k * self.head_dim
        return f / 2 if self.causal else f

    def label(self) -> str:
        return (f"b={self.batch} h={self.heads} s={self.seqlen_q} d={self.head_dim} "
                f"{'causal' if self.causal else 'non-causal'}")


@dataclass(frozen=True)
class PublishedPoint:
    """A published figure. ``fa4_switches``: how FA4 itself runs this problem where that
    differs from our default config (reported as a second prediction)."""

    name: str
    problem: Problem
    tflops: float
    fa4_switches: tuple[str, ...] = ()
    fa4_note: str = ""


# FlashAttention-4 forward on B200 (BF16), the figures issue 8 quotes. FA4 runs dense causal
# attention with its LPT scheduler and no static persistence when 2-CTA is on (its
# flash_attn/cute/interface.py decides ``is_static_persistent`` that way).
PUBLISHED_B200 = (
    PublishedPoint("FA4 B200 non-causal", Problem(causal=False), 1535.0),
    PublishedPoint("FA4 B200 causal", Problem(causal=True), 1418.0,
                   fa4_switches=("persistent=false",),
                   fa4_note="FA4 runs causal 2-CTA non-persistent (LPT order)"),
)
CALIBRATION_POINT = PUBLISHED_B200[0]


def overrides_of(values: dict) -> tuple[str, ...]:
    out = []
    for name, _ in SWITCHES:
        v = values[name]
        text = str(v).lower() if isinstance(v, bool) else repr(v) if isinstance(v, float) else str(v)
        out.append(f"{name}={text}")
    return tuple(out)


def config_for(problem: Problem, switches: Sequence[str] = ()) -> FmhaConfig:
    """The validated config the kernel would run ``problem`` with, with ``switches`` applied."""
    items = [f"head_dim={problem.head_dim}", f"causal={str(problem.causal).lower()}"]
    return config_from_overrides(items + list(switches))


@dataclass(frozen=True)
class Combination:
    values: dict
    overrides: tuple[str, ...]
    cfg: FmhaConfig

    @property
    def flipped(self) -> tuple[str, ...]:
        """The switches that differ from the default."""
        return tuple(name for name, vals in SWITCHES if self.values[name] != vals[0])


def ablation_matrix(problem: Problem) -> list[Combination]:
    """Every combination of ``SWITCHES`` (default first), each as a validated config."""
    out = []
    for vals in itertools.product(*(v for _, v in SWITCHES)):
        values = dict(zip(SWITCH_NAMES, vals))
        ov = overrides_of(values)
        out.append(Combination(values, ov, config_for(problem, ov)))
    return out


def parse_sweep(text: str, problem: Problem) -> tuple[str, list[Combination]]:
    """``"kv_stage=2,3,4"`` -> (field, one validated Combination per value, others default).

    Any FmhaConfig field may be swept (e.g. ex2_emu_fraction, kv_stage, split_p_col); a value
    the config rejects raises ValueError naming the rule, before any simulation."""
    from fa_sm100.config import parse_overrides

    if "=" not in text:
        raise ValueError(f"--sweep {text!r}: expected field=v1,v2,...")
    name, _, values = text.partition("=")
    name = name.strip()
    items = [v.strip() for v in values.split(",") if v.strip()]
    if len(items) < 2:
        raise ValueError(f"--sweep {text!r}: give at least two values")
    out = []
    for item in items:
        parse_overrides([f"{name}={item}"])  # unknown field / bad value -> ValueError
        ov = (f"{name}={item}",)
        cfg = config_for(problem, ov)
        values = {n: getattr(cfg, n) for n in SWITCH_NAMES}
        values[name] = getattr(cfg, name)
        out.append(Combination(values, ov, cfg))
    return name, out


def format_sweep(res: "AblationResult", name: str) -> str:
    src = res.rows[0].source if res.rows else "model"
    label = MODEL_LABEL if src == "model" else "MEASURED on an SM100 GPU"
    lines = [f"sweep of {name} on {res.problem.label()}, other switches at default  [{label}]"]
    if res.calibration is not None:
        lines.append(res.calibration.describe())
    kv = name != "kv_stage"  # the K/V stages the SMEM budget gives each value
    lines.append(f"{name:>20} {'kv_stage' if kv else '':>8} {'us/tile':>8} {'TFLOP/s':>8}")
    for r in res.rows:
        lines.append(f"{_fmt(r.combo.values[name]):>20} {r.combo.cfg.kv_stage if kv else '':>8} "
                     f"{r.tile_ns / 1000:8.3f} {r.tflops:8.0f}")
    best = max(res.rows, key=lambda r: r.tflops)
    lines.append(f"best in this sweep: {name}={_fmt(best.combo.values[name])} ({best.tflops:.0f} TFLOP/s)")
    return "\n".join(lines)


# --------------------------------------------------------------------------- problem time
# tile_time(cfg, n_blocks, steady) -> ns: one work tile of n_blocks K/V blocks; steady=True is
# the increment of a tile inside a persistent loop (its fill overlaps the previous tile),
# steady=False a tile that runs alone (fill and drain exposed).
TileTimer = Callable[[FmhaConfig, int, bool], float]


def tile_blocks(cfg: FmhaConfig, problem: Problem) -> list[int]:
    """K/V blocks of every work tile, in the order the scheduler hands tiles out."""
    from fa_sm100.emulation.forward import kv_tile_ranges
    from fa_sm100.sm100.scheduler import lpt_order

    ranges = kv_tile_ranges(problem.seqlen_q, problem.seqlen_k, cfg, problem.causal, (None, None))
    per_m = [n_max - n_min for _, _, n_min, n_max in ranges]
    order = lpt_order(len(per_m), problem.heads, problem.batch, problem.causal)
    return [per_m[m] for m, _, _ in order]


def problem_time(cfg: FmhaConfig, problem: Problem, tile_time: TileTimer) -> float:
    """Predicted ns for the whole problem.

    Persistent: ``num_sms / cta_group`` clusters; cluster c does tiles c, c + C, ... (the static
    scheduler); each cluster pays one exposed tile and steady increments after it; the problem
    ends with the slowest cluster. Non-persistent: one cluster per tile, ``num_sms / cta_group``
    resident at once, each new cluster taking the first free slot; every tile runs alone.
    """
    from fa_sm100.sm100.scheduler import grid_clusters

    blocks = tile_blocks(cfg, problem)
    slots = max(1, cfg.num_sms // cfg.cta_group)
    cache: dict = {}

    def t(n: int, steady: bool) -> float:
        key = (n, steady)
        if key not in cache:
            cache[key] = float(tile_time(cfg, n, steady))
        return cache[key]

    if cfg.persistent:
        clusters = grid_clusters(cfg, len(blocks))
        per = [0.0] * clusters
        for i, n in enumerate(blocks):
            c = i % clusters
            per[c] += t(n, per[c] > 0.0)
        return max(per)
    free = [0.0] * min(slots, len(blocks))
    for n in blocks:
        k = min(range(len(free)), key=free.__getitem__)
        free[k] += t(n, False)
    return max(free)


def tflops(problem: Problem, ns: float) -> float:
    return problem.flops() / (ns * 1e-9) / 1e12


@dataclass(frozen=True)
class Calibration:
    """The cost-table scale that makes the default config reproduce ``point``.

    scale: every UMMA, thread and TMA duration of the timing model is multiplied by it
        (``CostTable.scaled``); barrier and issue latencies are not;
    model_tflops: the uncalibrated model's prediction at the calibration point;
    calibrated_tflops: the prediction with ``scale`` (equal to the point within rel_tol).
    """

    scale: float
    point: PublishedPoint
    model_tflops: float
    calibrated_tflops: float
    iterations: int

    def describe(self) -> str:
        return (f"calibration: uncalibrated, the model predicts {self.model_tflops:.0f} TFLOP/s for the "
                f"default config on {self.point.problem.label()}; {self.point.name} is "
                f"{self.point.tflops:.0f} TFLOP/s. Scaling every tensor-core, thread and TMA duration "
                f"of the cost table by {self.scale:.4f} (latencies unchanged; {self.iterations} "
                f"iterations) gives {self.calibrated_tflops:.1f} TFLOP/s.")


TimerFactory = Callable[[float], TileTimer]


def calibrate(make_timer: TimerFactory, point: PublishedPoint = CALIBRATION_POINT,
              rel_tol: float = 1e-3, max_iter: int = 20) -> tuple[Calibration, TileTimer]:
    """The cost-table scale at which the default config predicts ``point.tflops``, and the
    tile timer with that scale. Predicted TFLOP/s fall about as 1 / scale (latencies are
    not scaled), so a fixed-point iteration converges in a few steps."""
    cfg = config_for(point.problem)
    scale, first = 1.0, None
    for it in range(1, max_iter + 1):
        timer = make_timer(scale)
        got = tflops(point.problem, problem_time(cfg, point.problem, timer))
        first = got if first is None else first
        if abs(got - point.tflops) <= rel_tol * point.tflops:
            return Calibration(scale, point, first, got, it), timer
        scale *= got / point.tflops
    raise ValueError(f"calibration did not reach {point.tflops} TFLOP/s within {max_iter} "
                     f"iterations (last {got:.1f} at scale {scale:.4f})")


@dataclass(frozen=True)
class Row:
    combo: Combination
    tile_ns: float  # calibrated ns of one steady-state tile with the problem's longest n_blocks
    total_ns: float  # calibrated ns for the whole problem
    tflops: float
    source: str  # "model" or "measured"


@dataclass
class AblationResult:
    problem: Problem
    calibration: Optional[Calibration]
    rows: list = field(default_factory=list)
    published: list = field(default_factory=list)  # (PublishedPoint, predicted TFLOP/s)
    # (PublishedPoint, FA4's switches, predicted TFLOP/s) for points FA4 runs differently
    published_as_fa4: list = field(default_factory=list)

    @property
    def default(self) -> Row:
        return self.rows[0]

    def row(self, **values) -> Row:
        for r in self.rows:
            if all(r.combo.values[k] == v for k, v in values.items()) and \
                    all(r.combo.values[k] == vals[0] for k, vals in SWITCHES if k not in values):
                return r
        raise KeyError(f"no ablation row for {values}")


def run_model(problem: Problem, tile_time: TileTimer, calibration: Optional[Calibration],
              combos: Optional[list] = None) -> AblationResult:
    """Predicted time and TFLOP/s of every combination (MODEL OUTPUT), with ``tile_time``
    already calibrated (``calibrate`` returns it)."""
    combos = combos if combos is not None else ablation_matrix(problem)
    res = AblationResult(problem, calibration)
    n_max = max(tile_blocks(combos[0].cfg, problem))
    for c in combos:
        total = problem_time(c.cfg, problem, tile_time)
        tile = tile_time(c.cfg, n_max, True)
        res.rows.append(Row(c, tile, total, tflops(problem, total), "model"))
    for p in PUBLISHED_B200:
        cfg = config_for(p.problem)
        res.published.append((p, tflops(p.problem, problem_time(cfg, p.problem, tile_time))))
        if p.fa4_switches:
            cfg = config_for(p.problem, p.fa4_switches)
            res.published_as_fa4.append(
                (p, p.fa4_switches, tflops(p.problem, problem_time(cfg, p.problem, tile_time))))
    return res


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    return f"{v:g}"


def format_result(res: AblationResult) -> str:
    """The printed report: calibration, published points, the matrix, one-switch effects."""
    src = res.rows[0].source if res.rows else "model"
    label = MODEL_LABEL if src == "model" else "MEASURED on an SM100 GPU"
    lines = [f"ablation of the SM100 forward switches on {res.problem.label()}  [{label}]"]
    if res.calibration is not None:
        lines.append(res.calibration.describe())
    for p, pred in res.published:
        lines.append(f"  {p.name:22} published {p.tflops:7.0f} TFLOP/s   {src} {pred:7.0f} TFLOP/s   "
                     f"({100 * (pred / p.tflops - 1):+.1f}%)  our default config")
    for p, switches, pred in res.published_as_fa4:
        lines.append(f"  {p.name:22} published {p.tflops:7.0f} TFLOP/s   {src} {pred:7.0f} TFLOP/s   "
                     f"({100 * (pred / p.tflops - 1):+.1f}%)  with {' '.join(switches)}: {p.fa4_note}")
    head = " ".join(f"{n[:10]:>10}" for n in SWITCH_NAMES)
    lines.append(f"{head} {'kv_stage':>8} {'us/tile':>8} {'ms total':>9} {'TFLOP/s':>8} {'vs default':>10}")
    base = res.default.tflops if res.rows else float("nan")
    for r in res.rows:
        vals = " ".join(f"{_fmt(r.combo.values[n]):>10}" for n in SWITCH_NAMES)
        lines.append(f"{vals} {r.combo.cfg.kv_stage:>8} {r.tile_ns / 1000:8.3f} {r.total_ns / 1e6:9.3f} "
                     f"{r.tflops:8.0f} {100 * (r.tflops / base - 1):+9.1f}%")
    lines.append("one switch flipped from the default:")
    for name, vals in SWITCHES:
        try:
            r = res.row(**{name: vals[1]})
        except KeyError:
            continue  # not varied in this run (--only)
        d = 100 * (r.tflops / base - 1)
        verdict = "no effect in the model" if abs(d) < 0.05 and src == "model" else f"{d:+.1f}%"
        lines.append(f"  {name + '=' + _fmt(vals[1]):24} {r.tflops:7.0f} TFLOP/s  {verdict}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ hardware
def device_mode() -> tuple[str, str]:
    """("measure", why) on an SM100 GPU, else ("model", why). Queries the GPU only when called."""
    try:
        import torch
    except ImportError:
        return "model", "torch is not installed"
    if not torch.cuda.is_available():
        return "model", "no CUDA device on this machine"
    major, minor = torch.cuda.get_device_capability(0)
    if major != 10:
        return "model", f"the GPU is sm_{major}{minor}, not sm_100: the SM100 kernel cannot run"
    return "measure", f"SM100 GPU: {torch.cuda.get_device_name(0)}"


def measure(cfg: FmhaConfig, problem: Problem, warmup: int = 3, iters: int = 10) -> float:
    """Median ns of ``sm100_fwd`` on ``problem`` with ``cfg`` (SM100 GPU only)."""
    mode, why = device_mode()
    if mode != "measure":
        raise RuntimeError(f"cannot measure the SM100 kernel here: {why}")
    import torch

    from fa_sm100.sm100.interface import sm100_fwd

    # The persistent grid is sized from the SM count: use this GPU's, not the B200 default.
    cfg = cfg.replace(num_sms=torch.cuda.get_device_properties(0).multi_processor_count)
    g = torch.Generator(device="cuda").manual_seed(0)
    shape_q = (problem.batch, problem.seqlen_q, problem.heads, problem.head_dim)
    shape_k = (problem.batch, problem.seqlen_k, problem.heads, problem.head_dim)
    q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(shape_k, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(shape_k, device="cuda", dtype=torch.bfloat16, generator=g)
    scale = 1.0 / math.sqrt(problem.head_dim)

    def call():
        return sm100_fwd(q, k, v, scale, problem.causal, (None, None), False, cfg)

    for _ in range(warmup):
        call()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e6)
    times.sort()
    return times[len(times) // 2]


def run_measured(problem: Problem, combos: Optional[list] = None, progress=None) -> AblationResult:
    """Measured time and TFLOP/s of every combination on the SM100 GPU of this machine."""
    combos = combos if combos is not None else ablation_matrix(problem)
    res = AblationResult(problem, None)
    for i, c in enumerate(combos):
        if progress:
            progress(i, len(combos), c)
        ns = measure(c.cfg, problem)
        res.rows.append(Row(c, float("nan"), ns, tflops(problem, ns), "measured"))
    for p in PUBLISHED_B200:
        ns = measure(config_for(p.problem), p.problem)
        res.published.append((p, tflops(p.problem, ns)))
        if p.fa4_switches:
            ns = measure(config_for(p.problem, p.fa4_switches), p.problem)
            res.published_as_fa4.append((p, p.fa4_switches, tflops(p.problem, ns)))
    return res
