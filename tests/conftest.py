"""Test-wide fixtures. GPU checks skip lazily, at test time, and say why."""

import os

import pytest

# The DSL reads the target arch once, at first import: cross-compiles here target sm_100a
# unless a test or the environment asks for another.
os.environ.setdefault("CUTE_DSL_ARCH", "sm_100a")
# Compiled kernels go to a disk cache (fa_sm100.kernel_cache); a test run uses its own, so it
# neither reads what another run or version left nor fills the user's cache. A run that sets
# FA_SM100_CACHE_DIR itself (GPU runs split into several calls) keeps it.
if "FA_SM100_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["FA_SM100_CACHE_DIR"] = tempfile.mkdtemp(prefix="fa_sm100_test_cache_")


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


# ---- --shard K/N: split a long run over several calls ----------------------------------------
# A lent GPU runs one command for at most 10 minutes, and tests/test_sm90_bwd_gpu.py alone takes
# about that long on an H100 (CHANGELOG.md). ``--shard K/N`` keeps the
# collected tests whose position in collection order is K - 1 modulo N (a round-robin deal, so
# that neighbouring cases, often of the same cost, spread over the shards) and deselects the
# rest; the N runs together run every test once (fa_sm100/shards.py).

from fa_sm100.shards import parse_shard, shard_of  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="run the K-th of N round-robin shares of the collected tests")
    # tests/test_adversarial_gpu.py: seeded random cases of fa_sm100.adversarial.random_case
    parser.addoption("--fuzz", type=int, default=0, metavar="N",
                     help="GPU: also run N seeded random adversarial cases on the Hopper kernels")
    parser.addoption("--fuzz-seed", type=int, default=0, metavar="S",
                     help="the first seed of --fuzz (a failure prints its repro with its seed)")


def pytest_configure(config):
    text = config.getoption("--shard")
    if text is not None:
        try:
            parse_shard(text)
        except ValueError as err:
            raise pytest.UsageError(str(err)) from None


def pytest_collection_modifyitems(config, items):
    text = config.getoption("--shard")
    if text is None:
        return
    kept, dropped = shard_of(items, *parse_shard(text))
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept
