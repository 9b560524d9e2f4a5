"""``sm90_fwd``: validate, pick the config, compile once per config, launch on the torch stream.

The first call with some metadata builds an ``Sm90FwdPlan`` (validation, config, kernel, SM
count); later calls with the same metadata find it by a cheap key and only allocate and launch
(``fa_sm100.call_plans``). ``prepare_sm90_fwd`` also allocates the outputs once and returns the
launch as a callable (the launch-only timing of ``scripts/benchmark.py``).
"""

from __future__ import annotations

from typing import Optional

import torch

from fa_sm100 import kernel_cache
from fa_sm100.bands import kernel_window
from fa_sm100.call_plans import PlanTable, aligned, current_stream_id
from fa_sm100.config import normalize_dtype
from fa_sm100.devices import sm_count
from fa_sm100.machines import HOPPER_SMS
from fa_sm100.hopper import probes
from fa_sm100.hopper.config import (SM90_ARCH, SM90_HEAD_DIMS, SM90_PAGE_BLOCKS, Sm90FwdConfig,
                                    select_sm90_fwd_config)
from fa_sm100.validation import (require_sm90, tma_ready, tma_strides_ok,
                                 validate_attention_inputs)
from fa_sm100.varlen import VarlenPlan, paged_rows, planned_varlen_call

_tile_counters: dict = {}


