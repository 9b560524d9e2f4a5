"""Host cost per call through the public APIs, ours beside the peers, in one process.

    python scripts/overhead.py                      # 1x128x2x64 bf16, the table below
    python scripts/overhead.py --shape 1 128 2 64 --calls 500 --rounds 3 --json out.json

A shape this small runs on the GPU in a few microseconds, so a loop of calls is bound by the
host: the time per call is what the Python and launch path cost. Rows:

- forward: ``flash_attn_func(q, k, v)`` (ours, FA4) and
  ``scaled_dot_product_attention`` with the cuDNN or the flash backend forced;
- forward + backward: the forward on tensors that require grad, then
  ``torch.autograd.grad`` of its output (ours, FA4, SDPA cuDNN); backward: the grad alone, of
  one forward's output;
- ours, launch only: the prepared forward and backward launches (``prepare_sm90_fwd``,
  ``prepare_sm90_bwd``), the floor of ours: the rest of a public call's time is host work.

SDPA's backend is chosen once around each of its measurements (``sdpa_kernel``), as a model
sets it, not per call.

Three figures per entry, microseconds per call:

- per call: ``calls`` calls back to back, then one synchronize: bound by whichever of the host
  and the GPU is slower (the table's headline, as a model's loop sees it);
- host: ``HOST_CALLS`` calls after a synchronize, timed until the last one returns (the GPU's
  queue never fills, so this is the host's own cost, whatever the kernels take);
- GPU (``--gpu-time``): the kernels' device time per call (torch.profiler), which bounds the
  per-call figure from below when the host is faster.

Rounds
interleave the providers (every round times each once, in a rotating order) and the table keeps
each one's minimum over the rounds: the least disturbed measurement of a fixed cost. A provider
that cannot run says why instead of a number.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time



def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=int, nargs=4, default=[1, 128, 2, 64],
                   metavar=("BATCH", "SEQLEN", "HEADS", "HDIM"))
    p.add_argument("--calls", type=int, default=500, help="calls per measurement")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", help="write the table as JSON")
    p.add_argument("--gpu-time", action="store_true",
                   help="also measure each entry's kernel time on the GPU (torch.profiler)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also print a cProfile of N warm calls of ours' training step (forward "
                        "+ autograd.grad), the functions by own time: where the host time goes")
    return p.parse_args(argv)


def providers(q, k, v, torch):
    """{row: {provider: (no-argument call, context)}}, where the context (or None) is entered
    around the provider's measurements, as a model sets SDPA's backend once; a provider that
    cannot be set up maps to its reason (a string)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fa_sm100.interface import flash_attn_func

    out = {"forward": {}, "forward + backward": {}, "backward": {}, "launch only: forward": {},
           "launch only: backward": {}}
    dout = torch.randn_like(q)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]

    def first(o):
        return o[0] if isinstance(o, tuple) else o

    def train(fwd):
        return lambda: torch.autograd.grad(first(fwd(*leaves)), leaves, dout)

    def backward(fwd, context):
        with context or contextlib.nullcontext():
            o = first(fwd(*leaves))
        return lambda: torch.autograd.grad(o, leaves, dout, retain_graph=True)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2)).transpose(1, 2)

    ours = {"forward": lambda: flash_attn_func(q, k, v), "forward + backward":
            train(flash_attn_func), "backward": backward(flash_attn_func, None)}
    for row, fn in ours.items():
        out[row]["ours"] = (fn, None)
    try:
        from flash_attn.cute import flash_attn_func as fa4
    except Exception as e:  # noqa: BLE001 - an absent peer is reported
        for row in ours:
            out[row]["fa4"] = f"{type(e).__name__}: {e}"
    else:
        out["forward"]["fa4"] = (lambda: fa4(q, k, v), None)
        out["forward + backward"]["fa4"] = (train(fa4), None)
        out["backward"]["fa4"] = (backward(fa4, None), None)
    cudnn = lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION)  # noqa: E731
    flash = lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)  # noqa: E731
    out["forward"]["sdpa_cudnn"] = (lambda: sdpa(q, k, v), cudnn)
    out["forward"]["sdpa_flash"] = (lambda: sdpa(q, k, v), flash)
    out["forward + backward"]["sdpa_cudnn"] = (train(sdpa), cudnn)
    out["backward"]["sdpa_cudnn"] = (backward(sdpa, cudnn()), cudnn)
    if torch.cuda.get_device_capability(q.device) == (9, 0):
        from fa_sm100.hopper.bwd_interface import prepare_sm90_bwd
        from fa_sm100.hopper.interface import prepare_sm90_fwd

        out["launch only: forward"]["ours"] = (prepare_sm90_fwd(q, k, v), None)
        o, lse = flash_attn_func(q, k, v, return_lse=True)
        out["launch only: backward"]["ours"] = (prepare_sm90_bwd(dout, q, k, v, o, lse), None)
    return out


