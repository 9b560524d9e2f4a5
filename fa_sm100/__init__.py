"""fa-sm100: CuTe-DSL FlashAttention kernels for Blackwell (SM100) with Hopper (SM90) fallbacks."""

from fa_sm100.config import FmhaConfig, WarpRoles, select_config

__all__ = ["FmhaConfig", "WarpRoles", "flash_attn_func", "flash_attn_varlen_func",
           "flash_attn_with_kvcache", "select_config"]


def __getattr__(name):
    # The public entry point imports torch; load it on first use so that config, layouts and
    # the protocol model stay importable (and fast) without it.
    if name in ("flash_attn_func", "flash_attn_varlen_func"):
        from fa_sm100 import interface

        globals()[name] = getattr(interface, name)  # later lookups find it without this hook
        return globals()[name]
    if name == "flash_attn_with_kvcache":
        from fa_sm100 import kvcache

        globals()[name] = kvcache.flash_attn_with_kvcache
        return globals()[name]
    raise AttributeError(f"module 'fa_sm100' has no attribute {name!r}")
