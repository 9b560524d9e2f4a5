"""Per-role timelines of the SM100 forward and backward, as the protocol model's timing mode
predicts them.

A ``Timeline`` is a list of ``Interval`` rows: for each warp role, when it is busy (issuing
work, computing) and when it waits on a barrier (the label names the pipeline). It is built
from the timing mode of ``pipelines`` by ``model_backend.model_timeline`` (the forward's
rows, ``ROLE_ROWS``) or ``model_backend.bwd_model_timeline`` (the backward's,
``BWD_ROLE_ROWS``) and is MODEL OUTPUT: no SM100 GPU produced it. ``render_text`` draws it as
a character Gantt chart, ``plotting.plot_timelines`` as a PNG.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

MODEL_LABEL = "MODEL OUTPUT (protocol model timing mode, not measured)"

# (role name in the model, row label in the charts), top to bottom.
ROLE_ROWS = (
    ("load", "LOAD"),
    ("mma", "MMA"),
    ("softmax0", "SOFTMAX0"),
    ("softmax1", "SOFTMAX1"),
    ("correction", "CORRECTION"),
    ("epilogue", "EPILOGUE"),
)
ROLE_NAMES = tuple(r for r, _ in ROLE_ROWS)
ROW_LABELS = tuple(label for _, label in ROLE_ROWS)
# The SM100 backward's rows: each compute warpgroup is a row of its own (a part of the compute
# role: P, dS, then dV or dK to global memory), DQ the dQ warps' read-out and adds.
BWD_ROLE_ROWS = (
    ("load", "LOAD"),
    ("mma", "MMA"),
    ("compute0", "COMPUTE0"),
    ("compute1", "COMPUTE1"),
    ("dq", "DQ"),
)
# The rows of each kernel the tools chart (``--kernel``, as scripts/inspect.py names them).
KERNEL_ROWS = {"sm100_fwd": ROLE_ROWS, "sm100_bwd": BWD_ROLE_ROWS}
ALL_ROLE_NAMES = tuple(dict.fromkeys(r for rows in KERNEL_ROWS.values() for r, _ in rows))
# Short row names of the comparison table.
SHORT_NAMES = {"load": "LOAD", "mma": "MMA", "softmax0": "SM0", "softmax1": "SM1",
               "correction": "CORR", "epilogue": "EPI", "compute0": "CMP0", "compute1": "CMP1",
               "dq": "DQ"}
STATES = ("busy", "wait")


@dataclass(frozen=True)
class Interval:
    """One stretch of one role: ``state`` "busy" or "wait", from ``start`` to ``end`` (ns)."""

    role: str
    start: float
    end: float
    state: str
    label: str = ""

    def __post_init__(self):
        if self.role not in ALL_ROLE_NAMES:
            raise ValueError(f"interval role {self.role!r}: must be one of {ALL_ROLE_NAMES}")
        if self.state not in STATES:
            raise ValueError(f"interval state {self.state!r}: must be one of {STATES}")
        if not self.end >= self.start:
            raise ValueError(f"interval of {self.role} ends ({self.end}) before it starts ({self.start})")

    @property
    def length(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Timeline:
    """The predicted schedule of one config: intervals per role and the time per work tile.

    title: what the panel shows (e.g. "default", "q_stage=1");
    overrides: the ``--set`` items the config was built from;
    time_per_tile: steady-state ns per work tile of one CTA (pair) as the model predicts;
    tile_rows: query rows one CTA finishes per work tile (m_block x q_stage), so configs with
        different tiles compare by throughput (rows per ns), not by time per tile;
    span: (start, end) of the window the intervals cover (ns);
    notes: extra lines (model assumptions) printed under the text chart;
    role_rows: the kernel's (role, row label) pairs, top to bottom (``KERNEL_ROWS``);
    step_time, bound_by: a kernel whose work tile is a walk of steps (the backward): the
        steady-state ns per step, and the role with the most time per step on the critical
        path (0.0 and "" otherwise).
    """

    title: str
    intervals: tuple[Interval, ...]
    time_per_tile: float
    span: tuple[float, float]
    overrides: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)
    tile_rows: int = 0
    role_rows: tuple = ROLE_ROWS
    step_time: float = 0.0
    bound_by: str = ""

    def __post_init__(self):
        names = {r for r, _ in self.role_rows}
        stray = sorted({iv.role for iv in self.intervals} - names)
        if stray:
            raise ValueError(f"timeline {self.title!r}: intervals of roles {stray}, which are "
                             f"not rows of its kernel {sorted(names)}")

    @property
    def rows_per_us(self) -> float:
        """Query rows per microsecond per CTA (the throughput the comparisons use)."""
        return 1000.0 * self.tile_rows / self.time_per_tile if self.time_per_tile else 0.0

    def rows(self) -> dict[str, list[Interval]]:
        """Role -> its intervals in time order (every row of ``role_rows``, possibly empty)."""
        out = {r: [] for r, _ in self.role_rows}
        for iv in self.intervals:
            out[iv.role].append(iv)
        for ivs in out.values():
            ivs.sort(key=lambda iv: iv.start)
        return out

    def total(self, role: str, state: str) -> float:
        """ns ``role`` spends in ``state`` inside the window (overlapping intervals count once)."""
        lo, hi = self.span
        spans = sorted((max(iv.start, lo), min(iv.end, hi)) for iv in self.intervals
                       if iv.role == role and iv.state == state and iv.end > lo and iv.start < hi)
        total, cur = 0.0, None
        for a, b in spans:
            if cur is None or a > cur[1]:
                if cur is not None:
                    total += cur[1] - cur[0]
                cur = [a, b]
            else:
                cur[1] = max(cur[1], b)
        if cur is not None:
            total += cur[1] - cur[0]
        return total

    def busy_fraction(self, role: str) -> float:
        """Share of the window ``role`` is busy (0..1)."""
        lo, hi = self.span
        return self.total(role, "busy") / (hi - lo) if hi > lo else 0.0

    def wait_fraction(self, role: str) -> float:
        lo, hi = self.span
        return self.total(role, "wait") / (hi - lo) if hi > lo else 0.0

    def top_waits(self, role: str, k: int = 2) -> list[tuple[str, float]]:
        """The pipelines ``role`` waits on longest, with the waited ns."""
        acc: dict[str, float] = {}
        for iv in self.intervals:
            if iv.role == role and iv.state == "wait":
                acc[iv.label or "?"] = acc.get(iv.label or "?", 0.0) + iv.length
        return sorted(acc.items(), key=lambda kv: -kv[1])[:k]


def common_rows(timelines: Sequence[Timeline]) -> tuple:
    """The role rows every one of ``timelines`` charts (ValueError when kernels are mixed)."""
    rows = timelines[0].role_rows
    if any(tl.role_rows != rows for tl in timelines):
        raise ValueError("the timelines chart different kernels' roles: draw each kernel apart")
    return rows


def step_text(tl: Timeline) -> str:
    """", X us per step, bound by ROW" for a timeline of steps ("" otherwise)."""
    if not tl.step_time:
        return ""
    label = dict(tl.role_rows).get(tl.bound_by, tl.bound_by)
    return f", {tl.step_time / 1000:.3f} us per step, bound by {label}"


def _cell(ivs: Sequence[Interval], lo: float, hi: float) -> str:
    """'#' when the role is mostly busy in [lo, hi), '-' mostly waiting, ' ' otherwise."""
    busy = wait = 0.0
    for iv in ivs:
        if iv.end <= lo or iv.start >= hi:
            continue
        part = min(iv.end, hi) - max(iv.start, lo)
        if iv.state == "busy":
            busy += part
        else:
            wait += part
    if busy == 0.0 and wait == 0.0:
        return " "
    return "#" if busy >= wait else "-"


def render_text(tl: Timeline, width: int = 96) -> str:
    """A character Gantt chart of ``tl``: one row per role, '#' busy, '-' waiting."""
    if width < 10:
        raise ValueError(f"width={width}: need at least 10 columns")
    lo, hi = tl.span
    step = (hi - lo) / width if hi > lo else 1.0
    rows = tl.rows()
    of_rows = f" of {tl.tile_rows} rows" if tl.tile_rows else ""
    head = (f"{tl.title}: predicted {tl.time_per_tile / 1000:.3f} us per work tile{of_rows}"
            f"{step_text(tl)}  [{MODEL_LABEL}]")
    lines = [head]
    if tl.overrides:
        lines.append("  --set " + " ".join(tl.overrides))
    lines.append(f"  {'':10} |{'window %.2f us' % ((hi - lo) / 1000):^{width}}| busy  wait")
    for role, label in tl.role_rows:
        cells = "".join(_cell(rows[role], lo + i * step, lo + (i + 1) * step) for i in range(width))
        lines.append(f"  {label:10} |{cells}| {100 * tl.busy_fraction(role):3.0f}% "
                     f"{100 * tl.wait_fraction(role):3.0f}%")
    lines.append("  legend: # busy, - waiting on a barrier, blank: no work in the window")
    for role, label in tl.role_rows:
        waits = tl.top_waits(role)
        if waits:
            lines.append(f"  {label:10} waits most on: " + ", ".join(
                f"{name} ({ns / 1000:.2f} us)" for name, ns in waits))
    lines.extend("  " + n for n in tl.notes)
    return "\n".join(lines)


def compare_table(timelines: Iterable[Timeline], baseline: Optional[Timeline] = None) -> str:
    """One line per timeline: time per tile, rows per tile, throughput (rows per us) relative
    to ``baseline`` (the first timeline by default), and each role's busy share."""
    timelines = list(timelines)
    base = baseline or (timelines[0] if timelines else None)
    rows = common_rows(timelines) if timelines else ROLE_ROWS
    busy_heads = " ".join(f"{SHORT_NAMES[role]:>5}" for role, _ in rows)
    lines = [f"{'config':24} {'us/tile':>8} {'rows':>5} {'rows/us':>8} {'throughput':>10}  "
             f"busy %: {busy_heads}   [{MODEL_LABEL}]"]
    for tl in timelines:
        rel = tl.rows_per_us / base.rows_per_us if base and base.rows_per_us else float("nan")
        busy = " ".join(f"{100 * tl.busy_fraction(role):5.0f}" for role, _ in rows)
        lines.append(f"{tl.title[:24]:24} {tl.time_per_tile / 1000:8.3f} {tl.tile_rows:5d} "
                     f"{tl.rows_per_us:8.2f} {rel:9.3f}x          {busy}")
    return "\n".join(lines)
