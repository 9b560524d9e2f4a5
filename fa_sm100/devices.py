"""What the kernels need to know about a GPU, asked once per device.

A device's compute capability and SM count never change while a process runs, and torch's
queries cost microseconds, which a warm call should not spend. The answers are cached per
(device, query function): a replaced query function (tests fake devices that way) starts a
fresh cache, so a faked device is never answered from a real one's entry or the reverse.
"""

from __future__ import annotations

import torch

_capabilities: dict = {}
_sm_counts: dict = {}


def capability(device: torch.device) -> tuple:
    """(major, minor) of a CUDA device."""
    query = torch.cuda.get_device_capability
    key = (device, query)
    found = _capabilities.get(key)
    if found is None:
        found = _capabilities[key] = tuple(query(device))
    return found


def is_sm100(device: torch.device) -> bool:
    """True for a CUDA device of an sm_100 (Blackwell) GPU: the SM100 kernels run there."""
    return device.type == "cuda" and capability(device)[0] == 10


def sm_count(device: torch.device) -> int:
    """The number of SMs of a CUDA device (the CTA count of a persistent grid)."""
    query = torch.cuda.get_device_properties
    key = (device, query)
    found = _sm_counts.get(key)
    if found is None:
        found = _sm_counts[key] = query(device).multi_processor_count
    return found
