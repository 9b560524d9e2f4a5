"""The SM100 varlen forward's own PTX on the CPU PTX emulator (fa_sm100.ptxemu): EMULATED, not
run on Blackwell hardware.

A small packed batch (a zero-length sequence, one shorter than a tile, a sequence without
keys, keys longer than queries and the reverse) through ``run_forward_varlen`` with O and LSE
poisoned with NaN: every row of every sequence meets the project's error rule against the
float64 reference of that sequence alone, rows without keys are O = 0 and LSE = -inf, and O is
bit-identical to the numerics emulation (``emulate_sm100_varlen``, each sequence as a batch-1
problem with the kernel's switches). Causal and not, with ``seqused_k`` in the second, whose
unused keys hold NaN and inf (``fa_sm100.adversarial.poison_unused_keys``).
"""

import math

import pytest
import torch

pytest.importorskip("cutlass")

from fa_sm100.adversarial import poison_unused_keys  # noqa: E402
from fa_sm100.config import select_config  # noqa: E402
from fa_sm100.testing import attention_reference, check_against_reference  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.compile]

CASES = {
    # name: (query lengths, key lengths, seqused_k, causal, --set)
    "causal_2cta": ([0, 5, 130, 40], [3, 0, 200, 40], None, True, {}),
    "used_keys_1cta": ([70, 0, 9, 20], [150, 16, 0, 80], [100, 16, 0, 33], False,
                       dict(use_2cta=False, q_stage=1)),
}


def _cu(lengths):
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)


@pytest.mark.parametrize("name", list(CASES))
def test_emulated_varlen_kernel(name):
    from fa_sm100.emulation import emulate_sm100_varlen
    from fa_sm100.ptxemu.sm100_run import run_forward_varlen

    lens_q, lens_k, used, causal, sets = CASES[name]
    h, hk, d = 2, 1, 64
    cfg = select_config(head_dim=d, seqlen_q=max(lens_q), seqlen_k=max(lens_k), causal=causal,
                        qhead_per_kvhead=h // hk, varlen=True, **sets)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(sum(lens_q), h, d, generator=g).to(torch.bfloat16)
    k = torch.randn(sum(lens_k), hk, d, generator=g).to(torch.bfloat16)
    v = torch.randn(sum(lens_k), hk, d, generator=g).to(torch.bfloat16)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    used_t = None if used is None else torch.tensor(used, dtype=torch.int32)
    if used_t is not None:  # the unused keys hold NaN and inf: they must not reach O
        assert poison_unused_keys(k, v, cu_k, used_t) > 0
    run = run_forward_varlen(cfg, q, k, v, cu_q, cu_k, max(lens_q), used_t)
    assert not run.out.isnan().any() and not run.lse.isnan().any(), "a row was not written"
    scale = 1.0 / math.sqrt(d)
    for i, sq in enumerate(lens_q):
        sk = (used or lens_k)[i]
        rows = slice(int(cu_q[i]), int(cu_q[i]) + sq)
        if sq == 0:
            continue
        o, lse = run.out[rows].unsqueeze(0), run.lse[:, rows].unsqueeze(0)
        if sk == 0:
            assert not o.any() and torch.isneginf(lse).all(), f"sequence {i} has no keys"
            continue
        keys = slice(int(cu_k[i]), int(cu_k[i]) + sk)
        qi, ki, vi = q[rows].unsqueeze(0), k[keys].unsqueeze(0), v[keys].unsqueeze(0)
        ref, ref_lse = attention_reference(qi, ki, vi, scale, causal=causal)
        plain, _ = attention_reference(qi, ki, vi, scale, causal=causal, dtype=torch.bfloat16,
                                       upcast=False)
        check_against_reference(o, ref, plain, atol=1e-3, what=f"O of sequence {i}")
        empty = torch.isneginf(ref_lse)
        assert torch.equal(torch.isneginf(lse), empty), f"LSE -inf rows of sequence {i}"
        assert torch.allclose(lse[~empty], ref_lse[~empty].float(), atol=1e-4, rtol=1e-5)
    emu_out, emu_lse = emulate_sm100_varlen(q, k, v, cu_q, cu_k, used_t, causal=causal,
                                            config=cfg)
    assert torch.equal(run.out.view(torch.int16), emu_out.view(torch.int16)), (
        "O differs from the numerics emulation")
