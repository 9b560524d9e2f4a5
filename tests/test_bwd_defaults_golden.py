"""Golden snapshot of the SM90 backward's defaults (``select_bwd_config``).

Contract: over the grids below (head dims, dtypes, causal, windows, GQA ratios, deterministic,
softcap, varlen, sequence lengths equal and unequal, and explicit overrides of the switches the
defaults decide), ``select_bwd_config`` returns the same config, field for field, or raises the
same error, as when ``tests/data/bwd_defaults_golden.json`` was written. The snapshot changes
only on purpose, regenerated explicitly, and its diff then shows which problems changed:

    python tests/test_bwd_defaults_golden.py --regenerate
    FA_SM100_REGENERATE_GOLDEN=1 python -m pytest tests/test_bwd_defaults_golden.py

The file stores each distinct outcome once (the fields that differ from the problem's plain
``BwdConfig``, or the error), then one line per (overrides, head dim, dtype, causal, window):
the outcome of each problem along ``INNER`` (run-length coded, ``i*n``: outcome i, n times).
A SHA-256 over every problem's full ``repr`` guards what the outcomes leave out.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import os
from pathlib import Path

from fa_sm100.config import default_head_dim_v, normalize_dtype
from fa_sm100.hopper.bwd_config import BwdConfig
from fa_sm100.hopper.bwd_defaults import select_bwd_config

GOLDEN = Path(__file__).parent / "data" / "bwd_defaults_golden.json"
REGENERATE_ENV = "FA_SM100_REGENERATE_GOLDEN"
COMMAND = "python tests/test_bwd_defaults_golden.py --regenerate"

BOOLS = (False, True)
# (seqlen_q, seqlen_k): unknown, the lengths around each threshold of the defaults (2048, 4096),
# odd numbers of 128-key blocks (640, 4224: no whole clusters of 2), and unequal pairs
SEQLENS = ((None, None), (None, 4096), (4096, None), (512, 512), (640, 640), (1024, 1024),
           (2048, 2048), (3000, 3000), (4096, 4096), (4224, 4224), (8192, 8192),
           (16384, 16384), (32768, 32768), (1024, 4096), (4096, 1024), (2048, 4224),
           (4224, 2048), (4096, 8192), (8192, 4096), (512, 32768), (32768, 512))
DEFAULTS_GRID = dict(
    head_dim=(64, 96, 128, 192, 256),  # 192: head_dim_v 128 (the default)
    dtype=("bfloat16", "float16"), causal=BOOLS,
    window=((None, None), (512, 0), (100, 30), (None, 0)),
    qhead_per_kvhead=(1, 2, 4, 8), deterministic=BOOLS, softcap=BOOLS, varlen=BOOLS,
    seqlens=SEQLENS)
# each override over a smaller grid: bf16, fewer windows, GQA ratios and lengths
OVERRIDES_GRID = dict(
    DEFAULTS_GRID, dtype=("bfloat16",), window=((None, None), (512, 0), (None, 0)),
    qhead_per_kvhead=(1, 4),
    seqlens=((None, None), (1024, 1024), (4096, 4096), (8192, 4224)))
OVERRIDES = (
    {"tile_m": 64}, {"tile_m": 80}, {"tile_m": 128}, {"tile_n": 64}, {"tile_n": 128},
    {"sdp_swap_ab": False}, {"sdp_swap_ab": True}, {"persistent_ctas": 0},
    {"persistent_ctas": 132}, {"persistent_ctas": 132, "dynamic_tiles": True},
    {"dynamic_tiles": False}, {"pre_ctas": 0}, {"pre_ctas": 32},
    {"stats_shuffle": True}, {"stats_shuffle": False}, {"lse_early": True}, {"lse_early": False},
    {"dp_wait_after": 10}, {"dp_wait_after": -1}, {"stats_first": False}, {"stats_smem": False},
    {"early_dv": True}, {"early_dv": False}, {"early_dv": None}, {"dv_before_barrier": False},
    {"dv_before_barrier": True}, {"gqa_reduce": "atomic"}, {"dq_accum": "red"},
    {"early_dq_post": False}, {"early_dq_post": True}, {"early_dq_post": None}, {"pdl": False},
    {"qdo_multicast": False}, {"qdo_multicast": True}, {"qdo_cluster": 4},
    {"stagger_m": False}, {"stagger_m": True}, {"dq_first_store": False},
    {"longest_first": False}, {"regs_producer": 32}, {"regs_mma": 232},
)
# section: (grid, the overrides each runs with)
SECTIONS = {"defaults": (DEFAULTS_GRID, ({},)), "with overrides": (OVERRIDES_GRID, OVERRIDES)}
OUTER = ("head_dim", "dtype", "causal", "window")  # one line each
INNER = ("qhead_per_kvhead", "deterministic", "softcap", "varlen", "seqlens")  # along a line
FIELDS = dataclasses.fields(BwdConfig)


def _plain(p: dict) -> BwdConfig:
    """The problem's ``BwdConfig`` with every switch at its field default (not validated)."""
    return BwdConfig(head_dim=p["head_dim"], head_dim_v=default_head_dim_v(p["head_dim"]),
                     dtype=normalize_dtype(p["dtype"]), causal=p["causal"],
                     window_left=p["window"][0], window_right=p["window"][1],
                     qhead_per_kvhead=p["qhead_per_kvhead"], softcap=p["softcap"],
                     deterministic=p["deterministic"], varlen=p["varlen"])


