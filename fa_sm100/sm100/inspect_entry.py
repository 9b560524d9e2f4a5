"""Registry entry ``sm100_fwd``: build the SM100 forward for a cross-compile on the CPU.

``scripts/inspect.py sm100_fwd --set use_2cta=false`` and the compile-contract tests reach the
kernel through ``KERNEL``. The fake arguments have dynamic batch and sequence lengths and static
head counts and head dims (the static parts of the compile-cache key, as in ``sm100_fwd``).
"""

from __future__ import annotations

from fa_sm100.config import FmhaConfig, config_from_overrides
from fa_sm100.registry import KernelBuild, KernelEntry

# Head counts of the fake problem: 8 query heads; K/V heads follow the config's GQA ratio.
FAKE_QUERY_HEADS = 8


def fake_arguments(cfg: FmhaConfig, num_heads: int = FAKE_QUERY_HEADS, env_stream: bool = False,
                   seqused_k: bool = False):
    """(q, k, v, o, lse, softmax_scale, softcap, window_left, window_right, cu_seqlens_q,
    cu_seqlens_k, seqused_k, max_seqlen_q, stream) fakes for ``Sm100Forward(cfg)``; the
    varlen tensors are None without ``cfg.varlen`` (``seqused_k``: a varlen kernel that takes
    used key lengths).

    ``env_stream``: the stream is TVM-FFI's environment stream (the compiled function is then
    called with torch tensors and no stream argument, as ``sm100_fwd`` does)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    from layouts.cute_layouts import cutlass_dtype

    if num_heads % cfg.qhead_per_kvhead:
        raise ValueError(
            f"num_heads={num_heads} is not divisible by qhead_per_kvhead={cfg.qhead_per_kvhead}")
    dtype = cutlass_dtype(cfg.dtype)
    batch = cute.sym_int()
    seqlen_q, seqlen_k = cute.sym_int(), cute.sym_int()
    heads_kv = num_heads // cfg.qhead_per_kvhead
    bshd = (3, 2, 1, 0)  # head_dim contiguous, then heads, sequence, batch

    def t(shape, dt=dtype, order=bshd):
        return make_fake_compact_tensor(dt, shape, stride_order=order, assumed_align=16)

    q = t((batch, seqlen_q, num_heads, cfg.head_dim))
    k = t((batch, seqlen_k, heads_kv, cfg.head_dim))
    v = t((batch, seqlen_k, heads_kv, cfg.head_dim_v))
    o = t((batch, seqlen_q, num_heads, cfg.head_dim_v))
    lse = (make_fake_compact_tensor(cutlass.Float32, (batch, num_heads, seqlen_q),
                                    stride_order=(2, 1, 0), assumed_align=16)
           if cfg.write_lse else None)
    cu_q = cu_k = used_k = pages = None
    seqused_k = seqused_k or cfg.page_size > 0  # a paged cache's lengths are its used keys
    if cfg.page_size:  # a paged cache: the page table, flat (batch x pages per sequence,)
        pages = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4)
    if cfg.varlen:  # fa_sm100.varlen: batch + 1 offsets, batch used key lengths
        n = cute.sym_int()
        cu_q, cu_k = (make_fake_compact_tensor(cutlass.Int32, (n,), assumed_align=4)
                      for _ in range(2))
        if seqused_k:
            used_k = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=4)
    return (q, k, v, o, lse, cutlass.Float32(1.0), cutlass.Float32(0.0), cutlass.Int32(0),
            cutlass.Int32(0), cu_q, cu_k, used_k, pages, cutlass.Int32(0),
            make_fake_stream(use_tvm_ffi_env_stream=env_stream))


def build(cfg: FmhaConfig, arch: str = "sm_100a") -> KernelBuild:
    if arch != "sm_100a":
        raise ValueError(f"sm100_fwd compiles for sm_100a only, not {arch}")
    from fa_sm100.sm100.kernel import Sm100Forward
    from layouts.smem import SmemPlan
    from layouts.tmem import TmemPlan

    kernel = Sm100Forward(cfg)
    roles = cfg.warp_roles()
    return KernelBuild(
        fn=kernel,
        args=fake_arguments(cfg),
        arch=arch,
        config=cfg,
        smem_bytes=SmemPlan.for_config(cfg).total,
        tmem_cols=TmemPlan.for_config(cfg).alloc_cols,
        setmaxnreg=roles.setmaxnreg(),
        # setmaxnreg acts per warpgroup: both softmax warpgroups, the correction warpgroup, and
        # warpgroup 3 (MMA, epilogue, load, empty) for "other".
        setmaxnreg_warps={
            "softmax": roles.softmax0 + roles.softmax1,
            "correction": roles.correction,
            "other": (roles.mma, roles.epilogue, roles.load, roles.empty),
        },
        cluster=cfg.cluster_shape,
    )


KERNEL = KernelEntry(
    name="sm100_fwd",
    archs=("sm_100a",),
    make_config=config_from_overrides,
    build=build,
)
