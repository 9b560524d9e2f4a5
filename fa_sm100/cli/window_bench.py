"""Sliding-window attention, ours against FA4 in one process on one GPU (forward and backward).

    python scripts/window_bench.py                                   # the default cells
    python scripts/window_bench.py --cells 4096:128 16384:512 --json w.json --png w.png

A cell ``SEQLEN:LEFT`` is causal attention with a left window of LEFT keys (each query sees
itself and the LEFT keys before it: ``window_size=(LEFT, 0)``), bf16, head dim 128,
``--tokens`` tokens per batch (batch = tokens / seqlen) and ``--heads`` heads. TFLOP/s count
the visible band only: 2 x (d + dv) per visible (query, key) pair forward, 2.5 times that
backward, as FA4 reports windowed throughput.

Every provider runs through its public API, as a model calls it: ours through
``fa_sm100.flash_attn_func`` (forward) and ``torch.autograd.grad`` of it (backward); FA4
through ``flash_attn.cute.flash_attn_func`` and ``torch.autograd.grad``. ``ours:launch`` is
the launch alone (``prepare_sm90_fwd`` / ``prepare_sm90_bwd``: everything decided once per
cell), the second column. SDPA's cuDNN and flash backends take no sliding window (a dense
mask would run a different algorithm), so they are not in this benchmark.

Rounds are interleaved (``fa_sm100.benchmarking.run_cell``); the ratio is the median of
ours / FA4 paired by round, with its 95% interval. Before timing, each provider's forward
is checked on the last 64 query rows of every (batch, head) against a float64 reference
(the project's rule: error <= 2 x the error of the same rows done plainly in bf16 + 1e-3),
and each backward's gradients for finiteness; a provider that fails is not timed there.
Progress goes to stderr; exit status 1 when ours fails a cell.
"""

from __future__ import annotations

import argparse
import sys


from fa_sm100.benchmarking import (add_feature_bench_args, feature_bench_main, optional_fa4,
                                   fill_ratio_row, format_interval, plot_mode_bars, run_cell,
                                   time_ms)

DEFAULT_CELLS = ["4096:128", "4096:1024", "16384:512", "16384:4096", "32768:4096",
                 "8192:256", "32768:1024"]
HEAD_DIM = 128
CHECK_ROWS = 64


def parse_cell(text: str) -> tuple:
    try:
        seqlen, left = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a cell is SEQLEN:LEFT, e.g. 4096:128")
    if seqlen < 1 or left < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: SEQLEN >= 1 and LEFT >= 0")
    return seqlen, left


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cells", type=parse_cell, nargs="+",
                   default=[parse_cell(c) for c in DEFAULT_CELLS])
    p.add_argument("--tokens", type=int, default=32768, help="batch x seqlen per cell")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--modes", nargs="+", choices=["fwd", "bwd"], default=["fwd", "bwd"])
    add_feature_bench_args(p)
    return p.parse_args(argv)


def visible_pairs(seqlen: int, left: int) -> int:
    """(query, key) pairs a causal window (left, 0) shows: row i sees min(i, left) + 1 keys."""
    full = min(seqlen, left + 1)  # rows 0 .. full - 1 see i + 1 keys, the rest left + 1
    return full * (full + 1) // 2 + (seqlen - full) * (left + 1)


def tflops(mode: str, batch: int, heads: int, seqlen: int, left: int, ms: float) -> float:
    flop = 2 * batch * heads * visible_pairs(seqlen, left) * (2 * HEAD_DIM)
    if mode == "bwd":
        flop *= 2.5
    return flop / (ms * 1e-3) / 1e12


def check_forward(out, q, k, v, left, torch):
    """The last ``CHECK_ROWS`` rows of every (batch, head) against float64 (None or why not)."""
    from fa_sm100.testing import attention_reference, max_abs_error

    s = q.shape[1]
    r0 = max(s - CHECK_ROWS, 0)
    k0 = max(r0 - left, 0)  # the rows' keys; both slices end at s, so alignment holds
    qs, ks, vs = q[:, r0:], k[:, k0:], v[:, k0:]
    ref, _ = attention_reference(qs, ks, vs, causal=True, window=(left, 0))
    plain, _ = attention_reference(qs, ks, vs, causal=True, window=(left, 0), dtype=q.dtype,
                                   upcast=False)
    got = out[0] if isinstance(out, tuple) else out
    err, plain_err = max_abs_error(got[:, r0:], ref), max_abs_error(plain, ref)
    if torch.isnan(got[:, r0:]).any() or not err <= 2 * plain_err + 1e-3:
        return f"max error {err:.3e} against plain bf16's {plain_err:.3e}"
    return None


