"""Autograd for ``flash_attn_func``: a ``torch.autograd.Function`` over two custom ops.

``torch.ops.fa_sm100.attn_fwd(q, k, v, ...) -> (out, lse)`` and
``torch.ops.fa_sm100.attn_bwd(dout, q, k, v, out, lse, ...) -> (dq, dk, dv)`` are registered
with ``torch.library.custom_op`` (plus fake implementations for shape propagation), so
``torch.compile(fullgraph=True)`` sees two opaque graph nodes instead of tracing into CuTe DSL.
``FlashAttnFunction`` saves q, k, v, out and lse and calls the backward op: what a compiled
graph records. Eager calls take ``EagerAttention`` instead, whose one non-tensor argument is a
``PlannedCall``: the forward's plan and the backward's options, decided once per (metadata,
options) pair by ``flash_attn_func`` (``fa_sm100.interface``), with the backward's plan kept
after the first backward. A warm training step so builds one key in the forward and none in the
backward; a custom op's Python dispatch would cost more host time than the rest of the call,
and the op node matters only to a graph.

Devices: CUDA tensors run the kernels (forward by capability through
``fa_sm100.interface``; backward on sm_90 through ``sm90_bwd``; other GPUs raise ValueError).
CPU tensors run a PyTorch model of the same arithmetic (the forward's O/LSE in float32; the
backward's Delta/P/dS formulas with P and dS rounded to the input dtype, as the kernel does),
so the autograd wiring, the compiled graph and the precision scheme are tested without a GPU.

A forward ``config`` object cannot be an op argument; it is registered in a table and passed
as an integer token (-1 = default). Configs are frozen dataclasses, so the table is keyed by
value: equal configs share one token and the table grows only with distinct configs.
"""

import math
from typing import Optional

import torch

from fa_sm100.devices import is_sm100
from fa_sm100.hopper import probes
from fa_sm100.hopper.bwd_config import SM90_BWD_HEAD_DIMS
from fa_sm100.hopper.bwd_interface import build_sm90_bwd_plan, sm90_bwd
from fa_sm100.sm100.bwd_config import SM100_BWD_HEAD_DIMS
from fa_sm100.sm100.bwd_interface import sm100_bwd
from fa_sm100.validation import check_softmax_scale, normalize_window, require_sm90

_CONFIGS: list = []  # token -> config
_CONFIG_TOKENS: dict = {}  # config -> token


def _config_token(config) -> int:
    if config is None:
        return -1
    try:
        token = _CONFIG_TOKENS.get(config)
    except TypeError:  # an unhashable object cannot be a table key
        raise ValueError(f"config must be a frozen (hashable) config object, got "
                         f"{type(config).__name__}") from None
    if token is None:
        token = len(_CONFIGS)
        _CONFIGS.append(config)
        _CONFIG_TOKENS[config] = token
    return token


def _cpu_forward(q, k, v, scale, causal, left, right, softcap):
    from fa_sm100.testing import attention_reference

    out, lse = attention_reference(q, k, v, softmax_scale=scale, causal=causal,
                                   window=(left, right), dtype=torch.float32, softcap=softcap)
    return out.to(q.dtype).contiguous(), lse.float().contiguous()


def _cpu_backward(dout, q, k, v, out, lse, scale, causal, left, right, softcap):
    """The kernel's arithmetic in PyTorch: Delta, P from LSE, dS in float32; P and dS rounded
    to the input dtype for the dV, dK, dQ products; float32 sums; GQA heads summed. With
    ``softcap`` the capped scores c tanh(s / c) give P, and dS takes tanh's derivative
    1 - tanh^2."""
    from fa_sm100.testing import attention_mask

    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    g = hq // hk
    qf, kf, vf, of, dof = (t.float() for t in (q, k, v, out, dout))
    kf, vf = kf.repeat_interleave(g, dim=2), vf.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * scale
    capped = None
    if softcap:
        capped = torch.tanh(s / softcap)
        s = capped * softcap
    mask = attention_mask(sq, sk, causal, (left, right), device=q.device)
    lse_safe = torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)
    p = torch.exp(s - lse_safe.unsqueeze(-1))
    if mask is not None:
        p = p.masked_fill(~mask, 0.0)
    delta = (of * dof).sum(-1).transpose(1, 2)  # (b, h, sq)
    dp = torch.einsum("bqhd,bkhd->bhqk", dof, vf)
    ds = p * (dp - delta.unsqueeze(-1))
    if capped is not None:
        ds = ds * (1.0 - capped * capped)
    # As in the kernel: P and dS enter their GEMMs in the input precision, sums stay float32.
    p, ds = p.to(q.dtype).float(), ds.to(q.dtype).float()
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kf) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, qf) * scale
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dof)
    dk = dk.view(b, sk, hk, g, d).sum(3)
    dv = dv.view(b, sk, hk, g, v.shape[-1]).sum(3)
    return tuple(t.to(dtype).contiguous() for t, dtype in ((dq, q.dtype), (dk, k.dtype), (dv, v.dtype)))


