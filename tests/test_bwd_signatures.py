"""The SM90 backward's kernels are compiled against fake arguments (symbolic extents, compact
row-major layouts) and called through TVM FFI, which checks every call's tensors against that
signature: a symbol must take one value across all the arguments, a static extent its value.
A mismatch only shows on the GPU, as a ValueError at the first call. Here, on the CPU, the
arguments ``launch_args`` builds for a call (the workspace included) are unified with each
kernel's fake arguments from ``kernel_specs``, for padded and packed (varlen) batches."""

import pytest
import torch

pytest.importorskip("cutlass")

from cutlass.cute.typing import SymInt  # noqa: E402

from fa_sm100.hopper.bwd_defaults import select_bwd_config  # noqa: E402
from fa_sm100.hopper.bwd_interface import (WorkspaceLayout, kernel_specs,  # noqa: E402
                                           launch_args, main_window)


def _unify(fakes, reals, what):
    """Bind each symbol of ``fakes`` to the extents of ``reals``: one value per symbol, the
    static extents equal, None where the fake is None, compact tensors."""
    assert len(fakes) == len(reals), f"{what}: {len(fakes)} fake vs {len(reals)} real arguments"
    bound = {}
    for i, (fake, real) in enumerate(zip(fakes, reals)):
        shape = getattr(fake, "shape", None)
        if fake is None or shape is None:
            assert (fake is None) == (real is None), f"{what} argument {i}: {fake!r} vs {real!r}"
            continue
        assert isinstance(real, torch.Tensor), f"{what} argument {i}: not a tensor"
        assert real.dim() == len(shape), f"{what} argument {i}: rank {real.dim()} vs {shape}"
        assert real.is_contiguous(), f"{what} argument {i}: not compact"
        for mode, (want, got) in enumerate(zip(shape, real.shape)):
            if isinstance(want, SymInt):
                seen = bound.setdefault(id(want), (got, i, mode))
                assert seen[0] == got, (f"{what}: argument {i} mode {mode} is {got}, but the same "
                                        f"symbol is {seen[0]} at argument {seen[1]} mode {seen[2]}")
            else:
                assert want == got, f"{what} argument {i} mode {mode}: {got} vs static {want}"


CASES = [dict(head_dim=128, causal=True), dict(head_dim=64, qhead_per_kvhead=4),
         dict(head_dim=192, head_dim_v=128), dict(head_dim=128, qhead_per_kvhead=2)]


def _tensors(b, sq, sk, h, hk, d, dv):
    bf = torch.bfloat16
    q, dout, out = (torch.zeros(b, sq, h, x, dtype=bf) for x in (d, dv, dv))
    k, v = torch.zeros(b, sk, hk, d, dtype=bf), torch.zeros(b, sk, hk, dv, dtype=bf)
    return q, k, v, out, dout, torch.zeros(b, h, sq)


@pytest.mark.parametrize("fields", CASES, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_padded_call_arguments_match_each_kernels_signature(fields):
    cfg = select_bwd_config(**fields, seqlen_q=300, seqlen_k=500)
    h = 4 * cfg.qhead_per_kvhead
    q, k, v, out, dout, lse = _tensors(2, 300, 500, h, 4, cfg.head_dim, cfg.head_dim_v)
    args = launch_args(cfg, q, k, v, out, dout, lse, torch.zeros_like(q), torch.zeros_like(k),
                       torch.zeros_like(v), 0.1, main_window(cfg, q, k))
    specs = kernel_specs(cfg)
    assert len(args) == len(specs)
    for (kind, _, _, fake), real in zip(specs, args):
        _unify(fake()[:-1], real, kind)  # the stream: the current one


@pytest.mark.parametrize("used", [False, True])
@pytest.mark.parametrize("fields", CASES, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()))
def test_varlen_call_arguments_match_each_kernels_signature(fields, used):
    """Note [Packed workspace]: one packed batch of float32 buffers beside one semaphore row
    per sequence, and the packed tensors as a batch of one."""
    lengths = [5, 0, 300, 77]
    cu = torch.tensor([0, 5, 5, 305, 382], dtype=torch.int32)
    n, total, longest = len(lengths), 382, 300
    cfg = select_bwd_config(**fields, seqlen_q=longest, seqlen_k=longest, varlen=True)
    h = 4 * cfg.qhead_per_kvhead
    q, k, v, out, dout, _ = _tensors(1, total, total, h, 4, cfg.head_dim, cfg.head_dim_v)
    lse = torch.zeros(1, h, total)
    layout = WorkspaceLayout(cfg, (n, longest, h, cfg.head_dim), (n, longest, 4, cfg.head_dim_v),
                             packed=(n, total, total))
    seqused = torch.tensor(lengths, dtype=torch.int32) if used else None
    args = launch_args(cfg, q, k, v, out, dout, lse, torch.zeros_like(q), torch.zeros_like(k),
                       torch.zeros_like(v), 0.1, (1 << 29, 1 << 29), 0.0, layout,
                       varlen=(cu, cu, seqused, longest, longest))
    specs = kernel_specs(cfg, used)
    assert len(args) == len(specs)
    for (kind, _, _, fake), real in zip(specs, args):
        real = [torch.tensor(x) if isinstance(x, float) else x for x in real]
        _unify(fake()[:-1], real, kind)