def _outcome(p: dict, overrides: dict):
    """(readable outcome, full repr): the fields that differ from the problem's plain config,
    or the error ``select_bwd_config`` raises."""
    try:
        cfg = select_bwd_config(
            head_dim=p["head_dim"], dtype=p["dtype"], causal=p["causal"],
            window_left=p["window"][0], window_right=p["window"][1],
            qhead_per_kvhead=p["qhead_per_kvhead"], deterministic=p["deterministic"],
            seqlen_q=p["seqlens"][0], seqlen_k=p["seqlens"][1], softcap=p["softcap"],
            varlen=p["varlen"], **overrides)
    except Exception as e:  # noqa: BLE001 - the snapshot records whichever error it is
        text = f"{type(e).__name__}: {e}"
        return text, text
    plain = _plain(p)
    diff = [f"{name}={value!r}" for name, value, base in
            ((f.name, getattr(cfg, f.name), getattr(plain, f.name)) for f in FIELDS)
            if value != base or type(value) is not type(base)]
    return " ".join(diff) or "(plain)", repr(cfg)


def _lines(section: str):
    """(line key, [(problem, overrides), ...] along ``INNER``) of a section."""
    grid, overrides_list = SECTIONS[section]
    for overrides in overrides_list:
        for outer in itertools.product(*(grid[a] for a in OUTER)):
            head = dict(zip(OUTER, outer))
            key = " ".join(f"{a}={v!r}" for a, v in {**head, **overrides}.items())
            yield key, [({**head, **dict(zip(INNER, inner))}, overrides)
                        for inner in itertools.product(*(grid[a] for a in INNER))]


def _encode(row: list) -> str:
    return " ".join(str(i) if n == 1 else f"{i}*{n}"
                    for i, n in ((i, len(list(run))) for i, run in itertools.groupby(row)))


def _decode(text: str) -> list:
    out = []
    for token in text.split():
        i, _, n = token.partition("*")
        out += [int(i)] * int(n or 1)
    return out


def snapshot() -> dict:
    outcomes, index = [], {}
    digest = hashlib.sha256()
    snap = {"about": "select_bwd_config over the grids of tests/test_bwd_defaults_golden.py "
                     "(its docstring explains the layout)", "command": COMMAND,
            "cases": 0, "sha256": None, "outer": " ".join(OUTER), "inner": " ".join(INNER),
            "grids": {name: {a: repr(values) for a, values in grid.items()}
                      for name, (grid, _) in SECTIONS.items()},
            "overrides": [repr(o) for o in OVERRIDES], "outcomes": outcomes}
    for section in SECTIONS:
        lines = snap[section] = {}
        for key, problems in _lines(section):
            row = []
            for problem, overrides in problems:
                text, full = _outcome(problem, overrides)
                row.append(index.setdefault(text, len(index)))
                if row[-1] == len(outcomes):
                    outcomes.append(text)
                digest.update(f"{key} {problem}\t{full}\n".encode())
            lines[key] = _encode(row)
            snap["cases"] += len(row)
    snap["sha256"] = digest.hexdigest()
    return snap


def write(path: Path = GOLDEN) -> dict:
    snap = snapshot()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(snap, indent=1) + "\n")
    return snap


def test_select_bwd_config_matches_golden():
    """Every problem of the grids gets the config (or error) the snapshot recorded."""
    if os.environ.get(REGENERATE_ENV):
        write()
    golden = json.loads(GOLDEN.read_text())
    now = snapshot()
    changed = []
    for section in SECTIONS:
        for key, problems in _lines(section):
            old = _decode(golden[section].get(key, ""))
            new = _decode(now[section][key])
            if len(old) != len(new):
                changed.append(f"{key}: {len(old)} problems in the snapshot, {len(new)} now")
                continue
            for (problem, _), a, b in zip(problems, old, new):
                was, got = golden["outcomes"][a], now["outcomes"][b]
                if was != got:
                    inner = {k: problem[k] for k in INNER}
                    changed.append(f"{key} {inner}:\n  was {was}\n  now {got}")
    assert not changed, (f"{len(changed)} problems changed (regenerate with {COMMAND} only if "
                         "that is meant):\n" + "\n".join(changed[:20]))
    assert now["cases"] == golden["cases"]
    assert now["sha256"] == golden["sha256"], "a config's repr changed beyond its fields"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--regenerate", action="store_true", help=f"write {GOLDEN}")
    if not parser.parse_args().regenerate:
        parser.error("nothing to do without --regenerate (pytest runs the check)")
    snap = write()
    print(f"{GOLDEN}: {snap['cases']} problems, {len(snap['outcomes'])} distinct outcomes")
