"""``sm100_fwd``: run the SM100 forward on torch tensors, with a compile cache.

Called by ``fa_sm100.interface.flash_attn_func`` on a (10, x) device after the shared input
validation; it may also be called directly (it validates again, cheaply). Every check that can
fail raises ValueError before any compile or launch.

Compile cache key (``fa_sm100.kernel_cache``): the validated ``FmhaConfig`` (head dims,
dtype, causal, GQA ratio, every switch) and the static parts of the shapes (the number of query
heads). Batch and sequence lengths are run-time values of the compiled kernel, so they never
trigger a recompile. As on SM90, a call whose metadata and options an earlier call planned
(``fa_sm100.call_plans``) skips validation, config choice and device queries.
"""

from __future__ import annotations

from typing import Optional

import torch

from fa_sm100 import kernel_cache
from fa_sm100.bands import kernel_window
from fa_sm100.call_plans import PlanTable, check_out_lse
from fa_sm100.config import FmhaConfig, normalize_dtype, select_config
from fa_sm100.devices import capability, sm_count
from fa_sm100.machines import B200_SMS
from fa_sm100.validation import validate_attention_inputs
from fa_sm100.varlen import VarlenPlan, paged_rows, planned_varlen_call

_plans = PlanTable()


def config_for_problem(prob, device=None, config: Optional[FmhaConfig] = None,
                       return_lse: bool = False) -> FmhaConfig:
    """The validated config for a problem: ``config`` checked against it, or the defaults."""
    dtype = normalize_dtype(prob.dtype)
    if config is None:
        num_sms = B200_SMS  # the count the defaults were chosen for, without a device
        if device is not None and torch.cuda.is_available():
            num_sms = sm_count(device)
        config = select_config(
            head_dim=prob.head_dim, head_dim_v=prob.head_dim_v, dtype=dtype,
            seqlen_q=prob.seqlen_q, seqlen_k=prob.seqlen_k, causal=prob.causal,
            qhead_per_kvhead=prob.qhead_per_kvhead, window_left=prob.window[0],
            window_right=prob.window[1], num_sms=num_sms, softcap=prob.softcap > 0,
        )
    if not isinstance(config, FmhaConfig):
        raise ValueError(f"config must be an FmhaConfig, got {type(config).__name__}")
    expected = {
        "head_dim": prob.head_dim, "head_dim_v": prob.head_dim_v, "dtype": dtype,
        "causal": prob.causal, "qhead_per_kvhead": prob.qhead_per_kvhead,
        "window_left": prob.window[0], "window_right": prob.window[1],
        "softcap": prob.softcap > 0,
    }
    for field, want in expected.items():
        have = getattr(config, field)
        if have != want:
            raise ValueError(f"config.{field}={have!r} does not match the inputs ({want!r})")
    return config.replace(write_lse=return_lse).validate()


def compile_for(cfg: FmhaConfig, num_heads: int, arch: Optional[str] = None,
                seqused_k: bool = False):
    """Compile the kernel for (config, query heads) for TVM-FFI: the result is called with
    torch tensors and runs on the current stream. ``arch`` (e.g. "sm_100a") cross-compiles
    without a GPU; None targets the device. ``seqused_k``: a varlen kernel that takes used key
    lengths."""
    import cutlass.cute as cute

    from fa_sm100.sm100.inspect_entry import fake_arguments
    from fa_sm100.sm100.kernel import Sm100Forward

    options = "--enable-tvm-ffi" + (f" --gpu-arch {arch}" if arch else "")
    return cute.compile(Sm100Forward(cfg), *fake_arguments(cfg, num_heads, env_stream=True,
                                                           seqused_k=seqused_k),
                        options=options)


def _compiled(cfg: FmhaConfig, num_heads: int, seqused_k: bool = False):
    """The launchable kernel; batch, sequence lengths and the window's bounds stay run-time
    values (``FmhaConfig.kernel_config``)."""
    cfg = cfg.kernel_config()
    key = (cfg, num_heads) + (("seqused_k",) if seqused_k else ())
    return kernel_cache.kernel("sm100_fwd", key,
                               lambda: compile_for(cfg, num_heads, seqused_k=seqused_k))


