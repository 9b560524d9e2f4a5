"""The warm call path, counted on the CPU: a second call with the same metadata and options
does no planning (no validation, config choice, compile lookup or device query), only the
allocation of its outputs and the launch; and what decides a plan is all in its key.

A GPU is faked: tensors live in a ``FakeTensorMode`` on "cuda", the device queries and the
kernel cache are replaced, and the fake kernel records its launches. The Python frames of
``fa_sm100`` that a warm call enters are counted with ``sys.setprofile``, so a regression that
puts planning work back on the warm path fails here without a GPU.
"""

import os
import sys
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import fa_sm100
from fa_sm100 import interface as public, kernel_cache
from fa_sm100.hopper import bwd_interface, interface as fwd_interface

PACKAGE = os.path.dirname(fa_sm100.__file__)
# Planning work: none of these may run on a warm call.
PLANNING = {"validate_attention_inputs", "validate_bwd_inputs", "select_sm90_fwd_config",
            "select_bwd_config", "sm90_config_for", "select_sm90_bwd_config", "replace",
            "validate", "build_sm90_fwd_plan", "build_sm90_bwd_plan", "kernel", "sm_count",
            "capability", "fake_arguments", "compile_sm90_fwd", "_compiled"}
# fa_sm100 frames a warm call may enter (comprehensions included): the forward's option checks,
# probe check, key and plan's call; the backward's key, the plan's call, its launch arguments
# and workspace (with the config's derived properties).
WARM_FWD_FRAMES = 6
WARM_BWD_FRAMES = 11


@pytest.fixture
def streams(monkeypatch):
    """The faked current stream and graph-capture state that the backward's kept workspace
    (Note [Kept workspace] in bwd_interface.py) reads; its kept buffers start empty."""
    state = SimpleNamespace(current=1, capturing=False)
    monkeypatch.setattr(bwd_interface, "current_stream_id", lambda device: state.current)
    monkeypatch.setattr(bwd_interface, "stream_capturing", lambda: state.capturing)
    monkeypatch.setattr(bwd_interface, "_kept", {})
    return state


@pytest.fixture
def fake_sm90(monkeypatch, streams):
    launches = []

    def kernel(kind, key, build):
        return lambda *args: launches.append((kind, args))

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(kernel_cache, "kernel", kernel)
    monkeypatch.setattr(fwd_interface, "aligned", lambda *t: True)  # fake tensors: no pointers
    monkeypatch.setattr(fwd_interface, "tile_counter", lambda device: None)
    for module in (fwd_interface, bwd_interface):
        monkeypatch.setattr(module, "_plans", type(module._plans)())
    monkeypatch.setattr(public, "_calls", type(public._calls)())
    with FakeTensorMode():
        yield launches


@pytest.fixture
def fake_sm100(monkeypatch):
    """A faked sm_100 device whose compiled kernels only record their launches: the list of
    (kind, compile key, arguments)."""
    launches = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(multi_processor_count=148))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernel_cache, "kernel",
                        lambda kind, key, build: (lambda *args: launches.append((kind, key,
                                                                                 args))))
    return launches


