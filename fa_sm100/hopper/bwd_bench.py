"""Backward benchmark on an SM90 GPU: ``sm90_bwd`` against FlashAttention-4 and cuDNN.

Used by ``scripts/benchmark.py --mode bwd`` and runnable as
``python -m fa_sm100.hopper.bwd_bench [--json out.json]``. Every cell draws fresh random
inputs, times each implementation in the same process with CUDA events (median of repeats,
after warm-up), and reports TFLOP/s with the backward's conventional FLOP count
2.5 x the forward's: 2.5 * 4 * b * h * sq * sk * d, halved for causal.
The peers' times include their own preprocess/postprocess kernels, as ours do.
"""

import argparse
import json
import math

import torch

DEFAULT_SEQLENS = (1024, 4096, 16384)
DEFAULT_HEAD_DIMS = (64, 128)
TOKENS = 16384  # batch * seqlen per cell
MODEL_DIM = 2048  # heads * head_dim per cell


def bwd_flops(b, h, sq, sk, d, causal):
    f = 2.5 * 4 * b * h * sq * sk * d
    return f / 2 if causal else f


def time_ms(fn, warmup=3, reps=10):
    """Median time of ``fn`` in milliseconds, measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def _fa4_fn():
    try:
        from flash_attn.cute.interface import flash_attn_func
    except Exception as exc:  # the peer is optional: report why it is missing
        return None, f"flash_attn.cute unavailable: {exc}"
    return flash_attn_func, None


def _fa4_backward(fa4, q, k, v, dout, causal, deterministic=False):
    """FA4's forward run once on leaf copies of q, k, v; returns the call that times its
    backward (``torch.autograd.grad``, its own pre/postprocess included)."""
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    o4 = fa4(qg, kg, vg, causal=causal, deterministic=deterministic)
    o4 = o4[0] if isinstance(o4, tuple) else o4
    return lambda: torch.autograd.grad(o4, (qg, kg, vg), dout, retain_graph=True)


def parse_variant(spec: str):
    """"NAME:field=value,field=value" -> (NAME, BwdConfig overrides dict)."""
    from fa_sm100.config import parse_overrides
    from fa_sm100.hopper.bwd_config import BwdConfig

    name, _, rest = spec.partition(":")
    items = [x for x in rest.split(",") if x]
    return name, parse_overrides(items, cls=BwdConfig)


def bench_cell(b, h, hk, s, d, causal, dtype=torch.bfloat16, deterministic=False, variants=()):
    from fa_sm100.hopper.bwd_config import SM90_BWD_HEAD_DIMS, select_bwd_config
    from fa_sm100.hopper.bwd_interface import sm90_bwd

    q = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
    k = torch.randn(b, s, hk, d, device="cuda", dtype=dtype)
    v = torch.randn(b, s, hk, d, device="cuda", dtype=dtype)
    dout = torch.randn(b, s, h, d, device="cuda", dtype=dtype)
    flops = bwd_flops(b, h, s, s, d, causal)
    row = {"batch": b, "heads": h, "heads_kv": hk, "seqlen": s, "head_dim": d,
           "causal": causal, "deterministic": deterministic}
    if d not in SM90_BWD_HEAD_DIMS:
        row["ours_error"] = f"head_dim {d} is not supported by sm90_bwd ({SM90_BWD_HEAD_DIMS})"
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
    if "ours_error" not in row:
        ms = time_ms(lambda: sm90_bwd(dout, q, k, v, out, lse, causal=causal,
                                      deterministic=deterministic))
        row["ours_ms"] = ms
        row["ours_tflops"] = flops / ms / 1e9
        for name, overrides in variants:
            # the cell's causality picks the variant's other defaults (early dV, swap, tile_m)
            cfg = select_bwd_config(head_dim=d, causal=causal, qhead_per_kvhead=h // hk,
                                    deterministic=deterministic, **overrides)
            msv = time_ms(lambda: sm90_bwd(dout, q, k, v, out, lse, causal=causal,
                                           deterministic=deterministic, config=cfg))
            row[f"ours:{name}_ms"], row[f"ours:{name}_tflops"] = msv, flops / msv / 1e9
    if fa4 is not None:
        ms4 = time_ms(_fa4_backward(fa4, q, k, v, dout, causal, deterministic))
        row["fa4_ms"], row["fa4_tflops"] = ms4, flops / ms4 / 1e9
    else:
        row["fa4_error"] = why
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        if hk != h:
            kt_, vt_ = (x.repeat_interleave(h // hk, dim=1) for x in (kt, vt))
        else:
            kt_, vt_ = kt, vt
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            oc = torch.nn.functional.scaled_dot_product_attention(qt, kt_, vt_, is_causal=causal)
            doc = dout.transpose(1, 2)
            msc = time_ms(lambda: torch.autograd.grad(oc, (qt, kt, vt), doc, retain_graph=True))
        row["cudnn_ms"], row["cudnn_tflops"] = msc, flops / msc / 1e9
    except Exception as exc:
        row["cudnn_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    peers = [row[k] for k in ("fa4_tflops", "cudnn_tflops") if k in row]
    if peers and "ours_tflops" in row:
        row["ratio_vs_best_peer"] = row["ours_tflops"] / max(peers)
    return row


def _torch_forward(q, k, v, causal):
    """O and LSE (natural log, (b, h, s)) in float32 math, for when FA4 is absent."""
    b, s, h, d = q.shape
    group = h // k.shape[2]
    kf = k.float().repeat_interleave(group, dim=2)
    vf = v.float().repeat_interleave(group, dim=2)
    scale = 1.0 / math.sqrt(d)
    out = torch.empty_like(q)
    lse = torch.empty(b, h, s, device=q.device, dtype=torch.float32)
    for i in range(b):
        sc = torch.einsum("qhd,khd->hqk", q[i].float(), kf[i]) * scale
        if causal:
            sc = sc.masked_fill(torch.ones(s, s, device=q.device, dtype=torch.bool).triu(1), -math.inf)
        lse[i] = torch.logsumexp(sc, dim=-1)
        out[i] = torch.einsum("hqk,khd->qhd", torch.softmax(sc, dim=-1), vf[i]).to(q.dtype)
    return out, lse


def run_grid(seqlens=DEFAULT_SEQLENS, head_dims=DEFAULT_HEAD_DIMS, causals=(False, True),
             gqa_ratio=1, deterministic=False, variants=(), tokens=TOKENS, model_dim=MODEL_DIM):
    rows = []
    for d in head_dims:
        h = model_dim // d
        for s in seqlens:
            b = max(1, tokens // s)
            for causal in causals:
                rows.append(bench_cell(b, h, h // gqa_ratio, s, d, causal,
                                       deterministic=deterministic, variants=variants))
                print(format_row(rows[-1]), flush=True)
    return rows


def run_from_benchmark_args(args):
    """``scripts/benchmark.py --mode bwd``: the forward grid's flags, timed for the backward.
    ``--ours-variant NAME:field=value,...`` takes BwdConfig fields here."""
    variants = [parse_variant(v) for v in args.ours_variant]
    rows = run_grid(args.seqlen, args.hdim, args.causal, variants=variants,
                    tokens=args.total_tokens, model_dim=args.hidden)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": "bwd", "device": torch.cuda.get_device_name(), "rows": rows},
                      f, indent=1)
    return rows


def kernel_breakdown(fn, reps=10):
    """Where the time of one backward call goes: {kernel name: mean ms per call} from the
    CUDA profiler, plus ``"(call, events)"``, the CUDA-event time of one call as ``time_ms``
    measures it; the difference to the kernels' sum is host time the GPU waited for."""
    from torch.profiler import ProfilerActivity, profile

    call_ms = time_ms(fn, reps=reps)
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
    from fa_sm100.hopper.bwd_interface import sm90_bwd

    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=dtype) for _ in range(4))
    out, lse = _torch_forward(q, k, v, causal)
    result = {"ours": kernel_breakdown(lambda: sm90_bwd(dout, q, k, v, out, lse, causal=causal))}
    fa4, _ = _fa4_fn()
    if fa4 is not None:
        result["fa4"] = kernel_breakdown(_fa4_backward(fa4, q, k, v, dout, causal))
    return result


