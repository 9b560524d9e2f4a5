"""fa-sm100: CuTe-DSL FlashAttention kernels for Blackwell (SM100) with Hopper (SM90) fallbacks."""

from fa_sm100.config import FmhaConfig, WarpRoles, select_config

__all__ = ["FmhaConfig", "WarpRoles", "select_config"]