def attn_fwd_impl(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                  config_token):
    """(out, lse) of the forward: the CPU model, or the device's kernel."""
    if q.device.type == "cpu":
        return _cpu_forward(q, k, v, softmax_scale, causal, window_left, window_right, softcap)
    from fa_sm100.interface import _backend_for

    config = _CONFIGS[config_token] if config_token >= 0 else None
    forward, _ = _backend_for(q.device)
    return forward(q, k, v, softmax_scale, causal, (window_left, window_right), True, config,
                   softcap=softcap)


@torch.library.custom_op("fa_sm100::attn_fwd", mutates_args=())
def attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float,
             causal: bool, window_left: Optional[int], window_right: Optional[int],
             softcap: float, config_token: int) -> tuple[torch.Tensor, torch.Tensor]:
    return attn_fwd_impl(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                         config_token)


@attn_fwd.register_fake
def _attn_fwd_fake(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                   config_token):
    b, sq, h, _ = q.shape
    out = q.new_empty((b, sq, h, v.shape[-1]))
    lse = q.new_empty((b, h, sq), dtype=torch.float32)
    return out, lse


def attn_bwd_impl(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right,
                  softcap, deterministic):
    """(dq, dk, dv): the CPU model, the SM100 backward on an sm_100 GPU, or the SM90 backward
    (which checks the device: sm_90 only)."""
    if q.device.type == "cpu":
        return _cpu_backward(dout, q, k, v, out, lse, softmax_scale, causal, window_left,
                             window_right, softcap)
    if is_sm100(q.device):
        return sm100_bwd(dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
                         window_size=(window_left, window_right), deterministic=deterministic,
                         softcap=softcap)
    return sm90_bwd(dout, q, k, v, out, lse, softmax_scale=softmax_scale, causal=causal,
                    window_size=(window_left, window_right), deterministic=deterministic,
                    softcap=softcap)


@torch.library.custom_op("fa_sm100::attn_bwd", mutates_args=())
def attn_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, softmax_scale: float, causal: bool,
             window_left: Optional[int], window_right: Optional[int], softcap: float,
             deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return attn_bwd_impl(dout, q, k, v, out, lse, softmax_scale, causal, window_left,
                         window_right, softcap, deterministic)


@attn_bwd.register_fake
def _attn_bwd_fake(dout, q, k, v, out, lse, softmax_scale, causal, window_left, window_right,
                   softcap, deterministic):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class FlashAttnFunction(torch.autograd.Function):
    """out, lse = attention(q, k, v); backward gives dq, dk, dv (lse is not differentiable)."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                config_token, deterministic):
        # Eager calls go straight to the implementation; the op's dispatch is for graphs
        # (torch.compile traces this function and records the op).
        op = torch.ops.fa_sm100.attn_fwd if torch.compiler.is_compiling() else attn_fwd_impl
        out, lse = op(q, k, v, softmax_scale, causal, window_left, window_right, softcap,
                      config_token)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.softmax_scale = softmax_scale
        ctx.causal = causal
        ctx.window = (window_left, window_right)
        ctx.softcap = softcap
        ctx.deterministic = deterministic
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        op = torch.ops.fa_sm100.attn_bwd if torch.compiler.is_compiling() else attn_bwd_impl
        dq, dk, dv = op(
            dout.contiguous(), q, k, v, out, lse, ctx.softmax_scale, ctx.causal, ctx.window[0],
            ctx.window[1], ctx.softcap, ctx.deterministic)
        return dq, dk, dv, None, None, None, None, None, None, None


class PlannedCall:
    """What a ``flash_attn_func`` call with gradients decided for its (metadata, options):
    ``plan``, the backend's forward plan (returning out and LSE), and the backward's options;
    ``bwd_plan``, the SM90 backward's plan, once a backward has run. The backward's inputs
    have the metadata the plan was made for: q, k, v are the forward's (the key's), out and
    lse the forward plan's, dout is made contiguous; a dout of other strides (a size-1
    dimension's stride is free) takes ``sm90_bwd``'s own plan table."""

    __slots__ = ("plan", "scale", "causal", "window", "softcap", "deterministic", "config",
                 "bwd_plan", "dout_stride", "sm100")

    def __init__(self, plan, scale, causal, window, softcap, deterministic, config):
        self.plan = plan
        self.scale, self.causal, self.window = scale, causal, window
        self.softcap, self.deterministic = softcap, deterministic
        self.config = config  # the caller's config, whose id is in the key (call_plans)
        self.bwd_plan = self.dout_stride = None
        self.sm100 = False  # the backward is sm100_bwd's (decided once, by planned_call)

    def backward(self, dout, q, k, v, out, lse):
        dout = dout.contiguous()
        if self.sm100:
            return sm100_bwd(dout, q, k, v, out, lse, softmax_scale=self.scale,
                             causal=self.causal, window_size=self.window,
                             deterministic=self.deterministic, softcap=self.softcap)
        plan = self.bwd_plan
        if plan is not None and dout.stride() == self.dout_stride and not probes.any_active():
            return plan(dout, q, k, v, out, lse)
        options = dict(softmax_scale=self.scale, causal=self.causal, window_size=self.window,
                       deterministic=self.deterministic, softcap=self.softcap)
        if plan is not None or probes.any_active():
            return sm90_bwd(dout, q, k, v, out, lse, **options)
        plan = build_sm90_bwd_plan(dout, q, k, v, out, lse, **options)
        self.bwd_plan, self.dout_stride = plan, dout.stride()
        return plan(dout, q, k, v, out, lse)


def planned_call(q, k, v, softmax_scale, causal, window_size, softcap, config, deterministic,
                 build_plan) -> PlannedCall:
    """The ``PlannedCall`` of validated inputs: raises ValueError first when the backward could
    not run (``check_backward_supported``); ``build_plan`` is the backend's plan builder."""
    check_backward_supported(q, k, v)
    plan = build_plan(q, k, v, softmax_scale, causal, window_size, True, config,
                      softcap=softcap)
    call = PlannedCall(plan, check_softmax_scale(softmax_scale, q.shape[-1]), bool(causal),
                       normalize_window(window_size), float(softcap), bool(deterministic),
                       config)
    call.sm100 = is_sm100(q.device)
    return call


