"""Backward benchmark on an SM90 GPU: ``sm90_bwd`` against FlashAttention-4 and cuDNN.

Used by ``scripts/benchmark.py --mode bwd`` and runnable as
``python -m fa_sm100.hopper.bwd_bench [--json out.json]``. Every cell draws fresh random
inputs and times each implementation in the same process with the forward benchmark's method
(``fa_sm100.benchmarking.run_cell``): every provider prepared and its first gradients checked
before any timing, a discarded warm-up, then ``repeat`` rounds in a carry-over balanced order
(``round_order``), each the median of ``triton.testing.do_bench``; the cell keeps the median
round. TFLOP/s use the backward's conventional FLOP count 2.5 x the forward's:
2.5 * 2 * b * h * sq * sk * (d + dv), halved for causal. V (and O, dO) take the forward's
default V head dim for the head dim d (``fa_sm100.config.default_head_dim_v``: 128 with 192,
else d). Every provider's backward is timed through its public path: its forward run once
on leaf tensors, then ``torch.autograd.grad`` (ours: ``flash_attn_func``); ``ours:launch``
(``timing="both"``, the default) is the launch alone (``prepare_sm90_bwd``: the plan made
once), a labelled second column. The peers' times include their own preprocess/postprocess
kernels, as ours do;
``do_bench`` does not synchronize between calls, so host time shorter than a call's GPU time
does not show for anyone.

Check: dQ, dK, dV of batch 0 for the first and the last KV head (with their query heads)
against float32 autograd of the same attention, with the project's rule (error <= 2 x the
error of the same computation in the input precision + ``testing.grad_atol``). A provider
that fails it is not timed on that cell and its ``<name>_error`` says why.
"""

import argparse
import json
import math
from typing import Optional

import torch

from fa_sm100.benchmarking import (MIN_ROUNDS, ClockSampler, cell_seed, clock_summary,
                                   format_interval, median, paired_interval, paired_ratio,
                                   ratio_points, run_cell, summarize_conditions, time_ms,
                                   verdict_summary, whole_cycles)

DEFAULT_SEQLENS = (1024, 4096, 16384)
DEFAULT_HEAD_DIMS = (64, 128)
TOKENS = 16384  # batch * seqlen per cell
MODEL_DIM = 2048  # heads * head_dim per cell
WARMUP_MS, REP_MS = 25, 100


def bwd_flops(b, h, sq, sk, d, dv, causal):
    f = 2.5 * 2 * b * h * sq * sk * (d + dv)
    return f / 2 if causal else f


def _fa4_fn():
    try:
        from flash_attn.cute.interface import flash_attn_func
    except Exception as exc:  # the peer is optional: report why it is missing
        return None, f"flash_attn.cute unavailable: {exc}"
    return flash_attn_func, None


def _fa4_backward(fa4, q, k, v, dout, causal, deterministic=False, window=(None, None)):
    """FA4's forward run once on leaf copies of q, k, v; returns the call that times its
    backward (``torch.autograd.grad``, its own pre/postprocess included)."""
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    windowed = {} if window == (None, None) else {"window_size": tuple(window)}
    o4 = fa4(qg, kg, vg, causal=causal, deterministic=deterministic, **windowed)
    o4 = o4[0] if isinstance(o4, tuple) else o4
    return lambda: torch.autograd.grad(o4, (qg, kg, vg), dout, retain_graph=True)


def _ours_backward(q, k, v, dout, causal, deterministic=False):
    """Ours through the public path: ``flash_attn_func`` run once on leaf copies of q, k, v;
    returns the call that times its backward (``torch.autograd.grad``), as the peers'."""
    from fa_sm100.interface import flash_attn_func

    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    o = flash_attn_func(qg, kg, vg, causal=causal, deterministic=deterministic)
    return lambda: torch.autograd.grad(o, (qg, kg, vg), dout, retain_graph=True)


def parse_variant(spec: str):
    """"NAME:field=value,field=value" -> (NAME, BwdConfig overrides dict)."""
    from fa_sm100.config import parse_variant as parse
    from fa_sm100.hopper.bwd_config import BwdConfig

    return parse(spec, BwdConfig)


def checked_heads(h, hk):
    """(kv head, its query heads) pairs the check covers: the first and the last KV head."""
    g = h // hk
    return [(kh, list(range(kh * g, (kh + 1) * g))) for kh in sorted({0, hk - 1})]


