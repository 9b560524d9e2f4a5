"""Golden snapshot of the SM90 forward's defaults (``select_sm90_fwd_config``).

Contract: over the grids below (head dims, dtypes, causal, local, softcap, varlen, write_lse,
sequence lengths unknown, equal and unequal, around each threshold of the defaults and with odd
numbers of m blocks, (batch, head) counts, and explicit overrides of the switches the defaults
decide), ``select_sm90_fwd_config`` returns the same config, field for field, or raises the
same error, as when ``tests/data/fwd_defaults_golden.json`` was written. The snapshot changes
only on purpose, regenerated explicitly, and its diff then shows which problems changed:

    python tests/test_fwd_defaults_golden.py --regenerate
    FA_SM100_REGENERATE_GOLDEN=1 python -m pytest tests/test_fwd_defaults_golden.py

The layout is the backward's (tests/test_bwd_defaults_golden.py): each distinct outcome once
(the fields that differ from the problem's plain ``Sm90FwdConfig``, or the error), then one
line per (overrides, ``OUTER``) with the outcome of each problem along ``INNER``, run-length
coded; a SHA-256 over every problem's full ``repr`` guards what the outcomes leave out.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import sys
from pathlib import Path

from test_bwd_defaults_golden import REGENERATE_ENV, _decode, _encode

from fa_sm100.config import default_head_dim_v, normalize_dtype
from fa_sm100.hopper.config import Sm90FwdConfig, select_sm90_fwd_config

GOLDEN = Path(__file__).parent / "data" / "fwd_defaults_golden.json"
COMMAND = "python tests/test_fwd_defaults_golden.py --regenerate"

BOOLS = (False, True)
# (seqlen_q, seqlen_k): unknown, the lengths around each threshold of the defaults (1024, 2048,
# 8192), odd numbers of 128-row m blocks (640, 1088, 8320) and 192-row tiles with an empty
# warpgroup (640, 1000, 3000), and unequal pairs
SEQLENS = ((None, None), (None, 8192), (8192, None), (512, 512), (640, 640), (1000, 1000),
           (1024, 1024), (1088, 1088), (2048, 2048), (3000, 3000), (4096, 4096), (8192, 8192),
           (8320, 8320), (16384, 16384), (32768, 32768), (1024, 4096), (4096, 1024),
           (2048, 8192), (8192, 2048), (8320, 16384), (16384, 8320), (512, 32768),
           (32768, 512))
DEFAULTS_GRID = dict(
    head_dim=(64, 96, 128, 192, 256),  # 192: head_dim_v 128 (the default)
    dtype=("bfloat16", "float16"), causal=BOOLS, local=BOOLS, softcap=BOOLS, varlen=BOOLS,
    write_lse=BOOLS, seqlens=SEQLENS, batch_heads=(None, 1, 2, 7, 16))
# each override over a smaller grid: bf16, write_lse, fewer lengths and (batch, head) counts
OVERRIDES_GRID = dict(
    DEFAULTS_GRID, dtype=("bfloat16",), write_lse=(True,), batch_heads=(None, 2, 7),
    seqlens=((None, None), (640, 640), (1024, 1024), (2048, 2048), (8192, 8192),
             (8320, 16384), (32768, 32768)))
OVERRIDES = (
    {"persistent": True}, {"persistent": False}, {"kv_multicast": True},
    {"kv_multicast": False}, {"kv_multicast": True, "kv_cluster": 4},
    {"kv_multicast": True, "persistent": True}, {"kv_multicast": True, "persistent": False},
    {"kv_cluster": 4}, {"num_consumer_wg": 2}, {"num_consumer_wg": 3}, {"num_consumer_wg": 4},
    {"q_stage": 1}, {"q_stage": 2}, {"wg_epilogue": False}, {"wg_epilogue": True},
    {"o_in_q_buffer": False}, {"o_in_q_buffer": True}, {"dynamic_schedule": False},
    {"dynamic_schedule": True}, {"persistent": True, "dynamic_schedule": False},
    {"persistent": True, "o_in_q_buffer": True}, {"multicast_odd_m": False},
    {"multicast_odd_m": True}, {"skip_empty_wg": False}, {"skip_empty_wg": True},
    {"n_block": 64}, {"n_block": 176}, {"kv_stage": 1}, {"kv_stage": 3}, {"pingpong": False},
    {"pingpong": True}, {"rescale_threshold": 0.0}, {"rescale_o_before_pv": False},
    {"intra_wg_overlap": False}, {"regs_consumer": 160, "regs_producer": 32},
    {"k_before_q": True}, {"l2_section_mib": 8},
)
# section: (grid, the overrides each runs with)
SECTIONS = {"defaults": (DEFAULTS_GRID, ({},)), "with overrides": (OVERRIDES_GRID, OVERRIDES)}
OUTER = ("head_dim", "dtype", "causal", "local")  # one line each
INNER = ("softcap", "varlen", "write_lse", "seqlens", "batch_heads")  # along a line
FIELDS = dataclasses.fields(Sm90FwdConfig)
PROBLEM_ARGS = ("head_dim", "dtype", "causal", "local", "softcap", "varlen", "write_lse",
                "batch_heads")


def _plain(p: dict) -> Sm90FwdConfig:
    """The problem's config with every switch at its field default (not validated)."""
    return Sm90FwdConfig(head_dim=p["head_dim"], head_dim_v=default_head_dim_v(p["head_dim"]),
                         dtype=normalize_dtype(p["dtype"]), causal=p["causal"],
                         local=p["local"] or p["varlen"], softcap=p["softcap"],
                         varlen=p["varlen"], write_lse=p["write_lse"])