class Sm100FwdPlan:
    """What ``sm100_fwd`` decided for one (metadata, options) pair: the config, the kernel,
    the output shapes."""

    __slots__ = ("kernel", "scale", "return_lse", "out_shape", "lse_shape", "dtype", "device",
                 "config", "window", "softcap")

    def __init__(self, prob, cfg: FmhaConfig, return_lse: bool, device, config=None):
        self.kernel = _compiled(cfg, prob.heads)
        self.scale = prob.softmax_scale
        self.softcap = prob.softcap
        self.window = kernel_window(prob.causal, prob.window, prob.seqlen_q, prob.seqlen_k)
        self.return_lse = return_lse
        self.out_shape = (prob.batch, prob.seqlen_q, prob.heads, prob.head_dim_v)
        self.lse_shape = (prob.batch, prob.heads, prob.seqlen_q)
        self.dtype = prob.dtype
        self.device = device
        self.config = config

    def __call__(self, q, k, v, out=None, lse=None):
        q, k, v = (t.contiguous() for t in (q, k, v))
        check_out_lse(out, lse, self.out_shape, self.lse_shape, self.dtype, self.device)
        if out is None:
            out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        if lse is None and self.return_lse:
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
        if lse is not None and not self.return_lse:
            raise ValueError("an lse buffer needs return_lse=True on SM100 (the kernel writes "
                             "LSE only then)")
        self.kernel(q, k, v, out, lse, self.scale, self.softcap, *self.window, None, None, None,
                    None, 0)
        return (out, lse) if self.return_lse else out


def build_sm100_fwd_plan(q, k, v, softmax_scale=None, causal=False, window_size=(None, None),
                         return_lse=False, config: Optional[FmhaConfig] = None,
                         softcap=0.0, need_lse: bool = False) -> Sm100FwdPlan:
    """Validate, pick and compile the config: the plan of one call. ``need_lse`` (an ``lse``
    buffer will be passed) changes nothing here: the kernel writes LSE only with
    ``return_lse``, and the plan's call raises for a buffer without it."""
    prob = validate_attention_inputs(q, k, v, softmax_scale, causal, window_size,
                                     softcap=softcap)
    cfg = config_for_problem(prob, q.device, config, return_lse)
    major, _ = capability(q.device)
    if major != 10:
        raise ValueError(f"sm100_fwd needs an sm_100 GPU, got sm_{major}x for {q.device}")
    return Sm100FwdPlan(prob, cfg, return_lse, q.device, config)


def sm100_fwd(q, k, v, softmax_scale=None, causal=False, window_size=(None, None),
              return_lse=False, config: Optional[FmhaConfig] = None, *, out=None, lse=None,
              softcap=0.0):
    """Attention forward on BSHD tensors with the SM100 kernel; returns out or (out, lse).
    ``out`` / ``lse`` buffers are written instead of allocating new ones; ``softcap`` > 0
    caps the scores (``flash_attn_func``)."""
    plan = _plans.plan((q, k, v), (softmax_scale, causal, window_size, return_lse, id(config),
                                   softcap),
                       lambda: build_sm100_fwd_plan(q, k, v, softmax_scale, causal, window_size,
                                                    return_lse, config, softcap))
    return plan(q, k, v, out, lse)


class Sm100VarlenPlan(VarlenPlan):
    """What ``sm100_fwd_varlen`` decided for one (metadata, options) pair
    (``fa_sm100.varlen.VarlenPlan``) with the SM100 kernel's launch."""

    __slots__ = ()

    def __init__(self, problem, cfg: FmhaConfig, return_lse: bool, seqused_k: bool, device,
                 config=None):
        super().__init__(problem, cfg, return_lse, device, config,
                         lambda: _compiled(cfg, problem.heads, seqused_k))

    def launch(self, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, page_table=None):
        self.kernel(q, k, v, out, lse, self.scale, self.softcap, *self.window, cu_seqlens_q,
                    cu_seqlens_k, seqused_k, page_table, self.max_seqlen_q)


_varlen_plans = PlanTable()