def reference_grads(q, k, v, dout, causal, dtype, window=(None, None)):
    """dQ, dK, dV of batch 0 for ``checked_heads``, by autograd of plain attention computed in
    ``dtype`` (float32: the reference; the input dtype: the baseline of the error rule).
    Causal is bottom-right aligned, a ``window`` (left, right) as ``sm90_bwd``'s. Returns
    [(kv head, query heads, (dq, dk, dv))]."""
    from fa_sm100.testing import attention_mask

    s, h, d = q.shape[1], q.shape[2], q.shape[3]
    sk, hk = k.shape[1], k.shape[2]
    mask = attention_mask(s, sk, causal, window, device=q.device)  # None: nothing masked
    out = []
    for kh, qh in checked_heads(h, hk):
        qs = q[0, :, qh].transpose(0, 1).to(dtype).requires_grad_()  # (g, s, d)
        ks, vs = (t[0, :, kh].to(dtype).requires_grad_() for t in (k, v))
        scores = torch.einsum("gqd,kd->gqk", qs, ks) * (1.0 / math.sqrt(d))
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        p = torch.softmax(scores.float(), dim=-1).to(dtype)
        o = torch.einsum("gqk,kd->gqd", p, vs)
        dq, dk, dv = torch.autograd.grad(o, (qs, ks, vs), dout[0, :, qh].transpose(0, 1).to(dtype))
        out.append((kh, qh, (dq.transpose(0, 1), dk, dv)))
        del scores, p, o
    return out


def check_grads(grads, ref, plain):
    """None when a provider's (dq, dk, dv) (BSHD) meet the error rule on the checked heads
    (``reference_grads`` in float32 and in the input dtype), else the reason."""
    from fa_sm100.testing import check_against_reference, grad_atol

    for (kh, qh, want), (_, _, base) in zip(ref, plain):
        got = (grads[0][0, :, qh], grads[1][0, :, kh], grads[2][0, :, kh])
        for name, x, r, b in zip(("dq", "dk", "dv"), got, want, base):
            if tuple(x.shape) != tuple(r.shape):
                return f"{name} shape {tuple(x.shape)}, expected {tuple(r.shape)}"
            try:
                check_against_reference(x, r, b, atol=grad_atol(r), what=f"{name} (kv head {kh})")
            except AssertionError as e:
                return str(e)
    return None


