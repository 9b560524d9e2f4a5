#!/bin/bash
# Round 31, device call: the causal tail and the preprocess's CTAs at hdim 128, 8k / 16k,
# paired against the default (tail_ctas=264, pre_ctas=32).
set -u
timeout 400 python scripts/ab_bench.py --mode bwd --hdim 128 --seqlen 8192 16384 --causal true \
  --rounds 12 --no-fa4 --variant t132:tail_ctas=132 --variant t528:tail_ctas=528 \
  --variant t1056:tail_ctas=1056 --variant pre16:pre_ctas=16 --variant pre64:pre_ctas=64 \
  --json "$OUT/tail_pre_h128_causal.json" 2>&1 | grep -v "^  round\|UserWarning\|exe_args\|run_backward"
