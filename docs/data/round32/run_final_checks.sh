#!/usr/bin/env bash
# Round 32, final code (the tile slot read by lane 0): the racecheck test, the GPU tests of
# dynamic tiles and persistent CTAs, and memcheck over every backward case.
set -uo pipefail
python -m pytest -q tests/test_sm90_bwd_sanitizer_gpu.py -rA 2>&1 | tail -40 | tee "$OUT/test_sanitizer_gpu.txt"
python -m pytest -q tests/test_sm90_bwd_gpu.py -k "dynamic or persistent" 2>&1 | tail -3 | tee "$OUT/test_dynamic_persistent_gpu.txt"
bash docs/data/round32/run_sanitizer.sh memcheck 1/1
