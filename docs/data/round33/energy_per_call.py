"""Round 33: energy per backward call, ours (and switches) against FA4, below the power cap.

In most stored grids that recorded the clock (rounds 6-33), the hdim 128 8k / 16k cells ran
ours at a lower median SM clock than FA4 (e.g. 1905 against 1935 MHz) at the same board power:
near the 700 W cap the power manager lowers the clock of whichever kernel spends more energy
per unit of work. Here each call is followed by a GPU sleep as long as the call, so the board stays well
below the cap and the clock at its maximum; NVML's energy counter
(nvmlDeviceGetTotalEnergyConsumption, mJ) over CALLS such pairs, less the same number of
sleeps alone (measured in the same round), gives the energy of one call. Providers alternate
over ROUNDS rounds; printed: median joules per call, ms per call (CUDA events around each
call) and the SM clock (NVML, sampled after each sequence). (The NVML reads and the
duty-cycled calls, this script's own when it ran, are ``fa_sm100.benchmarking``'s since round
34: the same code, with sleeps 1% longer, 2.0e6 cycles per ms of call instead of 1.98e6.)

python docs/data/round33/energy_per_call.py ROUNDS CALLS [switches|shuffle]
"""
import importlib.util
import statistics
import sys

import torch

from fa_sm100.benchmarking import NvmlDevice, duty_cycled_rounds

spec = importlib.util.spec_from_file_location("ab_bench", "scripts/ab_bench.py")
ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab)

rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
calls = int(sys.argv[2]) if len(sys.argv) > 2 else 100
nvml = NvmlDevice()

VARIANT_SETS = {
    "switches": [("nopre", {"pre_ctas": 0}), ("noearly", {"early_dq_post": False}),
                 ("nomc", {"qdo_multicast": False}), ("notry", {"try_wait": False})],
    # LSE2 / Delta loaded per use from SMEM (as FA4 does) instead of shuffled between lanes
    "shuffle": [("noshuf", {"stats_shuffle": False})],
}
VARIANTS = VARIANT_SETS[sys.argv[3] if len(sys.argv) > 3 else "switches"]
for causal in (False, True):
    runs, check = ab.bwd_cell(128, 16384, causal, 16, VARIANTS, True, torch)
    for name, run in runs.items():
        run()
    res = duty_cycled_rounds(runs, rounds, calls, torch, nvml, lambda rnd, sleep_j: print(
        f"causal={causal} round {rnd + 1}/{rounds}: sleeps alone {sleep_j:.3f} J per sleep",
        flush=True))
    fa4_j = statistics.median(r[0] for r in res["fa4"])
    for n, r in res.items():
        j = statistics.median(x[0] for x in r)
        print(f"causal={causal} {n:8s}: {j:.3f} J per call ({j / fa4_j:.4f} of FA4's), "
              f"{statistics.median(x[1] for x in r):.4f} ms, "
              f"{statistics.median(x[2] for x in r)} MHz", flush=True)
