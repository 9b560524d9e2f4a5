"""Hopper (SM90) fallback kernels: the warp-specialized forward (``fwd_*``, ``interface``) and
the backward (``bwd_*``). Nothing is imported here, so importing the package needs no DSL."""
