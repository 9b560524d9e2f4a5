#!/bin/bash
# Round 31, device call: lone_blocks_last (Note [lone blocks last]) on causal multicast pairs:
# the GPU multicast cases, then paired timing against the default (and multicast at 4k).
set -u
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_sm90_bwd_gpu.py -k "multicast" 2>&1 | grep -v "Warning\|exe_args\|run_backward\|^\s*$" | tail -8
ab() { local name=$1; shift; echo "== $name: $*"; timeout 200 python scripts/ab_bench.py --mode bwd "$@" --json "$OUT/$name.json" 2>&1 | grep -v "^  round\|UserWarning\|exe_args\|run_backward" ; }
ab lone_h128 --hdim 128 --seqlen 8192 16384 --causal true --rounds 12 --variant lone:lone_blocks_last=true
ab lone_h64 --hdim 64 --seqlen 8192 16384 --causal true --rounds 10 --no-fa4 --variant lone:lone_blocks_last=true
ab lone_4k --hdim 128 64 --seqlen 4096 --causal true --rounds 10 --no-fa4 \
   --variant mc:qdo_multicast=true --variant mclone:qdo_multicast=true,lone_blocks_last=true
