"""fa-sm100: CuTe-DSL FlashAttention kernels for Blackwell (SM100) with Hopper (SM90) fallbacks."""

from fa_sm100.config import FmhaConfig, WarpRoles, select_config

__all__ = ["FmhaConfig", "WarpRoles", "flash_attn_func", "select_config"]


def __getattr__(name):
    # The public entry point imports torch; load it on first use so that config, layouts and
    # the protocol model stay importable (and fast) without it.
    if name == "flash_attn_func":
        from fa_sm100.interface import flash_attn_func

        globals()[name] = flash_attn_func  # later lookups find it without this hook
        return flash_attn_func
    raise AttributeError(f"module 'fa_sm100' has no attribute {name!r}")
