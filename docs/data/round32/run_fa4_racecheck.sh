#!/usr/bin/env bash
# Round 32: racecheck over FA4's SM90 backward (fa4_racecheck.py), kernels named per hazard.
set -uo pipefail
compute-sanitizer --tool racecheck --report-api-errors no \
    python docs/data/round32/fa4_racecheck.py > "$OUT/racecheck_fa4.txt" 2>&1
echo "exit $?"
grep -E '^fa4|SUMMARY' "$OUT/racecheck_fa4.txt"
grep -oE 'Race reported between (Read|Write) access at [A-Za-z0-9_]{0,60}' "$OUT/racecheck_fa4.txt" | sort | uniq -c | head -20
