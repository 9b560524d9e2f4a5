"""Call plans: what a call decides from its inputs' metadata, decided once per metadata.

A public call (``sm90_fwd``, ``sm90_bwd``, ``sm100_fwd``) validates its inputs, picks a config,
fetches the compiled kernel and queries the device. All of that depends only on the inputs'
metadata (shapes, strides, dtypes, devices) and the options, never on the data; so the first
call with some metadata builds a *plan* (the config, the kernel, the SM count, the buffer
shapes), and every later call with the same metadata finds it (``PlanTable.plan``) and only
allocates its outputs and launches.

Why a hit is safe: the plan was built by a call that passed every check with the same key, and
no check reads anything outside the key except data pointers, which a hit still checks
(``aligned``). A call whose options cannot be a key (an unhashable ``window_size``, say) or
that raises while its key is built takes the full path, which validates and raises the same
ValueError as before. Cost probes (``hopper.probes``) change the compiled kernels while they
are active, so calls skip plans then.

A config object enters a key by its ``id``: every plan keeps a reference to the config it was
built for, so that id cannot be reused by another object while the plan exists.
"""

from __future__ import annotations

import torch

MAX_PLANS = 4096  # distinct (metadata, options) pairs kept; the table is cleared when full


def aligned(*tensors) -> bool:
    """True when every tensor's data starts on a 16-byte boundary (what TMA needs)."""
    for t in tensors:
        if t.data_ptr() % 16:
            return False
    return True


def check_out_lse(out, lse, out_shape, lse_shape, dtype, device) -> None:
    """ValueError unless each given ``out`` / ``lse`` buffer is a contiguous tensor of the
    plan's shape and dtype (LSE float32) on its device."""
    for name, t, shape, want in (("out", out, out_shape, dtype),
                                 ("lse", lse, lse_shape, torch.float32)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.shape != shape
                              or t.dtype != want or not t.is_contiguous() or t.device != device):
            raise ValueError(f"{name} must be a contiguous {want} tensor of shape {shape} on "
                             f"{device}")


class PlanTable(dict):
    """(metadata, options) -> plan, bounded by ``MAX_PLANS`` (a process that sees endless new
    shapes does not grow without bound; it rebuilds plans instead)."""

    def plan(self, tensors, options: tuple, build):
        """The plan of these tensors' metadata (shape, strides, dtype, device of each) and
        ``options``: the one kept, or ``build()``'s, kept for the next call. Metadata or
        options that cannot be a key (not tensors, unhashable) are not kept: ``build()``
        validates them and raises."""
        try:
            key = (tuple([(t.shape, t.stride(), t.dtype, t.device) for t in tensors]), options)
            found = self.get(key)
        except (AttributeError, TypeError):
            return build()
        if found is None:
            found = build()
            if len(self) >= MAX_PLANS:
                self.clear()
            self[key] = found
        return found


_stream_of = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream_id(device: torch.device) -> int:
    """The handle of ``device``'s current torch stream, without building a Stream object."""
    if _stream_of is not None:
        return _stream_of(device.index if device.index is not None else torch.cuda.current_device())
    return torch.cuda.current_stream(device).cuda_stream


_capturing = (getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
              if torch.cuda._is_compiled() else None)


def stream_capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA)."""
    return _capturing is not None and _capturing()