def format_row(r):
    cells = [f"d={r['head_dim']:3d} s={r['seqlen']:5d} b={r['batch']:2d} h={r['heads']}/{r['heads_kv']}"
             f" {'causal' if r['causal'] else 'full  '}"]
    names = ["ours"] + sorted(k[:-7] for k in r if k.startswith("ours:") and k.endswith("_tflops"))
    for peer in names + ["fa4", "cudnn"]:
        cells.append(f"{peer} {r[peer + '_tflops']:6.1f}" if peer + "_tflops" in r else f"{peer} n/a")
    if "ratio_vs_best_peer" in r:
        cells.append(f"ratio {r['ratio_vs_best_peer']:.2f}x")
    return " | ".join(cells) + " TFLOP/s"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqlens", type=int, nargs="+", default=list(DEFAULT_SEQLENS))
    p.add_argument("--head-dims", type=int, nargs="+", default=list(DEFAULT_HEAD_DIMS))
    p.add_argument("--gqa-ratio", type=int, default=1)
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:FIELD=VALUE[,...]",
                   help="also time sm90_bwd with these BwdConfig overrides")
    p.add_argument("--json", default=None)
    p.add_argument("--breakdown", action="store_true",
                   help="per-kernel times (CUDA profiler) of ours and FA4 instead of the grid")
    a = p.parse_args(argv)
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
                    variants=[parse_variant(v) for v in a.variant])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
