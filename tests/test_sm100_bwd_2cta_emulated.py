"""The SM100 backward's 2-CTA kernel (``use_2cta``, Note [Backward 2-CTA] in
fa_sm100/sm100/bwd_config.py): its own PTX, executed on the CPU PTX emulator with clusters of
two CTAs, cta_group::2 MMAs (dQ's M = 128 in the ISA's folded data-path layout) and the dS
exchange through shared::cluster stores. EMULATED, not run on Blackwell hardware.

Contract: for MHA, GQA and MQA, causal (seqlen_q above and below seqlen_k) and not, query and
key tails (an odd count of key blocks: the last pair's second CTA holds no key), several pairs
adding into one dQ row, head dims 64 / 96 / 128, one and two Q stages, windows (rows whose
band holds no key included) and softcap, (dq, dk, dv) meet the project's error rule against float64 autograd
(at most twice the error of the better plain 16-bit baseline, plus ``grad_atol``), and no
gradient is left unwritten. Both CTAs of pair p walk the query blocks whose band reaches the
pair's 2 x 128 keys (``bands.q_block_range``), times the group's heads. dK and dV equal the
numerics emulation's (``emulate_sm100_bwd``, one CTA per key block) value for value: the pair
changes who sums dQ over the keys, not the arithmetic of a CTA's own rows (the steps a pair
adds for one CTA's keys are masked, adding zeros). Deterministic mode: the same rule, each
dQ semaphore ends at 8 (4 dQ warps x 2 CTAs) per pair that reaches its query block, and a run
under another scheduler seed and policy gives the same accumulator bit for bit.
"""

import pytest
import torch

pytest.importorskip("cutlass")

from fa_sm100 import adversarial  # noqa: E402
from fa_sm100.bands import kernel_window, q_block_range  # noqa: E402
from test_sm100_bwd_emulated import expected_steps  # noqa: E402  (the 1-CTA file's rule)

pytestmark = [pytest.mark.slow, pytest.mark.compile]

NO_WINDOW = (None, None)
PAIR = 2  # CTAs of a cluster under use_2cta

CASES = {
    # name: (batch, seqlen_q, seqlen_k, heads, kv heads, head_dim, --set[, window, softcap])
    "one_pair": (1, 128, 256, 1, 1, 64, []),
    "tails_odd_key_blocks_gqa": (1, 200, 300, 2, 1, 64, []),
    "causal_sq_gt_sk": (1, 300, 130, 2, 2, 64, ["causal=true"]),
    "causal_two_pairs_mqa": (1, 256, 520, 2, 1, 64, ["causal=true"]),
    "hdim128_tails_gqa": (1, 200, 170, 2, 1, 128, []),
    "hdim128_causal_batch2": (2, 130, 257, 2, 2, 128, ["causal=true"]),
    "hdim96_causal": (1, 129, 140, 3, 3, 96, ["causal=true"]),
    "hdim64_causal_one_q_stage": (1, 256, 256, 2, 1, 64, ["causal=true", "q_stage=1"]),
    "window_causal_sq_gt_sk_gqa": (1, 300, 200, 2, 1, 64, ["causal=true"], (60, None)),
    # a band right of the diagonal: rows 108.. see no key, keys below 420 none of the rows,
    # so pair 1's first CTA (keys 256-383) walks the step its peer's keys need, all masked
    "window_rows_and_keys_unseen": (1, 128, 528, 2, 1, 64, [], (-20, 40)),
    "softcap_30_causal_hdim128": (1, 256, 256, 1, 1, 128, ["causal=true"], NO_WINDOW, 30.0),
}


def _options(case) -> tuple:
    extra = case[7:]
    return (extra[0] if extra else NO_WINDOW), (extra[1] if len(extra) > 1 else 0.0)


def _run(b, sq, sk, h, hk, d, sets, window=NO_WINDOW, softcap=0.0, seed=0,
         schedule=(0, "late")):
    from fa_sm100.ptxemu.sm100_bwd_run import run_backward
    from fa_sm100.sm100.bwd_inspect_entry import make_config

    cfg = make_config([f"head_dim={d}", f"qhead_per_kvhead={h // hk}", "use_2cta=true",
                       f"local={window != NO_WINDOW}", f"softcap={softcap > 0}"] + sets)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, s, n, d, generator=g).to(torch.bfloat16)
               for s, n in ((sq, h), (sk, hk), (sk, hk)))
    dout = torch.randn(b, sq, h, d, generator=g).to(torch.bfloat16)
    return cfg, (q, k, v, dout), run_backward(cfg, q, k, v, dout, window=window,
                                              softcap=softcap, seed=schedule[0],
                                              policy=schedule[1])