def _cudnn_backward(q, k, v, dout, causal):
    """torch SDPA forced onto cuDNN, run forward once; returns the call that times its
    backward, giving BSHD (dq, dk, dv)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
    # GQA/MQA as SDPA users call it: K/V at their own head count (no expanded copies, whose
    # reduction back would be timed as cuDNN's)
    gqa = {"enable_gqa": True} if k.shape[2] != q.shape[2] else {}
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        oc = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                              **gqa)
    doc = dout.transpose(1, 2)

    def run():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            grads = torch.autograd.grad(oc, (qt, kt, vt), doc, retain_graph=True)
        return tuple(g.transpose(1, 2) for g in grads)
    return run


def bench_cell(b, h, hk, s, d, causal, dtype=torch.bfloat16, deterministic=False, variants=(),
               repeat=None, warmup=WARMUP_MS, rep=REP_MS, timing="both"):
    from fa_sm100.hopper.bwd_config import SM90_BWD_HEAD_DIMS
    from fa_sm100.hopper.bwd_defaults import select_bwd_config
    from fa_sm100.hopper.bwd_interface import prepare_sm90_bwd, sm90_bwd

    from fa_sm100.config import default_head_dim_v

    dv = default_head_dim_v(d)
    seed = cell_seed(d, s, causal)  # the same data every run: a failed check can be rerun
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(b, s, hk, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(b, s, hk, dv, device="cuda", dtype=dtype, generator=gen)
    dout = torch.randn(b, s, h, dv, device="cuda", dtype=dtype, generator=gen)
    flops = bwd_flops(b, h, s, s, d, dv, causal)
    row = {"batch": b, "heads": h, "heads_kv": hk, "seqlen": s, "head_dim": d, "head_dim_v": dv,
           "causal": causal, "deterministic": deterministic, "dtype": str(dtype).split(".")[-1],
           "seed": seed}
    fa4, why = _fa4_fn()
    # O and LSE for our backward: FA4's forward when present, else the math in float32 chunks.
    if fa4 is not None:
        with torch.no_grad():
            out, lse = fa4(q, k, v, causal=causal, return_lse=True)
        if lse.shape != (b, h, s):
            lse = lse.permute(0, 2, 1)
        lse = lse.float().contiguous()
    else:
        out, lse = _torch_forward(q, k, v, causal)
        row["fa4_error"] = why
    prepares = {}
    if (d, dv) in SM90_BWD_HEAD_DIMS:
        launch = lambda: prepare_sm90_bwd(dout, q, k, v, out, lse, causal=causal,  # noqa: E731
                                          deterministic=deterministic)
        if timing == "launch":
            prepares["ours"] = launch
        else:
            prepares["ours"] = lambda: _ours_backward(q, k, v, dout, causal, deterministic)
            if timing == "both":
                prepares["ours:launch"] = launch
        for name, overrides in variants:
            # the cell's causality and length pick the variant's other defaults (early dV, swap,
            # tile_m)
            cfg = select_bwd_config(head_dim=d, causal=causal, qhead_per_kvhead=h // hk,
                                    deterministic=deterministic, seqlen_q=s, seqlen_k=s,
                                    **overrides)
            prepares[f"ours:{name}"] = lambda cfg=cfg: (
                lambda: sm90_bwd(dout, q, k, v, out, lse, causal=causal,
                                 deterministic=deterministic, config=cfg))
    else:  # a cell ours does not cover: reported, not a failure of the run
        row["ours_skipped"] = (f"head dims ({d}, {dv}) are not supported by sm90_bwd "
                               f"({SM90_BWD_HEAD_DIMS})")
    if fa4 is not None:
        prepares["fa4"] = lambda: _fa4_backward(fa4, q, k, v, dout, causal, deterministic)
    prepares["cudnn"] = lambda: _cudnn_backward(q, k, v, dout, causal)
    ref = reference_grads(q, k, v, dout, causal, torch.float32)
    plain = reference_grads(q, k, v, dout, causal, dtype)
    conditions = {}
    if repeat is None:  # whole cycles of the balanced order for this cell's providers
        repeat = whole_cycles(MIN_ROUNDS, len(prepares))
    times, errors = run_cell(prepares, lambda grads: check_grads(grads, ref, plain), repeat,
                             lambda fn: time_ms(fn, warmup, rep, torch),
                             sync=torch.cuda.synchronize,
                             monitor=lambda: ClockSampler(q.device.index or 0),
                             conditions=conditions)
    del ref, plain
    for name in prepares:
        if times[name]:
            ms = median(times[name])
            row[f"{name}_ms"], row[f"{name}_tflops"] = ms, flops / ms / 1e9
        clock = summarize_conditions(conditions.get(name, []))
        if clock is not None:  # SM clock and board power while it was timed
            row[f"{name}_mhz"], row[f"{name}_watts"] = clock
        if name in errors:
            row[f"{name}_error"] = errors[name]
        if times[name]:  # every round, for pooling runs later
            row[f"{name}_rounds_ms"] = list(times[name])
    peers = [row[k] for k in ("fa4_tflops", "cudnn_tflops") if k in row]
    if peers and "ours_tflops" in row:
        row["ratio_vs_best_peer"] = row["ours_tflops"] / max(peers)
        # round by round (a drift shared by a round cancels): fa_sm100.benchmarking.paired_ratio,
        # and the 95% interval of that median (paired_interval)
        row["ratio_paired"] = paired_ratio(times, "ours", ("fa4", "cudnn"))
        row["ratio_paired_ci"] = paired_interval(times, "ours", ("fa4", "cudnn"))
    return row


def _torch_forward(q, k, v, causal):
    """O and LSE (natural log, (b, h, s)) in float32 math, for when FA4 is absent."""
    b, s, h, d = q.shape
    group = h // k.shape[2]
    kf = k.float().repeat_interleave(group, dim=2)
    vf = v.float().repeat_interleave(group, dim=2)
    scale = 1.0 / math.sqrt(d)
    out = torch.empty(b, s, h, v.shape[3], device=q.device, dtype=q.dtype)
    lse = torch.empty(b, h, s, device=q.device, dtype=torch.float32)
    for i in range(b):
        sc = torch.einsum("qhd,khd->hqk", q[i].float(), kf[i]) * scale
        if causal:
            sc = sc.masked_fill(torch.ones(s, s, device=q.device, dtype=torch.bool).triu(1), -math.inf)
        lse[i] = torch.logsumexp(sc, dim=-1)
        out[i] = torch.einsum("hqk,khd->qhd", torch.softmax(sc, dim=-1), vf[i]).to(q.dtype)
    return out, lse


def run_grid(seqlens=DEFAULT_SEQLENS, head_dims=DEFAULT_HEAD_DIMS, causals=(False, True),
             gqa_ratio=1, deterministic=False, variants=(), tokens=TOKENS, model_dim=MODEL_DIM,
             repeat=None, warmup=WARMUP_MS, rep=REP_MS, dtype=torch.bfloat16, timing="both"):
    rows = []
    for d in head_dims:
        h = model_dim // d
        for s in seqlens:
            b = max(1, tokens // s)
            for causal in causals:
                rows.append(bench_cell(b, h, h // gqa_ratio, s, d, causal, dtype=dtype,
                                       deterministic=deterministic, variants=variants,
                                       repeat=repeat, warmup=warmup, rep=rep, timing=timing))
                print(format_row(rows[-1]), flush=True)
    return rows


def run_from_benchmark_args(args, meta=None):
    """``scripts/benchmark.py --mode bwd``: the forward grid's flags (``--providers`` aside:
    the backward always times ours, FA4 and cuDNN), timed for the backward; ``--csv`` and
    ``--png`` get one row / line per provider as the forward's; ``meta`` (a dict) goes into
    the JSON beside the rows. ``--ours-variant NAME:field=value,...`` takes BwdConfig fields
    here. Returns the exit status (``exit_status``)."""
    variants = [parse_variant(v) for v in args.ours_variant]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    rows = run_grid(args.seqlen, args.hdim, args.causal, variants=variants,
                    tokens=args.total_tokens, model_dim=args.hidden, repeat=args.repeat,
                    warmup=args.warmup, rep=args.rep, dtype=dtype,
                    timing=getattr(args, "timing", "both"))
    print_clocks(rows)
    points = ratio_points(rows)
    if points:
        print(verdict_summary(p.interval for p in points))
    device = torch.cuda.get_device_name()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**(meta or {}), "mode": "bwd", "device": device, "rows": rows}, f,
                      indent=1)
    long = long_rows(rows)
    if args.csv:
        import csv

        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(LONG_ROW_KEYS) + ["device"])
            w.writeheader()
            for r in long:
                w.writerow({**r, "device": device})
    if args.png:
        from fa_sm100.benchmarking import plot_grid

        names = (["ours"] + (["ours:launch"] if getattr(args, "timing", "both") == "both" else [])
                 + [f"ours:{name}" for name, _ in variants] + ["fa4", "cudnn"])
        plot_grid(long, names, args.png, f"backward attention, {device}")
    return exit_status(rows)


# what bench_cell appends to a provider's name in a row's keys
ROW_KEY_SUFFIXES = ("_ms", "_tflops", "_mhz", "_watts", "_error", "_skipped", "_rounds_ms")


def row_provider(key: str) -> Optional[str]:
    """The provider a row key belongs to ("ours:x_rounds_ms" -> "ours:x"), by its longest
    suffix in ``ROW_KEY_SUFFIXES``; None for the cell's own keys."""
    for suffix in sorted(ROW_KEY_SUFFIXES, key=len, reverse=True):
        if key.endswith(suffix):
            return key[:-len(suffix)]
    return None


