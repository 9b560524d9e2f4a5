"""Decode against a KV cache: one query token per sequence, ours against FA4 in one process
on one GPU, reported as the bandwidth of reading K and V.

    python scripts/decode_bench.py                       # the default cells
    python scripts/decode_bench.py --json d.json --png d.png

Each cell is (batch, keys per sequence), full caches, 32 query heads on 4 KV heads, hdim 128,
bf16, pages of ``--page`` tokens in a shuffled page table. Providers, through their public
APIs: ``ours`` (``fa_sm100.flash_attn_with_kvcache`` with ``page_table``), ``ours:contiguous``
(the same cache as one (batch, keys, heads, d) tensor: no page gather) and ``fa4``
(``flash_attn.cute.flash_attn_varlen_func`` with ``page_table`` and ``seqused_k``, its
defaults otherwise). GB/s counts the K and V bytes each call must read (batch x keys x KV
heads x (d + d_v) x 2 bytes) over the median time; TB/s against the H200's HBM (about 4.8)
is the figure of merit, since decode is bandwidth-bound.

Rounds are interleaved (``fa_sm100.benchmarking.run_cell``); before timing, each provider's
output for the first sequence is checked against a float64 reference under the project's
rule. Progress goes to stderr; exit status 1 when ours fails a cell.
"""

from __future__ import annotations

import argparse
import sys

from fa_sm100.benchmarking import (add_feature_bench_args, feature_bench_main, fill_ratio_row,
                                   optional_fa4, plot_mode_bars, run_cell, time_ms)

HEAD_DIM, HEADS, KV_HEADS = 128, 32, 4
DEFAULT_CELLS = ((8, 8192), (32, 8192), (32, 32768), (128, 4096))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--page", type=int, default=64, help="tokens per page")
    add_feature_bench_args(p)
    return p.parse_args(argv)


def kv_bytes(batch: int, keys: int) -> int:
    return batch * keys * KV_HEADS * 2 * HEAD_DIM * 2


def check_first(out, q, kc, vc, keys, torch):
    """The first sequence against float64 (None, or why not)."""
    from fa_sm100.testing import attention_reference, max_abs_error

    got = (out[0] if isinstance(out, tuple) else out)[:1].reshape(1, 1, HEADS, HEAD_DIM)
    args = (q[:1], kc[:1, :keys], vc[:1, :keys])
    ref, _ = attention_reference(*args)
    plain, _ = attention_reference(*args, dtype=q.dtype, upcast=False)
    err, plain_err = max_abs_error(got, ref), max_abs_error(plain, ref)
    if torch.isnan(got).any() or not err <= 2 * plain_err + 1e-3:
        return f"max error {err:.3e} against plain bf16's {plain_err:.3e}"
    return None


def run(args):
    import torch

    from fa_sm100.kvcache import flash_attn_with_kvcache

    fa4 = None if args.no_fa4 else optional_fa4("decode_bench", "flash_attn_varlen_func")
    rows = []
    for i, (batch, keys) in enumerate(DEFAULT_CELLS):
        print(f"[{i + 1}/{len(DEFAULT_CELLS)}] batch {batch} x {keys} keys", file=sys.stderr,
              flush=True)
        g = torch.Generator(device="cuda").manual_seed(batch + keys)
        kc, vc = (torch.randn(batch, keys, KV_HEADS, HEAD_DIM, device="cuda",
                              dtype=torch.bfloat16, generator=g) for _ in range(2))
        q = torch.randn(batch, 1, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                        generator=g)
        pages_per_seq = keys // args.page
        order = torch.randperm(batch * pages_per_seq, device="cuda", generator=g)
        table = order.view(batch, pages_per_seq).to(torch.int32)
        kp, vp = (torch.empty(batch * pages_per_seq, args.page, KV_HEADS, HEAD_DIM,
                              device="cuda", dtype=torch.bfloat16) for _ in range(2))
        for paged, flat in ((kp, kc), (vp, vc)):  # page table[b, j] holds rows j x page ...
            paged[table.flatten().long()] = flat.view(batch * pages_per_seq, args.page,
                                                      KV_HEADS, HEAD_DIM)
        lens = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
        prepares = {
            "ours": lambda: lambda: flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens,
                                                            page_table=table),
            "ours:contiguous": lambda: lambda: flash_attn_with_kvcache(q, kc, vc,
                                                                       cache_seqlens=lens),
        }
        if fa4 is not None:
            prepares["fa4"] = lambda: lambda: fa4(q, kp, vp, page_table=table, seqused_k=lens)
        times, errors = run_cell(
            prepares, lambda out: check_first(out, q, kc, vc, keys, torch), args.repeat,
            lambda fn: time_ms(fn, args.warmup, args.rep, torch), sync=torch.cuda.synchronize)
        row = {"mode": "fwd", "batch": batch, "keys": keys, "page": args.page, "heads": HEADS,
               "kv_heads": KV_HEADS, "hdim": HEAD_DIM, "errors": errors, "ms": {},
               "tflops": {}}
        # "tflops" carries GB/s here (fill_ratio_row's field), also as "gbps"
        fill_ratio_row(row, times, lambda ms: kv_bytes(batch, keys) / (ms * 1e-3) / 1e9)
        row["gbps"] = row.pop("tflops")
        row["tflops"] = row["gbps"]
        rows.append(row)
        print(format_row(row), file=sys.stderr, flush=True)
        del kc, vc, kp, vp
        torch.cuda.empty_cache()
    return rows


def format_row(row) -> str:
    gb = "  ".join(f"{n} {v:7.0f} GB/s ({row['ms'][n] * 1e3:.1f} us)"
                   for n, v in row["gbps"].items())
    ratio = "" if row["ratio"] is None else f"  ours/fa4 {row['ratio']:.3f}"
    errs = "".join(f"  [{n}: {e}]" for n, e in row["errors"].items())
    return f"batch {row['batch']:>3} x {row['keys']:>5}: {gb}{ratio}{errs}"


def plot(rows, path: str, device: str):
    plot_mode_bars(rows, ("ours", "ours:contiguous", "fa4"), path,
                   f"Decode, K/V read bandwidth through the public API on {device}",
                   lambda r: f"{r['batch']} x {r['keys'] // 1024}k",
                   lambda mode, cells: f"one query token, {HEADS} q / {KV_HEADS} kv heads, "
                                       f"hdim {HEAD_DIM}, page {cells[0]['page']}",
                   ylabel="GB/s of K and V")


def main(argv=None) -> int:
    return feature_bench_main("decode_bench", parse_args(argv), argv, run, plot)


if __name__ == "__main__":
    sys.exit(main())
