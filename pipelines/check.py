"""CLI: check the SM100 forward's pipeline protocol on the CPU.

    python -m pipelines.check [--set field=value ...] [--inject KIND:PIPELINE] [--json out]

With no --set, checks every combination of q_stage {1, 2}, kv_stage 1..6, use_2cta {on, off}
and split_p {on, off} (combinations the config rules reject, e.g. 2-CTA with one K/V stage,
are listed as skipped), each for n_blocks 1..6 and work tiles 1..3, by randomized schedules (a uniform one and one
where waits run last, so producers run as far ahead as the protocol lets them), plus an
interleaving search of the 1-CTA protocols at n_blocks <= 2 and one work tile, exhaustive when
it finishes within ``--exhaustive-states`` (the summary and the JSON count the searches that
ran out: those are not exhaustive). ``--set`` fixes a field (grid fields included). Exit
status 0 when no finding, 1 when the model reports a deadlock, over-arrival, phase overrun,
wrong phase or stage, never-completing wait, dangling arrival or race, 2 on bad input.

``--inject drop-release:P | extra-arrive:P | skip-wait:P`` applies that fault to pipeline P
first; the model must then reject the protocol (exit 1 and name what it found).
``--source`` picks the programs: ``kernel`` (default: recorded while tracing the SM100 kernel,
a cross-compile per config, minutes for the whole grid) or ``design`` (pipelines/design.py,
the DESIGN.md protocol written with the same pipeline classes; seconds).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections import Counter

from fa_sm100.config import FmhaConfig, default_head_dim_v, parse_overrides
from pipelines.model import ProtocolModel, Report
from pipelines.program import BRANCH_POLICIES, inject, parse_injection
from pipelines.spec import BWD_PIPELINES, table_of

GRID = {
    "q_stage": (1, 2),
    "kv_stage": (1, 2, 3, 4, 5, 6),
    "use_2cta": (True, False),
    "split_p": (True, False),
}
N_BLOCKS = (1, 2, 3, 4, 5, 6)
WORK_TILES = (1, 2, 3)
# State budget of each exhaustive search. The largest 1-CTA search of the default grid
# (q_stage 2, kv_stage 3, split P, n_blocks 2, one tile) visits about 43k states, so every
# search of the default grid completes (about 1 min of CPU for all 32); a search that runs
# out is counted as truncated in the result and the summary, never reported as exhaustive.
EXHAUSTIVE_STATES = 50_000


def parse_range(text: str) -> tuple[int, ...]:
    """'1-6' or '1,3,5' -> a tuple of ints (ValueError otherwise)."""
    out = []
    for part in text.split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    if not out or min(out) < 0:
        raise ValueError(f"{text!r}: expected non-negative integers like 1-6 or 1,2,4")
    return tuple(out)


def grid_configs(overrides: dict):
    """Yield (cfg or None, fields, reason-if-skipped) over the grid, --set fields fixed."""
    axes = {k: ((overrides[k],) if k in overrides else v) for k, v in GRID.items()}
    fixed = {k: v for k, v in overrides.items() if k not in GRID}
    if "head_dim" in fixed and "head_dim_v" not in fixed:  # as config_from_overrides does
        fixed["head_dim_v"] = default_head_dim_v(fixed["head_dim"])
    for values in itertools.product(*axes.values()):
        fields = dict(zip(axes, values))
        try:
            cfg = FmhaConfig(**fixed, **fields).validate()
        except ValueError as e:
            yield None, fields, str(e)
            continue
        yield cfg, fields, None


def programs_for(cfg: FmhaConfig, source: str) -> dict:
    if source == "design":
        from pipelines.design import design_recording

        return design_recording(cfg).programs
    from pipelines.kernel_source import kernel_recording

    return kernel_recording(cfg).programs


def trip_bindings(cfg, n: int, t: int) -> dict:
    """The loop trip counts of a run: the forward's K/V blocks per tile and tiles per CTA;
    the backward's steps (query blocks x query heads of its one work tile per CTA) = ``n``."""
    if table_of(cfg) is BWD_PIPELINES:
        return {"steps": n}
    return {"n_blocks": n, "work_tiles": t}


