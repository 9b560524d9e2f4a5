"""Context parallelism on the CPU: several gloo processes (torch.multiprocessing) run the ring
and the all-to-all with the PyTorch model of the kernels' arithmetic as the local step, against
single-process float64 attention under the project's rule (docs/verification.md): output and
gradients within 2x the error of plain attention in the input precision (+ slack). What is
under test is the parallel part: the layout, the ring's order and overlap, the LSE merge, the
backward's dK/dV return trip, the all-to-alls.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fa_sm100 import context_parallel as cp
from fa_sm100.testing import attention_reference_grads, check_against_reference

# (world, batch, seqlen, heads, kv heads, head dim, causal, variant)
CASES = [
    (2, 1, 64, 2, 2, 32, True, "ring"),
    (3, 2, 96, 4, 2, 16, False, "ring"),
    (4, 1, 128, 4, 1, 32, True, "ring"),
    (2, 1, 64, 4, 2, 32, True, "ulysses"),
    (4, 1, 64, 4, 4, 16, False, "ulysses"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(batch, seqlen, heads, kv_heads, d):
    g = torch.Generator().manual_seed(11)
    shapes = [(batch, seqlen, heads, d), (batch, seqlen, kv_heads, d), (batch, seqlen, kv_heads, d),
              (batch, seqlen, heads, d)]
    return [torch.randn(*s, generator=g).to(torch.bfloat16) for s in shapes]


def _worker(rank, world, port, case, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _, b, s, h, hk, d, causal, variant = case
        q, k, v, dout = (cp.shard(t, rank, world) for t in _inputs(b, s, h, hk, d))
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        fn = cp.ring_attention if variant == "ring" else cp.ulysses_attention
        out = fn(q, k, v, causal=causal)
        out.backward(dout)
        results[rank] = [t.detach() for t in (out, q.grad, k.grad, v.grad)]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[7]}_w{c[0]}_{'causal' if c[6] else 'full'}_h{c[3]}kv{c[4]}")
def test_parallel_attention_matches_one_process_float64(case):
    world, b, s, h, hk, d, causal, _ = case
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_worker, args=(world, _free_port(), case, results), nprocs=world, join=True)
    got = [cp.unshard([results[r][i] for r in range(world)]) for i in range(4)]
    q, k, v, dout = _inputs(b, s, h, hk, d)
    ref_out, _, ref_grads = attention_reference_grads(q, k, v, dout, causal=causal)
    plain_out, _, plain_grads = attention_reference_grads(q, k, v, dout, causal=causal,
                                                          dtype=torch.bfloat16, upcast=False)
    check_against_reference(got[0], ref_out, plain_out, atol=1e-3, what="O")
    for name, g, ref, plain in zip(("dq", "dk", "dv"), got[1:], ref_grads, plain_grads):
        check_against_reference(g, ref, plain, atol=1e-3, what=name)


def test_the_layout_round_trips_and_balances_causal_work():
    x = torch.arange(24).view(1, 24, 1, 1)
    shards = [cp.shard(x, r, 3) for r in range(3)]
    assert torch.equal(cp.unshard(shards), x)
    assert shards[0].flatten().tolist() == [0, 1, 2, 3, 20, 21, 22, 23]
    # causal work per rank (visible query-key pairs of its two chunks) is the same
    work = []
    for r in range(3):
        rows = cp.shard(torch.arange(24).view(1, 24, 1, 1), r, 3).flatten()
        work.append(int((rows + 1).sum()))
    assert len(set(work)) == 1
    with pytest.raises(ValueError, match="equal chunks"):
        cp.shard(torch.zeros(1, 10, 1, 1), 0, 3)


def test_merge_is_the_attention_of_the_union():
    """Two partial attentions merged by LSE equal attention over both key sets, and a part
    with no keys (LSE -inf) changes nothing."""
    from fa_sm100.testing import attention_reference

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 8, 2, 16, generator=g, dtype=torch.float64) for _ in range(3))
    o1, l1 = attention_reference(q, k[:, :3], v[:, :3])
    o2, l2 = attention_reference(q, k[:, 3:], v[:, 3:])
    out, lse = cp.merge(o1.float(), l1.float(), o2, l2.float())
    ref, ref_lse = attention_reference(q, k, v)
    assert torch.allclose(out.double(), ref, atol=1e-5)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-5)
    empty = torch.full_like(l1.float(), -torch.inf)
    out2, lse2 = cp.merge(torch.zeros_like(out), empty, o1, l1.float())
    assert torch.allclose(out2.double(), o1, atol=1e-6) and torch.equal(lse2, l1.float())


def test_the_one_process_ring_is_the_ring():
    """``simulate_ring`` (the schedule without communication, for one GPU) meets the same rule
    on the CPU model."""
    from fa_sm100.testing import attention_reference

    q, k, v, _ = _inputs(1, 96, 4, 2, 32)
    for causal in (False, True):
        out, lse = cp.simulate_ring(q, k, v, 3, causal=causal)
        ref, ref_lse = attention_reference(q, k, v, causal=causal)
        plain, _ = attention_reference(q, k, v, causal=causal, dtype=torch.bfloat16,
                                       upcast=False)
        check_against_reference(out, ref, plain, atol=1e-3, what="O")
        assert torch.allclose(lse.double(), ref_lse, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_the_ring_with_our_kernels_on_one_gpu(sm90_device, world, causal):
    """The ring's steps driven in one process with our kernels (``kernel_steps``) against
    float64, and against one call of ours over the whole sequence."""
    from fa_sm100 import flash_attn_func
    from fa_sm100.testing import attention_reference

    g = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = (torch.randn(2, 8192, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
               for _ in range(3))
    out, lse = cp.simulate_ring(q, k, v, world, causal=causal)
    one, one_lse = flash_attn_func(q, k, v, causal=causal, return_lse=True)
    rows = slice(0, 512)  # the float64 reference on a band of rows (all keys they see)
    ref, _ = attention_reference(q[:, rows], k, v, causal=False) if not causal else \
        attention_reference(q[:, rows], k[:, :512], v[:, :512], causal=True)
    plain, _ = attention_reference(q[:, rows], k if not causal else k[:, :512],
                                   v if not causal else v[:, :512], causal=causal,
                                   dtype=torch.bfloat16, upcast=False)
    check_against_reference(out[:, rows], ref, plain, atol=1e-3, what="O (ring)")
    check_against_reference(one[:, rows], ref, plain, atol=1e-3, what="O (one call)")
    assert torch.allclose(lse, one_lse, atol=1e-3)


# ----------------------------------------------------------------------------- two GPUs

def _gpu_worker(rank, world, port, case, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    try:
        causal, variant, full = case[0], case[1], torch.load(case[2])
        q, k, v, dout = (cp.shard(t, rank, world).cuda() for t in full)
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        fn = cp.ring_attention if variant == "ring" else cp.ulysses_attention
        out = fn(q, k, v, causal=causal)
        out.backward(dout)
        results[rank] = [t.detach().cpu() for t in (out, q.grad, k.grad, v.grad)]
    finally:
        dist.destroy_process_group()


def _two_gpus():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("multi-GPU test: fewer than two CUDA devices on this machine")


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["ring", "ulysses"])
@pytest.mark.parametrize("causal", [False, True])
def test_parallel_attention_on_two_gpus_with_our_kernels(sm90_device, tmp_path, variant, causal):
    """Two NCCL ranks, one per GPU, with our kernels as the local steps (GQA 8 query heads on
    2 K/V heads, 4k tokens): output and gradients against float64 under the project's rule,
    and against one GPU's single call of ours."""
    from fa_sm100 import flash_attn_func
    from fa_sm100.testing import grad_atol

    _two_gpus()
    world, b, s, h, hk, d = 2, 1, 4096, 8, 2, 128
    g = torch.Generator().manual_seed(7)
    full = [torch.randn(b, s, n, d, generator=g).to(torch.bfloat16) for n in (h, hk, hk, h)]
    path = tmp_path / "inputs.pt"
    torch.save(full, path)
    results = mp.Manager().dict()
    mp.spawn(_gpu_worker, args=(world, _free_port(), (causal, variant, str(path)), results),
             nprocs=world, join=True)
    got = [cp.unshard([results[r][i] for r in range(world)]).cuda() for i in range(4)]
    q, k, v, dout = (t.cuda() for t in full)
    ref_out, _, ref_grads = attention_reference_grads(q, k, v, dout, causal=causal)
    plain_out, _, plain_grads = attention_reference_grads(q, k, v, dout, causal=causal,
                                                          dtype=torch.bfloat16, upcast=False)
    check_against_reference(got[0], ref_out, plain_out, atol=1e-3, what="O")
    for name, gr, ref, plain in zip(("dq", "dk", "dv"), got[1:], ref_grads, plain_grads):
        check_against_reference(gr, ref, plain, atol=grad_atol(ref), what=name)
    # one call of ours on one GPU: the same rule, so the parallel path loses nothing
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
    one = flash_attn_func(qs, ks, vs, causal=causal)
    one.backward(dout)
    check_against_reference(one, ref_out, plain_out, atol=1e-3, what="O (one GPU)")
    for name, gr, ref, plain in zip(("dq", "dk", "dv"), (qs.grad, ks.grad, vs.grad), ref_grads,
                                    plain_grads):
        check_against_reference(gr, ref, plain, atol=grad_atol(ref), what=f"{name} (one GPU)")


