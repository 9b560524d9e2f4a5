"""Matplotlib (Agg) figures of model timelines: one Gantt panel per config, side by side, with
the rows of the timelines' kernel (the forward's or the backward's roles).

``plot_timelines`` returns a ``PlotInfo`` describing what it drew (panel titles, row labels,
the figure title) so tests check the figure's content without reading pixels. With an
emulator trace (``emu_trace.EmuTrace``) a panel of the PTX emulator's execution order is drawn
right below the first (base config) panel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

from fa_sm100.research import emu_trace as emu
from fa_sm100.research.role_panels import draw_share_bars
from fa_sm100.research.timeline import MODEL_LABEL, Timeline, common_rows, step_text

ROLE_COLORS = {
    "load": "#4C72B0",
    "mma": "#C44E52",
    "softmax0": "#55A868",
    "softmax1": "#8FCB8F",
    "correction": "#8172B2",
    "epilogue": "#CCB974",
    "compute0": "#55A868",
    "compute1": "#8FCB8F",
    "dq": "#8172B2",
}
WAIT_COLOR = "#D9D9D9"


@dataclass(frozen=True)
class PlotInfo:
    path: str
    suptitle: str
    panel_titles: tuple[str, ...]
    row_labels: tuple[tuple[str, ...], ...]
    bytes: int
    emu_title: str = ""  # the PTX emulator panel's title; "" when none was drawn


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def plot_timelines(timelines: Sequence[Timeline], path: str, title: str = "",
                   emu_trace: Optional[emu.EmuTrace] = None) -> PlotInfo:
    """Draw each timeline as a Gantt panel (its kernel's rows, e.g. LOAD..EPILOGUE, busy in
    the role's colour, waiting hatched grey) with its per-role busy share beside it, and save a PNG at ``path``.
    ``emu_trace``: also draw the PTX emulator's trace (x = execution step, no clock) below the
    first panel."""
    if not timelines:
        raise ValueError("plot_timelines: no timeline to draw")
    if not str(path).lower().endswith(".png"):
        raise ValueError(f"--out {path!r}: the figure is written as PNG; give a path ending in .png")
    role_rows = common_rows(timelines)
    plt = _pyplot()
    from matplotlib.patches import Patch

    n = len(timelines) + (emu_trace is not None)
    fig = plt.figure(figsize=(13, 1.0 + 2.35 * n))
    grid = fig.add_gridspec(n, 2, width_ratios=(5, 1), hspace=0.55, wspace=0.06)
    xmax = max(tl.span[1] - tl.span[0] for tl in timelines) / 1000.0
    panel_titles, row_labels = [], []
    emu_title = ""
    if emu_trace is not None:
        emu_title = emu.draw_emu_panel(fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1]),
                                   emu_trace, ROLE_COLORS)
    for k, tl in enumerate(timelines):
        slot = k + (emu_trace is not None and k > 0)
        ax = fig.add_subplot(grid[slot, 0])
        bars = fig.add_subplot(grid[slot, 1])
        lo = tl.span[0]
        rows = tl.rows()
        labels = []
        for y, (role, label) in enumerate(role_rows):
            labels.append(label)
            ivs = rows[role]
            busy = [((iv.start - lo) / 1000, iv.length / 1000) for iv in ivs if iv.state == "busy"]
            wait = [((iv.start - lo) / 1000, iv.length / 1000) for iv in ivs if iv.state == "wait"]
            ax.broken_barh(wait, (y - 0.32, 0.64), facecolors=WAIT_COLOR, edgecolor="#A0A0A0",
                           hatch="///", linewidth=0.0)
            ax.broken_barh(busy, (y - 0.32, 0.64), facecolors=ROLE_COLORS[role], linewidth=0.0)
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.set_ylim(len(labels) - 0.5, -0.5)
        ax.set_xlim(0, xmax)
        ax.set_xlabel("time (us, model)", fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
        ax.grid(axis="x", alpha=0.3)
        rows_txt = f" of {tl.tile_rows} rows ({tl.rows_per_us:.1f} rows/us)" if tl.tile_rows else ""
        panel = (f"{tl.title}: {tl.time_per_tile / 1000:.3f} us per work tile{rows_txt}"
                 f"{step_text(tl)} (model)")
        ax.set_title(panel, fontsize=10, loc="left")
        fracs = [100 * tl.busy_fraction(role) for role, _ in role_rows]
        draw_share_bars(bars, fracs, ROLE_COLORS, "busy %", [f"{f:.0f}%" for f in fracs], role_rows)
        panel_titles.append(panel)
        row_labels.append(tuple(labels))
    handles = [Patch(facecolor=ROLE_COLORS[r], label=f"{lab} busy") for r, lab in role_rows]
    handles.append(Patch(facecolor=WAIT_COLOR, edgecolor="#A0A0A0", hatch="///",
                         label="waiting on a barrier"))
    if emu_trace is not None:
        handles.append(Patch(facecolor=emu.WAIT_COLOR, label="emulator: barrier waits"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    suptitle = (title + "\n" if title else "") + MODEL_LABEL
    if emu_trace is not None:
        suptitle += f"; second panel: {emu.EMU_AXIS_LABEL}"
    fig.suptitle(suptitle, fontsize=11, color="#8B0000")
    fig.subplots_adjust(top=1 - 0.55 / (1.0 + 2.35 * n) - 0.03, bottom=0.9 / (1.0 + 2.35 * n),
                        left=0.08, right=0.98)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return PlotInfo(str(path), suptitle, tuple(panel_titles), tuple(row_labels), os.path.getsize(path),
                    emu_title)
