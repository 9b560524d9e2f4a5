#!/usr/bin/env bash
# Round 32: the racecheck GPU test again, after excluding cuBLAS's kernels and the file cache.
set -uo pipefail
python -m pytest -q tests/test_sm90_bwd_sanitizer_gpu.py -rA 2>&1 | tail -40 | tee "$OUT/test_sanitizer_gpu.txt"