LONG_ROW_KEYS = ("provider", "hdim", "causal", "seqlen", "ms", "tflops")


def long_rows(rows):
    """The grid's rows (one per cell, ``<provider>_ms`` / ``_tflops`` keys) as one row per
    (cell, provider) with ``LONG_ROW_KEYS``, the forward's shape (CSV, ``plot_grid``);
    providers without a time in a cell are left out."""
    out = []
    for r in rows:
        for key in r:
            if key.endswith("_tflops"):
                name = key[:-len("_tflops")]
                out.append({"provider": name, "hdim": r["head_dim"], "causal": r["causal"],
                            "seqlen": r["seqlen"], "ms": r.get(f"{name}_ms"),
                            "tflops": r[key]})
    return out


def print_clocks(rows):
    """Print ``clock_summary`` of a grid's rows (keys ``<provider>_mhz`` / ``_watts``), if
    any round was sampled."""
    line = clock_summary((k[:-len("_mhz")], (r[k], r[k[:-len("_mhz")] + "_watts"]))
                         for r in rows for k in r if k.endswith("_mhz"))
    if line:
        print(line)


def kernel_breakdown(fn, reps=10):
    """Where the time of one backward call goes: {kernel name: mean ms per call} from the
    CUDA profiler, plus ``"(call, events)"``, the time of one call as the grid measures it;
    the difference to the kernels' sum is host time the GPU waited for."""
    from torch.profiler import ProfilerActivity, profile

    call_ms = time_ms(fn, WARMUP_MS, REP_MS, torch)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per_kernel = {}
    for ev in prof.key_averages():
        device_us = getattr(ev, "device_time_total", None)
        if device_us is None:
            device_us = ev.cuda_time_total
        if device_us > 0 and ev.count >= reps:
            per_kernel[ev.key[:70]] = device_us / 1000 / reps
    per_kernel["(call, events)"] = call_ms
    return per_kernel