def tile_counter(device: torch.device) -> torch.Tensor:
    """The dynamic schedule's work-tile counter for launches on ``device``'s current stream.

    One int32 per (device, stream), zero when made; each launch leaves it at zero again (Note
    [Dynamic tile schedule] in ``fwd_kernel.py``), so launches that follow each other in one
    stream share it, and launches on different streams, which may overlap, do not.
    """
    key = (device, current_stream_id(device))
    counter = _tile_counters.get(key)
    if counter is None:
        counter = _tile_counters[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


def sm90_config_for(problem, config: Optional[Sm90FwdConfig], need_lse: bool = False) -> Sm90FwdConfig:
    """The config for a validated problem: the default one, or ``config`` checked against it.

    ``need_lse``: the caller reads LSE (``return_lse``, an ``lse`` buffer, or the backward of
    autograd, which always asks for it); a config with ``write_lse=False`` would leave that
    buffer unwritten, so it is a ValueError. The default config writes LSE only then, as the
    SM100 path (``config_for_problem``) and FA4 do: a call without it skips the log and the
    stores.
    """
    dtype = normalize_dtype(problem.dtype)
    local = problem.window != (None, None)
    softcap = problem.softcap > 0
    if config is None:
        return select_sm90_fwd_config(problem.head_dim, problem.head_dim_v, dtype, problem.causal,
                                      write_lse=need_lse, seqlen_k=problem.seqlen_k,
                                      seqlen_q=problem.seqlen_q,
                                      batch_heads=problem.batch * problem.heads, local=local,
                                      softcap=softcap)
    if not isinstance(config, Sm90FwdConfig):
        raise ValueError(f"config must be an Sm90FwdConfig on SM90, got {type(config).__name__}")
    config = config.validate()
    want = {"head_dim": problem.head_dim, "head_dim_v": problem.head_dim_v, "dtype": dtype,
            "causal": problem.causal, "local": local, "softcap": softcap}
    for field, value in want.items():
        if getattr(config, field) != value:
            raise ValueError(f"config.{field}={getattr(config, field)!r} does not match the inputs "
                             f"({field}={value!r})")
    if need_lse and not config.write_lse:
        raise ValueError("config.write_lse=False, but LSE is needed (return_lse=True, an lse "
                         "buffer, or gradients): use a config with write_lse=True")
    batch_heads = problem.batch * problem.heads
    if config.kv_multicast and not config.multicast_fits(problem.seqlen_q, batch_heads):
        odd = (" (an odd count pairs across heads only with kv_cluster=2, multicast_odd_m=True "
               "and an even number of (batch, head) pairs)")
        raise ValueError(f"config.kv_multicast=True groups the CTAs of neighbouring m blocks of "
                         f"a head in clusters of {config.kv_cluster}, but "
                         f"seqlen_q={problem.seqlen_q} gives "
                         f"{config.num_m_blocks(problem.seqlen_q)} blocks of {config.m_block} "
                         f"rows and there are {batch_heads} (batch, head) pairs{odd}: use "
                         f"kv_multicast=False")
    return config


def fake_arguments(cfg: Sm90FwdConfig, seqused_k: bool = False):
    """Fake (b, s, h, d) tensors with dynamic sizes and 16-byte aligned dynamic strides, the
    softmax scale, the CTA count, the window bounds, varlen's tensors (``seqused_k``: with a
    used length per sequence) and a stream: the compile-time signature of the kernel."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from fa_sm100.config import cutlass_dtype

    dt = cutlass_dtype(cfg.dtype)
    b, sq, sk, h, hk = (cute.sym_int(symbol=s) for s in ("b", "sq", "sk", "h", "hk"))

    def bshd(s, heads, d):
        strides = tuple(cute.sym_int64(divisibility=8) for _ in range(3))
        return make_fake_tensor(dt, (b, s, heads, d), (*strides, 1), assumed_align=16)

    q, k = bshd(sq, h, cfg.head_dim), bshd(sk, hk, cfg.head_dim)
    v, o = bshd(sk, hk, cfg.head_dim_v), bshd(sq, h, cfg.head_dim_v)
    lse = None
    if cfg.write_lse:
        lse = make_fake_tensor(cutlass.Float32, (b, h, sq),
                               (cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)
    counter = None
    if cfg.dynamic_schedule:
        counter = make_fake_tensor(cutlass.Int32, (1,), (1,), assumed_align=4)
    # Note [Varlen]: cu_seqlens_q / _k (batch + 1,), seqused_k (batch,), the longest query
    cu_q = cu_k = used_k = table = None
    if cfg.varlen:
        n = cute.sym_int(symbol="n")
        cu_q, cu_k = (make_fake_tensor(cutlass.Int32, (n,), (1,), assumed_align=4)
                      for _ in range(2))
        if seqused_k or cfg.page_size:
            used_k = make_fake_tensor(cutlass.Int32, (cute.sym_int(),), (1,), assumed_align=4)
        if cfg.page_size:  # Note [Paged K/V]: (sequences, pages per sequence)
            table = make_fake_tensor(cutlass.Int32, (cute.sym_int(), cute.sym_int()),
                                     (cute.sym_int64(), 1), assumed_align=4)
    # softmax scale, softcap, CTA count of a persistent grid (the SM count), window bounds,
    # varlen's tensors and longest query sequence, stream
    return (q, k, v, o, lse, counter, cutlass.Float32(1.0), cutlass.Float32(0.0),
            cutlass.Int32(HOPPER_SMS), cutlass.Int32(0), cutlass.Int32(0), cu_q, cu_k, used_k,
            table, cutlass.Int32(0), make_fake_stream(use_tvm_ffi_env_stream=True))


def compile_sm90_fwd(cfg: Sm90FwdConfig, arch: str = SM90_ARCH, seqused_k: bool = False):
    """The launchable kernel of ``cfg`` (``fa_sm100.kernel_cache``: compiled once per machine,
    per active forward probe too: Note [cost probes]), called with torch tensors through TVM
    FFI on the current stream. ``seqused_k``: a varlen kernel that takes used key lengths."""
    key = (cfg, arch, probes.compile_tag(probes.FWD_KERNEL_PROBES))
    if seqused_k:
        key = (*key, "seqused_k")

    def build():
        import cutlass.cute as cute

        from fa_sm100.hopper.common import dsl_runtime_arch
        from fa_sm100.hopper.fwd_kernel import Sm90FwdKernel

        with dsl_runtime_arch(arch):
            return cute.compile(Sm90FwdKernel(cfg), *fake_arguments(cfg, seqused_k),
                                options=f"--gpu-arch {arch} --enable-tvm-ffi")

    return kernel_cache.kernel("sm90_fwd", key, build)


class Sm90FwdPlan:
    """What ``sm90_fwd`` decided for one (metadata, options) pair (``fa_sm100.call_plans``):
    the config, the kernel, the SM count and the output shapes. Calling it allocates the
    outputs (or checks the given ones) and launches on q, k, v of that metadata."""

    __slots__ = ("cfg", "kernel", "num_sms", "scale", "return_lse", "out_shape", "lse_shape",
                 "dtype", "device", "copy_inputs", "config", "window", "softcap")

    def __init__(self, problem, cfg: Sm90FwdConfig, return_lse: bool, copy_inputs: bool,
                 device: torch.device, config=None):
        self.cfg = cfg
        self.config = config  # the caller's config, whose id is in the key (call_plans)
        self.kernel = compile_sm90_fwd(cfg)
        self.num_sms = sm_count(device)
        self.scale = problem.softmax_scale
        self.softcap = problem.softcap
        # run-time arguments: a new window reuses the kernel (fa_sm100.bands)
        self.window = (kernel_window(problem.causal, problem.window, problem.seqlen_q,
                                     problem.seqlen_k) if cfg.local else (0, 0))
        self.return_lse = return_lse
        b, sq, h = problem.batch, problem.seqlen_q, problem.heads
        self.out_shape = (b, sq, h, problem.head_dim_v)
        self.lse_shape = (b, h, sq)
        self.dtype = problem.dtype
        self.device = device
        self.copy_inputs = copy_inputs  # strides TMA cannot read: copy q, k, v every call

    def __call__(self, q, k, v, out=None, lse=None):
        if self.copy_inputs or not aligned(q, k, v):
            q, k, v = (tma_ready(t) for t in (q, k, v))
        if out is None:
            out = o_buf = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        else:
            self.check_buffer("out", out, self.out_shape, self.dtype)
            o_buf = tma_ready(out)
        if lse is not None:
            self.check_buffer("lse", lse, self.lse_shape, torch.float32)
        elif self.cfg.write_lse:
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
        counter = tile_counter(self.device) if self.cfg.dynamic_schedule else None
        self.kernel(q, k, v, o_buf, lse if self.cfg.write_lse else None, counter, self.scale,
                    self.softcap, self.num_sms, *self.window, None, None, None, None, 0)
        if o_buf is not out:
            out.copy_(o_buf)
        return (out, lse) if self.return_lse else out

    def check_buffer(self, name, t, shape, dtype):
        if (not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != dtype
                or t.stride(-1) != 1 or t.device != self.device):
            raise ValueError(f"{name} must be a {dtype} tensor of shape {shape} on "
                             f"{self.device} with unit last stride")


_plans = PlanTable()


def build_sm90_fwd_plan(q, k, v, softmax_scale=None, causal=False, window_size=(None, None),
                        return_lse=False, config: Optional[Sm90FwdConfig] = None,
                        need_lse: bool = False, softcap=0.0) -> Sm90FwdPlan:
    """Validate, pick and compile the config, query the SM count: the plan of one call.
    ``need_lse``: an ``lse`` buffer will be passed (the config must write LSE)."""
    problem = validate_attention_inputs(q, k, v, softmax_scale, causal, window_size,
                                        head_dims=SM90_HEAD_DIMS, softcap=softcap)
    cfg = sm90_config_for(problem, config, need_lse=return_lse or need_lse)
    require_sm90(q.device, "sm90_fwd")
    copy_inputs = not all(tma_strides_ok(t) for t in (q, k, v))
    return Sm90FwdPlan(problem, cfg, return_lse, copy_inputs, q.device, config)


def prepare_sm90_fwd(q, k, v, softmax_scale=None, causal=False, window_size=(None, None),
                     return_lse=False, config: Optional[Sm90FwdConfig] = None, *, out=None,
                     lse=None, softcap=0.0):
    """Everything ``sm90_fwd`` does before the launch (the plan, and ``out`` / ``lse``
    allocated once). Returns a no-argument callable that launches the kernel on these tensors
    and returns ``out`` or ``(out, lse)``: the launch-only timing of ``scripts/benchmark.py``.

    Each call of the callable recomputes attention of the current contents of q, k, v (their
    shapes, strides and storage must stay as they were).
    """
    plan = build_sm90_fwd_plan(q, k, v, softmax_scale, causal, window_size, return_lse, config,
                               need_lse=lse is not None, softcap=softcap)
    if out is None:
        out = torch.empty(plan.out_shape, dtype=plan.dtype, device=plan.device)
    if lse is None and (return_lse or plan.cfg.write_lse):
        lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=plan.device)
    plan.check_buffer("out", out, plan.out_shape, plan.dtype)
    if lse is not None:
        plan.check_buffer("lse", lse, plan.lse_shape, torch.float32)
    return lambda: plan(q, k, v, out, lse)


def sm90_fwd(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), return_lse=False,
             config: Optional[Sm90FwdConfig] = None, *, out=None, lse=None, softcap=0.0):
    """Attention forward on an SM90 GPU. BSHD tensors; returns ``out`` or ``(out, lse)``.

    ``out`` / ``lse`` may be given (e.g. poisoned buffers in tests): they are written in place.
    LSE is (batch, heads, seqlen_q) float32 in natural-log units, -inf for rows with no key.
    The second call with the same metadata and options reuses the first one's plan
    (``fa_sm100.call_plans``). ``softcap`` > 0 caps the scores (``flash_attn_func``).
    """
    def build():
        return build_sm90_fwd_plan(q, k, v, softmax_scale, causal, window_size, return_lse,
                                   config, need_lse=lse is not None, softcap=softcap)

    if probes.any_active():
        return build()(q, k, v, out, lse)
    plan = _plans.plan((q, k, v), (softmax_scale, causal, window_size, return_lse, id(config),
                                   lse is not None, softcap), build)
    return plan(q, k, v, out, lse)


class Sm90VarlenPlan(VarlenPlan):
    """What ``sm90_fwd_varlen`` decided for one (metadata, options) pair
    (``fa_sm100.varlen.VarlenPlan``) with the SM90 kernel's launch."""

    __slots__ = ("num_sms",)

    def __init__(self, problem, cfg: Sm90FwdConfig, return_lse: bool, seqused_k: bool,
                 device: torch.device, config=None):
        super().__init__(problem, cfg, return_lse, device, config,
                         lambda: compile_sm90_fwd(cfg, seqused_k=seqused_k))
        self.num_sms = sm_count(device)

    def launch(self, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table=None):
        counter = tile_counter(self.device) if self.cfg.dynamic_schedule else None
        self.kernel(q, k, v, out, lse, counter, self.scale, self.softcap, self.num_sms,
                    *self.window, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table,
                    self.max_seqlen_q)


_varlen_plans = PlanTable()


def build_sm90_varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           seqused_k=None, softmax_scale=None, causal=False,
                           window_size=(None, None), softcap=0.0, return_lse=False,
                           config: Optional[Sm90FwdConfig] = None,
                           page_size: int = 0) -> Sm90VarlenPlan:
    """Validate, pick and compile the varlen config: the plan of one call (``page_size``: of a
    paged cache, Note [Paged K/V])."""
    from fa_sm100.validation import validate_varlen_inputs

    problem = validate_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, seqused_k, softmax_scale, causal,
                                     window_size, softcap, head_dims=SM90_HEAD_DIMS)
    require_sm90(q.device, "sm90_fwd_varlen")
    want = dict(head_dim=problem.head_dim, head_dim_v=problem.head_dim_v,
                dtype=normalize_dtype(problem.dtype), causal=problem.causal,
                softcap=problem.softcap > 0, varlen=True, local=True, page_size=page_size)
    if config is None:
        paged = {}
        if page_size:  # the largest key block that one page holds whole
            paged = dict(n_block=next(n for n in SM90_PAGE_BLOCKS if page_size % n == 0))
        cfg = select_sm90_fwd_config(write_lse=return_lse, seqlen_k=max(max_seqlen_k, 1),
                                     **want, **paged)
    else:
        if not isinstance(config, Sm90FwdConfig):
            raise ValueError(f"config must be an Sm90FwdConfig, got {type(config).__name__}")
        cfg = config.validate()
        for field, value in want.items():
            if getattr(cfg, field) != value:
                raise ValueError(f"config.{field}={getattr(cfg, field)!r} does not match a "
                                 f"varlen call with these inputs ({field}={value!r})")
        if return_lse and not cfg.write_lse:
            raise ValueError("config.write_lse=False, but return_lse=True")
    return Sm90VarlenPlan(problem, cfg, return_lse, seqused_k is not None, q.device, config)