def check_config(cfg: FmhaConfig, programs: dict, n_blocks, work_tiles, seeds: int,
                 exhaustive_states: int) -> list[dict]:
    """Model runs of one config over the trip grid; one dict per (n_blocks, work_tiles). For
    the backward (``Sm100BwdConfig``) ``n_blocks`` are its steps and there is one work tile."""
    rows = []
    policies = list(BRANCH_POLICIES.values())
    backward = table_of(cfg) is BWD_PIPELINES
    if backward:
        work_tiles = (1,)  # one work tile per CTA; n_blocks counts its steps
    for n, t in itertools.product(n_blocks, work_tiles):
        bindings = trip_bindings(cfg, n, t)
        rep = Report()
        for seed in range(seeds):
            # vary the run-time branch policy (then / else / alternate) across the grid
            policy = policies[(seed + n + t) % len(policies)]
            rep.merge(ProtocolModel(cfg, programs, bindings, policy).run_random(seed=seed))
            # the adversarial schedule: waits run last, producers run ahead
            rep.merge(ProtocolModel(cfg, programs, bindings, policy).run_random(seed, waits_last=True))
        random_truncated = rep.truncated  # a schedule cut off at run_random's step limit
        exhaustive = bool(exhaustive_states) and n <= 2 and t == 1 and not cfg.use_2cta
        ex_truncated = False
        if exhaustive:
            ex = ProtocolModel(cfg, programs, bindings).explore(exhaustive_states)
            ex_truncated = ex.truncated
            rep.merge(ex)
        rows.append({"n_blocks": n, "work_tiles": t, "schedules": rep.schedules,
                     "states": rep.states, "exhaustive": exhaustive,
                     "exhaustive_truncated": ex_truncated, "random_truncated": random_truncated,
                     "findings": [{"kind": f.kind, "message": f.message} for f in rep.findings]})
    return rows


class SourceError(RuntimeError):
    """The programs could not be obtained (e.g. the kernel failed to trace)."""


def run(overrides: dict, injection=None, source: str = "kernel", n_blocks=N_BLOCKS,
        work_tiles=WORK_TILES, seeds: int = 1, exhaustive_states: int = EXHAUSTIVE_STATES,
        stop_on_finding: bool = False) -> dict:
    """Check the grid; return the JSON-able result (``result["ok"]``)."""
    t0 = time.perf_counter()
    results, skipped = [], []
    stop = False
    for cfg, fields, why in grid_configs(overrides):
        if stop:
            break
        if cfg is None:
            skipped.append({"fields": fields, "reason": why})
            continue
        try:
            programs = programs_for(cfg, source)
        except Exception as e:  # a kernel that fails to trace cannot be checked
            raise SourceError(f"could not record the {source} protocol for {fields}: "
                              f"{type(e).__name__}: {e}") from e
        if injection is not None:
            programs = inject(programs, *injection)
        rows = check_config(cfg, programs, n_blocks, work_tiles, seeds, exhaustive_states)
        results.append({"fields": fields, "runs": rows})
        stop = stop_on_finding and any(r["findings"] for r in rows)
    kinds = Counter()
    messages, first_of_kind = [], {}
    for res in results:
        for row in res["runs"]:
            for f in row["findings"]:
                kinds[f["kind"]] += 1
                first_of_kind.setdefault(f["kind"], f["message"])
                if f["message"] not in messages:
                    messages.append(f["message"])
    # one message of every kind first, then the rest in order
    messages = list(first_of_kind.values()) + [m for m in messages if m not in first_of_kind.values()]
    runs = sum(len(r["runs"]) for r in results)
    rows = [row for r in results for row in r["runs"]]
    return {
        "ok": not kinds,
        "source": source,
        "injection": None if injection is None else f"{injection[0]}:{injection[1]}",
        "overrides": {k: v for k, v in overrides.items()},
        "configs_checked": len(results),
        "configs_skipped": skipped,
        "runs": runs,
        "schedules": sum(row["schedules"] for r in results for row in r["runs"]),
        "states_explored": sum(row["states"] for r in results for row in r["runs"]),
        "exhaustive_state_budget": exhaustive_states,
        "exhaustive_runs": sum(row["exhaustive"] for row in rows),
        # searches that ran out of states: not exhaustive, whatever they found
        "exhaustive_truncated": sum(row["exhaustive_truncated"] for row in rows),
        "random_truncated": sum(row["random_truncated"] for row in rows),
        "findings_by_kind": dict(kinds),
        "first_findings": messages[:10],
        "seconds": round(time.perf_counter() - t0, 2),
        "results": results,
    }