def breakdown_cell(b, h, s, d, causal, dtype=torch.bfloat16):
    """``kernel_breakdown`` of ours and of FA4 on one cell (``--breakdown``)."""
    from fa_sm100.hopper.bwd_interface import prepare_sm90_bwd, sm90_bwd

    from fa_sm100.config import default_head_dim_v

    dv = default_head_dim_v(d)  # as the grid does: (192, 128)
    q, k = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(2))
    v, dout = (torch.randn(b, s, h, dv, device="cuda", dtype=dtype) for _ in range(2))
    out, lse = _torch_forward(q, k, v, causal)
    result = {"ours": kernel_breakdown(lambda: sm90_bwd(dout, q, k, v, out, lse, causal=causal))}
    fa4, _ = _fa4_fn()
    if fa4 is not None:
        result["fa4"] = kernel_breakdown(_fa4_backward(fa4, q, k, v, dout, causal))
    return result


def format_row(r):
    """One line per cell: TFLOP/s of each provider (n/a when it has no time), the ratio, and
    the reason of every provider that failed or could not run."""
    cells = [f"d={r['head_dim']:3d} s={r['seqlen']:5d} b={r['batch']:2d} h={r['heads']}/{r['heads_kv']}"
             f" {'causal' if r['causal'] else 'full  '}"]
    names = ["ours"] + sorted({p for p in map(row_provider, r) if p and p.startswith("ours:")})
    for peer in names + ["fa4", "cudnn"]:
        cells.append(f"{peer} {r[peer + '_tflops']:6.1f}" if peer + "_tflops" in r else f"{peer} n/a")
    if "ratio_vs_best_peer" in r:
        cells.append(f"ratio {r['ratio_vs_best_peer']:.2f}x")
    if r.get("ratio_paired"):
        cells.append(f"paired {r['ratio_paired']:.3f}x {format_interval(r.get('ratio_paired_ci'))}")
    line = " | ".join(cells) + " TFLOP/s"
    for peer in names + ["fa4", "cudnn"]:
        for kind in ("_error", "_skipped"):
            if peer + kind in r:
                line += f"\n    {peer}: {r[peer + kind]}"
    return line


def exit_status(rows) -> int:
    """1 when a provider gave wrong gradients, or ours (or a variant) failed on a cell."""
    for r in rows:
        for key, err in r.items():
            if key.endswith("_error") and (key.startswith("ours") or err.startswith("wrong output")):
                return 1
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlens", type=int, nargs="+", default=list(DEFAULT_SEQLENS))
    p.add_argument("--head-dims", type=int, nargs="+", default=list(DEFAULT_HEAD_DIMS))
    p.add_argument("--gqa-ratio", type=int, default=1)
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:FIELD=VALUE[,...]",
                   help="also time sm90_bwd with these BwdConfig overrides")
    p.add_argument("--repeat", type=int, default=None,
                   help="rounds per cell (median kept; default: whole cycles of the balanced "
                        f"order, at least {MIN_ROUNDS})")
    p.add_argument("--warmup", type=int, default=WARMUP_MS, help="ms of warm-up per measurement")
    p.add_argument("--rep", type=int, default=REP_MS, help="ms of timed calls per measurement")
    p.add_argument("--json", default=None)
    p.add_argument("--breakdown", action="store_true",
                   help="per-kernel times (CUDA profiler) of ours and FA4 instead of the grid")
    a = p.parse_args(argv)
    if a.repeat is not None and a.repeat < 1:
        p.error(f"--repeat {a.repeat}: must be at least 1")
    if a.breakdown:
        rows = []
        for d in a.head_dims:
            for s in a.seqlens:
                for causal in (False, True):
                    b, h = max(1, TOKENS // s), MODEL_DIM // d
                    rows.append({"head_dim": d, "seqlen": s, "causal": causal,
                                 **breakdown_cell(b, h, s, d, causal)})
                    print(json.dumps(rows[-1], indent=1), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rows, f, indent=1)
        return rows
    rows = run_grid(a.seqlens, a.head_dims, gqa_ratio=a.gqa_ratio, deterministic=a.deterministic,
                    variants=[parse_variant(v) for v in a.variant], repeat=a.repeat,
                    warmup=a.warmup, rep=a.rep)
    print_clocks(rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    raise SystemExit(exit_status(main()))