def sm90_fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    seqused_k=None, softmax_scale=None, causal=False, window_size=(None, None),
                    softcap=0.0, return_lse=False, config: Optional[Sm90FwdConfig] = None, *,
                    out=None, lse=None):
    """Attention over a batch of packed sequences on an SM90 GPU (Note [Varlen] in
    fwd_kernel.py): q (total_q, h, d), k / v (total_k, h_kv, d / dv), sequence i at rows
    cu_seqlens[i] .. cu_seqlens[i + 1] (keys: the first ``seqused_k[i]`` of them when given).
    Returns out (total_q, h, dv) or (out, lse) with lse (h, total_q) float32. ``max_seqlen_q``
    must be at least the longest query sequence (its m blocks are the grid). ``out`` / ``lse``
    buffers are written instead of allocating (tests poison them)."""
    def build():
        return build_sm90_varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                      max_seqlen_k, seqused_k, softmax_scale, causal,
                                      window_size, softcap, return_lse, config)

    if probes.any_active():
        return build()(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, out, lse)
    return planned_varlen_call(
        _varlen_plans, build, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
        (softmax_scale, causal, window_size, softcap, return_lse, max_seqlen_q, max_seqlen_k,
         id(config)), out, lse)


def sm90_fwd_paged(q, k_pages, v_pages, cu_seqlens_q, max_seqlen_q, page_table, seqused_k,
                   max_seqlen_k, softmax_scale=None, causal=False, window_size=(None, None),
                   softcap=0.0, return_lse=False, config: Optional[Sm90FwdConfig] = None, *,
                   out=None, lse=None):
    """Packed queries against a paged K/V cache on an SM90 GPU (Note [Paged K/V] in
    fwd_kernel.py): k_pages / v_pages (pages, page_size, h_kv, d / dv), ``page_table``
    (sequences, pages per sequence) int32 naming sequence i's pages in order, ``seqused_k``
    (sequences,) its keys. The producer reads each key block from its page; the rows of a page
    past the sequence's keys load as zeros. ``page_size`` must be a multiple of 64 (one TMA
    copy per key block): others raise ValueError. Otherwise as ``sm90_fwd_varlen``."""
    page_size, k, v, page_table = paged_rows(q, k_pages, v_pages, cu_seqlens_q, page_table,
                                             seqused_k, min(SM90_PAGE_BLOCKS), "SM90")

    def build():
        return build_sm90_varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_q, max_seqlen_q,
                                      max_seqlen_k, seqused_k, softmax_scale, causal,
                                      window_size, softcap, return_lse, config, page_size)

    # cu_seqlens_q stands in for the unread cu_seqlens_k (Note [Paged K/V])
    plan = _paged_plans.plan((q, k, v, cu_seqlens_q, page_table, seqused_k),
                             (softmax_scale, causal, window_size, softcap, return_lse,
                              max_seqlen_q, max_seqlen_k, id(config), page_size), build)
    return plan(q, k, v, cu_seqlens_q, cu_seqlens_q, seqused_k, out, lse, page_table=page_table)


_paged_plans = PlanTable()
