"""Context parallelism on several GPUs: tokens per second per GPU, and what the ring's
communication costs (fa_sm100.context_parallel, docs/context_parallel.md).

    python scripts/cp_bench.py                                  # every GPU, 64k-1M tokens
    python scripts/cp_bench.py --gpus 2 --tokens 65536,262144 --json cp.json --png cp.png

One process per GPU (NCCL), bf16, batch 1, ``--heads`` heads on ``--kv-heads`` K/V heads, head
dim 128, causal unless ``--non-causal``. Each rank holds its balanced shard of the sequence
(``shard``: 2 chunks, one from each end). Per sequence length, timed with CUDA events between
barriers, the slowest rank's time counting:

- ``ring`` and ``ulysses``: the forward, and forward + backward (autograd), of
  ``ring_attention`` / ``ulysses_attention`` with our kernels as the local steps;
- ``compute``: the ring's local steps alone (the same block pairs and merges, against the
  rank's own K/V, no communication);
- ``comm``: the ring's transfers alone (the forward's K/V hops; the backward's K/V hops and
  float32 dK/dV accumulator hops);
- ``one GPU``: one call of ours over the whole sequence on rank 0's GPU (up to
  ``--one-gpu-max`` tokens).

``exposed comm`` = ring - compute: the part of the communication the kernels did not hide
(the ring overlaps each step's transfer with its local kernels). Tokens per second per GPU =
tokens / time / GPUs. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

HEAD_DIM = 128
DEFAULT_TOKENS = (65536, 131072, 262144, 524288, 1048576)
MEASURES = ("ring", "ulysses", "compute", "comm")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=None, help="ranks, one per GPU (default: all)")
    p.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)),
                   help="comma-separated total sequence lengths")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--non-causal", action="store_true")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions (after one warm-up)")
    p.add_argument("--one-gpu-max", type=int, default=524288,
                   help="longest sequence also timed as one call on one GPU")
    p.add_argument("--json")
    p.add_argument("--png")
    p.add_argument("--replot", metavar="JSON",
                   help="only draw --png from a results file (no GPU needed)")
    return p.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _timed(fn, reps, torch, dist):
    """The slowest rank's median ms of ``fn()`` over ``reps`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        t = torch.tensor([start.elapsed_time(end)], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    return sorted(times)[len(times) // 2]


def _compute_only(q, k, v, dout, causal, scale, steps, backward, world, rank, torch):
    """The ring's local work on this rank without communication: every step's block pairs
    against this rank's own K/V (same shapes as the visiting ones), merged as the ring merges;
    with ``backward`` the backward's block pairs too."""
    from fa_sm100 import context_parallel as cp

    half = q.shape[1] // 2
    b, s, h, _ = q.shape
    out = torch.zeros(b, s, h, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, s), -float("inf"), dtype=torch.float32, device=q.device)
    for step in range(world):
        for qi, ki, diag in cp._pairs(rank, (rank - step) % world, world, causal):
            qs, ks = slice(qi * half, (qi + 1) * half), slice(ki * half, (ki + 1) * half)
            o, l = steps.forward(q[:, qs], k[:, ks], v[:, ks], diag, scale)
            out[:, qs], lse[:, :, qs] = cp.merge(out[:, qs], lse[:, :, qs], o, l)
    if not backward:
        return
    out = out.to(q.dtype)
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk = torch.zeros_like(k, dtype=torch.float32)
    dv = torch.zeros_like(v, dtype=torch.float32)
    for step in range(world):
        for qi, ki, diag in cp._pairs(rank, (rank - step) % world, world, causal):
            qs, ks = slice(qi * half, (qi + 1) * half), slice(ki * half, (ki + 1) * half)
            g = steps.backward(dout[:, qs].contiguous(), q[:, qs].contiguous(),
                               k[:, ks].contiguous(), v[:, ks].contiguous(),
                               out[:, qs].contiguous(), lse[:, :, qs].contiguous(), diag, scale)
            dq[:, qs] += g[0].float()
            dk[:, ks] += g[1].float()
            dv[:, ks] += g[2].float()


