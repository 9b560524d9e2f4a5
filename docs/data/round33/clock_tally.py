"""Round 33: ours' median SM clock against FA4's in the stored backward grids (CPU).

Every docs/data/sm90_bwd_*round*.json (and this round's unseeded grid) whose rows recorded
``ours_mhz`` and ``fa4_mhz`` (rounds 6-33, H100 and H200): per hdim 128 cell at 8k and 16k,
how many grids ran ours at a lower, the same or a higher median clock than FA4, and the mean
difference.

python docs/data/round33/clock_tally.py
"""
import glob
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
files = sorted(glob.glob(str(ROOT / "docs/data/sm90_bwd_*round*.json")))
files.append(str(ROOT / "docs/data/round33/sm90_bwd_h200_round33_unseeded.json"))
diffs, grids = {}, set()
for f in files:
    data = json.loads(Path(f).read_text())
    for r in data["rows"] if isinstance(data, dict) else data:
        if (r.get("head_dim") == 128 and r.get("seqlen") in (8192, 16384)
                and r.get("ours_mhz") and r.get("fa4_mhz")):
            grids.add(f)
            diffs.setdefault((r["causal"], r["seqlen"]), []).append(r["ours_mhz"] - r["fa4_mhz"])
print(f"{len(grids)} grids with clocks")
for (causal, s), d in sorted(diffs.items()):
    print(f"hdim 128 {'causal' if causal else 'non-causal'} {s // 1024}k: {len(d)} grids, ours "
          f"lower in {sum(x < 0 for x in d)}, the same in {sum(x == 0 for x in d)}, higher in "
          f"{sum(x > 0 for x in d)}; mean difference {statistics.fmean(d):+.1f} MHz")
