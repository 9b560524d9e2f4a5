"""Every launch the public functions make, checked against the signature its kernel is
compiled with, on the CPU.

A kernel is compiled (``cute.compile`` with TVM FFI) against fake arguments: symbolic extents,
static head dims, dtypes, compact or 8-element-aligned strides. At each call TVM FFI checks the
real arguments against them, and a mismatch (a symbol given two values, a wrong dtype, a stride
the kernel assumed aligned) is a ValueError at the first call on a GPU, the only place the
launch runs; for the SM100 kernels no GPU is here at all. So here a CUDA device is faked
(``FakeTensorMode``: no data), each kernel's build runs with ``cute.compile`` replaced by a
recorder of the fake arguments it is given, and each launch's arguments are unified with them:
one value per symbol across all the arguments, static extents and strides equal, symbolic
strides divisible as assumed, dtypes equal, None where the kernel takes none. (The KV-cache
paths slice their metadata tensors on the device, which fake CUDA tensors of a CPU-only torch
cannot do; their kernels are the varlen forwards checked here and the split combine.)"""

from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

cutlass = pytest.importorskip("cutlass")

import cutlass.cute as cute  # noqa: E402
from cutlass.cute.typing import SymInt  # noqa: E402

import fa_sm100  # noqa: E402
from fa_sm100 import interface as public, kernel_cache  # noqa: E402
from fa_sm100.hopper import bwd_interface, interface as fwd_interface  # noqa: E402

DTYPES = {torch.bfloat16: "BFloat16", torch.float16: "Float16", torch.float32: "Float32",
          torch.int32: "Int32"}


def unify(fakes, reals, what):
    """Check ``reals`` (one launch's arguments) against ``fakes`` (its kernel's compile-time
    arguments, the stream left out), as TVM FFI would."""
    assert len(fakes) == len(reals), f"{what}: {len(fakes)} compiled vs {len(reals)} given"
    bound = {}

    def bind(sym, value, where):
        seen = bound.setdefault(id(sym), (value, where))
        assert seen[0] == value, f"{what}: {where} is {value}, the same symbol is {seen[0]} at {seen[1]}"

    for i, (fake, real) in enumerate(zip(fakes, reals)):
        if fake is None or real is None:
            assert fake is None and real is None, f"{what} argument {i}: {fake!r} vs {real!r}"
            continue
        if not hasattr(fake, "shape"):  # a scalar: Int32 takes ints, Float32 numbers
            kind = type(fake).__name__
            ok = (isinstance(real, int) if kind.startswith("Int")
                  else isinstance(real, (int, float)))
            assert ok and not isinstance(real, bool), f"{what} argument {i}: {real!r} for {kind}"
            continue
        assert isinstance(real, torch.Tensor), f"{what} argument {i}: {type(real)} for a tensor"
        assert DTYPES[real.dtype] == str(fake.element_type), (
            f"{what} argument {i}: {real.dtype} for {fake.element_type}")
        assert real.dim() == len(fake.shape), f"{what} argument {i}: {real.shape} vs {fake.shape}"
        for mode, (want, got) in enumerate(zip(fake.shape, real.shape)):
            if isinstance(want, SymInt):
                bind(want, got, f"argument {i} extent {mode}")
            else:
                assert want == got, f"{what} argument {i} extent {mode}: {got} vs {want}"
        for mode, (want, got) in enumerate(zip(fake.stride, real.stride())):
            if real.shape[mode] == 1:
                continue  # a unit mode's stride is never read
            if isinstance(want, SymInt):
                assert got % want.divisibility == 0, (
                    f"{what} argument {i} stride {mode}: {got}, assumed a multiple of "
                    f"{want.divisibility}")
            else:
                assert want == got, f"{what} argument {i} stride {mode}: {got} vs {want}"