def build_sm100_varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            seqused_k=None, softmax_scale=None, causal=False,
                            window_size=(None, None), softcap=0.0, return_lse=False,
                            config: Optional[FmhaConfig] = None,
                            page_size: int = 0) -> Sm100VarlenPlan:
    """Validate, pick and compile the varlen config: the plan of one call (``page_size``: a
    paged cache's, ``sm100_fwd_paged``; k / v then come as its pages, packed)."""
    from fa_sm100.config import SM100_HEAD_DIMS
    from fa_sm100.validation import validate_varlen_inputs

    prob = validate_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, seqused_k, softmax_scale, causal, window_size,
                                  softcap, head_dims=SM100_HEAD_DIMS)
    major, _ = capability(q.device)
    if major != 10:
        raise ValueError(f"sm100_fwd_varlen needs an sm_100 GPU, got sm_{major}x for {q.device}")
    if config is None:
        left, right = prob.window
        config = select_config(
            head_dim=prob.head_dim, head_dim_v=prob.head_dim_v, dtype=normalize_dtype(prob.dtype),
            seqlen_q=max(max_seqlen_q, 1), seqlen_k=max(max_seqlen_k, 1), causal=prob.causal,
            qhead_per_kvhead=prob.heads // prob.heads_kv, window_left=left, window_right=right,
            num_sms=sm_count(q.device), softcap=prob.softcap > 0, varlen=True,
            page_size=page_size)
    elif not isinstance(config, FmhaConfig) or not config.varlen:
        raise ValueError("config must be an FmhaConfig with varlen=True for a varlen call")
    cfg = config.replace(write_lse=return_lse, page_size=page_size).validate()
    return Sm100VarlenPlan(prob, cfg, return_lse, seqused_k is not None, q.device, config)


def sm100_fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     seqused_k=None, softmax_scale=None, causal=False, window_size=(None, None),
                     softcap=0.0, return_lse=False, config: Optional[FmhaConfig] = None, *,
                     out=None, lse=None):
    """Attention over a batch of packed sequences with the SM100 kernel (``fa_sm100.varlen``;
    the arguments and results of ``fa_sm100.hopper.interface.sm90_fwd_varlen``)."""
    return planned_varlen_call(
        _varlen_plans,
        lambda: build_sm100_varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                        max_seqlen_k, seqused_k, softmax_scale, causal,
                                        window_size, softcap, return_lse, config),
        q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
        (softmax_scale, causal, window_size, softcap, return_lse, max_seqlen_q, max_seqlen_k,
         id(config)), out, lse)


def sm100_fwd_paged(q, k_pages, v_pages, cu_seqlens_q, max_seqlen_q, page_table, seqused_k,
                    max_seqlen_k, softmax_scale=None, causal=False, window_size=(None, None),
                    softcap=0.0, return_lse=False, config: Optional[FmhaConfig] = None, *,
                    out=None, lse=None):
    """Packed queries against a paged K/V cache with the SM100 kernel (``FmhaConfig.page_size``):
    k_pages / v_pages (pages, page_size, h_kv, d / dv), ``page_table`` (batch, pages per
    sequence) int32 naming sequence i's pages in order, ``seqused_k`` (batch,) its keys. The
    load warp reads each key block from its page; the rows of a page past the sequence's keys
    load as zeros. ``page_size`` must be a multiple of the kernel's 128-key blocks (one TMA
    copy per block): others raise ValueError. Otherwise as ``sm100_fwd_varlen``."""
    page_size, k, v, table = paged_rows(q, k_pages, v_pages, cu_seqlens_q, page_table,
                                        seqused_k, 128, "SM100")
    table = table.flatten()
    plan = _paged_plans.plan(
        (q, k, v, cu_seqlens_q, table, seqused_k),
        (softmax_scale, causal, window_size, softcap, return_lse, max_seqlen_q, max_seqlen_k,
         id(config), page_size),
        lambda: build_sm100_varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_q, max_seqlen_q,
                                        max_seqlen_k, seqused_k, softmax_scale, causal,
                                        window_size, softcap, return_lse, config, page_size))
    return plan(q, k, v, cu_seqlens_q, cu_seqlens_q, seqused_k, out, lse, page_table=table)


_paged_plans = PlanTable()
