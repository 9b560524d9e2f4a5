"""Registry entry ``sm100_bwd``: build the SM100 backward main kernel for a cross-compile on
the CPU (``scripts/inspect.py --kernel sm100_bwd --set head_dim=64 ...`` and the compile
contract). The fake arguments have dynamic batch and sequence lengths and static head counts
and head dims, as ``sm100_bwd`` compiles them."""

from __future__ import annotations

from fa_sm100.compile_tools import fake_rowmajor
from fa_sm100.config import parse_overrides
from fa_sm100.registry import KernelBuild, KernelEntry
from fa_sm100.sm100.bwd_config import Sm100BwdConfig, select_sm100_bwd_config

FAKE_QUERY_HEADS = 8


def make_config(overrides) -> Sm100BwdConfig:
    """The default config of the problem the overrides name, with their switches applied."""
    fields = parse_overrides(overrides, Sm100BwdConfig)
    problem = {k: fields.pop(k) for k in ("head_dim", "head_dim_v", "dtype", "causal",
                                          "qhead_per_kvhead", "deterministic", "local",
                                          "softcap") if k in fields}
    d = problem.pop("head_dim", 128)
    return select_sm100_bwd_config(d, problem.pop("head_dim_v", d),
                                   problem.pop("dtype", "bfloat16"),
                                   problem.pop("causal", False),
                                   problem.pop("qhead_per_kvhead", 1),
                                   problem.pop("deterministic", False),
                                   problem.pop("local", False), problem.pop("softcap", False),
                                   **fields)


def fake_arguments(cfg: Sm100BwdConfig, num_heads: int = FAKE_QUERY_HEADS,
                   env_stream: bool = False):
    """(q, k, v, dout, lse2, delta, dq_acc, dk, dv, dq_sem, softmax_scale, softcap,
    window_left, window_right, stream) fakes for ``Sm100Backward(cfg)`` (dq_sem: (batch,
    heads, query blocks) int32 of a deterministic config, else None; the cap and the
    window's bounds are run-time scalars of every config; only a capped / windowed kernel
    reads them)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    from layouts.cute_layouts import cutlass_dtype

    if num_heads % cfg.qhead_per_kvhead:
        raise ValueError(f"num_heads={num_heads} is not divisible by "
                         f"qhead_per_kvhead={cfg.qhead_per_kvhead}")
    dtype = cutlass_dtype(cfg.dtype)
    batch, seqlen_q, seqlen_k, rows = (cute.sym_int() for _ in range(4))
    heads_kv = num_heads // cfg.qhead_per_kvhead

    def t(shape, dt=dtype):
        return fake_rowmajor(dt, shape)

    q = t((batch, seqlen_q, num_heads, cfg.head_dim))
    k = t((batch, seqlen_k, heads_kv, cfg.head_dim))
    v = t((batch, seqlen_k, heads_kv, cfg.head_dim_v))
    dout = t((batch, seqlen_q, num_heads, cfg.head_dim_v))
    lse2 = t((batch, num_heads, rows), cutlass.Float32)
    delta = t((batch, num_heads, rows), cutlass.Float32)
    dq_acc = t((batch, num_heads, rows, cfg.head_dim), cutlass.Float32)
    dk = t((batch, seqlen_k, heads_kv, cfg.head_dim))
    dv = t((batch, seqlen_k, heads_kv, cfg.head_dim_v))
    dq_sem = None  # deterministic: one int32 semaphore per (batch, head, query block)
    if cfg.deterministic:
        dq_sem = fake_rowmajor(cutlass.Int32, (batch, num_heads, cute.sym_int()), align=4)
    return (q, k, v, dout, lse2, delta, dq_acc, dk, dv, dq_sem, cutlass.Float32(1.0),
            cutlass.Float32(0.0), cutlass.Int32(0), cutlass.Int32(0),
            make_fake_stream(use_tvm_ffi_env_stream=env_stream))


def build(cfg: Sm100BwdConfig, arch: str = "sm_100a") -> KernelBuild:
    if arch != "sm_100a":
        raise ValueError(f"sm100_bwd compiles for sm_100a only, not {arch}")
    from fa_sm100.sm100.bwd_kernel import Sm100Backward
    from layouts.tmem import TmemPlan

    roles = cfg.warp_roles()
    return KernelBuild(
        fn=Sm100Backward(cfg), args=fake_arguments(cfg), arch=arch, config=cfg,
        smem_bytes=cfg.smem_bytes(), tmem_cols=TmemPlan.for_backward(cfg).alloc_cols,
        setmaxnreg=roles.setmaxnreg(),
        setmaxnreg_warps={"compute": roles.compute, "dq": roles.dq,
                          "other": (roles.mma, roles.load) + roles.empty},
        cluster=cfg.cluster_shape)


KERNEL = KernelEntry(name="sm100_bwd", archs=("sm_100a",), make_config=make_config, build=build)
