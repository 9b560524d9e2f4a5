#!/bin/bash
# Round 31, device call: static persistent CTAs for windowed problems whose tiles are of
# equal length (a band bounded on both sides). Paired against the default of each cell.
# Run from the repo root on the lent GPU; writes JSON and logs under $OUT.
set -u
ab() { local name=$1; shift; echo "== $name: $*"; timeout 170 python scripts/ab_bench.py --mode bwd "$@" --json "$OUT/$name.json" 2>&1 | grep -v "^  round" ; }
PERS=pers:persistent_ctas=132,pre_ctas=0
ab w128_512 --hdim 128 --seqlen 4096 16384 --causal true --window 512 0 --rounds 10 \
   --variant $PERS --variant pre0:pre_ctas=0
ab w128_band16k --hdim 128 --seqlen 16384 --causal true --window 1024 0 --rounds 8 --no-fa4 --variant $PERS
ab w128_2048 --hdim 128 --seqlen 16384 --causal true --window 2048 0 --rounds 8 --no-fa4 --variant $PERS
ab w128_256x2 --hdim 128 --seqlen 16384 --causal false --window 256 256 --rounds 8 --no-fa4 --variant $PERS
ab w64_512 --hdim 64 --seqlen 4096 16384 --causal true --window 512 0 --rounds 10 --no-fa4 \
   --variant static:dynamic_tiles=false
ab w64_2048 --hdim 64 --seqlen 16384 --causal true --window 2048 0 --rounds 8 --no-fa4 --variant $PERS