def _comm_only(k, v, backward, world, rank, group, torch):
    """The ring's transfers alone: W - 1 K/V hops; with ``backward`` also the backward's
    W - 1 K/V hops and W float32 dK/dV hops."""
    from fa_sm100 import context_parallel as cp

    def hops(tensors, n):
        for _ in range(n):
            got, reqs = cp._send_recv(tensors, group, rank, world)
            for r in reqs:
                r.wait()
            tensors = got

    hops((k, v), world - 1)
    if backward:
        hops((k, v), world - 1)
        hops((k.float(), v.float()), world)


def _worker(rank, world, port, args, tokens_list, queue):
    import torch
    import torch.distributed as dist

    from fa_sm100 import context_parallel as cp
    from fa_sm100 import flash_attn_func

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    causal = not args.non_causal
    steps = cp.kernel_steps()
    scale = HEAD_DIM ** -0.5
    try:
        for tokens in tokens_list:
            local = tokens // world
            g = torch.Generator(device="cuda").manual_seed(rank)
            mk = lambda n: torch.randn(1, local, n, HEAD_DIM, device="cuda",  # noqa: E731
                                       dtype=torch.bfloat16, generator=g)
            q, k, v, dout = mk(args.heads), mk(args.kv_heads), mk(args.kv_heads), mk(args.heads)
            row = {"tokens": tokens, "gpus": world, "ms": {}}
            for name in MEASURES:
                for mode in ("fwd", "fwd+bwd"):
                    bwd = mode == "fwd+bwd"
                    if name in ("ring", "ulysses"):
                        if name == "ulysses" and (args.heads % world or args.kv_heads % world):
                            continue
                        fn_attn = cp.ring_attention if name == "ring" else cp.ulysses_attention

                        def fn(fn_attn=fn_attn, bwd=bwd):
                            if bwd:
                                qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                                fn_attn(qg, kg, vg, causal=causal).backward(dout)
                            else:
                                with torch.no_grad():
                                    fn_attn(q, k, v, causal=causal)
                    elif name == "compute":
                        fn = lambda bwd=bwd: _compute_only(  # noqa: E731
                            q, k, v, dout, causal, scale, steps, bwd, world, rank, torch)
                    else:
                        fn = lambda bwd=bwd: _comm_only(k, v, bwd, world, rank, None,  # noqa: E731
                                                        torch)
                    row["ms"][f"{name} {mode}"] = _timed(fn, args.reps, torch, dist)
                    if rank == 0:
                        print(f"cp_bench: {tokens} tokens, {world} GPUs, {name} {mode}: "
                              f"{row['ms'][f'{name} {mode}']:.2f} ms", file=sys.stderr, flush=True)
            if rank == 0 and tokens <= args.one_gpu_max:
                gf = torch.Generator(device="cuda").manual_seed(99)
                full = [torch.randn(1, tokens, n, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                                    generator=gf) for n in (args.heads, args.kv_heads,
                                                            args.kv_heads, args.heads)]
                for mode in ("fwd", "fwd+bwd"):
                    def one(mode=mode):
                        if mode == "fwd":
                            with torch.no_grad():
                                flash_attn_func(*full[:3], causal=causal)
                        else:
                            qg, kg, vg = (t.detach().requires_grad_() for t in full[:3])
                            flash_attn_func(qg, kg, vg, causal=causal).backward(full[3])
                    one()
                    ts = []
                    for _ in range(args.reps):
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        one()
                        torch.cuda.synchronize()
                        ts.append((time.perf_counter() - t0) * 1e3)
                    row["ms"][f"one GPU {mode}"] = sorted(ts)[len(ts) // 2]
                del full
            if rank == 0:
                queue.put(row)
            del q, k, v, dout
            torch.cuda.empty_cache()
            dist.barrier()
    finally:
        dist.destroy_process_group()


def summarize(row: dict, heads: int, causal: bool) -> dict:
    """Tokens per second per GPU of each measure, and the exposed communication."""
    world, tokens = row["gpus"], row["tokens"]
    ms = row["ms"]
    row["tokens_per_s_per_gpu"] = {
        name: tokens / (t * 1e-3) / (1 if name.startswith("one GPU") else world)
        for name, t in ms.items() if not name.startswith(("compute", "comm"))}
    flops = 4 * tokens * tokens * HEAD_DIM * heads * (0.5 if causal else 1.0)
    row["tflops_per_gpu"] = {
        name: flops * (1 if name.endswith("fwd") else 3.5) / (t * 1e-3) / 1e12
        / (1 if name.startswith("one GPU") else world)
        for name, t in ms.items() if not name.startswith("comm")}
    row["exposed_comm_ms"] = {mode: ms[f"ring {mode}"] - ms[f"compute {mode}"]
                              for mode in ("fwd", "fwd+bwd")
                              if f"ring {mode}" in ms and f"compute {mode}" in ms}
    row["steps"] = world
    return row


def plot(rows, path: str, title: str) -> None:
    """TFLOP/s per GPU of the ring, the all-to-all and one GPU (left axis; flat where the
    parallel path loses nothing), and the ring's transfers alone over its local steps alone
    (right axis), forward and forward + backward."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, mode in zip(axes, ("fwd", "fwd+bwd")):
        for name, style in (("ring", "o-"), ("ulysses", "s-"), ("one GPU", "k^--")):
            pts = [(r["tokens"], r["tflops_per_gpu"][f"{name} {mode}"]) for r in rows
                   if f"{name} {mode}" in r["tflops_per_gpu"]]
            if pts:
                ax.plot(*zip(*pts), style, label=name)
        ratio = [(r["tokens"], r["ms"][f"comm {mode}"] / r["ms"][f"compute {mode}"])
                 for r in rows if f"comm {mode}" in r["ms"]]
        ax2 = ax.twinx()
        ax2.plot(*zip(*ratio), "r:", label="transfers alone / local steps alone (right)")
        ax2.set_ylabel("ring transfers / local steps", color="r")
        ax2.set_ylim(bottom=0)
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("tokens (whole sequence)")
        ax.set_ylabel("TFLOP/s per GPU")
        ax.set_title(f"{mode}, {rows[0]['gpus']} GPUs")
        ax.legend(loc="lower left", fontsize=8)
        ax2.legend(loc="lower right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def title_of(results: dict) -> str:
    return (f"context parallelism on {results['device']}, {results['heads']} heads on "
            f"{results['kv_heads']} K/V, hdim {results['head_dim']}, "
            f"{'causal' if results['causal'] else 'non-causal'}, bf16")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            results = json.load(f)
        plot(results["rows"], args.png or args.replot.replace(".json", ".png"),
             title_of(results))
        return 0
    import torch
    import torch.multiprocessing as mp

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        print("cp_bench: needs two or more CUDA GPUs", file=sys.stderr)
        return 2
    world = args.gpus or torch.cuda.device_count()
    tokens_list = [int(t) for t in args.tokens.split(",")]
    for t in tokens_list:
        if t % (2 * world):
            print(f"cp_bench: {t} tokens do not split into {2 * world} chunks", file=sys.stderr)
            return 2
    ctx = mp.get_context("spawn")
    queue = ctx.Manager().Queue()
    mp.spawn(_worker, args=(world, _free_port(), args, tokens_list, queue), nprocs=world,
             join=True)
    causal = not args.non_causal
    rows = [summarize(queue.get(), args.heads, causal) for _ in tokens_list]
    device = f"{world} x {torch.cuda.get_device_name()}"
    for r in rows:
        tps = r["tokens_per_s_per_gpu"]
        print(f"{r['tokens']:>8} tokens: " + "  ".join(
            f"{n} {v / 1e3:.1f}k tok/s/GPU" for n, v in tps.items())
            + "  exposed comm " + ", ".join(f"{m} {v:.2f} ms"
                                            for m, v in r["exposed_comm_ms"].items()))
    results = {"command": "python scripts/cp_bench.py "
               + " ".join(sys.argv[1:] if argv is None else argv),
               "device": device, "heads": args.heads, "kv_heads": args.kv_heads,
               "head_dim": HEAD_DIM, "causal": causal, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.png:
        plot(rows, args.png, title_of(results))
    return 0
