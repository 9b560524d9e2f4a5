#!/usr/bin/env bash
# Round 32: racecheck on four minimal (and one racy) mbarrier handoffs (racecheck_mbarrier.cu), for scale
# against the hazards it reports in the backward (racecheck_*.txt).
set -uo pipefail
here=$(dirname "$0")
nvcc -arch=sm_90a -o /tmp/rc "$here/racecheck_mbarrier.cu" || exit 1
for v in 0 1 2 3 4; do
    echo "== variant $v"
    compute-sanitizer --tool racecheck /tmp/rc $v 2>&1 | grep -vE '^=========\s*$'
done 2>&1 | tee "$OUT/racecheck_mbarrier.txt"