@pytest.fixture
def device(monkeypatch):
    """``device(major)``: a faked CUDA device of that compute capability; returns the list of
    (kind, checked launches)."""
    launches = []

    def kernel(kind, key, build):
        captured = []
        with monkeypatch.context() as m:
            m.setattr(cute, "compile", lambda fn, *args, **kw: captured.append(args))
            build()
        (fakes,) = captured
        if fakes and "Stream" in type(fakes[-1]).__name__:
            fakes = fakes[:-1]  # TVM FFI passes the current stream itself

        def launch(*args):
            unify(fakes, args, kind)
            launches.append(kind)
        return launch

    def make(major):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (major, 0))
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda d=None: SimpleNamespace(multi_processor_count=132))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(kernel_cache, "kernel", kernel)
        monkeypatch.setattr(fwd_interface, "aligned", lambda *t: True)  # no pointers here
        monkeypatch.setattr(fwd_interface, "tile_counter",
                            lambda d: torch.zeros(1, dtype=torch.int32, device="cuda"))
        monkeypatch.setattr(bwd_interface, "current_stream_id", lambda d: 1)
        monkeypatch.setattr(bwd_interface, "stream_capturing", lambda: False)
        monkeypatch.setattr(bwd_interface, "_kept", {})
        # masking by values: the fake tensors have none
        monkeypatch.setattr(bwd_interface, "zero_unused_keys", lambda k, v, cu, used: (k, v))
        from fa_sm100.sm100 import interface as sm100

        for module, names in ((fwd_interface, ("_plans", "_varlen_plans")),
                              (bwd_interface, ("_plans", "_varlen_plans")),
                              (sm100, ("_plans", "_varlen_plans", "_paged_plans"))):
            for name in names:
                monkeypatch.setattr(module, name, type(getattr(module, name))())
        monkeypatch.setattr(public, "_calls", type(public._calls)())
        monkeypatch.setattr(public, "_varlen_forwards", {})
        return launches
    with FakeTensorMode():
        yield make


def bshd(b, s, h, d, dtype=torch.bfloat16):
    return torch.empty(b, s, h, d, device="cuda", dtype=dtype)


HEAD_DIMS = [(64, 64), (128, 128), (192, 128), (256, 256)]


@pytest.mark.parametrize("dims", HEAD_DIMS, ids=lambda d: f"d{d[0]}")
def test_sm90_forward_and_backward_launches_match_their_signatures(device, dims):
    launches = device(9)
    d, dv = dims
    for hq, hk, causal, window in ((8, 8, True, (None, None)), (8, 2, False, (100, 0))):
        q, k, v = bshd(2, 300, hq, d), bshd(2, 500, hk, d), bshd(2, 500, hk, dv)
        out, lse = fa_sm100.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                            return_lse=True)
        dout = torch.empty_like(out)
        bwd_interface.sm90_bwd(dout, q, k, v, out, lse, causal=causal, window_size=window)
    assert "sm90_fwd" in launches and "sm90_bwd_main" in launches


# (b, sq, sk, hq, hk, d, config overrides) of the backward's switches that change its launches:
# semaphores, atomics into one buffer per KV head, persistent and fetched tiles
SWITCH_CASES = [
    (1, 100, 333, 4, 4, 128, dict(deterministic=True)),
    (1, 70, 90, 4, 1, 96, dict(gqa_reduce="atomic")),
    (3, 129, 64, 4, 2, 64, dict(deterministic=True, causal=True)),
    (1, 65, 63, 4, 1, 192, dict(gqa_reduce="atomic")),
    (2, 100, 100, 6, 2, 256, dict(deterministic=True)),
    (2, 300, 256, 4, 4, 128, dict(persistent_ctas=132, pre_ctas=0)),
    (2, 300, 256, 4, 4, 64, dict(causal=True, persistent_ctas=132, dynamic_tiles=True)),
]


