"""The public forward: ``flash_attn_func`` on BSHD tensors, dispatched by GPU capability.

(10, x) -> the SM100 kernel (``fa_sm100.sm100.interface.sm100_fwd``)
(9, 0)  -> the Hopper fallback (``fa_sm100.hopper.interface.sm90_fwd``)
others  -> ValueError naming the device.

Inputs are validated (``fa_sm100.validation``) before the device is queried, before any
compile and before any launch. A call whose metadata and options passed validation before
skips it (``fa_sm100.call_plans``: nothing validation reads lies outside that key), and the
backend's own plan skips the config choice and the compile.
"""

from __future__ import annotations

import torch

from fa_sm100.call_plans import PlanTable
from fa_sm100.devices import capability
from fa_sm100.validation import validate_attention_inputs

_validated = PlanTable()  # (metadata, options) that passed validation -> backend


def _validated_backend(q, k, v, softmax_scale, causal, window_size, softcap):
    validate_attention_inputs(q, k, v, softmax_scale, causal, window_size, softcap=softcap)
    return _backend_for(q.device)


def _backend_for(device: torch.device):
    major, minor = capability(device)
    if major == 10:
        from fa_sm100.sm100.interface import sm100_fwd

        return sm100_fwd
    if (major, minor) == (9, 0):
        from fa_sm100.hopper.interface import sm90_fwd

        return sm90_fwd
    raise ValueError(
        f"no fa_sm100 kernel for {torch.cuda.get_device_name(device)} (sm_{major}{minor}): "
        "the forward runs on sm_100 (Blackwell) and sm_90 (Hopper) GPUs"
    )


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
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or dropout_p != 0:
        raise ValueError(f"dropout_p={dropout_p!r}: only 0.0 is supported (there is no dropout "
                         "kernel)")
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes: ALiBi is not supported (pass None)")
    for name, flag in (("deterministic", deterministic), ("return_lse", return_lse),
                       ("return_attn_probs", return_attn_probs)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be a bool, got {flag!r}")
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
    backend = _validated.plan((q, k, v), (softmax_scale, causal, window_size, softcap),
                              lambda: _validated_backend(q, k, v, softmax_scale, causal,
                                                         window_size, softcap))
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        if out is not None or lse is not None:
            raise ValueError("out= and lse= buffers are for calls without gradients: with "
                             "gradients autograd owns the outputs")
        from fa_sm100.autograd import flash_attn_autograd

        return flash_attn_autograd(q, k, v, softmax_scale, causal, return_lse, config,
                                   window_size, deterministic, softcap)
    return backend(q, k, v, softmax_scale, causal, window_size, return_lse, config, out=out,
                   lse=lse, softcap=softcap)