def summary(result: dict) -> str:
    lines = [
        f"pipelines.check ({result['source']} protocol"
        + (f", injected {result['injection']}" if result["injection"] else "") + ")",
        f"configs checked: {result['configs_checked']} (skipped by config rules: "
        f"{len(result['configs_skipped'])}); runs: {result['runs']}; random schedules: "
        f"{result['schedules']}; {result['seconds']} s",
        f"exhaustive searches: {result['exhaustive_runs']}, "
        + (f"of which {result['exhaustive_runs'] - result['exhaustive_truncated']} complete and "
           f"{result['exhaustive_truncated']} truncated at {result['exhaustive_state_budget']} states "
           f"(not exhaustive)" if result["exhaustive_truncated"] else
           f"all complete (state budget {result['exhaustive_state_budget']})")
        + f"; states explored: {result['states_explored']}",
    ]
    if result["random_truncated"]:
        lines.append(f"random schedules cut off at the step limit: {result['random_truncated']} runs")
    if result["ok"]:
        lines.append("OK: no deadlock, over-arrival, phase overrun, wrong phase, dangling arrival or race"
                     + (" (but the truncated searches above are incomplete)"
                        if result["exhaustive_truncated"] else ""))
    else:
        kinds = ", ".join(f"{k} x{v}" for k, v in sorted(result["findings_by_kind"].items()))
        lines.append(f"FAILED: {kinds}")
        lines += [f"  - {m}" for m in result["first_findings"]]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipelines.check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", action="append", default=[], metavar="field=value",
                    help="fix an FmhaConfig field (grid fields included)")
    ap.add_argument("--inject", metavar="KIND:PIPELINE",
                    help="drop-release:P, extra-arrive:P or skip-wait:P")
    ap.add_argument("--json", metavar="OUT", help="write the full result as JSON")
    ap.add_argument("--source", choices=("kernel", "design"), default="kernel",
                    help="kernel: trace the SM100 kernel (default); design: pipelines/design.py")
    ap.add_argument("--n-blocks", default="1-6", help="trip counts of the K/V loop (default 1-6)")
    ap.add_argument("--work-tiles", default="1-3", help="work tiles per CTA (default 1-3)")
    ap.add_argument("--seeds", type=int, default=1, help="random schedules per run (default 1)")
    ap.add_argument("--exhaustive-states", type=int, default=EXHAUSTIVE_STATES,
                    help=f"state budget of each exhaustive search (0: none; default "
                         f"{EXHAUSTIVE_STATES}, enough for every search of the default grid)")
    ap.add_argument("--stop-on-finding", action="store_true",
                    help="stop after the first config with a finding")
    args = ap.parse_args(argv)
    try:
        overrides = parse_overrides(args.set)
        injection = parse_injection(args.inject) if args.inject else None
        n_blocks, work_tiles = parse_range(args.n_blocks), parse_range(args.work_tiles)
        if args.seeds < 1:
            raise ValueError("--seeds must be >= 1")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        result = run(overrides, injection, args.source, n_blocks, work_tiles, args.seeds,
                     args.exhaustive_states, args.stop_on_finding)
    except SourceError as e:
        print(f"error: {e} (try --source design)", file=sys.stderr)
        return 2
    print(summary(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
