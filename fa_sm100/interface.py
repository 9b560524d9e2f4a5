"""The public forward: ``flash_attn_func`` on BSHD tensors, dispatched by GPU capability.

(10, x) -> the SM100 kernel (``fa_sm100.sm100.interface.sm100_fwd``)
(9, 0)  -> the Hopper fallback (``fa_sm100.hopper.interface.sm90_fwd``)
others  -> ValueError naming the device.

Inputs are validated (``fa_sm100.validation``) before the device is queried, before any
compile and before any launch. What a call decides from its inputs' metadata and options (the
checks, the backend's config and kernel, for gradients the backward's options) is decided once
per (metadata, options) pair and kept in ``_calls`` (``fa_sm100.call_plans``): a warm call
builds one key, finds its plan, allocates and launches.
"""

from __future__ import annotations

import torch

from fa_sm100.call_plans import PlanTable
from fa_sm100.devices import capability, is_sm100
from fa_sm100.hopper import probes
from fa_sm100.validation import (check_varlen_values, checking_values,
                                 validate_attention_inputs, validate_varlen_inputs)

_calls = PlanTable()  # (metadata, options) that passed validation -> the backend's plan


def _backend_for(device: torch.device):
    """(forward function, plan builder) of the device's kernel."""
    major, minor = capability(device)
    if major == 10:
        from fa_sm100.sm100.interface import build_sm100_fwd_plan, sm100_fwd

        return sm100_fwd, build_sm100_fwd_plan
    if (major, minor) == (9, 0):
        from fa_sm100.hopper.interface import build_sm90_fwd_plan, sm90_fwd

        return sm90_fwd, build_sm90_fwd_plan
    raise ValueError(
        f"no fa_sm100 kernel for {torch.cuda.get_device_name(device)} (sm_{major}{minor}): "
        "the forward runs on sm_100 (Blackwell) and sm_90 (Hopper) GPUs"
    )


def _build_call(q, k, v, softmax_scale, causal, window_size, softcap, return_lse, config,
                need_lse, grad, deterministic):
    """The plan of a public call: the backend's forward plan, or for a call with gradients a
    ``PlannedCall`` (``fa_sm100.autograd``) around the forward plan that writes LSE."""
    validate_attention_inputs(q, k, v, softmax_scale, causal, window_size, softcap=softcap)
    _, build_plan = _backend_for(q.device)
    if grad:
        from fa_sm100.autograd import planned_call

        return planned_call(q, k, v, softmax_scale, causal, window_size, softcap, config,
                            deterministic, build_plan)
    return build_plan(q, k, v, softmax_scale, causal, window_size, return_lse, config,
                      need_lse=need_lse, softcap=softcap)


def _check_flash_attn_options(dropout_p, alibi_slopes, deterministic, return_lse,
                              return_attn_probs) -> None:
    """flash-attn 2's options we take but do not implement, and the flags: ValueError naming
    the first one out of range."""
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or dropout_p != 0:
        raise ValueError(f"dropout_p={dropout_p!r}: only 0.0 is supported (there is no dropout "
                         "kernel)")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes: ALiBi is not supported (pass None)")
    for name, flag in (("deterministic", deterministic), ("return_lse", return_lse),
                       ("return_attn_probs", return_attn_probs)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be a bool, got {flag!r}")


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, *, return_lse=False, config=None, out=None,
                    lse=None):
    """Attention forward ``softmax(q k^T * scale) v`` on (batch, seqlen, heads, head_dim) tensors.

    The positional order and keyword names are flash-attn 2's ``flash_attn_func``, so a model
    swaps the import and nothing else (docs/api.md has the table beside flash-attn 2 and FA4):

    - dropout_p: 0.0 only (no dropout kernel; a model in eval mode passes 0.0).
    - softmax_scale: default ``1 / sqrt(head_dim)``.
    - causal: bottom-right aligned when seqlen_q != seqlen_k (query i sees keys
      j <= i + seqlen_k - seqlen_q); rows that see no key give 0 (and LSE -inf).
    - window_size: (left, right) keys around the aligned diagonal; -1 or None is unbounded on
      that side (flash-attn 2's and FA4's conventions).
    - softcap: 0.0 is off; c > 0 caps the scaled scores s to ``c * tanh(s / c)`` before the
      softmax (Gemma 2's logit softcapping, as flash-attn defines it; docs/softcap.md).
    - alibi_slopes: None only.
    - deterministic: the forward is always deterministic; the flag is for the backward.
    - return_attn_probs: as flash-attn 2, return ``(out, lse, None)``: the log-sum-exp, and no
      probabilities (flash-attn 2 returns them only for testing with dropout).
    - GQA/MQA: k and v may have fewer heads than q (a divisor of q's heads).

    Keyword-only, ours: ``return_lse`` returns ``(out, lse)`` as FA4 does, lse (batch, heads,
    seqlen_q) float32 natural log; ``config`` a kernel config for the device's backend (default:
    chosen per problem); ``out`` / ``lse`` buffers to write instead of allocating (without
    gradients).
    """
    _check_flash_attn_options(dropout_p, alibi_slopes, deterministic, return_lse,
                              return_attn_probs)
    if return_attn_probs:
        result = flash_attn_func(q, k, v, 0.0, softmax_scale, causal, window_size, softcap,
                                 deterministic=deterministic, return_lse=True, config=config,
                                 out=out, lse=lse)
        return (*result, None)
    if torch.compiler.is_compiling():
        # torch.compile graphs go through the custom ops (fa_sm100.autograd); the checks run
        # on the traced (fake) tensors, once per trace.
        validate_attention_inputs(q, k, v, softmax_scale, causal, window_size, softcap=softcap)
        from fa_sm100.autograd import flash_attn_autograd

        return flash_attn_autograd(q, k, v, softmax_scale, causal, return_lse, config,
                                   window_size, deterministic, softcap)
    try:
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    except AttributeError:  # not tensors: the validation names the argument
        grad = False

    def build():
        return _build_call(q, k, v, softmax_scale, causal, window_size, softcap, return_lse,
                           config, lse is not None, grad, deterministic)

    if probes.any_active():  # a cost probe changes the kernels while it is active: no plans
        call = build()
    else:
        call = _calls.plan((q, k, v), (softmax_scale, causal, window_size, softcap, return_lse,
                                       id(config), lse is not None, grad, deterministic), build)
    if grad:
        if out is not None or lse is not None:
            raise ValueError("out= and lse= buffers are for calls without gradients: with "
                             "gradients autograd owns the outputs")
        from fa_sm100.autograd import EagerAttention

        out, lse = EagerAttention.apply(q, k, v, call)
        return (out, lse) if return_lse else out
    return call(q, k, v, out, lse)


