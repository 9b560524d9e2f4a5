"""Logit softcapping's cost, ours and FA4's, in one process on one GPU (forward and backward).

    python scripts/softcap_bench.py                              # the default cells
    python scripts/softcap_bench.py --cells 128:4096:1 --softcap 30 --json s.json --png s.png

A cell ``HDIM:SEQLEN:CAUSAL`` runs bf16 attention with ``--tokens`` tokens per batch and
``--hidden / HDIM`` heads, four ways: ours and FA4, each without and with ``softcap``. The
question is what the cap costs: ``ours cap / ours`` (the goal: at least 0.8) beside
``fa4 cap / fa4``, and ``ours cap / fa4 cap``. Every provider runs through its public API
(``flash_attn_func``; ``torch.autograd.grad`` of it for the backward). TFLOP/s count the two
GEMMs (2.5x backward), halved for causal.

Rounds are interleaved (``fa_sm100.benchmarking.run_cell``); ratios are medians paired by
round, with the 95% interval. Each forward is first checked on its last 64 query rows of every
(batch, head) against float64 (the project's rule, error <= 2 x plain bf16 + 1e-3), each
backward for finite gradients; a provider that fails is not timed there.
"""

from __future__ import annotations

import argparse
import sys


from fa_sm100.benchmarking import (MIN_ROUNDS, format_interval, optional_fa4,
                                   paired_interval, paired_ratio, plot_mode_bars, run_cell,
                                   save_results, time_ms)

DEFAULT_CELLS = ["128:4096:1", "128:16384:1", "128:4096:0", "64:8192:1", "256:8192:1"]
CHECK_ROWS = 64


def parse_cell(text: str) -> tuple:
    try:
        hdim, seqlen, causal = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a cell is HDIM:SEQLEN:CAUSAL, e.g. 128:4096:1")
    return hdim, seqlen, bool(causal)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", type=parse_cell, nargs="+",
                   default=[parse_cell(c) for c in DEFAULT_CELLS])
    p.add_argument("--softcap", type=float, default=30.0)
    p.add_argument("--tokens", type=int, default=16384, help="batch x seqlen per cell")
    p.add_argument("--hidden", type=int, default=2048, help="heads x head dim")
    p.add_argument("--modes", nargs="+", choices=["fwd", "bwd"], default=["fwd", "bwd"])
    p.add_argument("--no-fa4", action="store_true")
    p.add_argument("--ours-ex2", type=float, nargs="*", default=[], metavar="F",
                   help="forward: also ours capped with ex2_emu_fraction=F (a share of the "
                        "softmax's exp2 on the FMA pipe), as 'ours cap ex2=F'")
    p.add_argument("--repeat", type=int, default=MIN_ROUNDS)
    p.add_argument("--warmup", type=int, default=25)
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--json")
    p.add_argument("--png")
    return p.parse_args(argv)


def tflops(mode, batch, heads, seqlen, hdim, causal, ms) -> float:
    flop = 4 * batch * heads * seqlen * seqlen * hdim * (0.5 if causal else 1.0)
    return flop * (2.5 if mode == "bwd" else 1.0) / (ms * 1e-3) / 1e12


def check_forward(out, q, k, v, causal, softcap, torch):
    from fa_sm100.testing import attention_reference, max_abs_error

    r0 = max(q.shape[1] - CHECK_ROWS, 0)  # the last rows: keys [0, s) stay aligned
    ref, _ = attention_reference(q[:, r0:], k, v, causal=causal, softcap=softcap)
    plain, _ = attention_reference(q[:, r0:], k, v, causal=causal, softcap=softcap,
                                   dtype=q.dtype, upcast=False)
    got = (out[0] if isinstance(out, tuple) else out)[:, r0:]
    err, plain_err = max_abs_error(got, ref), max_abs_error(plain, ref)
    if torch.isnan(got).any() or not err <= 2 * plain_err + 1e-3:
        return f"max error {err:.3e} against plain bf16's {plain_err:.3e}"
    return None


def providers(mode, q, k, v, dout, causal, softcap, fa4, torch, ex2_fractions=()):
    from fa_sm100.hopper.config import select_sm90_fwd_config
    from fa_sm100.interface import flash_attn_func

    fns = {"ours": lambda a, b, c: flash_attn_func(a, b, c, causal=causal),
           "ours cap": lambda a, b, c: flash_attn_func(a, b, c, causal=causal, softcap=softcap)}
    for f in ex2_fractions if mode == "fwd" else ():
        cfg = select_sm90_fwd_config(q.shape[3], causal=causal, softcap=True, write_lse=False,
                                     seqlen_q=q.shape[1], seqlen_k=k.shape[1],
                                     batch_heads=q.shape[0] * q.shape[2], ex2_emu_fraction=f)
        fns[f"ours cap ex2={f:g}"] = (lambda a, b, c, cfg=cfg: flash_attn_func(
            a, b, c, causal=causal, softcap=softcap, config=cfg))
    if fa4 is not None:
        fns["fa4"] = lambda a, b, c: fa4(a, b, c, causal=causal)
        fns["fa4 cap"] = lambda a, b, c: fa4(a, b, c, causal=causal, softcap=softcap)
    if mode == "fwd":
        return {name: (lambda fn=fn: lambda: fn(q, k, v)) for name, fn in fns.items()}

    def backward(fn):
        def prepare():
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            o = fn(qg, kg, vg)
            o = o[0] if isinstance(o, tuple) else o
            return lambda: torch.autograd.grad(o, (qg, kg, vg), dout, retain_graph=True)
        return prepare

    return {name: backward(fn) for name, fn in fns.items()}