class EagerAttention(torch.autograd.Function):
    """``FlashAttnFunction`` for eager calls: ``call`` (a ``PlannedCall``) holds the plans."""

    @staticmethod
    def forward(ctx, q, k, v, call):
        out, lse = call.plan(q, k, v)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = call
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        return (*ctx.call.backward(dout, *ctx.saved_tensors), None)


def check_backward_supported(q, k, v):
    """Raise ValueError before the forward runs when its backward could not: head dims
    without a backward kernel, or (CUDA tensors) a GPU other than sm_90 and sm_100."""
    d, dv = q.shape[-1], v.shape[-1]
    if is_sm100(q.device):
        if (d, dv) not in SM100_BWD_HEAD_DIMS:
            raise ValueError(f"head dims (qk={d}, v={dv}) have no SM100 backward: gradients "
                             f"need (head_dim, head_dim_v) in {SM100_BWD_HEAD_DIMS}")
        return
    if (d, dv) not in SM90_BWD_HEAD_DIMS:
        raise ValueError(f"head dims (qk={d}, v={dv}) have no backward kernel: gradients need "
                         f"(head_dim, head_dim_v) in {SM90_BWD_HEAD_DIMS}")
    if q.device.type == "cuda":
        require_sm90(q.device, "the backward (gradients: sm_90 or sm_100)")


def flash_attn_autograd(q, k, v, softmax_scale=None, causal=False, return_lse=False,
                        config=None, window_size=(None, None), deterministic=False, softcap=0.0):
    """``flash_attn_func`` with gradients (inputs already validated by the caller)."""
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    left, right = normalize_window(window_size)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if needs_grad and q.device.type == "cuda":
        check_backward_supported(q, k, v)
    out, lse = FlashAttnFunction.apply(q, k, v, float(softmax_scale), bool(causal), left, right,
                                       float(softcap), _config_token(config),
                                       bool(deterministic))
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- varlen

def _cpu_varlen(step, cu_seqlens_q, cu_seqlens_k, seqused_k):
    """Run ``step(i, rows, keys)`` for each sequence i of a packed batch on the CPU model
    (rows / keys: its slices of the query and key axes; keys: the used ones)."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    used = None if seqused_k is None else seqused_k.tolist()
    for i in range(len(cq) - 1):
        keys = ck[i + 1] - ck[i] if used is None else used[i]
        step(i, slice(cq[i], cq[i + 1]), slice(ck[i], ck[i] + keys))


def varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                    softmax_scale, causal, window_left, window_right, softcap, config_token):
    """(out (total_q, h, dv), lse (h, total_q)) of a packed batch: the CPU model per sequence,
    or the device's varlen kernel."""
    if q.device.type == "cpu":
        out = q.new_zeros((q.shape[0], q.shape[1], v.shape[-1]))
        lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=torch.float32)

        def step(i, rows, keys):
            if rows.stop > rows.start and keys.stop > keys.start:
                o, l = _cpu_forward(q[None, rows], k[None, keys], v[None, keys], softmax_scale,
                                    causal, window_left, window_right, softcap)
                out[rows], lse[:, rows] = o[0], l[0]

        _cpu_varlen(step, cu_seqlens_q, cu_seqlens_k, seqused_k)
        return out, lse
    from fa_sm100.interface import _varlen_forward_for

    config = _CONFIGS[config_token] if config_token >= 0 else None
    return _varlen_forward_for(q)(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, seqused_k, softmax_scale, causal,
                                  (window_left, window_right), softcap, True, config)