_varlen_forwards: dict = {}  # device -> the varlen forward of its kernel


def _varlen_forward_for(q):
    """The varlen forward of q's device: SM100's on an sm_100 GPU, else SM90's (whose checks
    reject anything else with the reason); kept per CUDA device."""
    if isinstance(q, torch.Tensor) and is_sm100(q.device):
        from fa_sm100.sm100.interface import sm100_fwd_varlen as forward
    else:
        from fa_sm100.hopper.interface import sm90_fwd_varlen as forward
    if isinstance(q, torch.Tensor) and q.device.type == "cuda":
        _varlen_forwards[q.device] = forward
    return forward


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, *, return_lse=False,
                           seqused_k=None, config=None):
    """Attention over a batch of sequences packed along the token axis (flash-attn 2's
    ``flash_attn_varlen_func``; docs/varlen.md).

    q (total_q, heads, head_dim), k / v (total_k, heads_kv, head_dim[_v]); sequence i is rows
    ``cu_seqlens_q[i] .. cu_seqlens_q[i + 1]`` of q and ``cu_seqlens_k[i] ..
    cu_seqlens_k[i + 1]`` of k and v (int32, batch + 1 offsets from 0, non-decreasing: zero-
    length sequences are legal). ``max_seqlen_q`` / ``max_seqlen_k``: at least the longest
    sequence (as flash-attn requires: the launch grid is cut from them; they are not checked
    against the offsets, which would wait for the GPU, unless ``FA_SM100_CHECK_VALUES=1``: then
    the offsets are read and bad ones raise ValueError before any launch). ``seqused_k``
    (batch,) int32: use only the first ``seqused_k[i]`` keys of sequence i (a cache longer than
    what is filled).
    causal, window_size, softcap, softmax_scale: as ``flash_attn_func``, per sequence
    (bottom-right aligned to each sequence's own lengths). Returns out (total_q, heads,
    head_dim_v), or ``(out, lse)`` with ``return_lse`` (lse (heads, total_q) float32, natural
    log) or ``(out, lse, None)`` with ``return_attn_probs``.

    The forward on sm_90 (Hopper) and sm_100 (the SM100 kernel, held by its CPU layers).
    Gradients (autograd, ``torch.compile``) on sm_90: the varlen backward
    (``sm90_bwd_varlen``); CPU tensors with gradients run the PyTorch model of the same
    arithmetic.
    """
    _check_flash_attn_options(dropout_p, alibi_slopes, deterministic, return_lse,
                              return_attn_probs)
    if checking_values():  # FA_SM100_CHECK_VALUES=1: the offsets' values too (a GPU wait)
        validate_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               seqused_k, softmax_scale, causal, window_size, softcap,
                               require_cuda=False)
        check_varlen_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q,
                            max_seqlen_k, seqused_k)
    try:
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
        forward = _varlen_forwards.get(q.device)
    except AttributeError:  # not tensors: the checks name the argument
        grad, forward = False, None
    if grad:
        from fa_sm100.autograd import flash_attn_varlen_autograd

        out, lse = flash_attn_varlen_autograd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                              max_seqlen_k, seqused_k, softmax_scale, causal,
                                              window_size, softcap, config)
        if return_attn_probs:
            return out, lse, None
        return (out, lse) if return_lse else out
    if forward is None:
        forward = _varlen_forward_for(q)

    result = forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     seqused_k, softmax_scale, causal, window_size, softcap,
                     return_lse or return_attn_probs, config)
    return (*result, None) if return_attn_probs else result