def test_the_scaling_benchmark_reports_throughput_and_hidden_transfers(tmp_path):
    """cp_bench's summary of one row: tokens per second per GPU divide by the GPUs (not for the
    one-GPU call), causal FLOPs count half the pairs, exposed communication is the ring's time
    over its local steps alone; the figure is written."""
    from fa_sm100.cli import cp_bench

    ms = {"ring fwd": 12.0, "ring fwd+bwd": 40.0, "compute fwd": 10.0, "compute fwd+bwd": 39.0,
          "comm fwd": 1.0, "comm fwd+bwd": 5.0, "one GPU fwd": 20.0, "one GPU fwd+bwd": 70.0}
    causal = cp_bench.summarize({"tokens": 65536, "gpus": 2, "ms": dict(ms)}, 8, True)
    full = cp_bench.summarize({"tokens": 65536, "gpus": 2, "ms": dict(ms)}, 8, False)
    tps = causal["tokens_per_s_per_gpu"]
    assert tps["ring fwd"] == pytest.approx(65536 / 0.012 / 2)
    assert tps["one GPU fwd"] == pytest.approx(65536 / 0.020)
    assert "comm fwd" not in tps and "compute fwd" not in tps
    assert full["tflops_per_gpu"]["ring fwd"] == pytest.approx(2 * causal["tflops_per_gpu"]["ring fwd"])
    # a training step does 3.5x a forward's FLOPs
    assert causal["tflops_per_gpu"]["compute fwd+bwd"] * 39.0 == pytest.approx(
        3.5 * causal["tflops_per_gpu"]["compute fwd"] * 10.0)
    assert causal["exposed_comm_ms"] == {"fwd": pytest.approx(2.0), "fwd+bwd": pytest.approx(1.0)}
    pytest.importorskip("matplotlib")
    cp_bench.plot([causal, full], str(tmp_path / "cp.png"), "test")
    assert (tmp_path / "cp.png").stat().st_size > 0
