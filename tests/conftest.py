"""Test-wide fixtures. GPU checks skip lazily, at test time, and say why."""

import os

import pytest

# The DSL reads the target arch once, at first import: cross-compiles here target sm_100a
# unless a test or the environment asks for another.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")


def _device_capability():
    try:
        import torch
    except ImportError:
        return None, "torch is not installed"
    if not torch.cuda.is_available():
        return None, "no CUDA device on this machine"
    return torch.cuda.get_device_capability(), None


@pytest.fixture
def sm100_device():
    cap, why = _device_capability()
    if cap is None:
        pytest.skip(f"SM100 hardware test: {why}; the SM100 kernel is held here by the compile "
                    "contract, the protocol model and the numerics emulation instead")
    if cap[0] != 10:
        pytest.skip(f"SM100 hardware test: the device is sm_{cap[0]}{cap[1]}, not sm_100")
    return cap


@pytest.fixture
def sm90_device():
    cap, why = _device_capability()
    if cap is None:
        pytest.skip(f"SM90 hardware test: {why}")
    if cap != (9, 0):
        pytest.skip(f"SM90 hardware test: the device is sm_{cap[0]}{cap[1]}, not sm_90")
    return cap
