"""The side panel every role chart shares (the model's timelines, the PTX emulator's trace):
one bar per role row, as a percentage."""

from __future__ import annotations

from fa_sm100.research.timeline import ROLE_ROWS


def draw_share_bars(bars, fracs, colors, xlabel: str, texts, rows=ROLE_ROWS) -> None:
    """The side panel of a role chart: one horizontal bar per role row (``rows``: the
    kernel's, the forward's by default), as a percentage."""
    n = len(rows)
    bars.barh(range(n), fracs, color=[colors[r] for r, _ in rows])
    bars.set_ylim(n - 0.5, -0.5)
    bars.set_yticks([])
    bars.set_xlim(0, 100)
    bars.set_xlabel(xlabel, fontsize=8)
    bars.tick_params(axis="x", labelsize=8)
    for y, (f, text) in enumerate(zip(fracs, texts)):
        bars.text(min(f + 2, 70), y, text, va="center", fontsize=7)
