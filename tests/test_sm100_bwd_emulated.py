"""The SM100 backward's own PTX, executed on the CPU PTX emulator (fa_sm100.ptxemu): EMULATED,
not run on Blackwell hardware.

Contract: for MHA, GQA and MQA, causal (bottom-right, seqlen_q above and below seqlen_k) and
not, query and key tails, several key blocks adding into one dQ row, head dims 64 / 96 / 128,
one and two Q stages, sliding windows (with and without causal, seqlen_q != seqlen_k, rows
whose band holds no key, blocks inside the band and across its edges), softcap (caps 5 and
30, alone and with a window), and the small adversarial gradient cases (their windows and caps
included), (dq, dk, dv) meet the project's error rule against float64 autograd (at most twice
the error of the better plain 16-bit baseline, plus ``grad_atol``); a row that sees no key
gets zero gradients. With a causal mask or a window each CTA runs one step per query block
whose band reaches its key block (``bands.q_block_range``) and head of its group, no more.
Deterministic mode (MHA and GQA, causal and not, a window, tails): the same rule, every dQ
semaphore ends at its count of turns, and another scheduler seed and policy gives the same
accumulator bit for bit (the emulator runs CTAs one at a time, so the unordered kernel
repeats too: see the test). The preprocess's rows are made on the CPU (``sm100_bwd_run.preprocess_rows``); dq is scale x
the kernel's float32 accumulator.

In every one of those runs, the numerics emulation of the backward's algorithm
(``fa_sm100.emulation.emulate_sm100_bwd``) gives the kernel's dK, dV and dQ accumulator bit for
bit and the same steps per CTA: two independent descriptions of the arithmetic (the kernel's
compiled PTX, the emulation's torch code) that share only the model of what the ISA leaves
open (an MMA instruction rounds once, MUFU.EX2 is correctly rounded). The emulation takes the
exp2 argument (and softcap's 1 - t^2) rounded twice there, as the PTX writes it; ptxas fuses
each into one FFMA for sm_100a, which the emulation models by default (checked in the SASS).
"""

import re

import pytest
import torch

pytest.importorskip("cutlass")

from fa_sm100 import adversarial  # noqa: E402
from fa_sm100.bands import kernel_window, q_block_range  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.compile]

NO_WINDOW = (None, None)

CASES = {
    # name: (batch, seqlen_q, seqlen_k, heads, kv heads, head_dim, --set[, window, softcap])
    "one_block": (1, 128, 128, 1, 1, 64, []),
    "tails_three_key_blocks_gqa": (1, 200, 300, 2, 1, 64, []),
    "causal_sq_gt_sk": (1, 300, 130, 2, 2, 64, ["causal=true"]),
    "causal_batch2_mqa": (2, 130, 257, 4, 1, 64, ["causal=true"]),
    "hdim128_tails": (1, 200, 170, 2, 1, 128, []),
    "hdim96_causal": (1, 129, 140, 3, 3, 96, ["causal=true"]),
    "hdim128_causal_one_q_stage": (1, 256, 256, 2, 1, 128, ["causal=true", "q_stage=1"]),
    # windows: the first rows see no key (causal, seqlen_q > seqlen_k), a two-sided band with
    # seqlen_q < seqlen_k, a band right of the diagonal that no row sees at either end, a
    # wide band whose middle blocks need no mask (GQA), head dim 128 with one Q stage
    "window_causal_sq_gt_sk_gqa": (1, 300, 200, 2, 1, 64, ["causal=true"], (60, None)),
    "window_two_sided_sq_lt_sk": (1, 200, 390, 1, 1, 64, [], (50, 20)),
    "window_rows_without_keys": (1, 256, 160, 2, 2, 64, [], (-20, 40)),
    "window_wide_gqa_inner_blocks": (1, 384, 384, 4, 1, 64, [], (200, 150)),
    "window_hdim128_causal_q1": (1, 256, 300, 2, 1, 128, ["causal=true", "q_stage=1"],
                                 (100, None)),
    # softcap: caps 5 and 30, with GQA, causal, a window, head dim 96
    "softcap_5_gqa": (1, 200, 300, 2, 1, 64, [], NO_WINDOW, 5.0),
    "softcap_30_causal_hdim128": (1, 256, 256, 1, 1, 128, ["causal=true"], NO_WINDOW, 30.0),
    "softcap_30_window_hdim96": (1, 200, 260, 2, 2, 96, ["causal=true"], (70, None), 30.0),
}


