"""Run the SM90 forward (or backward) on a representative set of problems, for compute-sanitizer.

    compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 1 \
        python scripts/sm90_memcheck.py [--mode bwd] [--shard K/N]

(``--report-api-errors no``: the DSL's runtime probes driver entry points with
``cuGetProcAddress``, and the failed probes would otherwise count as errors.) ``--mode calls
--provider ours|fa4`` runs small training steps through a public ``flash_attn_func``, first and
warm calls marked, to attribute those reports (docs/host_path.md).

Forward: every head-dim pair, causal and not, MHA/GQA/MQA, seqlens that are not tile
multiples (tail rows and keys), seqlen_q > seqlen_k (rows with no key), the one-tile-per-CTA,
static persistent and dynamic persistent schedules. Backward (``sm90_bwd``: preprocess, main
kernel, postprocesses): every head-dim pair, causal with the CTAs renumbered longest first
(Note [longest first]: the whole grid, and a tail after CTAs in the grid's order), the grid's
order, deterministic mode, windows, GQA/MQA, both dQ paths, rows with no key, persistent CTAs
that walk several tiles by a fixed stride or fetch them (Notes [persistent CTAs], [dynamic
tiles]). ``--shard K/N`` runs every N-th case from the K-th (fa_sm100/shards.py). Small shapes:
memcheck slows kernels down a lot. Each result is also checked against a float32 reference,
so a silent wrong answer fails too.
"""

import argparse
import os
import sys


import torch

from fa_sm100.hopper.bwd_defaults import select_bwd_config
from fa_sm100.hopper.bwd_interface import sm90_bwd
from fa_sm100.hopper.config import select_sm90_fwd_config
from fa_sm100.hopper.interface import sm90_fwd
from fa_sm100.shards import parse_shard, shard_of
from fa_sm100.testing import (attention_reference, attention_reference_grads,
                              check_against_reference, grad_atol)

# (batch, seqlen_q, seqlen_k, heads, heads_kv, hdim, hdim_v, causal, schedule): "tile" = one
# work tile per CTA, "static" = persistent CTAs taking every gridDim.x-th tile, "dynamic" =
# persistent CTAs taking tiles from the global counter (Note [Dynamic tile schedule])
SCHEDULES = {"tile": {"persistent": False},
             "static": {"persistent": True, "dynamic_schedule": False},
             "dynamic": {"persistent": True, "dynamic_schedule": True},
             # each consumer warpgroup stores its own rows of O (Note [Warpgroup epilogues])
             "wg_epilogue": {"persistent": True, "dynamic_schedule": True, "wg_epilogue": True},
             # ... and the next tile's Q loads during this one (Note [Two Q stages])
             "two_q": {"persistent": True, "dynamic_schedule": True, "wg_epilogue": True,
                       "q_stage": 2},
             # CTA pairs multicasting their halves of each K/V tile (Note [K/V multicast])
             "multicast": {"persistent": False, "kv_multicast": True},
             "multicast4": {"persistent": False, "kv_multicast": True, "kv_cluster": 4},
             # ... from one work tile to the next (Note [Persistent multicast])
             "multicast_persistent": {"persistent": True, "kv_multicast": True},
             "multicast_two_q": {"persistent": True, "kv_multicast": True,
                                 "wg_epilogue": True, "q_stage": 2}}