def forward_runs(q, k, v, left, fa4, torch):
    from fa_sm100.hopper.interface import prepare_sm90_fwd
    from fa_sm100.interface import flash_attn_func

    runs = {"ours": lambda: lambda: flash_attn_func(q, k, v, causal=True,
                                                    window_size=(left, 0)),
            "ours:launch": lambda: prepare_sm90_fwd(q, k, v, causal=True, window_size=(left, 0))}
    if fa4 is not None:
        runs["fa4"] = lambda: lambda: fa4(q, k, v, causal=True, window_size=(left, 0))
    return runs


def backward_runs(q, k, v, dout, left, fa4, torch):
    from fa_sm100.hopper.bwd_interface import prepare_sm90_bwd
    from fa_sm100.interface import flash_attn_func

    def public(fn):
        def prepare():
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            o = fn(qg, kg, vg)
            o = o[0] if isinstance(o, tuple) else o
            return lambda: torch.autograd.grad(o, (qg, kg, vg), dout, retain_graph=True)
        return prepare

    def launch():
        out, lse = flash_attn_func(q, k, v, causal=True, window_size=(left, 0), return_lse=True)
        return prepare_sm90_bwd(dout, q, k, v, out, lse, causal=True, window_size=(left, 0))

    runs = {"ours": public(lambda a, b, c: flash_attn_func(a, b, c, causal=True,
                                                          window_size=(left, 0))),
            "ours:launch": launch}
    if fa4 is not None:
        runs["fa4"] = public(lambda a, b, c: fa4(a, b, c, causal=True, window_size=(left, 0)))
    return runs


def run(args):
    import torch

    fa4 = None if args.no_fa4 else optional_fa4("window_bench", "flash_attn_func")
    rows = []
    total = len(args.cells) * len(args.modes)
    for i, (mode, (seqlen, left)) in enumerate(
            (m, c) for c in args.cells for m in args.modes):
        batch = max(args.tokens // seqlen, 1)
        print(f"[{i + 1}/{total}] {mode} seqlen {seqlen} window ({left}, 0) batch {batch}",
              file=sys.stderr, flush=True)
        g = torch.Generator(device="cuda").manual_seed(seqlen * 7919 + left)
        q, k, v, dout = (torch.randn(batch, seqlen, args.heads, HEAD_DIM, device="cuda",
                                     dtype=torch.bfloat16, generator=g) for _ in range(4))
        if mode == "fwd":
            prepares = forward_runs(q, k, v, left, fa4, torch)
            check = lambda out: check_forward(out, q, k, v, left, torch)  # noqa: E731
        else:
            prepares = backward_runs(q, k, v, dout, left, fa4, torch)
            check = lambda grads: (None if all(bool(torch.isfinite(x).all()) for x in grads)  # noqa: E731
                                   else "non-finite gradients")
        times, errors = run_cell(prepares, check, args.repeat,
                                 lambda fn: time_ms(fn, args.warmup, args.rep, torch),
                                 sync=torch.cuda.synchronize)
        row = {"mode": mode, "seqlen": seqlen, "window": [left, 0], "batch": batch,
               "heads": args.heads, "hdim": HEAD_DIM, "errors": errors, "ms": {}, "tflops": {}}
        fill_ratio_row(row, times,
                       lambda ms: tflops(mode, batch, args.heads, seqlen, left, ms))
        rows.append(row)
        print(format_row(row), file=sys.stderr, flush=True)
        del q, k, v, dout
        torch.cuda.empty_cache()
    return rows


def format_row(row) -> str:
    tf = "  ".join(f"{n} {t:6.1f}" for n, t in row["tflops"].items())
    ratio = "" if row["ratio"] is None else (f"  ours/fa4 {row['ratio']:.3f} "
                                             f"{format_interval(row['interval'])}")
    errs = "".join(f"  [{n}: {e}]" for n, e in row["errors"].items())
    return (f"{row['mode']} {row['seqlen']:6d} w{row['window'][0]:5d}: {tf} TFLOP/s"
            f"{ratio}{errs}")


def plot(rows, path: str, device: str):
    mode_name = {"fwd": "forward", "bwd": "backward"}
    plot_mode_bars(
        rows, ("ours", "ours:launch", "fa4"), path,
        f"Sliding window through the public API on {device}",
        lambda r: f"{r['seqlen'] // 1024}k\nw{r['window'][0]}",
        lambda mode, cells: f"{mode_name[mode]}, causal + left window, hdim {HEAD_DIM}",
        ylabel="TFLOP/s on the visible band")


def main(argv=None) -> int:
    return feature_bench_main("window_bench", parse_args(argv), argv, run, plot)

if __name__ == "__main__":
    sys.exit(main())
