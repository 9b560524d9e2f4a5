"""``python -m fa_sm100 warmup``: compile ahead of time the kernels a server's calls will use.

The first call of a new config compiles its kernel (seconds to tens of seconds);
``fa_sm100.kernel_cache`` keeps every compiled kernel on disk, so a second process loads it in
milliseconds. This command fills that cache before the first request: for each problem given
(head dim, causality, sequence length, heads, dtype) it picks the configs the public functions
would pick, compiles their kernels for sm_90a (on a GPU machine or on a CPU one: the object
files are the same) and prints what each cost.

    python -m fa_sm100 warmup --hdim 64 128 --causal both --seqlen 4096 --heads 16
    python -m fa_sm100 warmup --hdim 128 --seqlen 8192 --heads 32 --heads-kv 8 --backward

Configs depend on the sequence lengths where a default does (see ``select_sm90_fwd_config``):
give the lengths the server will see. ``--backward`` also compiles the forward that autograd
runs (it writes LSE) and the backward's kernels. The SM100 forward is not warmed here: its
kernels compile for the GPU they run on.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from fa_sm100.config import default_head_dim_v, normalize_dtype


def _bools(text: str):
    return {"both": (False, True), "true": (True,), "false": (False,)}[text.lower()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m fa_sm100 warmup",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hdim", type=int, nargs="+", default=[128])
    p.add_argument("--causal", type=_bools, default=(False, True), metavar="{both,true,false}")
    p.add_argument("--seqlen", type=int, nargs="+", default=[4096],
                   help="query and key length of each problem")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--heads-kv", type=int, default=None, help="default: --heads (MHA)")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--backward", action="store_true",
                   help="also the kernels of training: the LSE-writing forward and the backward")
    return p.parse_args(argv)


def kernels_for(args) -> list:
    """[(label, make)] where ``make()`` fetches one kernel through the kernel cache."""
    from fa_sm100.hopper.bwd_defaults import select_bwd_config
    from fa_sm100.hopper.bwd_interface import _compiled, kernel_specs
    from fa_sm100.hopper.config import select_sm90_fwd_config
    from fa_sm100.hopper.interface import compile_sm90_fwd

    dtype = normalize_dtype({"bf16": "bfloat16", "fp16": "float16"}[args.dtype])
    heads_kv = args.heads_kv or args.heads
    if args.heads % heads_kv:
        raise ValueError(f"--heads {args.heads} is not a multiple of --heads-kv {heads_kv}")
    jobs, seen = [], set()
    for d in args.hdim:
        dv = default_head_dim_v(d)
        for causal in args.causal:
            for s in args.seqlen:
                where = f"hdim {d} {'causal' if causal else 'non-causal'} seqlen {s}"
                for lse in ((False, True) if args.backward else (False,)):
                    cfg = select_sm90_fwd_config(d, dv, dtype, causal, write_lse=lse,
                                                 seqlen_k=s, seqlen_q=s,
                                                 batch_heads=args.batch * args.heads)
                    if cfg not in seen:
                        seen.add(cfg)
                        label = f"sm90_fwd{' (writes LSE)' if lse else ''}, {where}"
                        jobs.append((label, lambda cfg=cfg: compile_sm90_fwd(cfg)))
                if args.backward:
                    bwd = select_bwd_config(head_dim=d, head_dim_v=dv, dtype=dtype,
                                            causal=causal, qhead_per_kvhead=args.heads // heads_kv,
                                            seqlen_q=s, seqlen_k=s)
                    for spec in kernel_specs(bwd):
                        if (spec[0], spec[1]) not in seen:
                            seen.add((spec[0], spec[1]))
                            jobs.append((f"sm90_bwd {spec[0]}, {where}",
                                         lambda spec=spec: _compiled(*spec)))
    return jobs


def main(argv=None) -> int:
    args = parse_args(argv)
    from fa_sm100 import kernel_cache

    try:
        jobs = kernels_for(args)
    except ValueError as e:
        print(f"warmup: {e}", file=sys.stderr)
        return 2
    where = kernel_cache.cache_dir() if kernel_cache.disk_enabled() else "memory only"
    print(f"warmup: {len(jobs)} kernels, cache {where}", flush=True)
    start = time.perf_counter()
    for i, (label, make) in enumerate(jobs, 1):
        print(f"[{i}/{len(jobs)}] {label} ...", end=" ", flush=True)
        before = len(kernel_cache.records())
        make()
        new = kernel_cache.records()[before:]
        if new:
            r = new[-1]
            how = "compiled" if r.source == "compiled" else "loaded from disk"
            print(f"{how} in {r.seconds:.2f} s", flush=True)
        else:
            print("already loaded", flush=True)
    total = time.perf_counter() - start
    compiled = [r for r in kernel_cache.records() if r.source == "compiled"]
    print(f"warmup: done in {total:.1f} s ({len(compiled)} compiled, "
          f"{sum(r.seconds for r in compiled):.1f} s compiling)")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    sys.exit(main())
