#!/usr/bin/env bash
# Round 32: racecheck's per-hazard report (its hazard type: RAW / WAR / WAW) for the minimal
# handoff with __syncwarp (racecheck_mbarrier.cu, variant 3) and one backward case.
set -uo pipefail
here=$(dirname "$0")
nvcc -arch=sm_90a -o /tmp/rc "$here/racecheck_mbarrier.cu" || exit 1
compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 6 /tmp/rc 3 \
    > "$OUT/racecheck_kinds_minimal.txt" 2>&1
compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 12 --report-api-errors no \
    python scripts/sm90_memcheck.py --mode bwd --shard 22/25 > "$OUT/racecheck_kinds_case22.txt" 2>&1
for f in "$OUT"/racecheck_kinds_*.txt; do
    echo "== $f"; grep -iE 'hazard|SUMMARY' "$f" | sort | uniq -c | sort -rn | head -12
done
