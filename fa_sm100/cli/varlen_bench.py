"""Variable-length (packed) batches, ours against FA4 in one process on one GPU (forward and
backward).

    python scripts/varlen_bench.py                       # the default batches
    python scripts/varlen_bench.py --json v.json --png v.png

A batch is a list of sequence lengths packed along the token axis, bf16, head dim 128,
``--heads`` heads, causal (``--causal both``: each batch causal and not). TFLOP/s count the
visible (query, key) pairs of every sequence: 4 x d per pair, as flash-attn reports varlen
throughput (the backward: 2.5 times that). ``--mode bwd`` times ``torch.autograd.grad`` of
each provider's output (the forward outside the timing); ``ours:launch`` is then our backward
plan's launch alone (``sm90_bwd_varlen``'s). Both providers run through their public API: ``fa_sm100.flash_attn_varlen_func``
and FA4's ``flash_attn.cute.flash_attn_varlen_func``; ``ours:launch`` is our plan's launch
alone (everything decided once per batch), the second column. SDPA has no packed-varlen entry
point, so it is not in this benchmark.

Rounds are interleaved (``fa_sm100.benchmarking.run_cell``); the ratio is the median of
ours / FA4 paired by round, with its 95% interval. Before timing, each provider's output for
the batch's last sequence is checked against a float64 reference under the project's rule
(error <= 2 x the error of the same rows done plainly in bf16 + 1e-3); a provider that fails
is not timed there. Progress goes to stderr; exit status 1 when ours fails a batch.
"""

from __future__ import annotations

import argparse
import sys
import textwrap

from fa_sm100.benchmarking import (add_feature_bench_args, feature_bench_main, fill_ratio_row,
                                   format_interval, optional_fa4, plot_mode_bars, run_cell,
                                   time_ms)

