"""Compile and run FlashAttention-4's SM90 forward once so CUTE_DSL_KEEP can keep its PTX and
cubin, for a side-by-side reading with ours (scripts/inspect.py --kernel sm90_fwd --keep-dir).

    CUTE_DSL_KEEP=ptx,cubin CUTE_DSL_DUMP_DIR=out/ python scripts/dump_fa4_sm90.py --hdim 128
"""

import argparse
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--causal", action="store_true")
    args = p.parse_args(argv)
    import torch
    from flash_attn.cute import flash_attn_func

    q, k, v = (torch.randn(4, 4096, 16, args.hdim, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    flash_attn_func(q, k, v, causal=args.causal)
    torch.cuda.synchronize()
    print("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