CASES = [
    (2, 300, 300, 4, 4, 128, 128, False, "tile"),
    (2, 300, 300, 4, 4, 128, 128, True, "static"),
    (1, 17, 1000, 4, 1, 64, 64, True, "tile"),
    (3, 1000, 17, 6, 2, 64, 64, False, "static"),
    (1, 257, 129, 2, 2, 96, 96, True, "tile"),
    (2, 129, 257, 4, 2, 192, 128, False, "static"),
    (1, 200, 333, 2, 1, 256, 256, True, "tile"),
    (1, 1, 1, 2, 2, 256, 256, False, "tile"),
    (4, 1000, 1000, 8, 2, 128, 128, True, "dynamic"),
    (3, 700, 1500, 6, 6, 64, 64, True, "dynamic"),
    (2, 700, 900, 4, 2, 256, 256, True, "dynamic"),  # O staged in Q's buffer
    (3, 1000, 1500, 6, 2, 64, 64, False, "wg_epilogue"),  # 192-row tiles, 2 empty warpgroups
    (2, 1000, 700, 4, 1, 128, 128, True, "two_q"),  # rows without keys
    (2, 300, 1000, 6, 6, 96, 96, False, "two_q"),
    (2, 500, 1000, 4, 2, 128, 128, False, "multicast"),  # 4 m blocks per head
    (1, 700, 333, 2, 1, 64, 64, False, "multicast"),  # 4 blocks of 192 rows
    (1, 255, 1, 2, 2, 256, 256, False, "multicast"),  # one key
    (2, 500, 1000, 4, 2, 128, 128, False, "multicast4"),  # clusters of 4 m blocks
    (1, 500, 80, 2, 2, 256, 256, False, "multicast4"),  # a quarter of an 80-row tile each
    (4, 500, 1000, 40, 8, 128, 128, False, "multicast_persistent"),  # 640 tiles on the SMs
    (2, 700, 333, 36, 36, 64, 64, False, "multicast_two_q"),  # 288 tiles of 192 rows
    (2, 255, 300, 70, 70, 256, 256, False, "multicast_persistent"),  # O in Q's buffer
    # Note [Odd m blocks]: 3 and 5 m blocks per head, the last ones paired across heads
    (2, 500, 700, 4, 2, 64, 64, False, "multicast"),
    (3, 1200, 333, 46, 23, 64, 64, False, "multicast_persistent"),  # 690 tiles on the SMs
    (1, 600, 1000, 2, 1, 128, 128, False, "multicast_persistent"),
]


