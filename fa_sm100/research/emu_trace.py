"""The PTX emulator's per-warp event trace (``scripts/emulate_sm100.py --trace``), read for
``scripts/timeline.py --emu-trace``.

The trace is JSON ``{"kernel", "time": "logical (execution order)", "events": [{"cluster",
"warp", "step", "line", "op", "lanes", "role"}]}`` (``ptxemu.emulator.write_trace``): one event
per executed warp instruction. The emulator has no clock: ``step`` is the execution order, so
the panel drawn here shows order and overlap of the roles, never durations. It is EMULATOR
OUTPUT (the compiled kernel's PTX run on the CPU), not the timing model and not a measurement.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

from fa_sm100.research.role_panels import draw_share_bars
from fa_sm100.research.timeline import ROLE_ROWS

EMU_AXIS_LABEL = "PTX emulator, execution order (no clock)"
EVENT_KEYS = ("cluster", "warp", "step", "line", "op", "lanes", "role")
# Ops that wait on a barrier: mbarrier waits and named/CTA barriers (bar.arrive does not wait).
WAIT_PREFIXES = ("mbarrier.try_wait", "mbarrier.test_wait", "bar.", "barrier.")
WAIT_COLOR = "#404040"
MAX_BINS = 1500


def is_barrier_wait(op: str) -> bool:
    return op.startswith(WAIT_PREFIXES) and not op.startswith(("bar.arrive", "barrier.arrive"))


@dataclass(frozen=True)
class RoleSummary:
    """One role's share of the trace: instructions (events), barrier waits among them, and the
    first and last step at which it executed (None when it executed nothing)."""

    role: str
    instructions: int
    barrier_waits: int
    first_step: Optional[int]
    last_step: Optional[int]


@dataclass(frozen=True)
class EmuTrace:
    """A validated trace: ``steps``/``ops`` per role (in step order), the kernel name, the step
    range and events of warps with no chart role (e.g. the idle warp), counted apart."""

    path: str
    kernel: str
    n_events: int
    max_step: int
    steps: dict
    ops: dict
    other_events: int

    def summary(self) -> tuple[RoleSummary, ...]:
        out = []
        for role, _ in ROLE_ROWS:
            steps, ops = self.steps[role], self.ops[role]
            out.append(RoleSummary(role, len(steps), sum(is_barrier_wait(o) for o in ops),
                                   steps[0] if steps else None, steps[-1] if steps else None))
        return tuple(out)

    def summary_text(self) -> str:
        lines = [f"{EMU_AXIS_LABEL}: trace {self.path} (kernel {self.kernel}), "
                 f"{self.n_events} warp instructions, steps 0..{self.max_step}",
                 f"{'role':<12}{'instructions':>13}{'barrier waits':>15}{'first step':>12}{'last step':>11}"]
        for s, (_, label) in zip(self.summary(), ROLE_ROWS):
            first = "-" if s.first_step is None else str(s.first_step)
            last = "-" if s.last_step is None else str(s.last_step)
            lines.append(f"{label:<12}{s.instructions:>13}{s.barrier_waits:>15}{first:>12}{last:>11}")
        if self.other_events:
            lines.append(f"(+ {self.other_events} instructions of warps with no chart role)")
        return "\n".join(lines)


def load_emu_trace(path: str) -> EmuTrace:
    """Read and validate the trace at ``path``; ValueError naming the problem (missing file,
    not JSON, not the ``write_trace`` format, events without a role)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"--emu-trace {path!r}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--emu-trace {path!r}: not a JSON trace ({e})") from None
    fmt = ("expected scripts/emulate_sm100.py --trace output: {\"kernel\", \"time\": "
           "\"logical (execution order)\", \"events\": [...]}")
    if not isinstance(data, dict) or not isinstance(data.get("events"), list) \
            or not isinstance(data.get("kernel"), str) or "time" not in data:
        raise ValueError(f"--emu-trace {path!r}: {fmt}")
    if not data["events"]:
        raise ValueError(f"--emu-trace {path!r}: the trace has no events")
    roles = {r for r, _ in ROLE_ROWS}
    steps = {r: [] for r in roles}
    ops = {r: [] for r in roles}
    other, max_step = 0, -1
    for i, ev in enumerate(data["events"]):
        missing = [k for k in EVENT_KEYS if not isinstance(ev, dict) or k not in ev]
        if missing:
            raise ValueError(f"--emu-trace {path!r}: event {i} lacks {missing} ({fmt}; "
                             "'role' is written when emulate_sm100.py knows the warp roles)")
        step, op, role = ev["step"], ev["op"], ev["role"]
        if not isinstance(step, int) or step < 0 or not isinstance(op, str) or not isinstance(role, str):
            raise ValueError(f"--emu-trace {path!r}: event {i} has a bad step/op/role: {ev}")
        max_step = max(max_step, step)
        if role.lower() in roles:
            steps[role.lower()].append(step)
            ops[role.lower()].append(op)
        else:
            other += 1
    for r in roles:
        order = sorted(range(len(steps[r])), key=steps[r].__getitem__)
        steps[r] = [steps[r][k] for k in order]
        ops[r] = [ops[r][k] for k in order]
    return EmuTrace(str(path), data["kernel"], len(data["events"]), max_step, steps, ops, other)


def _segments(flags: list) -> list:
    """(start, width) in bins of each run of True in ``flags``."""
    out, start = [], None
    for k, f in enumerate(flags + [False]):
        if f and start is None:
            start = k
        elif not f and start is not None:
            out.append((start, k - start))
            start = None
    return out


def draw_emu_panel(ax, bars, trace: EmuTrace, colors: dict) -> str:
    """Draw the trace on ``ax`` (one row per role, x = step): where the role executed, in its
    colour; where its instructions in a step bin are mostly barrier waits, dark. ``bars`` gets
    each role's share of the instructions. Returns the panel title."""
    span = trace.max_step + 1
    nbins = min(span, MAX_BINS)
    width = span / nbins
    labels = []
    for y, (role, label) in enumerate(ROLE_ROWS):
        labels.append(label)
        busy, wait = [0] * nbins, [0] * nbins
        for s, op in zip(trace.steps[role], trace.ops[role]):
            b = min(int(s / width), nbins - 1)
            (wait if is_barrier_wait(op) else busy)[b] += 1
        run = [busy[k] > wait[k] for k in range(nbins)]
        waits = [wait[k] > 0 and wait[k] >= busy[k] for k in range(nbins)]
        ax.broken_barh([(a * width, w * width) for a, w in _segments(run)], (y - 0.32, 0.64),
                       facecolors=colors[role], linewidth=0.0)
        ax.broken_barh([(a * width, w * width) for a, w in _segments(waits)], (y - 0.32, 0.64),
                       facecolors=WAIT_COLOR, linewidth=0.0)
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.set_xlim(0, span)
    ax.set_xlabel(f"step ({EMU_AXIS_LABEL})", fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    ax.grid(axis="x", alpha=0.3)
    title = (f"{EMU_AXIS_LABEL}: {trace.kernel}, {trace.n_events} warp instructions "
             f"(dark: barrier waits)")
    ax.set_title(title, fontsize=10, loc="left")
    counts = [len(trace.steps[r]) for r, _ in ROLE_ROWS]
    total = max(1, sum(counts))
    fracs = [100 * c / total for c in counts]
    draw_share_bars(bars, fracs, colors, "instructions %", [str(c) for c in counts])
    return title
