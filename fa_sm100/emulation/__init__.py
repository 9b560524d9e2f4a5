"""CPU emulation of the SM100 kernels' arithmetic (the forward: issue 5, docs/numerics.md; the
backward: docs/sm100_backward.md).

- ``forward.emulate_sm100_fwd``: the kernel's algorithm on CPU tensors (float32 torch);
- ``backward.emulate_sm100_bwd``: the SM100 backward's algorithm (dK, dV, the dQ accumulator);
- ``ex2``: the kernel's two exp2 paths (polynomial bit model, SFU model) and their accuracy;
- ``cases``: the CI case matrix, the error rule per case, the rescale-threshold report;
- ``gpu_ex2``: hardware check of the exp2 models on a CUDA GPU (triton inline PTX).

Constants come from ``fa_sm100.softmax_math``, the module the kernel imports.
"""

from fa_sm100.emulation.backward import EmulatedBackward, emulate_sm100_bwd
from fa_sm100.emulation.forward import (EmulationStats, emulate_sm100_fwd, emulate_sm100_varlen,
                                        kv_tile_ranges)

__all__ = ["EmulatedBackward", "EmulationStats", "emulate_sm100_bwd", "emulate_sm100_fwd",
           "emulate_sm100_varlen", "kv_tile_ranges"]