def _run(b, sq, sk, h, hk, d, sets, window=NO_WINDOW, softcap=0.0, q=None, k=None, v=None,
         seed=0, schedule=(0, "late")):
    from fa_sm100.ptxemu.sm100_bwd_run import run_backward
    from fa_sm100.sm100.bwd_inspect_entry import make_config

    dtype = "fp16" if q is not None and q.dtype == torch.float16 else "bf16"
    switches = [f"local={window != NO_WINDOW}", f"softcap={softcap > 0}"]
    cfg = make_config([f"head_dim={d}", f"qhead_per_kvhead={h // hk}", f"dtype={dtype}"] + sets
                      + switches)
    g = torch.Generator().manual_seed(seed)
    if q is None:
        q, k, v = (torch.randn(b, s, n, d, generator=g).to(torch.bfloat16)
                   for s, n in ((sq, h), (sk, hk), (sk, hk)))
    dout = torch.randn(q.shape[0], q.shape[1], q.shape[2], v.shape[3], generator=g).to(q.dtype)
    return cfg, (q, k, v, dout), run_backward(cfg, q, k, v, dout, window=window,
                                              softcap=softcap, seed=schedule[0],
                                              policy=schedule[1])


def expected_steps(cfg, q, k, window) -> dict:
    """(key block, KV head, batch) -> steps: the query blocks whose band reaches the key block
    (``bands.q_block_range``; every block without a mask) times the group's heads. Under 2-CTA
    both CTAs of pair p take the blocks whose band reaches the pair's keys [2 p n_block,
    2 (p + 1) n_block)."""
    b, sq, h, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    left, right = kernel_window(cfg.causal, window, sq, sk)
    span = cfg.cta_group * cfg.n_block  # keys of one work tile
    steps = {}
    for p in range(-(-sk // span)):
        lo, hi = q_block_range(p * span, span, cfg.m_block, sq, sk, left, right)
        for n in range(cfg.cta_group * p, cfg.cta_group * (p + 1)):
            for kv_head in range(hk):
                for batch in range(b):
                    steps[n, kv_head, batch] = max(hi - lo, 0) * (h // hk)
    return steps


def _check(name, cfg, inputs, run, window, softcap):
    q, k, v, dout = inputs
    assert run.launch["block"][0] == 512
    assert not any(torch.isnan(t).any() for t in (run.dq, run.dk, run.dv)), "a row left unwritten"
    adversarial.check_adversarial_grads(name, (run.dq, run.dk, run.dv), q, k, v, dout,
                                        causal=cfg.causal, window=window, softcap=softcap)
    assert run.steps == expected_steps(cfg, q, k, window)
    _check_emulation_bits(name, cfg, inputs, run, window, softcap)


def _check_emulation_bits(name, cfg, inputs, run, window, softcap):
    """The numerics emulation (``emulate_sm100_bwd``) on the same inputs and rows gives the
    kernel's dK, dV and float32 dQ accumulator bit for bit, with the same steps per CTA.
    ``fma_contracted=False``: the exp2 argument (and 1 - t^2) rounded twice, as the PTX
    writes them and the emulator runs them (ptxas fuses each into one FFMA: see
    ``test_ptxas_fuses_the_multiply_adds_the_ptx_writes_apart``). The emulator runs the CTAs
    in key-block order, so the dQ adds land in the emulation's order with or without the
    deterministic mode."""
    from fa_sm100.emulation import emulate_sm100_bwd

    q, k, v, dout = inputs
    emu = emulate_sm100_bwd(dout, q, k, v, causal=cfg.causal, window_size=window,
                            softcap=softcap, fma_contracted=False)
    for what, mine, kernel, bits in (("dk", emu.dk, run.dk, torch.int16),
                                     ("dv", emu.dv, run.dv, torch.int16),
                                     ("dq accumulator", emu.dq_acc, run.dq_acc, torch.int32)):
        differ = mine.view(bits) != kernel.view(bits)
        assert not differ.any(), (f"{name} {what}: {int(differ.sum())} of {differ.numel()} "
                                  "elements differ from the numerics emulation")
    assert emu.steps == run.steps


def _options(case) -> tuple:
    """(window, softcap) of a CASES entry (no window, no cap where it leaves them out)."""
    extra = case[7:]
    return (extra[0] if extra else NO_WINDOW), (extra[1] if len(extra) > 1 else 0.0)


@pytest.mark.parametrize("name", list(CASES))
def test_emulated_backward_meets_the_float64_rule(name):
    cfg, inputs, run = _run(*CASES[name])
    _check(name, cfg, inputs, run, *_options(CASES[name]))


def test_rows_without_keys_get_zero_gradients_and_the_walk_follows_the_band():
    """A band right of the diagonal (-20, 40) with seqlen_q > seqlen_k: the first and last rows
    see no key (O = 0, LSE = -inf), so their dq is exactly 0, as are dk and dv of keys that no
    row sees; and a key block visits fewer query blocks than there are."""
    from fa_sm100.testing import attention_mask

    window = _options(CASES["window_rows_without_keys"])[0]
    cfg, (q, k, v, dout), run = _run(*CASES["window_rows_without_keys"])
    sq, sk = q.shape[1], k.shape[1]
    visible = attention_mask(sq, sk, cfg.causal, window)
    no_key = ~visible.any(dim=1)
    assert no_key[0] and no_key[-1]
    assert torch.count_nonzero(run.dq[:, no_key]) == 0
    unseen = ~visible.any(dim=0)
    assert torch.count_nonzero(run.dk[:, unseen]) == 0
    assert torch.count_nonzero(run.dv[:, unseen]) == 0
    assert min(run.steps.values()) < -(-sq // cfg.m_block) * cfg.qhead_per_kvhead


BWD_ADVERSARIAL = [c.name for c in adversarial.gradient_cases() if c.small]


@pytest.mark.parametrize("name", BWD_ADVERSARIAL)
def test_emulated_backward_on_the_adversarial_cases(name):
    case = adversarial.BY_NAME[name]
    q, k, v = case.inputs()
    cfg, inputs, run = _run(case.batch, case.seqlen_q, case.seqlen_k, case.heads, case.kv_heads,
                            case.head_dim, ["causal=true"] if case.causal else [], case.window,
                            case.softcap, q, k, v)
    _check(name, cfg, inputs, run, case.window, case.softcap)


def test_the_adversarial_list_reaches_the_backward():
    cases = [adversarial.BY_NAME[n] for n in BWD_ADVERSARIAL]
    assert len(cases) >= 5
    assert any(c.window != NO_WINDOW for c in cases) and any(c.softcap for c in cases)


DETERMINISTIC = {
    # MHA with query and key tails; GQA causal with seqlen_q > seqlen_k (the first query
    # block sees no key block, later ones 1 and 2); GQA with a left window, so that the key
    # blocks of a query block start past block 0 (turns count from there)
    "det_mha_tails": (1, 200, 300, 1, 1, 64, ["deterministic=true"]),
    "det_gqa_causal": (1, 300, 260, 2, 1, 64, ["deterministic=true", "causal=true"]),
    "det_gqa_window": (1, 300, 390, 2, 1, 64, ["deterministic=true"], (60, None)),
}


def _visiting_key_blocks(cfg, q, k, window) -> torch.Tensor:
    """(query blocks,): how many key blocks' walks reach each query block."""
    sq, sk = q.shape[1], k.shape[1]
    left, right = kernel_window(cfg.causal, window, sq, sk)
    count = torch.zeros(-(-sq // cfg.m_block), dtype=torch.int32)
    for n in range(-(-sk // cfg.n_block)):
        lo, hi = q_block_range(n * cfg.n_block, cfg.n_block, cfg.m_block, sq, sk, left, right)
        count[lo:max(hi, lo)] += 1
    return count


@pytest.mark.parametrize("name", list(DETERMINISTIC))
def test_deterministic_backward_meets_the_rule_and_repeats_bit_for_bit(name):
    """Note [Deterministic dQ] on the emulator: (dq, dk, dv) meet the float64 rule; each
    (batch, head, query block) semaphore ends at one release per dQ warp per key block that
    reaches the block (a turn that waited for a block that never comes would leave the run
    spinning until the emulator's step limit fails it); and a run under another scheduler
    seed and policy writes the same dQ accumulator bit for bit.

    The emulator runs the CTAs of a launch one after another, key block fastest
    (``machine.Machine.run``), so its float adds land in key-block order with or without the
    semaphores: the non-deterministic kernel repeats bit for bit there as well, and the half
    of this contract that would show it varying cannot be run on the CPU. What it can show:
    the deterministic kernel's accumulator equals the non-deterministic one's (the turns
    change no sum) under either schedule."""
    case = DETERMINISTIC[name]
    cfg, inputs, run = _run(*case)
    window = _options(case)[0]
    assert cfg.deterministic
    _check(name, cfg, inputs, run, window, 0.0)
    q, k = inputs[0], inputs[1]
    b, h = q.shape[0], q.shape[2]
    visits = _visiting_key_blocks(cfg, q, k, window)
    expected = (visits * cfg.dq_releases_per_turn()).expand(b, h, -1)
    assert torch.equal(run.dq_sem, expected)
    _, _, again = _run(*case, schedule=(7, "random"))
    assert torch.equal(again.dq_acc.view(torch.int32), run.dq_acc.view(torch.int32))
    assert torch.equal(again.dq_sem, run.dq_sem)
    plain = list(case)
    plain[6] = [s for s in case[6] if s != "deterministic=true"]
    _, _, unordered = _run(*plain, schedule=(7, "random"))
    assert unordered.dq_sem is None
    assert torch.equal(unordered.dq_acc.view(torch.int32), run.dq_acc.view(torch.int32))


def _ptx_defs(ptx: str) -> dict:
    """register -> (opcode, source operands) of the PTX instruction that writes it."""
    defs = {}
    for line in ptx.splitlines():
        m = re.match(r"\s*([a-z][\w.]*)\s+(%\w+),\s*(.*);", line)
        if m:
            defs[m.group(2)] = (m.group(1), [o.strip() for o in m.group(3).split(",")])
    return defs


def test_ptxas_fuses_the_multiply_adds_the_ptx_writes_apart():
    """What ``emulate_sm100_bwd(fma_contracted=True)`` models: the kernel's PTX computes P's
    exp2 argument as ``mul.f32`` then ``sub.f32`` (x = S^T scale_log2 - LSE2; no rounding
    modifier, so PTX lets the code generator fuse them), and with softcap 1 - t^2 as
    ``mul.f32`` then ``sub.f32``; ptxas makes one FFMA of each for sm_100a (x: a register
    times the uniform scale_log2 minus LSE2; 1 - t^2: -t times t plus 1). So on hardware
    each is rounded once, on the PTX emulator twice. (The kernel could write them with
    ``dsl_math.fma_rn``, as the forward writes its exp2 argument; then the PTX, the emulator
    and the hardware would round alike.)"""
    from fa_sm100.compile_tools import cross_compile
    from fa_sm100.sm100.bwd_inspect_entry import build, make_config

    x_ffma = re.compile(r"FFMA R\d+, R\d+(\.reuse)?, UR\d+(\.reuse)?, -R\d+ ;")
    one_minus_square = re.compile(r"FFMA R\d+, -(R\d+)(\.reuse)?, \1(\.reuse)?, 1 ;")
    for capped in (False, True):
        b = build(make_config(["head_dim=64", f"softcap={str(capped).lower()}"]))
        art = cross_compile(b.fn, b.args, "sm_100a")
        # with a cap, each score takes two exp2s: tanh's (of a product) and P's
        per_score = 2 if capped else 1
        defs = _ptx_defs(art.ptx)
        ex2_args = [defs[ops[0]] for op, ops in defs.values() if op.startswith("ex2.approx")]
        p_args = [ops for op, ops in ex2_args
                  if op == "sub.f32" and defs.get(ops[0], ("",))[0] == "mul.f32"]
        assert p_args and len(p_args) * per_score == len(ex2_args)
        # ptxas may merge the loop's masked and unmasked copies: count against its own exp2s
        p_in_sass = art.sass.count("MUFU.EX2") // per_score
        assert len(x_ffma.findall(art.sass)) == p_in_sass
        if capped:
            assert len(one_minus_square.findall(art.sass)) == p_in_sass
