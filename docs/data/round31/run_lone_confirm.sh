#!/bin/bash
set -u
timeout 450 python scripts/ab_bench.py --mode bwd --hdim 128 --seqlen 8192 16384 --causal true --rounds 20 \
  --variant lone:lone_blocks_last=true --variant aa:qdo_multicast=true \
  --json "$OUT/lone_h128_20r.json" 2>&1 | grep -v "^  round\|UserWarning\|exe_args\|run_backward"