def run(args):
    import torch

    fa4 = None if args.no_fa4 else optional_fa4("softcap_bench", "flash_attn_func")
    rows = []
    jobs = [(m, c) for c in args.cells for m in args.modes]
    for i, (mode, (hdim, seqlen, causal)) in enumerate(jobs):
        batch, heads = max(args.tokens // seqlen, 1), args.hidden // hdim
        print(f"[{i + 1}/{len(jobs)}] {mode} hdim {hdim} seqlen {seqlen} causal {causal}",
              file=sys.stderr, flush=True)
        g = torch.Generator(device="cuda").manual_seed(hdim * 131 + seqlen)
        q, k, v, dout = (torch.randn(batch, seqlen, heads, hdim, device="cuda",
                                     dtype=torch.bfloat16, generator=g) for _ in range(4))
        q = q * 2  # scores of a few units: the cap bends the larger ones
        current = {}  # the provider run_cell checks next: it prepares, runs, checks in turn

        def named(name, prepare):
            def wrapped():
                current["name"] = name
                return prepare()
            return wrapped

        prepares = {name: named(name, prep) for name, prep in
                    providers(mode, q, k, v, dout, causal, args.softcap, fa4, torch,
                              args.ours_ex2).items()}

        def check(out):
            if mode == "bwd":
                return None if all(bool(torch.isfinite(x).all()) for x in out) else "non-finite"
            capped = "cap" in current["name"]
            return check_forward(out, q, k, v, causal, args.softcap if capped else 0.0, torch)

        times, errors = run_cell(prepares, check, args.repeat,
                                 lambda fn: time_ms(fn, args.warmup, args.rep, torch),
                                 sync=torch.cuda.synchronize)
        row = {"mode": mode, "hdim": hdim, "seqlen": seqlen, "causal": causal, "batch": batch,
               "heads": heads, "softcap": args.softcap, "errors": errors, "ms": {},
               "tflops": {}, "ratios": {}}
        for name, ms in times.items():
            if ms:
                med = sorted(ms)[len(ms) // 2]
                row["ms"][name] = med
                row["tflops"][name] = tflops(mode, batch, heads, seqlen, hdim, causal, med)
        for label, mine, base in (("ours cap / ours", "ours cap", "ours"),
                                  ("fa4 cap / fa4", "fa4 cap", "fa4"),
                                  ("ours cap / fa4 cap", "ours cap", "fa4 cap")):
            if times.get(mine) and times.get(base):
                # paired_ratio(times, a, [b]) = b's ms / a's ms: a's speed over b's
                row["ratios"][label] = (paired_ratio(times, mine, [base]),
                                        paired_interval(times, mine, [base]))
        for name in times:
            if name.startswith("ours cap ex2=") and times[name] and times.get("ours"):
                row["ratios"][f"{name} / ours"] = (paired_ratio(times, name, ["ours"]),
                                                   paired_interval(times, name, ["ours"]))
        rows.append(row)
        print(format_row(row), file=sys.stderr, flush=True)
        if args.json:  # after every cell: a run cut short keeps what it measured
            save_results(args.json, "scripts/softcap_bench.py", args.argv,
                         torch.cuda.get_device_name(), rows)
        del q, k, v, dout
        torch.cuda.empty_cache()
    return rows


def format_row(row) -> str:
    tf = "  ".join(f"{n} {t:6.1f}" for n, t in row["tflops"].items())
    ratios = "  ".join(f"{n} {r:.3f} {format_interval(i)}" for n, (r, i) in row["ratios"].items())
    errs = "".join(f"  [{n}: {e}]" for n, e in row["errors"].items())
    return (f"{row['mode']} d{row['hdim']} {row['seqlen']} "
            f"{'causal' if row['causal'] else 'non-causal'}: {tf} TFLOP/s  {ratios}{errs}")


def plot(rows, path: str, device: str):
    mode_name = {"fwd": "forward", "bwd": "backward"}
    plot_mode_bars(
        rows, ("ours", "ours cap", "fa4", "fa4 cap"), path,
        f"Logit softcapping through the public API on {device}",
        lambda r: f"d{r['hdim']}\n{r['seqlen'] // 1024}k {'c' if r['causal'] else 'nc'}",
        lambda mode, cells: f"{mode_name[mode]}, softcap {cells[0]['softcap']:g} vs none")


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("softcap_bench: needs a CUDA GPU (SM90)", file=sys.stderr)
        return 2
    args.argv = sys.argv[1:] if argv is None else argv
    rows = run(args)
    device = torch.cuda.get_device_name()
    if args.png:
        plot(rows, args.png, device)
    return 1 if any(n.startswith("ours") for r in rows for n in r["errors"]) else 0


if __name__ == "__main__":
    sys.exit(main())
