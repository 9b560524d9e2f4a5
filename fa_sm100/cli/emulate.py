"""Numerics of the SM100 forward algorithm, emulated on the CPU (issue 5).

    python scripts/emulate.py [--json out.json] [--case NAME ...] [--set field=value ...]
                              [--no-threshold] [--no-ex2]

``--set`` applies FmhaConfig switches (e.g. ``ex2_emu_fraction=1.0``, ``rescale_threshold=0``)
to every case, on top of the case's own switches.

Prints three reports and exits non-zero if any case breaks the error rule:

1. per case of the CI matrix (``fa_sm100.emulation.cases.CI_CASES``): the emulation's max
   error on O and LSE against the float64 reference, the same for plain attention in the input
   dtype, the ratio, the rescales, the largest P and whether the rule (err <= 2 x plain + atol)
   holds;
2. the ex2 polynomial against correctly rounded float32 exp2: max relative
   error, ulp distribution, over every fraction on the 2^-23 grid and over the kernel's input
   range [-126, threshold];
3. how often the rescale threshold fires, with threshold 8 and 0, on random and adversarial
   (monotonically rising) scores.

``--json`` writes {"constants", "cases", "ex2", "threshold", "seconds"}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time



def _switches(case) -> str:
    return ",".join(case.switches) if case.switches else "-"


def print_cases(cases, results) -> None:
    head = (f"{'case':38s} {'dt':4s} {'sq x sk':>11s} {'h/kv':>5s} {'d':>7s} {'mask':6s} "
            f"{'err O':>9s} {'plain O':>9s} {'ratio':>6s} {'err LSE':>9s} {'plain LSE':>9s} "
            f"{'rescale':>11s} {'max P':>7s} {'s':>5s}  ok  switches")
    print(head)
    print("-" * len(head))
    for case, r in zip(cases, results):
        mask = "causal" if case.causal else "-"
        if case.window != (None, None):
            mask = f"w{case.window[0]},{case.window[1]}"
        ratio = r.err / r.plain_err if r.plain_err > 0 else float("nan")
        resc = f"{r.stats['rescaled']}/{r.stats['row_tiles']}"
        print(f"{case.name:38s} {case.dtype:4s} {case.seqlen_q:>5d}x{case.seqlen_k:<5d} "
              f"{case.heads:>2d}/{case.kv_heads:<2d} {case.head_dim:>3d},{case.head_dim_v:<3d} "
              f"{mask:6s} {r.err:9.2e} {r.plain_err:9.2e} {ratio:6.2f} {r.lse_err:9.2e} "
              f"{r.plain_lse_err:9.2e} {resc:>11s} {r.stats['max_p']:7.3g} {r.seconds:5.2f}  "
              f"{'yes' if r.ok else 'NO '} {_switches(case)}")
        if not r.ok:
            print(f"    {r.message}")


def print_ex2(rows) -> None:
    print(f"{'path':5s} {'inputs':36s} {'count':>9s} {'max rel':>9s} {'max ulp':>7s} "
          f"{'mean ulp':>8s}  ulp distribution (share of inputs)")
    for r in rows:
        hist = " ".join(f"{k}:{v:.3f}" for k, v in r["ulp_histogram"].items() if v > 0)
        print(f"{r['path']:5s} {r['inputs']:36s} {r['count']:9d} {r['max_rel_error']:9.2e} "
              f"{r['max_ulp']:7d} {r['mean_ulp']:8.1f}  {hist}")


def print_threshold(rows) -> None:
    print(f"{'scenario':38s} {'thr':>4s} {'decisions':>9s} {'max grew':>9s} {'rescaled':>9s} "
          f"{'rate':>7s} {'rows hit':>9s} {'max P':>8s} {'err O':>9s} {'plain O':>9s}")
    for r in rows:
        print(f"{r['scenario']:38s} {r['threshold']:4g} {r['row_tiles']:9d} {r['max_grew']:9d} "
              f"{r['rescaled']:9d} {r['rescale_rate']:7.2%} {r['rows_rescaled']:4d}/{r['rows']:<4d} "
              f"{r['max_p']:8.3g} {r['err']:9.2e} {r['plain_err']:9.2e}")


def threshold_summary(rows) -> str:
    """One sentence per scenario answering whether the threshold "never triggered"."""
    lines = []
    for r in rows:
        if r["threshold"] == 0:
            continue
        lines.append(f"  {r['scenario']}: the max grew in {r['grow_rate']:.1%} of row-block steps; "
                     f"threshold {r['threshold']:g} rescaled in {r['rescale_rate']:.3%} "
                     f"({r['rescaled']} of {r['row_tiles']}); largest P {r['max_p']:.3g}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the reports to this JSON file")
    ap.add_argument("--case", nargs="*", default=None, help="run only these CI cases (by name)")
    ap.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                    help="FmhaConfig switches applied to every case (after the case's own)")
    ap.add_argument("--no-threshold", action="store_true", help="skip the threshold report")
    ap.add_argument("--no-ex2", action="store_true", help="skip the ex2 accuracy report")
    args = ap.parse_args(argv)

    import dataclasses  # after the path fix above: dataclasses imports inspect

    import torch

    from fa_sm100 import softmax_math as sm
    from fa_sm100.config import FmhaConfig, parse_overrides
    from fa_sm100.emulation.cases import CI_CASES, run_case, threshold_report
    from fa_sm100.emulation.ex2 import ex2_report

    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    t0 = time.perf_counter()
    cases = CI_CASES
    if args.case is not None:
        known = {c.name: c for c in CI_CASES}
        unknown = [n for n in args.case if n not in known]
        if unknown:
            ap.error(f"unknown case(s) {unknown}; known: {sorted(known)}")
        cases = tuple(known[n] for n in args.case)

    if args.set:
        try:
            FmhaConfig(**parse_overrides(args.set)).replace(kv_stage=3, use_2cta=False).validate()
        except (ValueError, TypeError) as exc:
            ap.error(f"--set: {exc}")
        cases = tuple(dataclasses.replace(c, switches=tuple(c.switches) + tuple(args.set))
                      for c in cases)

    cfg = FmhaConfig()
    constants = dict(
        ex2_poly_coeffs=list(sm.EX2_POLY_COEFFS),
        ex2_poly_coeffs_bits=[hex(b) for b in sm.EX2_POLY_COEFFS_BITS],
        ex2_emu_fraction=cfg.ex2_emu_fraction,
        ex2_emulated_pairs=list(sm.ex2_emulated_pairs(cfg.n_block, cfg.ex2_emu_fraction)),
        rescale_threshold=cfg.rescale_threshold,
        split_p_col=cfg.split_p_col,
    )
    print("constants (fa_sm100.softmax_math):", json.dumps(constants))

    print("\n== error per case: emulation vs float64 reference, plain = torch in the input dtype ==")
    results = [run_case(c) for c in cases]
    print_cases(cases, results)

    ex2_rows = []
    if not args.no_ex2:
        print("\n== ex2: the polynomial (FMA pipe) vs correctly rounded float32 exp2 ==")
        ex2_rows = ex2_report(cfg.rescale_threshold)
        print_ex2(ex2_rows)

    thr_rows = []
    if not args.no_threshold:
        print("\n== rescale threshold: how often O is rescaled (decisions = row x K/V block after "
              "the first finite max) ==")
        thr_rows = threshold_report()
        print_threshold(thr_rows)
        print(threshold_summary(thr_rows))

    seconds = time.perf_counter() - t0
    failed = [r.name for r in results if not r.ok]
    print(f"\n{len(results) - len(failed)}/{len(results)} cases meet the rule; {seconds:.1f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(constants=constants, cases=[r.as_dict() for r in results],
                           ex2=ex2_rows, threshold=thr_rows, seconds=seconds), fh, indent=1)
        print(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