def _check(name, cfg, inputs, run, window, softcap):
    from fa_sm100.emulation import emulate_sm100_bwd

    q, k, v, dout = inputs
    assert run.launch["block"][0] == 512 and run.launch["grid"][0] % PAIR == 0
    assert not any(torch.isnan(t).any() for t in (run.dq, run.dk, run.dv)), "a row left unwritten"
    adversarial.check_adversarial_grads(name, (run.dq, run.dk, run.dv), q, k, v, dout,
                                        causal=cfg.causal, window=window, softcap=softcap)
    assert run.steps == expected_steps(cfg, q, k, window)
    emu = emulate_sm100_bwd(dout, q, k, v, causal=cfg.causal, window_size=window,
                            softcap=softcap, fma_contracted=False)
    for what, mine, kernel in (("dk", emu.dk, run.dk), ("dv", emu.dv, run.dv)):
        differ = mine != kernel  # by value: a zero's sign may differ
        assert not differ.any(), (f"{name} {what}: {int(differ.sum())} of {differ.numel()} "
                                  "elements differ from the one-CTA numerics emulation")


@pytest.mark.parametrize("name", list(CASES))
def test_emulated_2cta_backward_meets_the_float64_rule(name):
    cfg, inputs, run = _run(*CASES[name])
    assert cfg.use_2cta and cfg.cluster_shape == (PAIR, 1, 1)
    _check(name, cfg, inputs, run, *_options(CASES[name]))


def test_rows_and_keys_without_a_partner_get_zero_gradients_in_a_pair():
    """Rows that see no key get dq = 0 and keys no row sees get dk = dv = 0: those of a pair
    no row reaches (no step, zeros written), and those of a CTA whose peer's keys are seen,
    which walks the pair's steps with every score masked."""
    from fa_sm100.testing import attention_mask

    case = CASES["window_rows_and_keys_unseen"]
    window = _options(case)[0]
    cfg, (q, k, v, dout), run = _run(*case)
    visible = attention_mask(q.shape[1], k.shape[1], cfg.causal, window)
    no_key, unseen = ~visible.any(dim=1), ~visible.any(dim=0)
    assert no_key.any()
    assert unseen[:2 * cfg.n_block].all() and run.steps[0, 0, 0] == 0  # pair 0: no step
    block2 = slice(2 * cfg.n_block, 3 * cfg.n_block)
    assert unseen[block2].all() and run.steps[2, 0, 0] > 0  # masked steps for its peer
    assert torch.count_nonzero(run.dq[:, no_key]) == 0
    assert torch.count_nonzero(run.dk[:, unseen]) == 0
    assert torch.count_nonzero(run.dv[:, unseen]) == 0


DETERMINISTIC = {
    # GQA causal with seqlen_q > seqlen_k and three key blocks (two pairs, the second half
    # empty); GQA with a left window, so the pairs of a query block start past pair 0
    "det_gqa_causal": (1, 300, 300, 2, 1, 64, ["deterministic=true", "causal=true"]),
    "det_gqa_window": (1, 300, 520, 2, 1, 64, ["deterministic=true"], (60, None)),
}


def _visiting_pairs(cfg, q, k, window) -> torch.Tensor:
    """(query blocks,): how many pairs' walks reach each query block."""
    sq, sk = q.shape[1], k.shape[1]
    left, right = kernel_window(cfg.causal, window, sq, sk)
    count = torch.zeros(-(-sq // cfg.m_block), dtype=torch.int32)
    for p in range(-(-sk // (PAIR * cfg.n_block))):
        lo, hi = q_block_range(p * PAIR * cfg.n_block, PAIR * cfg.n_block, cfg.m_block, sq, sk,
                               left, right)
        count[lo:max(hi, lo)] += 1
    return count


@pytest.mark.parametrize("name", list(DETERMINISTIC))
def test_deterministic_2cta_backward_takes_turns_per_pair(name):
    """Note [Deterministic dQ] with pairs: the rule holds, every semaphore ends at 8 per pair
    whose walk reaches its query block (a turn that waited for a pair that never comes would
    spin until the emulator's step limit fails the run), and another scheduler seed and policy
    gives the same accumulator bit for bit."""
    case = DETERMINISTIC[name]
    window = _options(case)[0]
    cfg, inputs, run = _run(*case)
    assert cfg.deterministic and cfg.dq_releases_per_turn() == 8
    _check(name, cfg, inputs, run, window, 0.0)
    q, k = inputs[0], inputs[1]
    expected = (_visiting_pairs(cfg, q, k, window) * 8).expand(q.shape[0], q.shape[2], -1)
    assert torch.equal(run.dq_sem, expected)
    _, _, again = _run(*case, schedule=(7, "random"))
    assert torch.equal(again.dq_acc.view(torch.int32), run.dq_acc.view(torch.int32))