@torch.library.custom_op("fa_sm100::varlen_fwd", mutates_args=())
def varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
               cu_seqlens_k: torch.Tensor, seqused_k: Optional[torch.Tensor], max_seqlen_q: int,
               max_seqlen_k: int, softmax_scale: float, causal: bool,
               window_left: Optional[int], window_right: Optional[int], softcap: float,
               config_token: int) -> tuple[torch.Tensor, torch.Tensor]:
    return varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                           max_seqlen_k, softmax_scale, causal, window_left, window_right,
                           softcap, config_token)


@varlen_fwd.register_fake
def _varlen_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                     max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
                     config_token):
    return (q.new_empty((q.shape[0], q.shape[1], v.shape[-1])),
            q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32))


def varlen_bwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                    max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right,
                    softcap):
    """(dq, dk, dv) of a packed batch: the CPU model per sequence, or ``sm90_bwd_varlen``
    (which checks the device: sm_90 only)."""
    if q.device.type == "cpu":
        dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))

        def step(i, rows, keys):
            if rows.stop > rows.start and keys.stop > keys.start:
                g = _cpu_backward(dout[None, rows], q[None, rows], k[None, keys],
                                  v[None, keys], out[None, rows], lse[None, :, rows],
                                  softmax_scale, causal, window_left, window_right, softcap)
                dq[rows], dk[keys], dv[keys] = g[0][0], g[1][0], g[2][0]

        _cpu_varlen(step, cu_seqlens_q, cu_seqlens_k, seqused_k)
        return dq, dk, dv
    from fa_sm100.hopper.bwd_interface import sm90_bwd_varlen

    return sm90_bwd_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           max_seqlen_k, seqused_k, softmax_scale, causal,
                           (window_left, window_right), softcap)


@torch.library.custom_op("fa_sm100::varlen_bwd", mutates_args=())
def varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
               cu_seqlens_k: torch.Tensor, seqused_k: Optional[torch.Tensor], max_seqlen_q: int,
               max_seqlen_k: int, softmax_scale: float, causal: bool,
               window_left: Optional[int], window_right: Optional[int],
               softcap: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return varlen_bwd_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                           max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
                           window_right, softcap)


@varlen_bwd.register_fake
def _varlen_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                     max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
                     window_right, softcap):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class VarlenAttnFunction(torch.autograd.Function):
    """``flash_attn_varlen_func`` with gradients: out, lse of the packed batch; the backward
    gives dq, dk, dv (lse is not differentiable). Eager calls run the implementations, graphs
    record the two ops (as ``FlashAttnFunction``)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                softmax_scale, causal, window_left, window_right, softcap, config_token):
        op = torch.ops.fa_sm100.varlen_fwd if torch.compiler.is_compiling() else varlen_fwd_impl
        out, lse = op(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                      max_seqlen_k, softmax_scale, causal, window_left, window_right, softcap,
                      config_token)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k)
        ctx.options = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left,
                       window_right, softcap)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        op = torch.ops.fa_sm100.varlen_bwd if torch.compiler.is_compiling() else varlen_bwd_impl
        q, k, v, out, lse, cu_q, cu_k, seqused_k = ctx.saved_tensors
        dq, dk, dv = op(dout.contiguous(), q, k, v, out, lse, cu_q, cu_k, seqused_k,
                        *ctx.options)
        return (dq, dk, dv) + (None,) * 11


def flash_attn_varlen_autograd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               seqused_k=None, softmax_scale=None, causal=False,
                               window_size=(None, None), softcap=0.0, config=None):
    """``flash_attn_varlen_func`` with gradients: (out, lse). The inputs are validated here
    (the forward's varlen checks with the backward's head dims), before anything runs."""
    from fa_sm100.validation import validate_varlen_inputs

    on_cpu = all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in (q, k, v))
    problem = validate_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, seqused_k, softmax_scale, causal, window_size,
                                     softcap, require_cuda=not on_cpu)
    check_backward_supported(q, k, v)
    left, right = problem.window
    return VarlenAttnFunction.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                    max_seqlen_q, max_seqlen_k, problem.softmax_scale,
                                    problem.causal, left, right, float(problem.softcap),
                                    _config_token(config))
