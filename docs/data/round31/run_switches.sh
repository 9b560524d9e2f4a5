#!/bin/bash
# Round 31, device call: two switches at hdim 128 on the long cells, paired against the
# default and FA4: early dV (issued before the dS math, dS from the 16-bit P^T), and one
# pair of each thread's 40 exp2s on the FMA pipe (the most that keeps 5 WGMMA commit groups).
set -u
ab() { local name=$1; shift; echo "== $name: $*"; timeout 280 python scripts/ab_bench.py --mode bwd "$@" --json "$OUT/$name.json" 2>&1 | grep -v "^  round\|UserWarning\|exe_args\|run_backward" ; }
V="--variant edv:early_dv=true,dv_before_barrier=false --variant ex2:ex2_emu_fraction=0.05"
ab h128_nc --hdim 128 --seqlen 4096 16384 --causal false --rounds 12 $V
ab h128_c --hdim 128 --seqlen 4096 16384 --causal true --rounds 12 $V
