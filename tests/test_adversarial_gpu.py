"""The adversarial numerics list (``fa_sm100.adversarial``) on the Hopper kernels, through the
public API. Skip off SM90 with the reason.

Contracts: on every case of the list, ``flash_attn_func`` (the forward the device picks, with
its default config, and with the rescale threshold forced to 8 and to 0) gives O and LSE that
meet the adversarial rule (float64 reference, the better plain baseline, outputs within the
range of the visible rows of v); gradients through autograd from such forwards meet the float64
rule (``adversarial.gradient_cases``: scores within float32's reach, see there), the causal ones
also at head dims (192, 128) with dQ by reductions. ``--fuzz N`` adds N seeded random cases (``adversarial.random_case``; ``--fuzz-seed S``
starts at seed S), forward and, for odd seeds, gradients; a failure prints its one-line repro.
The SM100 forward's cases are written the same way and skip off SM100 with the reason.
"""

import pytest
import torch

from fa_sm100 import adversarial as adv


def _forward(case, q, k, v, threshold):
    from fa_sm100 import flash_attn_func
    from fa_sm100.hopper.config import select_sm90_fwd_config
    from fa_sm100.hopper.interface import sm90_fwd

    if threshold is None:
        return flash_attn_func(q, k, v, causal=case.causal, window_size=case.window,
                               softcap=case.softcap, return_lse=True)
    cfg = select_sm90_fwd_config(case.head_dim, case.head_dim, dtype=q.dtype, causal=case.causal,
                                 seqlen_q=case.seqlen_q, seqlen_k=case.seqlen_k,
                                 local=case.window != (None, None), softcap=case.softcap > 0,
                                 rescale_threshold=threshold)
    return sm90_fwd(q, k, v, causal=case.causal, window_size=case.window, return_lse=True,
                    config=cfg, softcap=case.softcap)


def check_case(case, threshold=None, grads=False):
    from fa_sm100 import flash_attn_func

    q, k, v = case.inputs("cuda")
    out, lse = _forward(case, q, k, v, threshold)
    torch.cuda.synchronize()
    adv.check_adversarial(f"{case.name} threshold={threshold}", out, lse, q, k, v,
                          **case.problem())
    if grads:
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        gen = torch.Generator(device="cuda").manual_seed(case.seed + 1)
        dout = torch.randn(out.shape, device="cuda", dtype=q.dtype, generator=gen)
        o = flash_attn_func(qg, kg, vg, causal=case.causal, window_size=case.window,
                            softcap=case.softcap)
        g = torch.autograd.grad(o, (qg, kg, vg), dout)
        adv.check_adversarial_grads(case.name, g, q, k, v, dout, **case.problem())


@pytest.mark.gpu
@pytest.mark.parametrize("threshold", [None, 8.0, 0.0], ids=["default", "t8", "t0"])
@pytest.mark.parametrize("name", [c.name for c in adv.CASES])
def test_sm90_fwd_adversarial(sm90_device, name, threshold):
    check_case(adv.BY_NAME[name], threshold)


@pytest.mark.gpu
@pytest.mark.parametrize("threshold", [None, 8.0, 0.0], ids=["default", "t8", "t0"])
@pytest.mark.parametrize("name", [c.name for c in adv.CASES])
def test_sm100_fwd_adversarial(sm100_device, name, threshold):
    """The SM100 forward on the same list (written; it has not run: no SM100 GPU was lent)."""
    from fa_sm100 import FmhaConfig, flash_attn_func

    case = adv.BY_NAME[name]
    q, k, v = case.inputs("cuda")
    config = None
    if threshold is not None:
        config = FmhaConfig(causal=case.causal, window_left=case.window[0],
                            window_right=case.window[1], softcap=case.softcap > 0,
                            rescale_threshold=threshold)
    out, lse = flash_attn_func(q, k, v, causal=case.causal, window_size=case.window,
                               softcap=case.softcap, return_lse=True, config=config)
    torch.cuda.synchronize()
    adv.check_adversarial(f"{case.name} threshold={threshold}", out, lse, q, k, v,
                          **case.problem())


@pytest.mark.gpu
@pytest.mark.parametrize("name", [c.name for c in adv.gradient_cases()])
def test_sm90_bwd_adversarial_gradients(sm90_device, name):
    check_case(adv.BY_NAME[name], grads=True)


@pytest.mark.gpu
@pytest.mark.parametrize("name", [c.name for c in adv.gradient_cases() if c.causal])
def test_sm90_bwd_adversarial_gradients_d192_red_dq(sm90_device, name):
    """The causal gradient cases at head dims (192, 128) with dQ by reductions (the long causal
    default, bwd_tuning's "(192, 128) long causal" row, forced here at the cases' lengths):
    q and k of 192 columns (the constructions use column 0), v of 128."""
    import dataclasses

    from fa_sm100 import flash_attn_func
    from fa_sm100.hopper.bwd_defaults import select_bwd_config
    from fa_sm100.hopper.bwd_interface import sm90_bwd

    case = dataclasses.replace(adv.BY_NAME[name], head_dim=192)
    q, k, v = case.inputs("cuda")
    v = v[..., :128].contiguous()
    left, right = case.window
    cfg = select_bwd_config(192, head_dim_v=128, causal=True, window_left=left,
                            window_right=right, qhead_per_kvhead=q.shape[2] // k.shape[2],
                            softcap=case.softcap > 0, dq_accum="red")
    out, lse = flash_attn_func(q, k, v, causal=True, window_size=case.window,
                               softcap=case.softcap, return_lse=True)
    gen = torch.Generator(device="cuda").manual_seed(case.seed + 1)
    dout = torch.randn(out.shape, device="cuda", dtype=q.dtype, generator=gen)
    grads = sm90_bwd(dout, q, k, v, out, lse, causal=True, window_size=case.window,
                     softcap=case.softcap, config=cfg)
    adv.check_adversarial_grads(case.name, grads, q, k, v, dout, **case.problem())


def pytest_generate_tests(metafunc):
    if "fuzz_seed" in metafunc.fixturenames:
        n = metafunc.config.getoption("--fuzz")
        start = metafunc.config.getoption("--fuzz-seed")
        metafunc.parametrize("fuzz_seed", list(range(start, start + n)) or [None])


@pytest.mark.gpu
def test_sm90_fuzz(sm90_device, fuzz_seed):
    if fuzz_seed is None:
        pytest.skip("fuzzing is off: pass --fuzz N (and --fuzz-seed S) to run N random cases")
    case = adv.random_case(fuzz_seed)
    try:
        check_case(case, grads=fuzz_seed % 2 == 1)
    except AssertionError as err:
        raise AssertionError(
            f"{err}\nrepro: python -m pytest tests/test_adversarial_gpu.py --fuzz 1 "
            f"--fuzz-seed {fuzz_seed}   # {case.repro()}") from None