@pytest.mark.parametrize("case", SWITCH_CASES, ids=lambda c: f"d{c[5]}-h{c[3]}/{c[4]}-{c[6]}")
def test_sm90_backward_switches_launch_as_compiled(device, case):
    from fa_sm100.hopper.bwd_defaults import select_bwd_config

    launches = device(9)
    b, sq, sk, hq, hk, d, overrides = case
    causal = overrides.get("causal", False)
    cfg = select_bwd_config(head_dim=d, qhead_per_kvhead=hq // hk, **overrides)
    dv = cfg.head_dim_v
    q, k, v = bshd(b, sq, hq, d), bshd(b, sk, hk, d), bshd(b, sk, hk, dv)
    out, dout = bshd(b, sq, hq, dv), bshd(b, sq, hq, dv)
    lse = torch.empty(b, hq, sq, device="cuda", dtype=torch.float32)
    bwd_interface.sm90_bwd(dout, q, k, v, out, lse, causal=causal,
                           deterministic=cfg.deterministic, config=cfg)
    assert launches[:2] == ["sm90_bwd_pre", "sm90_bwd_main"]


@pytest.mark.parametrize("used", [False, True])
@pytest.mark.parametrize("dims", HEAD_DIMS, ids=lambda d: f"d{d[0]}")
def test_sm90_varlen_launches_match_their_signatures(device, dims, used):
    from fa_sm100.hopper.bwd_interface import sm90_bwd_varlen

    launches = device(9)
    d, dv = dims
    cu = torch.empty(5, device="cuda", dtype=torch.int32)
    seqused = torch.empty(4, device="cuda", dtype=torch.int32) if used else None
    for hq, hk, causal in ((8, 8, True), (8, 2, False)):
        q, k, v = (torch.empty(700, h, x, device="cuda", dtype=torch.bfloat16)
                   for h, x in ((hq, d), (hk, d), (hk, dv)))
        out, lse = fa_sm100.flash_attn_varlen_func(q, k, v, cu, cu, 300, 300, causal=causal,
                                                   return_lse=True, seqused_k=seqused)
        sm90_bwd_varlen(torch.empty_like(out), q, k, v, out, lse, cu, cu, 300, 300,
                        seqused_k=seqused, causal=causal)
    assert {"sm90_fwd", "sm90_bwd_pre", "sm90_bwd_main"} <= set(launches)


def test_sm100_launches_match_their_signatures(device):
    """The SM100 forward (padded, varlen, paged) and backward: no SM100 GPU runs them here or
    anywhere this project has been, so this is where their launches meet their signatures."""
    from fa_sm100.sm100 import interface as sm100
    from fa_sm100.sm100.bwd_interface import sm100_bwd

    launches = device(10)
    q, k, v = bshd(2, 300, 8, 128), bshd(2, 200, 2, 128), bshd(2, 200, 2, 128)
    out, lse = fa_sm100.flash_attn_func(q, k, v, causal=True, return_lse=True)
    sm100_bwd(torch.empty_like(out), q, k, v, out, lse, causal=True)
    sm100_bwd(torch.empty_like(out), q, k, v, out, lse, deterministic=True)
    qp = torch.empty(700, 8, 128, device="cuda", dtype=torch.bfloat16)
    kp = torch.empty(700, 2, 128, device="cuda", dtype=torch.bfloat16)
    cu = torch.empty(5, device="cuda", dtype=torch.int32)
    fa_sm100.flash_attn_varlen_func(qp, kp, kp, cu, cu, 300, 300, causal=True, return_lse=True)
    pages = torch.empty(10, 256, 2, 128, device="cuda", dtype=torch.bfloat16)
    table = torch.empty(2, 5, device="cuda", dtype=torch.int32)
    used = torch.empty(2, device="cuda", dtype=torch.int32)
    q8 = torch.empty(8, 8, 128, device="cuda", dtype=torch.bfloat16)
    cu3 = torch.empty(3, device="cuda", dtype=torch.int32)
    sm100.sm100_fwd_paged(q8, pages, pages, cu3, 4, table, used, 1280, return_lse=True)
    assert {"sm100_fwd", "sm100_bwd_pre", "sm100_bwd_main", "sm100_bwd_post"} <= set(launches)