# (batch, seqlen_q, seqlen_k, heads, heads_kv, hdim, hdim_v, causal, window, deterministic,
# BwdConfig overrides); with causal the default renumbers the CTAs longest first
BWD_CASES = [
    (2, 300, 300, 4, 4, 128, 128, True, (None, None), False, {}),  # tail = the whole grid
    (3, 333, 300, 4, 2, 128, 128, True, (None, None), False, {"tail_ctas": 7}),
    (2, 1000, 1000, 4, 4, 64, 64, True, (None, None), True, {"tail_ctas": 20}),
    (2, 300, 100, 2, 2, 128, 128, True, (None, None), False, {"longest_first": False}),
    (1, 200, 333, 2, 1, 256, 256, True, (None, None), False, {}),  # "red" dQ
    (2, 129, 257, 4, 2, 192, 128, False, (None, None), False, {}),
    (1, 500, 500, 2, 2, 128, 128, False, (100, 30), True, {}),
    (1, 257, 257, 2, 2, 96, 96, False, (None, None), False, {"dq_accum": "red"}),
    # non-causal with an even number of key blocks: CTA pairs multicast Q and dO
    (2, 300, 250, 4, 2, 128, 128, False, (None, None), False, {}),
    (1, 333, 200, 2, 1, 256, 256, False, (None, None), False, {}),  # "red" dQ, by columns
    # clusters of 4 (80-row blocks: 20 rows of each Q / dO tile per CTA)
    (2, 300, 500, 4, 2, 128, 128, False, (None, None), False, {"qdo_cluster": 4}),
    # causal multicast: skipped query blocks, longest first by clusters (2 pairs in the tail)
    (3, 333, 1000, 4, 2, 128, 128, True, (None, None), False,
     {"qdo_multicast": True, "tail_ctas": 16}),
    (2, 257, 255, 4, 1, 64, 64, True, (None, None), False, {"qdo_multicast": True}),
    # Note [dQ first store] (the causal cases above have it by default; the deterministic one
    # stores on turn 0): 16 key blocks racing for each query block, and a window
    (2, 500, 2048, 4, 4, 128, 128, False, (None, None), False,
     {"dq_first_store": True, "stagger_m": False}),
    (1, 600, 500, 2, 2, 64, 64, False, (50, 20), False, {"dq_first_store": True}),
    # Note [staggered query blocks] (non-causal hdim 128's default, with first stores; the
    # non-causal hdim 128 cases above have it too): more clusters than query blocks, one CTA
    # each; tile_m 128 without first stores
    (1, 200, 2048, 2, 2, 128, 128, False, (None, None), False, {"qdo_multicast": False}),
    (1, 1000, 640, 2, 1, 64, 64, False, (None, None), False,
     {"stagger_m": True, "dq_first_store": False}),
    # Note [dQ postprocess in the tail] (hdim 128's default; the hdim 128 cases above have it):
    # more CTAs than SMs, GQA (the dK/dV postprocess follows), hdim 64 with a window
    (2, 2048, 2048, 8, 2, 128, 128, False, (None, None), False, {}),
    (1, 600, 500, 4, 2, 64, 64, True, (50, None), False, {"early_dq_post": True}),
    # Note [persistent CTAs]: far fewer CTAs than tiles, so that each walks several and stages
    # one tile's dK/dV epilogue while the next tile's K/V and first Q/dO load: multicast pairs
    # with staggered sweeps (hdim 128's default), and alone with ragged tails (hdim 64)
    (2, 1000, 1000, 4, 4, 128, 128, False, (None, None), False, {"persistent_ctas": 4}),
    (1, 257, 255, 3, 3, 64, 64, False, (None, None), False,
     {"persistent_ctas": 2, "qdo_multicast": False}),
    # Note [dynamic tiles]: tiles fetched from the counter, causal (longest first; sq < sk),
    # a band (hdim 64's windowed default), and unswapped hdim 96 with rows that see no key
    (3, 333, 777, 2, 2, 64, 64, True, (None, None), False,
     {"persistent_ctas": 3, "dynamic_tiles": True}),
    (2, 1000, 1000, 4, 4, 64, 64, False, (256, 64), False,
     {"persistent_ctas": 4, "dynamic_tiles": True}),
    (2, 900, 700, 3, 3, 96, 96, True, (None, None), False,
     {"persistent_ctas": 2, "dynamic_tiles": True}),
    # a narrow window at hdim 128 takes the short causal tile (64-row blocks, stats first)
    (1, 700, 900, 2, 2, 128, 128, False, (256, 0), False, {}),
]


def bwd_config(case):
    """The ``BwdConfig`` a backward case runs (its overrides on the defaults)."""
    b, sq, sk, h, hk, d, dv, causal, window, deterministic, overrides = case
    return select_bwd_config(head_dim=d, head_dim_v=dv, causal=causal, window_left=window[0],
                             window_right=window[1], qhead_per_kvhead=h // hk,
                             deterministic=deterministic, seqlen_q=sq, seqlen_k=sk, **overrides)


def main_fwd(gen, cases):
    for b, sq, sk, h, hk, d, dv, causal, schedule in cases:
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(b, sk, hk, dv, device="cuda", dtype=torch.bfloat16, generator=gen)
        cfg = select_sm90_fwd_config(d, dv, "bfloat16", causal, **SCHEDULES[schedule])
        out, lse = sm90_fwd(q, k, v, None, causal, (None, None), True, cfg)
        torch.cuda.synchronize()
        ref, ref_lse = attention_reference(q, k, v, causal=causal, dtype=torch.float32)
        plain, _ = attention_reference(q, k, v, causal=causal, dtype=torch.bfloat16, upcast=False)
        check_against_reference(out, ref, plain, atol=1e-3, what=f"O {(b, sq, sk, h, hk, d, dv, causal)}")
        print(f"ok b={b} sq={sq} sk={sk} h={h}/{hk} d={d}/{dv} causal={causal} "
              f"schedule={schedule}", flush=True)


