#!/usr/bin/env bash
# Round 32: compute-sanitizer over the backward's memcheck cases, one share per device call.
#   bash docs/data/round32/run_sanitizer.sh TOOL K/N   (TOOL: memcheck | synccheck)
set -uo pipefail
tool=$1; shard=$2
tag=${shard/\//of}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/${tool}_bwd_${tag}.txt"
start=$(date +%s)
compute-sanitizer --tool "$tool" --report-api-errors no --error-exitcode 1 \
    python scripts/sm90_memcheck.py --mode bwd --shard "$shard" 2>&1 | tee -a "$OUT/${tool}_bwd_${tag}.txt"
rc=${PIPESTATUS[0]}
echo "exit $rc after $(( $(date +%s) - start )) s" | tee -a "$OUT/${tool}_bwd_${tag}.txt"
