"""Contracts of the timeline data, its text and PNG renderings, and the docs figures (CPU).

- ``Interval`` refuses unknown roles/states and negative lengths (ValueError).
- Busy/wait shares are the interval lengths inside the window; the text chart draws '#'
  where a role is busy and '-' where it waits, one row per role LOAD..EPILOGUE, and says it
  is model output.
- ``plot_timelines`` writes a non-trivial PNG with one panel per timeline, the six role rows
  and the MODEL OUTPUT label; it refuses a non-PNG path.
- The docs figures come from the project's objects: the TMEM figure draws every region of
  ``TmemPlan``; the warp figure every warp of ``WarpRoles``; the pipeline graph one edge per
  producer/consumer pair of the pipeline table.
"""

import pytest

from fa_sm100.research import figures
from fa_sm100.research.plotting import plot_timelines
from fa_sm100.research.timeline import (MODEL_LABEL, ROLE_NAMES, ROW_LABELS, Interval, Timeline,
                                        compare_table, render_text)


def _timeline(title="t", busy_role="mma"):
    ivs = []
    for role in ROLE_NAMES:
        if role == busy_role:
            ivs.append(Interval(role, 0.0, 750.0, "busy", ""))
            ivs.append(Interval(role, 750.0, 1000.0, "wait", "kv"))
        else:
            ivs.append(Interval(role, 0.0, 250.0, "wait", "s_p_o"))
            ivs.append(Interval(role, 250.0, 500.0, "busy", ""))
    return Timeline(title, tuple(ivs), time_per_tile=500.0, span=(0.0, 1000.0), overrides=("q_stage=1",),
                    tile_rows=256)


def test_interval_rejects_bad_rows():
    with pytest.raises(ValueError, match="role"):
        Interval("tensor_core", 0, 1, "busy")
    with pytest.raises(ValueError, match="state"):
        Interval("mma", 0, 1, "sleeping")
    with pytest.raises(ValueError, match="before it starts"):
        Interval("mma", 2, 1, "busy")


def test_fractions_and_text_chart():
    tl = _timeline()
    assert tl.busy_fraction("mma") == pytest.approx(0.75)
    assert tl.wait_fraction("mma") == pytest.approx(0.25)
    assert tl.busy_fraction("load") == pytest.approx(0.25)
    assert tl.top_waits("mma") == [("kv", 250.0)]
    text = render_text(tl, width=40)
    assert MODEL_LABEL in text
    rows = {line.split("|")[0].strip(): line.split("|")[1]
            for line in text.splitlines() if line.count("|") == 2}
    for label in ROW_LABELS:
        assert len(rows[label]) == 40
    assert rows["MMA"] == "#" * 30 + "-" * 10
    assert rows["LOAD"] == "-" * 10 + "#" * 10 + " " * 20
    with pytest.raises(ValueError):
        render_text(tl, width=3)
    assert tl.rows_per_us == pytest.approx(1000.0 * 256 / 500.0)
    half = Timeline("half", tl.intervals, time_per_tile=500.0, span=tl.span, tile_rows=128)
    table = compare_table([tl, half])
    assert MODEL_LABEL in table
    assert " 1.000x " in table.splitlines()[1]
    assert " 0.500x " in table.splitlines()[2], "throughput counts rows per tile"
    assert table.splitlines()[1].split()[-6:] == ["25", "75", "25", "25", "25", "25"], "busy % per role"


def test_png_has_one_panel_per_timeline(tmp_path):
    out = tmp_path / "tl.png"
    info = plot_timelines([_timeline("a"), _timeline("b", "load")], str(out), title="x")
    assert out.exists() and out.stat().st_size > 10_000
    assert info.bytes == out.stat().st_size
    assert len(info.panel_titles) == 2 and info.panel_titles[1].startswith("b:")
    assert all(rows == ROW_LABELS for rows in info.row_labels)
    assert MODEL_LABEL in info.suptitle
    with pytest.raises(ValueError, match="PNG"):
        plot_timelines([_timeline()], str(tmp_path / "tl.svg"))
    with pytest.raises(ValueError, match="no timeline"):
        plot_timelines([], str(out))


def test_docs_figures_come_from_the_project_objects(tmp_path):
    from fa_sm100.config import FmhaConfig, config_from_overrides
    from layouts.tmem import TmemPlan
    from pipelines.spec import PIPELINES

    drawn = figures.plot_tmem_plan(str(tmp_path / "tmem.png"))
    assert set(drawn["q_stage=2 (default)"]) == set(TmemPlan.for_config(FmhaConfig()).names)
    assert set(drawn["q_stage=1"]) == set(TmemPlan.for_config(config_from_overrides(["q_stage=1"])).names)
    warps = figures.plot_warp_roles(str(tmp_path / "warps.png"))
    roles = FmhaConfig().warp_roles()
    assert sorted(warps["warps"]) == list(range(roles.num_warps))
    assert warps["registers_used"] == roles.registers_used()
    graph = figures.plot_pipeline_graph(str(tmp_path / "graph.png"))
    expected = {(p.name, a, b) for p in PIPELINES for a in p.producer.roles for b in p.consumer.roles}
    assert set(graph["edges"]) == expected
    smem = figures.plot_smem_budget(str(tmp_path / "smem.png"))
    assert len(smem) == len(figures.SMEM_CONFIGS)
    for name in ("tmem.png", "warps.png", "graph.png", "smem.png"):
        assert (tmp_path / name).stat().st_size > 10_000


def test_docs_index_links_every_page_and_figures_exist():
    """docs/index.md links every page in docs/; every figure any page embeds is committed under
    docs/figures/; the figures of the pages this tool owns are ones its generator draws."""
    import os
    import re

    docs = os.path.join(os.path.dirname(__file__), "..", "docs")
    index = open(os.path.join(docs, "index.md")).read()
    linked = set(re.findall(r"\]\(([\w.-]+\.md)\)", index))
    pages = {f for f in os.listdir(docs) if f.endswith(".md") and f != "index.md"}
    assert pages <= linked, f"pages missing from docs/index.md: {sorted(pages - linked)}"
    generated = {name for name, _ in figures.STATIC_FIGURES.values()} | set(figures.MODEL_FIGURES.values())
    ours = {"index.md", "warp_roles.md", "tmem_plan.md", "switches.md", "verification.md"}
    for page in pages | {"index.md"}:
        for fig in re.findall(r"\]\(figures/([\w.-]+\.png)\)", open(os.path.join(docs, page)).read()):
            path = os.path.join(docs, "figures", fig)
            assert os.path.exists(path) and os.path.getsize(path) > 10_000, f"{page}: {fig} missing"
            if page in ours:
                assert fig in generated, f"{page} embeds {fig}, which the figures generator does not draw"


def test_docs_index_lists_every_committed_figure():
    """Every figure under docs/figures/ has a row in docs/index.md's figure table (what drew
    it and whether it is design, model output or a measurement), and every figure the table
    names is there."""
    import os
    import re

    docs = os.path.join(os.path.dirname(__file__), "..", "docs")
    index = open(os.path.join(docs, "index.md")).read()
    rows = [line for line in index.splitlines() if line.startswith("| `") and ".png`" in line]
    listed = {name for line in rows
              for name in re.findall(r"`([\w.-]+\.png)`", line.split("|")[1])}
    committed = {f for f in os.listdir(os.path.join(docs, "figures")) if f.endswith(".png")}
    assert committed <= listed, (f"figures without a row in docs/index.md: "
                                 f"{sorted(committed - listed)}")
    assert listed <= committed, f"rows for figures not committed: {sorted(listed - committed)}"
