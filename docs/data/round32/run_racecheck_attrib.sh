#!/usr/bin/env bash
# Round 32: which instructions racecheck's hazards name. Two memcheck cases under racecheck
# with the DSL keeping each kernel's cubin, to disassemble on the CPU (nvdisasm).
set -uo pipefail
for shard in 1/25 22/25; do
    tag=${shard/\//of}
    mkdir -p "$OUT/cubin_$tag"
    CUTE_DSL_KEEP=cubin CUTE_DSL_DUMP_DIR="$OUT/cubin_$tag" \
        compute-sanitizer --tool racecheck --report-api-errors no \
        python scripts/sm90_memcheck.py --mode bwd --shard "$shard" > "$OUT/racecheck_$tag.txt" 2>&1
    echo "exit $? $shard"; tail -2 "$OUT/racecheck_$tag.txt"
done
ls -la "$OUT"/cubin_*
