"""Call plans: what a call decides from its inputs' metadata, decided once per metadata.

A public call (``sm90_fwd``, ``sm90_bwd``, ``sm100_fwd``) validates its inputs, picks a config,
fetches the compiled kernel and queries the device. All of that depends only on the inputs'
metadata (shapes, strides, dtypes, devices) and the options, never on the data; so the first
call with some metadata builds a *plan* (the config, the kernel, the SM count, the buffer
shapes), and every later call with the same metadata finds the plan by ``metadata_key`` and only
allocates its outputs and launches.

Why a hit is safe: the plan was built by a call that passed every check with the same key, and
no check reads anything outside the key except data pointers, which a hit still checks
(``aligned``). A call whose options cannot be a key (an unhashable ``window_size``, say) or
that raises while its key is built takes the full path, which validates and raises the same
ValueError as before. Cost probes (``hopper.probes``) change the compiled kernels while they
are active, so calls skip plans then.
"""

from __future__ import annotations

import torch

MAX_PLANS = 4096  # distinct (metadata, options) pairs kept; the table is cleared when full


def metadata_key(*tensors) -> tuple:
    """(shape, strides, dtype, device) of each tensor: everything a plan may depend on."""
    return tuple([(t.shape, t.stride(), t.dtype, t.device) for t in tensors])


def aligned(*tensors) -> bool:
    """True when every tensor's data starts on a 16-byte boundary (what TMA needs)."""
    for t in tensors:
        if t.data_ptr() % 16:
            return False
    return True


class PlanTable(dict):
    """key -> plan, bounded by ``MAX_PLANS`` (a process that sees endless new shapes does not
    grow without bound; it rebuilds plans instead)."""

    def put(self, key, plan):
        if len(self) >= MAX_PLANS:
            self.clear()
        self[key] = plan
        return plan


_stream_of = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_stream_id(device: torch.device) -> int:
    """The handle of ``device``'s current torch stream, without building a Stream object."""
    if _stream_of is not None:
        return _stream_of(device.index if device.index is not None else torch.cuda.current_device())
    return torch.cuda.current_stream(device).cuda_stream
