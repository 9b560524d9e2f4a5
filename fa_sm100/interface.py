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

from fa_sm100.call_plans import PlanTable, metadata_key
from fa_sm100.devices import capability
from fa_sm100.validation import validate_attention_inputs

_validated = PlanTable()  # (metadata, options) that passed validation -> backend


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


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, return_lse=False, config=None,
                    window_size=(None, None), deterministic=False):
    """Attention forward ``softmax(q k^T * scale) v`` on (batch, seqlen, heads, head_dim) tensors.

    - GQA/MQA: k and v may have fewer heads than q (a divisor of q's heads).
    - causal: bottom-right aligned when seqlen_q != seqlen_k (query i sees keys
      j <= i + seqlen_k - seqlen_q); rows that see no key give 0 (and LSE -inf).
    - return_lse: also return the (batch, heads, seqlen_q) float32 log-sum-exp.
    - config: a kernel config for the device's backend (default: chosen per problem).
    - deterministic: the forward is always deterministic; the flag is for the backward.
    """
    if not isinstance(deterministic, bool):
        raise ValueError(f"deterministic must be a bool, got {deterministic!r}")
    if not isinstance(return_lse, bool):
        raise ValueError(f"return_lse must be a bool, got {return_lse!r}")
    if torch.compiler.is_compiling():
        # torch.compile graphs go through the custom ops (fa_sm100.autograd); the checks run
        # on the traced (fake) tensors, once per trace.
        validate_attention_inputs(q, k, v, softmax_scale, causal, window_size)
        from fa_sm100.autograd import flash_attn_autograd

        return flash_attn_autograd(q, k, v, softmax_scale, causal, return_lse, config,
                                   window_size, deterministic)
    try:
        key = (metadata_key(q, k, v), softmax_scale, causal, window_size)
        backend = _validated.get(key)
    except (AttributeError, TypeError):  # not tensors, unhashable options: validate
        key = backend = None
    if backend is None:
        validate_attention_inputs(q, k, v, softmax_scale, causal, window_size)
        backend = _backend_for(q.device)
        if key is not None:
            _validated.put(key, backend)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        from fa_sm100.autograd import flash_attn_autograd

        return flash_attn_autograd(q, k, v, softmax_scale, causal, return_lse, config,
                                   window_size, deterministic)
    return backend(q, k, v, softmax_scale, causal, window_size, return_lse, config)