HEAD_DIM = 128
# the packed causal batch (17.5k tokens), a batch of short prompts, one of long
# documents with a short tail, and a ragged mix with a zero-length sequence
DEFAULT_BATCHES = {
    "7 seqs 128-4096": [128, 4096, 1024, 2048, 3072, 3200, 4032],
    "64 x ~256": [256 + (i * 37) % 129 - 64 for i in range(64)],
    "4 x 8k + 100": [8192, 8192, 8192, 8192, 100],
    "ragged mix": [0, 1, 3000, 77, 1500, 640, 9000, 33],
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--causal", choices=["true", "false", "both"], default="both")
    p.add_argument("--mode", choices=["fwd", "bwd", "both"], default="both")
    add_feature_bench_args(p)
    return p.parse_args(argv)


def visible_pairs(lengths, causal: bool) -> int:
    return sum(n * (n + 1) // 2 if causal else n * n for n in lengths)


def check_last(out, q, k, v, lengths, causal, torch):
    """The batch's last non-empty sequence against float64 (None, or why not)."""
    from fa_sm100.testing import attention_reference, max_abs_error

    got = out[0] if isinstance(out, tuple) else out
    while lengths[-1] == 0:  # the last sequence with rows
        lengths = lengths[:-1]
    end = sum(lengths)
    start = end - lengths[-1]
    qs, ks, vs = (t[start:end].unsqueeze(0) for t in (q, k, v))
    ref, _ = attention_reference(qs, ks, vs, causal=causal)
    plain, _ = attention_reference(qs, ks, vs, causal=causal, dtype=q.dtype, upcast=False)
    err, plain_err = max_abs_error(got[start:end].unsqueeze(0), ref), max_abs_error(plain, ref)
    if torch.isnan(got[start:end]).any() or not err <= 2 * plain_err + 1e-3:
        return f"max error {err:.3e} against plain bf16's {plain_err:.3e}"
    return None


def check_last_grads(grads, q, k, v, dout, lengths, causal, torch):
    """dq, dk, dv of the batch's last non-empty sequence against float64 (None, or why
    not)."""
    from fa_sm100.testing import attention_reference_grads, grad_atol, max_abs_error

    while lengths[-1] == 0:
        lengths = lengths[:-1]
    end = sum(lengths)
    rows = slice(end - lengths[-1], end)
    args = [t[rows].unsqueeze(0) for t in (q, k, v, dout)]
    _, _, ref = attention_reference_grads(*args, causal=causal)
    _, _, plain = attention_reference_grads(*args, causal=causal, dtype=q.dtype, upcast=False)
    for name, got, r, p in zip(("dq", "dk", "dv"), grads, ref, plain):
        got = got[rows].unsqueeze(0)
        err, plain_err = max_abs_error(got, r), max_abs_error(p, r)
        if torch.isnan(got).any() or not err <= 2 * plain_err + grad_atol(r):
            return f"{name}: max error {err:.3e} against plain bf16's {plain_err:.3e}"
    return None


def run(args):
    import torch

    from fa_sm100.hopper.bwd_interface import build_sm90_bwd_varlen_plan
    from fa_sm100.hopper.interface import build_sm90_varlen_plan
    from fa_sm100.interface import flash_attn_varlen_func

    fa4 = None if args.no_fa4 else optional_fa4("varlen_bench", "flash_attn_varlen_func")
    causals = {"true": [True], "false": [False], "both": [True, False]}[args.causal]
    modes = ["fwd", "bwd"] if args.mode == "both" else [args.mode]
    cells = [(mode, name, lengths, c) for mode in modes
             for name, lengths in DEFAULT_BATCHES.items() for c in causals]
    rows = []
    for i, (mode, name, lengths, causal) in enumerate(cells):
        print(f"[{i + 1}/{len(cells)}] {mode} {name} causal={causal}", file=sys.stderr,
              flush=True)
        if mode == "bwd":
            rows.append(bwd_row(args, fa4, name, lengths, causal, torch,
                                flash_attn_varlen_func, build_sm90_bwd_varlen_plan))
            print(format_row(rows[-1]), file=sys.stderr, flush=True)
            continue
        total, longest = sum(lengths), max(lengths)
        g = torch.Generator(device="cuda").manual_seed(total)
        q, k, v = (torch.randn(total, args.heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                               generator=g) for _ in range(3))
        cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32,
                          device="cuda")
        plan = build_sm90_varlen_plan(q, k, v, cu, cu, longest, longest, causal=causal)
        prepares = {
            "ours": lambda: lambda: flash_attn_varlen_func(q, k, v, cu, cu, longest, longest,
                                                           causal=causal),
            "ours:launch": lambda: lambda: plan(q, k, v, cu, cu),
        }
        if fa4 is not None:
            prepares["fa4"] = lambda: lambda: fa4(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                                  max_seqlen_q=longest, max_seqlen_k=longest,
                                                  causal=causal)
        times, errors = run_cell(
            prepares, lambda out: check_last(out, q, k, v, list(lengths), causal, torch),
            args.repeat, lambda fn: time_ms(fn, args.warmup, args.rep, torch),
            sync=torch.cuda.synchronize)
        flop = 4 * HEAD_DIM * args.heads * visible_pairs(lengths, causal)
        row = {"mode": "fwd", "batch_name": name, "lengths": list(lengths), "causal": causal,
               "heads": args.heads, "hdim": HEAD_DIM, "errors": errors, "ms": {}, "tflops": {}}
        fill_ratio_row(row, times, lambda ms: flop / (ms * 1e-3) / 1e12)
        rows.append(row)
        print(format_row(row), file=sys.stderr, flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def bwd_row(args, fa4, name, lengths, causal, torch, ours_fn, build_bwd_plan):
    """One backward cell: ``torch.autograd.grad`` of each provider's output, and our backward
    plan's launch alone."""
    total, longest = sum(lengths), max(lengths)
    g = torch.Generator(device="cuda").manual_seed(total)
    q, k, v, dout = (torch.randn(total, args.heads, HEAD_DIM, device="cuda",
                                 dtype=torch.bfloat16, generator=g) for _ in range(4))
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32,
                      device="cuda")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def grads(fn, **kw):
        def prepare():
            out = fn(*leaves, cu, cu, longest, longest, causal=causal, **kw)
            out = out[0] if isinstance(out, tuple) else out
            return lambda: torch.autograd.grad(out, leaves, dout, retain_graph=True)
        return prepare

    prepares = {"ours": grads(ours_fn)}

    def launch():
        out, lse = ours_fn(q, k, v, cu, cu, longest, longest, causal=causal, return_lse=True)
        plan = build_bwd_plan(dout, q, k, v, out, lse, cu, cu, longest, longest, causal=causal)
        return lambda: plan(dout, q, k, v, out, lse, cu, cu)

    prepares["ours:launch"] = launch
    if fa4 is not None:
        prepares["fa4"] = grads(lambda q_, k_, v_, cq, ck, mq, mk, causal: fa4(
            q_, k_, v_, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=mq, max_seqlen_k=mk,
            causal=causal))
    times, errors = run_cell(
        prepares, lambda got: check_last_grads(got, q, k, v, dout, list(lengths), causal, torch),
        args.repeat, lambda fn: time_ms(fn, args.warmup, args.rep, torch),
        sync=torch.cuda.synchronize)
    flop = 2.5 * 4 * HEAD_DIM * args.heads * visible_pairs(lengths, causal)
    row = {"mode": "bwd", "batch_name": name, "lengths": list(lengths), "causal": causal,
           "heads": args.heads, "hdim": HEAD_DIM, "errors": errors, "ms": {}, "tflops": {}}
    fill_ratio_row(row, times, lambda ms: flop / (ms * 1e-3) / 1e12)
    return row


def format_row(row) -> str:
    tf = "  ".join(f"{n} {t:6.1f}" for n, t in row["tflops"].items())
    ratio = "" if row["ratio"] is None else (f"  ours/fa4 {row['ratio']:.3f} "
                                             f"{format_interval(row['interval'])}")
    errs = "".join(f"  [{n}: {e}]" for n, e in row["errors"].items())
    return (f"{row['mode']} {row['batch_name']:>16} causal={row['causal']!s:5}: {tf} "
            f"TFLOP/s{ratio}{errs}")


def plot(rows, path: str, device: str):
    plot_mode_bars(
        rows, ("ours", "ours:launch", "fa4"), path,
        f"Packed (varlen) batches through the public API on {device}",
        lambda r: "\n".join(textwrap.wrap(r["batch_name"], 9)
                             + ["causal" if r["causal"] else "full"]),
        lambda mode, cells: f"{'forward' if mode == 'fwd' else 'backward'}, hdim {HEAD_DIM}",
        ylabel="TFLOP/s")


def main(argv=None) -> int:
    return feature_bench_main("varlen_bench", parse_args(argv), argv, run, plot)

if __name__ == "__main__":
    sys.exit(main())
