#!/usr/bin/env python
"""Compile and run FlashAttention-4's SM90 forward once so CUTE_DSL_KEEP can keep its PTX and
cubin, for a side-by-side reading with ours (scripts/inspect.py --kernel sm90_fwd --keep-dir).

    CUTE_DSL_KEEP=ptx,cubin CUTE_DSL_DUMP_DIR=out/ python scripts/dump_fa4_sm90.py --hdim 128
"""

import argparse

try:  # first import: keeps scripts/inspect.py from shadowing the standard `inspect`
    import _paths  # noqa: F401
except ImportError:  # loaded as a module (tests): this folder is not on sys.path
    pass

import torch  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    args = p.parse_args()
    from flash_attn.cute import flash_attn_func

    q, k, v = (torch.randn(4, 4096, 16, args.hdim, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    flash_attn_func(q, k, v, causal=args.causal)
    torch.cuda.synchronize()
    print("done")


if __name__ == "__main__":
    main()
