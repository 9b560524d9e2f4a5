"""The 16-warp warp-specialized SM100 (Blackwell) forward kernel, one module per warp role.

kernel.py (setup + dispatch only), load.py, mma.py, softmax.py, correction.py, epilogue.py
(the roles), scheduler.py (static persistent tile order, LPT for causal), masking.py (key
ranges and masks), ex2.py (exp2 on the FMA pipe), pipes.py (the pipelines as the roles hold
them), context.py (what the roles share), interface.py (``sm100_fwd``), inspect_entry.py (the
``sm100_fwd`` registry entry), protocol.py (the kernel's recorded protocol for the model).
bwd_*.py: the backward (``sm100_bwd``), one module per role in the same style
(docs/sm100_backward.md). Importing this package does not import CuTe DSL.
"""