def per_call_us(fn, calls, torch) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


HOST_CALLS = 32  # few enough launches that the GPU's queue never blocks the host


def host_us(fn, torch) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(HOST_CALLS):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / HOST_CALLS * 1e6


def gpu_us(fn, calls, torch) -> tuple:
    """(device time per call in us, {kernel name: us per call}) over ``calls`` calls."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = {}
    for event in prof.key_averages():
        t = getattr(event, "device_time_total", None)
        if t is None:
            t = getattr(event, "cuda_time_total", 0)
        if t and event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.key[:80]] = t / calls
    return sum(kernels.values()), kernels


def measure(table, calls, rounds, torch, gpu_time=False):
    """{figure: {row: {provider: min us per call, or the reason it did not run}}} for the
    figures "per call", "host" and (``gpu_time``) "GPU" of the module docstring, with the GPU
    figure's kernels under "kernels"."""
    result = {row: {} for row in table}
    runnable = []
    for row, entries in table.items():
        for name, entry in entries.items():
            if isinstance(entry, str):
                result[row][name] = entry
                continue
            fn, context = entry
            try:
                with context() if context else contextlib.nullcontext():
                    for _ in range(3):  # compile, plan, warm the caches
                        fn()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - reported in its cell
                result[row][name] = f"{type(e).__name__}: {e}"
                continue
            runnable.append((row, name, fn, context))
    best, host = {}, {}
    for r in range(rounds):
        shift = r % max(1, len(runnable))
        for row, name, fn, context in runnable[shift:] + runnable[:shift]:
            with context() if context else contextlib.nullcontext():
                us = per_call_us(fn, calls, torch)
                h = host_us(fn, torch)
            best[(row, name)] = min(us, best.get((row, name), float("inf")))
            host[(row, name)] = min(h, host.get((row, name), float("inf")))
        print(f"round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    host_result = {row: dict(entries) for row, entries in result.items()}
    gpu_result = {row: dict(entries) for row, entries in result.items()}
    kernels = {}
    for (row, name), us in best.items():
        result[row][name] = us
        host_result[row][name] = host[(row, name)]
    if gpu_time:
        for row, name, fn, context in runnable:
            with context() if context else contextlib.nullcontext():
                gpu_result[row][name], kernels[f"{row} / {name}"] = gpu_us(fn, 50, torch)
    figures = {"per call": result, "host": host_result}
    if gpu_time:
        figures["GPU"] = gpu_result
        figures["kernels"] = kernels
    return figures


def format_table(result, shape, device) -> str:
    names = []
    for entries in result.values():
        names += [n for n in entries if n not in names]
    b, s, h, d = shape
    lines = [f"per call, {b}x{s}x{h}x{d} bf16, {device} (us, minimum over rounds)", "",
             "| path | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for row, entries in result.items():
        cells = []
        for n in names:
            v = entries.get(n)
            cells.append("" if v is None else f"{v:.1f}" if isinstance(v, float) else "n/a")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    reasons = [f"{row} / {n}: {v}" for row, e in result.items() for n, v in e.items()
               if isinstance(v, str)]
    return "\n".join(lines + ([""] + reasons if reasons else []))


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("overhead: needs a CUDA device", file=sys.stderr)
        return 2
    b, s, h, d = args.shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
               for _ in range(3))
    table = providers(q, k, v, torch)
    figures = measure(table, args.calls, args.rounds, torch, args.gpu_time)
    if args.profile:
        import cProfile
        import pstats

        step = table["forward + backward"]["ours"][0]
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.profile):
            step()
        torch.cuda.synchronize()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    device = torch.cuda.get_device_name()
    for figure in ("per call", "host", "GPU"):
        if figure in figures:
            print(f"\n{figure}: " + format_table(figures[figure], args.shape, device))
    for entry, kernels in figures.get("kernels", {}).items():
        print(f"\nkernels of {entry} (us per call):")
        for name, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
            print(f"  {us:8.2f}  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python scripts/overhead.py " + " ".join(argv or sys.argv[1:]),
                       "device": device, "shape": args.shape, "calls": args.calls,
                       "rounds": args.rounds, "us_per_call": figures["per call"],
                       "host_us_per_call": figures["host"],
                       **({"gpu_us_per_call": figures["GPU"], "kernels_us_per_call":
                           figures["kernels"]} if "GPU" in figures else {})}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