def main_bwd(gen, cases):
    for case in cases:
        b, sq, sk, h, hk, d, dv, causal, window, deterministic, _ = case
        q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(b, sk, hk, dv, device="cuda", dtype=torch.bfloat16, generator=gen)
        dout = torch.randn(b, sq, h, dv, device="cuda", dtype=torch.bfloat16, generator=gen)
        out, lse, ref = attention_reference_grads(q, k, v, dout, causal, window, torch.float32)
        _, _, plain = attention_reference_grads(q, k, v, dout, causal, window, torch.bfloat16,
                                                upcast=False)
        got = sm90_bwd(dout, q, k, v, out.to(torch.bfloat16), lse, causal=causal,
                       window_size=window, deterministic=deterministic, config=bwd_config(case))
        torch.cuda.synchronize()
        for name, x, r, p in zip(("dq", "dk", "dv"), got, ref, plain):
            check_against_reference(x, r, p, atol=grad_atol(r), what=f"{name} {case}")
        print(f"ok bwd b={b} sq={sq} sk={sk} h={h}/{hk} d={d}/{dv} causal={causal} "
              f"window={window} deterministic={deterministic} {case[-1]}", flush=True)


def select_cases(mode: str, shard=None) -> list:
    """The cases of ``mode`` ("fwd" or "bwd"), or with ``shard`` ("K/N") the K-th of N
    round-robin shares of them; a malformed shard raises ValueError."""
    cases = BWD_CASES if mode == "bwd" else CASES
    return cases if shard is None else shard_of(cases, *parse_shard(shard))[0]


# --mode calls: small training steps through a public API, each preceded by a marker line, so
# that the sanitizer's API-error reports can be told apart by provider and by first / warm call
# (docs/host_path.md, "compute-sanitizer"). (batch, seqlen, heads, hdim, causal)
CALL_CASES = [(1, 128, 2, 64, False), (1, 128, 2, 64, True), (1, 256, 2, 128, False),
              (1, 256, 2, 128, True), (1, 128, 2, 256, False)]


def main_calls(gen, provider: str, repeat: int):
    if provider == "fa4":
        from flash_attn.cute import flash_attn_func as fn
    else:
        from fa_sm100.interface import flash_attn_func as fn
    for b, s, h, d, causal in CALL_CASES:
        q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16,
                                     generator=gen) for _ in range(4))
        leaves = [t.requires_grad_() for t in (q, k, v)]
        for i in range(repeat):
            print(f"== {provider} hdim {d} causal {causal}: call {i + 1} "
                  f"({'first' if i == 0 else 'warm'})", flush=True)
            out = fn(*leaves, causal=causal)
            out = out[0] if isinstance(out, tuple) else out
            torch.autograd.grad(out, leaves, dout)
            torch.cuda.synchronize()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("fwd", "bwd", "calls"), default="fwd")
    p.add_argument("--provider", choices=("ours", "fa4"), default="ours",
                   help="--mode calls: whose public flash_attn_func to call")
    p.add_argument("--repeat", type=int, default=3, help="--mode calls: calls per case")
    p.add_argument("--shard", default=None, metavar="K/N",
                   help="run the K-th of N round-robin shares of the cases (one device call "
                        "each: a lent GPU runs a command for at most 10 minutes)")
    args = p.parse_args(argv)
    if args.mode == "calls":
        gen = torch.Generator(device="cuda")
        gen.manual_seed(0)
        main_calls(gen, args.provider, args.repeat)
        print(f"{args.provider}: {len(CALL_CASES)} cases x {args.repeat} calls ok", flush=True)
        return
    try:
        cases = select_cases(args.mode, args.shard)
    except ValueError as err:
        p.error(str(err))
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    (main_bwd if args.mode == "bwd" else main_fwd)(gen, cases)
    print(f"all {len(cases)} {args.mode} cases ok", flush=True)


if __name__ == "__main__":
    main()
