"""The SM100 backward's own PTX, executed on the CPU PTX emulator (fa_sm100.ptxemu): EMULATED,
not run on Blackwell hardware.

Contract: for MHA, GQA and MQA, causal (bottom-right, seqlen_q above and below seqlen_k) and
not, query and key tails, several key blocks adding into one dQ row, head dims 64 / 96 / 128,
one and two Q stages, and the small adversarial gradient cases, (dq, dk, dv) meet the
project's error rule against float64 autograd (at most twice the error of the better plain
16-bit baseline, plus ``grad_atol``). The preprocess's rows are made on the CPU
(``sm100_bwd_run.preprocess_rows``); dq is scale x the kernel's float32 accumulator.
"""

import pytest
import torch

pytest.importorskip("cutlass")

from fa_sm100 import adversarial  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.compile]

CASES = {
    # name: (batch, seqlen_q, seqlen_k, heads, kv heads, head_dim, --set)
    "one_block": (1, 128, 128, 1, 1, 64, []),
    "tails_three_key_blocks_gqa": (1, 200, 300, 2, 1, 64, []),
    "causal_sq_gt_sk": (1, 300, 130, 2, 2, 64, ["causal=true"]),
    "causal_batch2_mqa": (2, 130, 257, 4, 1, 64, ["causal=true"]),
    "hdim128_tails": (1, 200, 170, 2, 1, 128, []),
    "hdim96_causal": (1, 129, 140, 3, 3, 96, ["causal=true"]),
    "hdim128_causal_one_q_stage": (1, 256, 256, 2, 1, 128, ["causal=true", "q_stage=1"]),
}


def _run(b, sq, sk, h, hk, d, sets, q=None, k=None, v=None, seed=0):
    from fa_sm100.ptxemu.sm100_bwd_run import run_backward
    from fa_sm100.sm100.bwd_inspect_entry import make_config

    dtype = "fp16" if q is not None and q.dtype == torch.float16 else "bf16"
    cfg = make_config([f"head_dim={d}", f"qhead_per_kvhead={h // hk}", f"dtype={dtype}"] + sets)
    g = torch.Generator().manual_seed(seed)
    if q is None:
        q, k, v = (torch.randn(b, s, n, d, generator=g).to(torch.bfloat16)
                   for s, n in ((sq, h), (sk, hk), (sk, hk)))
    dout = torch.randn(q.shape[0], q.shape[1], q.shape[2], v.shape[3], generator=g).to(q.dtype)
    return cfg, (q, k, v, dout), run_backward(cfg, q, k, v, dout)


@pytest.mark.parametrize("name", list(CASES))
def test_emulated_backward_meets_the_float64_rule(name):
    cfg, (q, k, v, dout), run = _run(*CASES[name])
    assert run.launch["block"][0] == 512
    assert not any(torch.isnan(t).any() for t in (run.dq, run.dk, run.dv)), "a row left unwritten"
    adversarial.check_adversarial_grads(name, (run.dq, run.dk, run.dv), q, k, v, dout,
                                        causal=cfg.causal)


BWD_ADVERSARIAL = [c.name for c in adversarial.gradient_cases()
                   if c.small and c.window == (None, None) and not c.softcap]


@pytest.mark.parametrize("name", BWD_ADVERSARIAL)
def test_emulated_backward_on_the_adversarial_cases(name):
    case = adversarial.BY_NAME[name]
    q, k, v = case.inputs()
    cfg, (q, k, v, dout), run = _run(case.batch, case.seqlen_q, case.seqlen_k, case.heads,
                                     case.kv_heads, case.head_dim,
                                     ["causal=true"] if case.causal else [], q, k, v)
    adversarial.check_adversarial_grads(name, (run.dq, run.dk, run.dv), q, k, v, dout,
                                        causal=case.causal)


def test_the_adversarial_list_reaches_the_backward():
    assert len(BWD_ADVERSARIAL) >= 5