def package_calls(fn):
    """Run ``fn``; return the names of the fa_sm100 functions it entered, in order."""
    names = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            names.append(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return names


def bshd(b, s, h, d):
    return torch.empty(b, s, h, d, device="cuda", dtype=torch.bfloat16)


def test_a_warm_forward_call_does_no_planning(fake_sm90):
    q, k, v = bshd(1, 128, 2, 64), bshd(1, 128, 2, 64), bshd(1, 128, 2, 64)
    cold = package_calls(lambda: fa_sm100.flash_attn_func(q, k, v, causal=True))
    assert PLANNING & set(cold), "the first call plans"
    warm = package_calls(lambda: fa_sm100.flash_attn_func(q, k, v, causal=True))
    assert not PLANNING & set(warm), sorted(PLANNING & set(warm))
    assert len(warm) <= WARM_FWD_FRAMES, warm
    (kind0, first), (kind1, second) = fake_sm90
    # the same kernel, scale and SM count; fresh outputs of the same shapes
    assert kind0 == kind1 == "sm90_fwd"
    assert first[6:] == second[6:] and first[3].shape == second[3].shape == (1, 128, 2, 64)


def test_a_warm_backward_call_does_no_planning(fake_sm90):
    q, k, v, out, dout = (bshd(2, 256, 4, 128) for _ in range(5))
    lse = torch.empty(2, 4, 256, device="cuda", dtype=torch.float32)
    cold = package_calls(lambda: bwd_interface.sm90_bwd(dout, q, k, v, out, lse, causal=True))
    assert PLANNING & set(cold)
    n_cold = len(fake_sm90)
    warm = package_calls(lambda: bwd_interface.sm90_bwd(dout, q, k, v, out, lse, causal=True))
    assert not PLANNING & set(warm), sorted(PLANNING & set(warm))
    assert len(warm) <= WARM_BWD_FRAMES, warm
    # the same kernels in the same order (preprocess, main, dQ postprocess)
    assert [kind for kind, _ in fake_sm90[n_cold:]] == [kind for kind, _ in fake_sm90[:n_cold]]
    assert len(fake_sm90) == 2 * n_cold >= 6


@pytest.mark.parametrize("change", [
    dict(seqlen=256), dict(causal=False), dict(softmax_scale=0.5), dict(return_lse=True),
    dict(heads_kv=1), dict(transposed=True)])
def test_anything_a_plan_depends_on_makes_a_new_plan(fake_sm90, change):
    """The key holds every input of the planning: changing any of them plans again."""
    def call(seqlen=128, causal=True, softmax_scale=None, return_lse=False, heads_kv=2,
             transposed=False):
        q = bshd(1, seqlen, 2, 64)
        k = v = bshd(1, seqlen, heads_kv, 64)
        if transposed:  # the same shape with other strides
            k = v = torch.empty(1, heads_kv, seqlen, 64, device="cuda",
                                dtype=torch.bfloat16).transpose(1, 2)
        return package_calls(lambda: fa_sm100.flash_attn_func(
            q, k, v, softmax_scale=softmax_scale, causal=causal, return_lse=return_lse))

    call()
    assert not PLANNING & set(call())
    assert PLANNING & set(call(**change)), change


def test_bad_input_still_raises_after_good_calls(fake_sm90):
    """A warm path never hides a check: the same tensors with a bad option, or a tensor of a
    bad dtype, raise the same ValueError as on a first call."""
    q, k, v = bshd(1, 128, 2, 64), bshd(1, 128, 2, 64), bshd(1, 128, 2, 64)
    fa_sm100.flash_attn_func(q, k, v)
    fa_sm100.flash_attn_func(q, k, v)
    with pytest.raises(ValueError, match="softmax_scale"):
        fa_sm100.flash_attn_func(q, k, v, softmax_scale=-1.0)
    with pytest.raises(ValueError, match="dtype"):
        fa_sm100.flash_attn_func(q, k, v.float())
    with pytest.raises(ValueError, match="window_size"):
        fa_sm100.flash_attn_func(q, k, v, window_size=[1, 2, 3])
    with pytest.raises(ValueError, match="must be a torch.Tensor"):
        fa_sm100.flash_attn_func(q, k, "v")


def test_an_active_probe_skips_the_plans(fake_sm90):
    """A cost probe changes the compiled kernel while it is active: calls then plan again."""
    from fa_sm100.hopper import probes

    q, k, v = bshd(1, 128, 2, 128), bshd(1, 128, 2, 128), bshd(1, 128, 2, 128)
    fwd_interface.sm90_fwd(q, k, v)
    with probes.probe("correction_vote", "skip_zero"):
        assert PLANNING & set(package_calls(lambda: fwd_interface.sm90_fwd(q, k, v)))
        assert PLANNING & set(package_calls(lambda: fwd_interface.sm90_fwd(q, k, v)))
    assert not PLANNING & set(package_calls(lambda: fwd_interface.sm90_fwd(q, k, v)))


def test_out_and_lse_buffers_are_written_not_allocated(fake_sm90):
    """``out=`` / ``lse=`` reach the kernel as given and are returned; a wrong buffer raises."""
    q, k, v = bshd(1, 128, 2, 64), bshd(1, 128, 2, 64), bshd(1, 128, 2, 64)
    out = bshd(1, 128, 2, 64)
    lse = torch.empty(1, 2, 128, device="cuda", dtype=torch.float32)
    for _ in range(2):  # the first call and a warm one
        got, got_lse = fa_sm100.flash_attn_func(q, k, v, return_lse=True, out=out, lse=lse)
        assert got is out and got_lse is lse
        kind, args = fake_sm90[-1]
        assert args[3] is out and args[4] is lse
    with pytest.raises(ValueError, match="out must be"):
        fa_sm100.flash_attn_func(q, k, v, out=bshd(1, 64, 2, 64))


def test_return_attn_probs_gives_out_lse_and_no_probabilities(fake_sm90):
    q, k, v = bshd(1, 128, 2, 64), bshd(1, 128, 2, 64), bshd(1, 128, 2, 64)
    out, lse, probs = fa_sm100.flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.shape == (1, 128, 2, 64) and lse.shape == (1, 2, 128) and probs is None


def test_sm100_warm_calls_plan_nothing_and_take_buffers(monkeypatch, fake_sm100):
    """The SM100 forward's plan, on a faked sm_100 device (no SM100 code runs here): a warm
    call does no planning, and ``out`` / ``lse`` buffers reach the kernel and come back."""
    from fa_sm100.sm100 import interface as sm100

    monkeypatch.setattr(sm100, "_plans", type(sm100._plans)())
    monkeypatch.setattr(public, "_calls", type(public._calls)())
    with FakeTensorMode():
        q, k, v = bshd(1, 256, 4, 128), bshd(1, 256, 2, 128), bshd(1, 256, 2, 128)
        cold = package_calls(lambda: fa_sm100.flash_attn_func(q, k, v, causal=True))
        assert PLANNING & set(cold)
        warm = package_calls(lambda: fa_sm100.flash_attn_func(q, k, v, causal=True))
        assert not (PLANNING | {"config_for_problem", "select_config"}) & set(warm), warm
        out = bshd(1, 256, 4, 128)
        lse = torch.empty(1, 4, 256, device="cuda", dtype=torch.float32)
        got, got_lse = fa_sm100.flash_attn_func(q, k, v, causal=True, return_lse=True,
                                                out=out, lse=lse)
        assert got is out and got_lse is lse
        kind, _, args = fake_sm100[-1]
        assert kind == "sm100_fwd" and args[3] is out and args[4] is lse
        with pytest.raises(ValueError, match="lse buffer needs return_lse"):
            fa_sm100.flash_attn_func(q, k, v, causal=True, lse=lse)


def _visible(sq, sk, left, right):
    """The (row, key) pairs a band shows, by the element-wise rule (None: unbounded)."""
    return {(i, j) for i in range(sq) for j in range(sk)
            if (right is None or j <= i + sk - sq + right)
            and (left is None or j >= i + sk - sq - left)}


@pytest.mark.parametrize("seqlens, window", [((256, 96), (32, None)), ((96, 256), (None, 40)),
                                             ((200, 64), (-20, None))])
def test_the_backward_plan_launches_the_band_of_its_problem(fake_sm90, seqlens, window):
    """The window a warm backward launches shows the keys of the problem's band (with more
    queries than keys, an unbounded side must stay unbounded for every row)."""
    sq, sk = seqlens
    q, out, dout = (bshd(1, sq, 2, 64) for _ in range(3))
    k, v = bshd(1, sk, 2, 64), bshd(1, sk, 2, 64)
    lse = torch.empty(1, 2, sq, device="cuda", dtype=torch.float32)
    for _ in range(2):  # the first call and a warm one
        bwd_interface.sm90_bwd(dout, q, k, v, out, lse, window_size=window)
        main = [args for kind, args in fake_sm90 if kind == "sm90_bwd_main"][-1]
        left, right = main[12:14]  # after the scale and the cap (launch_args)
        assert _visible(sq, sk, left, right) == _visible(sq, sk, *window)


def test_a_warm_training_step_does_no_planning(fake_sm90):
    """A call with gradients keeps the forward's plan and, after the first backward, the
    backward's: the second step's forward and backward plan nothing. (Autograd's engine needs
    real CUDA tensors, so the step's two halves are called as autograd calls them.)"""
    from fa_sm100.autograd import EagerAttention

    q, k, v, dout = (bshd(2, 256, 4, 128) for _ in range(4))
    # what flash_attn_func keeps for a causal call with gradients
    call = public._build_call(q, k, v, None, True, (-1, -1), 0.0, False, None, False, True,
                              False)
    ctx = SimpleNamespace(save_for_backward=lambda *t: None,
                          mark_non_differentiable=lambda *t: None)

    def step():
        out, lse = EagerAttention.forward(ctx, q, k, v, call)
        return call.backward(dout, q, k, v, out, lse)

    cold = package_calls(step)
    assert PLANNING & set(cold)  # the first backward plans
    n_cold = len(fake_sm90)
    warm = package_calls(step)
    assert not PLANNING & set(warm), sorted(PLANNING & set(warm))
    kinds = [kind for kind, _ in fake_sm90]
    assert kinds[n_cold:] == kinds[:n_cold] and kinds[0] == "sm90_fwd"


def test_sm100_varlen_call_launches_the_packed_problem(monkeypatch, fake_sm100):
    """``flash_attn_varlen_func`` on a faked sm_100 device (no SM100 code runs here): the
    SM100 varlen kernel gets the packed tensors as a batch of one, the offsets, the longest
    query sequence and window bounds that cover every key; a warm call plans nothing."""
    from fa_sm100.sm100 import interface as sm100
    from fa_sm100.varlen import VARLEN_UNBOUNDED

    monkeypatch.setattr(sm100, "_varlen_plans", type(sm100._varlen_plans)())
    monkeypatch.setattr(public, "_varlen_forwards", {})
    with FakeTensorMode():
        q = torch.empty(300, 4, 128, device="cuda", dtype=torch.bfloat16)
        k = v = torch.empty(500, 2, 128, device="cuda", dtype=torch.bfloat16)
        cu_q = torch.empty(4, device="cuda", dtype=torch.int32)
        cu_k = torch.empty(4, device="cuda", dtype=torch.int32)
        call = lambda: fa_sm100.flash_attn_varlen_func(  # noqa: E731
            q, k, v, cu_q, cu_k, 200, 400, causal=True, return_lse=True)
        cold = package_calls(call)
        assert PLANNING & set(cold) or "validate_varlen_inputs" in cold
        warm = package_calls(call)
        assert not ({"validate_varlen_inputs", "select_config"} | PLANNING) & set(warm), warm
    kind, key, args = fake_sm100[-1]
    cfg = key[0]
    assert kind == "sm100_fwd" and cfg.varlen and cfg.causal and cfg.is_local
    assert args[0].shape == (1, 300, 4, 128) and args[3].shape == (1, 300, 4, 128)
    assert args[4].shape == (1, 4, 300)  # LSE (h, total_q) as a batch of one
    left, right = args[7:9]
    assert left == VARLEN_UNBOUNDED and right == 0  # causal: right bound 0, left unbounded
    assert args[9] is cu_q and args[10] is cu_k and args[11] is None  # no seqused_k
    assert args[12] is None and args[13] == 200  # no page table; the longest query sequence


def test_sm100_paged_call_launches_its_pages(monkeypatch, fake_sm100):
    """``sm100_fwd_paged`` on a faked sm_100 device (no SM100 code runs here): a paged kernel
    (``page_size`` from the pages' shape) gets the pages as packed rows, the used keys and the
    flat page table; pages that one TMA copy per key block cannot read raise ValueError first."""
    from fa_sm100.sm100 import interface as sm100

    monkeypatch.setattr(sm100, "_paged_plans", type(sm100._paged_plans)())
    with FakeTensorMode():
        q = torch.empty(8, 4, 128, device="cuda", dtype=torch.bfloat16)
        pages = torch.empty(10, 256, 2, 128, device="cuda", dtype=torch.bfloat16)
        cu_q = torch.empty(3, device="cuda", dtype=torch.int32)
        table = torch.empty(2, 5, device="cuda", dtype=torch.int32)
        used = torch.empty(2, device="cuda", dtype=torch.int32)
        sm100.sm100_fwd_paged(q, pages, pages, cu_q, 4, table, used, 1280, return_lse=True)
        small = torch.empty(10, 64, 2, 128, device="cuda", dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="multiple of 128"):
            sm100.sm100_fwd_paged(q, small, small, cu_q, 4, table, used, 1280)
        with pytest.raises(ValueError, match="seqused_k"):
            sm100.sm100_fwd_paged(q, pages, pages, cu_q, 4, table, None, 1280)
    kind, key, args = fake_sm100[-1]
    cfg = key[0]
    assert kind == "sm100_fwd" and cfg.varlen and cfg.page_size == 256
    assert args[1].shape == (1, 2560, 2, 128)  # the pages as packed rows, a batch of one
    assert args[11] is used and args[12].shape == (10,)  # used keys, the flat page table


def test_sm100_backward_launches_pre_main_post_on_a_faked_sm100(fake_sm100):
    """Gradients on an sm_100 device go to ``sm100_bwd`` (faked device: no SM100 code runs):
    preprocess, main kernel, dq postprocess in order, with the main kernel writing dk and dv
    itself and the postprocess dq; what it has no kernel for raises before any launch;
    deterministic=True passes the preprocess-zeroed dQ semaphores to the main kernel. A
    window and a cap reach the main kernel as launch arguments (the window as
    ``bands.kernel_window`` gives it), its config saying only that there are."""
    from fa_sm100.autograd import check_backward_supported
    from fa_sm100.bands import kernel_window
    from fa_sm100.sm100.bwd_interface import sm100_bwd

    with FakeTensorMode():
        q, k, v = bshd(2, 300, 4, 128), bshd(2, 200, 1, 128), bshd(2, 200, 1, 128)
        out, dout = bshd(2, 300, 4, 128), bshd(2, 300, 4, 128)
        lse = torch.empty(2, 4, 300, device="cuda", dtype=torch.float32)
        check_backward_supported(q, k, v)  # an SM100 backward exists for head dim 128
        with pytest.raises(ValueError, match="no SM100 backward"):
            check_backward_supported(bshd(1, 8, 1, 192), bshd(1, 8, 1, 192), bshd(1, 8, 1, 128))
        sm100_bwd(dout, q, k, v, out, lse, deterministic=True)
        ordered = fake_sm100[:]
        fake_sm100.clear()
        sm100_bwd(dout, q, k, v, out, lse, causal=True, window_size=(64, None), softcap=5.0)
        windowed = fake_sm100[1]
        fake_sm100.clear()
        dq, dk, dv = sm100_bwd(dout, q, k, v, out, lse, causal=True)
    assert [kind for kind, _, _ in fake_sm100] == ["sm100_bwd_pre", "sm100_bwd_main",
                                                    "sm100_bwd_post"]
    main = fake_sm100[1][2]
    assert main[7] is dk and main[8] is dv and main[0] is q
    assert fake_sm100[2][2][1] is dq
    cfg = fake_sm100[1][1][0]
    assert cfg.causal and cfg.qhead_per_kvhead == 4 and cfg.head_dim == 128
    # the accumulator: padded query rows (300 -> 384), head_dim floats each
    assert tuple(main[6].shape) == (2, 4, 384, 128)
    assert not cfg.local and not cfg.softcap
    # deterministic: the main kernel gets the semaphores, one per (batch, head, query block),
    # which the preprocess zeroes first (it takes the same tensor); otherwise none
    assert main[9] is None and not cfg.deterministic
    assert ordered[1][1][0].deterministic
    sem = ordered[1][2][9]
    assert tuple(sem.shape) == (2, 4, 3) and sem.dtype == torch.int32 and ordered[0][2][6] is sem
    cfg_w, args_w = windowed[1][0], windowed[2]
    assert cfg_w.local and cfg_w.softcap and cfg_w.causal
    assert args_w[11] == 5.0 and tuple(args_w[12:14]) == kernel_window(True, (64, None), 300, 200)


def _workspace_of(launches, since):
    """The workspace tensors (LSE2, Delta, dQ accumulator, semaphores) of the first
    preprocess launched from index ``since`` on."""
    kind, args = next((kind, args) for kind, args in launches[since:] if kind == "sm90_bwd_pre")
    return args[3:7]


def _backward(q, k, v, out, dout, lse, **options):
    return bwd_interface.sm90_bwd(dout, q, k, v, out, lse, **options)


def test_warm_backwards_on_one_stream_share_its_workspace_and_no_other(fake_sm90, streams):
    q, k, v, out, dout = (bshd(2, 256, 4, 128) for _ in range(5))
    lse = torch.empty(2, 4, 256, device="cuda", dtype=torch.float32)
    args = (q, k, v, out, dout, lse)
    marks = []
    for stream, capturing in ((1, False), (1, False), (2, False), (1, False), (1, True),
                              (1, True)):
        streams.current, streams.capturing = stream, capturing
        marks.append(len(fake_sm90))
        _backward(*args, causal=True)
    ws = [_workspace_of(fake_sm90, m)[:3] for m in marks]  # LSE2, Delta, dQ accumulator
    same = lambda a, b: all(x is y for x, y in zip(a, b))  # noqa: E731
    assert same(ws[0], ws[1]) and same(ws[0], ws[3])  # stream 1 keeps its buffer
    assert not any(x is y for x, y in zip(ws[0], ws[2]))  # stream 2 has its own
    # under graph capture every call is fresh: a graph never shares an eager buffer
    for captured in ws[4:]:
        assert not any(x is y for x in captured for w in ws[:4] for y in w)
    assert not any(x is y for x, y in zip(ws[4], ws[5]))


def test_a_kept_workspace_grows_to_fit_and_large_ones_stay_fresh(fake_sm90, streams,
                                                                  monkeypatch):
    small = [bshd(1, 128, 2, 64) for _ in range(5)]
    large = [bshd(2, 1024, 4, 64) for _ in range(5)]
    for tensors, seqlen, heads in ((small, 128, 2), (large, 1024, 4), (small, 128, 2)):
        lse = torch.empty(tensors[0].shape[0], heads, seqlen, device="cuda")
        mark = len(fake_sm90)
        _backward(*tensors, lse)
        lse2, delta, acc, sem = _workspace_of(fake_sm90, mark)
        # every view lies inside the one buffer they share
        storage = lse2.untyped_storage().nbytes()
        for t in (lse2, delta, acc, sem):
            assert t.untyped_storage().nbytes() == storage
            assert (t.storage_offset() + sum((n - 1) * st for n, st in
                                             zip(t.shape, t.stride())) + 1) * 4 <= storage
    monkeypatch.setattr(bwd_interface, "KEPT_WORKSPACE_BYTES", 1024)
    lse = torch.empty(1, 2, 128, device="cuda")
    marks = [len(fake_sm90), None]
    _backward(*small, lse)
    marks[1] = len(fake_sm90)
    _backward(*small, lse)
    first, second = (_workspace_of(fake_sm90, m) for m in marks)
    assert not any(x is y for x, y in zip(first, second))


@pytest.mark.parametrize("overrides", [dict(gqa_reduce="atomic"), dict(pre_ctas=32)])
def test_buffers_that_must_arrive_zeroed_are_never_kept(fake_sm90, streams, overrides):
    """GQA's atomic dK/dV accumulators, and the semaphores a preprocess beside the main kernel
    counts in, arrive zeroed: each call allocates them fresh; the rest is kept."""
    from fa_sm100.hopper.bwd_defaults import select_bwd_config

    q, out, dout = (bshd(1, 256, 8, 64) for _ in range(3))
    k, v = bshd(1, 256, 2, 64), bshd(1, 256, 2, 64)
    lse = torch.empty(1, 8, 256, device="cuda")
    config = select_bwd_config(64, qhead_per_kvhead=4, seqlen_q=256, seqlen_k=256, **overrides)
    for _ in range(2):
        _backward(q, k, v, out, dout, lse, config=config)
    first, second = [args for kind, args in fake_sm90 if kind == "sm90_bwd_main"]
    # (q, k, v, dout, LSE2, Delta, dQ accumulator, dK, dV, semaphores, ...)
    assert all(a is b for a, b in zip(first[4:7], second[4:7]))
    zeroed = [9] if config.pre_ctas else [7, 8]
    assert all(first[i] is not second[i] for i in zeroed)