def _outcome(p: dict, overrides: dict) -> tuple[str, str]:
    """(readable outcome, full repr): the fields that differ from the problem's plain config,
    or the error ``select_sm90_fwd_config`` raises."""
    try:
        cfg = select_sm90_fwd_config(**{a: p[a] for a in PROBLEM_ARGS}, seqlen_q=p["seqlens"][0],
                                     seqlen_k=p["seqlens"][1], **overrides)
    except Exception as e:  # noqa: BLE001 - the snapshot records whichever error it is
        return (f"{type(e).__name__}: {e}",) * 2
    plain = _plain(p)
    diff = [f"{f.name}={getattr(cfg, f.name)!r}" for f in FIELDS
            if getattr(cfg, f.name) != getattr(plain, f.name)
            or type(getattr(cfg, f.name)) is not type(getattr(plain, f.name))]
    return " ".join(diff) or "(plain)", repr(cfg)


def problem_lines():
    """(section, line key, [(problem, overrides), ...] along ``INNER``) over every section."""
    for section, (grid, overrides_list) in SECTIONS.items():
        for overrides, outer in itertools.product(overrides_list,
                                                  itertools.product(*map(grid.get, OUTER))):
            head = dict(zip(OUTER, outer))
            key = " ".join(f"{a}={v!r}" for a, v in {**head, **overrides}.items())
            inner = itertools.product(*map(grid.get, INNER))
            yield section, key, [({**head, **dict(zip(INNER, i))}, overrides) for i in inner]


def snapshot() -> dict:
    """The golden file's content, computed from the current code."""
    outcomes: dict[str, int] = {}
    digest = hashlib.sha256()
    lines: dict[str, dict] = {section: {} for section in SECTIONS}
    cases = 0
    for section, key, problems in problem_lines():
        row = []
        for problem, overrides in problems:
            text, full = _outcome(problem, overrides)
            row.append(outcomes.setdefault(text, len(outcomes)))
            digest.update(f"{key} {problem}\t{full}\n".encode())
        lines[section][key] = _encode(row)
        cases += len(row)
    return {"about": "select_sm90_fwd_config over the grids of tests/test_fwd_defaults_golden.py"
                     " (its docstring explains the layout)", "command": COMMAND,
            "cases": cases, "sha256": digest.hexdigest(), "outer": " ".join(OUTER),
            "inner": " ".join(INNER),
            "grids": {name: {a: repr(v) for a, v in grid.items()}
                      for name, (grid, _) in SECTIONS.items()},
            "overrides": [repr(o) for o in OVERRIDES], "outcomes": list(outcomes), **lines}


def write(path: Path = GOLDEN) -> dict:
    snap = snapshot()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(snap, indent=1) + "\n")
    return snap


def changed_problems(golden: dict, now: dict) -> list[str]:
    """The problems whose outcome differs between two snapshots, in words."""
    changed = []
    for section, key, problems in problem_lines():
        old, new = (_decode(s[section].get(key, "")) for s in (golden, now))
        if len(old) != len(new):
            changed.append(f"{key}: {len(old)} problems in the snapshot, {len(new)} now")
            continue
        for (problem, _), a, b in zip(problems, old, new):
            if golden["outcomes"][a] != now["outcomes"][b]:
                inner = {k: problem[k] for k in INNER}
                changed.append(f"{key} {inner}:\n  was {golden['outcomes'][a]}\n"
                               f"  now {now['outcomes'][b]}")
    return changed


def stored() -> dict:
    """The snapshot on disk (rewritten from the current code first when ``REGENERATE_ENV`` is
    set)."""
    return write() if os.environ.get(REGENERATE_ENV) else json.loads(GOLDEN.read_text())


def test_select_sm90_fwd_config_matches_golden():
    """Every problem of the grids gets the config (or error) the snapshot recorded."""
    golden, now = stored(), snapshot()
    changed = changed_problems(golden, now)
    assert not changed, (f"{len(changed)} problems changed (regenerate with {COMMAND} only if "
                         "that is meant):\n" + "\n".join(changed[:20]))
    assert (now["cases"], now["sha256"]) == (golden["cases"], golden["sha256"]), (
        "a config's repr changed beyond its fields")


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit(f"usage: {COMMAND} (pytest runs the check)")
    written = write()
    print(f"{GOLDEN}: {written['cases']} problems, {len(written['outcomes'])} distinct outcomes")
