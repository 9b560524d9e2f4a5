"""The SM90 backward's preprocess and postprocess kernels, EMULATED on the CPU: their sm_90a
PTX (the code the H200 runs, minus the TVM-FFI wrapper) executed by ``fa_sm100.ptxemu`` on
small problems, against float64 references (STYLE.md rule) and, where the kernel's order of
float32 operations is fixed, bit for bit against the same operations in torch."""

import math

import pytest
import torch

cutlass = pytest.importorskip("cutlass")

from cutlass.cute.runtime import from_dlpack, make_fake_stream  # noqa: E402

from fa_sm100.config import cutlass_dtype  # noqa: E402
from fa_sm100.hopper.bwd_config import dq_fragment_index
from fa_sm100.hopper.bwd_defaults import select_bwd_config  # noqa: E402
from fa_sm100.compile_tools import fake_rowmajor as _rowmajor  # noqa: E402
from fa_sm100.hopper.bwd_prepost import BwdPostprocess, BwdPreprocess, DqPostprocess  # noqa: E402
from fa_sm100.ptxemu import EmulationError, capture_launch, emulate  # noqa: E402
from fa_sm100.testing import check_against_reference  # noqa: E402
from fa_sm100.varlen import first_block, packed_blocks  # noqa: E402

pytestmark = pytest.mark.compile


def _run(kernel, fakes, tensors, scalars=(), max_steps=2_000_000, varlen=None,
         max_seqlen=None):
    """Capture the sm_90a launch of ``kernel`` and emulate it on the CPU tensors
    (``max_steps``: the emulator's limit per CTA). ``varlen``: the int32 tensors of the
    varlen arguments after the scalars (cu_seqlens[, seqused]), and ``max_seqlen`` the
    longest sequence (the grid); None for a padded batch."""
    import cuda.bindings.driver as cuda

    n = 2 if isinstance(kernel, BwdPostprocess) else 1
    varlen = list(varlen or []) + [None] * (n - len(varlen or []))
    fake_tail = tuple(None if t is None else _rowmajor(cutlass.Int32, t.shape, 4) for t in varlen)
    real_tail = tuple(None if t is None else from_dlpack(t) for t in varlen)
    fake_tail += (None if max_seqlen is None else cutlass.Int32(1),)
    real_tail += (None if max_seqlen is None else cutlass.Int32(max_seqlen),)
    real = tuple(from_dlpack(t) for t in tensors) + tuple(scalars) + real_tail + (
        cuda.CUstream(0),)
    cap = capture_launch(kernel, tuple(fakes) + tuple(scalars) + fake_tail + (make_fake_stream(),),
                         real, arch="sm_90a")
    emulate(cap, list(tensors) + [t for t in varlen if t is not None], seed=0,
            max_steps=max_steps)


@pytest.mark.parametrize("head_dim,head_dim_v,dtype,tile_m,n_sem,zero_dq",
                         [(64, 64, "bfloat16", 64, 1, True), (96, 96, "float16", 64, 2, True),
                          (128, 128, "bfloat16", 80, 1, True), (192, 128, "bfloat16", 64, 2, True),
                          (128, 128, "bfloat16", 80, 3, False)])
def test_preprocess_delta_lse2_padding_and_zeroed_dq(head_dim, head_dim_v, dtype, tile_m, n_sem,
                                                     zero_dq):
    """Delta = rowsum(O * dO) (16 lanes per row, butterfly sum) within the error rule;
    LSE2 = LSE * log2(e) bit for bit, -inf (a row that sees no key) -> +inf; the padding rows
    seqlen_q <= i < seqlen_q_pad get Delta 0 and LSE2 +inf. 37 rows: a partial last CTA.
    The dQ semaphores come out zero wherever they started (Note [chained launches]), and with
    ``zero_dq`` the dQ accumulator (seqlen_q_pad x head_dim floats per head, in tile_m-row
    blocks); without it (Note [dQ first store]) the preprocess leaves the accumulator alone."""
    torch.manual_seed(head_dim)
    b, sq, h = 2, 37, 3
    pad = -(-sq // tile_m) * tile_m
    t = getattr(torch, dtype)
    dt, f32 = cutlass_dtype(dtype), cutlass.Float32
    o, do = torch.randn(b, sq, h, head_dim_v).to(t), torch.randn(b, sq, h, head_dim_v).to(t)
    lse = torch.randn(b, h, sq) * 4
    lse[1, 2, 5] = -math.inf
    lse2 = torch.full((b, h, pad), 7.0)  # poisoned: every element must be written
    delta = torch.full((b, h, pad), 7.0)
    dq_acc = torch.full((b, h, pad // tile_m, tile_m * head_dim), math.nan)
    dq_sem = torch.full((b, h, n_sem), 7, dtype=torch.int32)
    _run(BwdPreprocess(head_dim_v, head_dim, pdl=True, zero_dq=zero_dq),
         (_rowmajor(dt, o.shape), _rowmajor(dt, do.shape), _rowmajor(f32, lse.shape),
          _rowmajor(f32, lse2.shape), _rowmajor(f32, delta.shape),
          _rowmajor(f32, dq_acc.shape), _rowmajor(cutlass.Int32, dq_sem.shape, 4)),
         (o, do, lse, lse2, delta, dq_acc, dq_sem))
    if zero_dq:
        assert torch.equal(dq_acc, torch.zeros_like(dq_acc))
    else:
        assert dq_acc.isnan().all()
    assert torch.equal(dq_sem, torch.zeros_like(dq_sem))
    ref64 = (o.double() * do.double()).sum(-1).transpose(1, 2)
    plain = (o.float() * do.float()).sum(-1).transpose(1, 2)
    check_against_reference(delta[..., :sq], ref64, plain, what="Delta")
    want = lse * torch.tensor(math.log2(math.e), dtype=torch.float32)
    want[1, 2, 5] = math.inf
    assert torch.equal(lse2[..., :sq], want)
    assert torch.equal(delta[..., sq:], torch.zeros(b, h, pad - sq))
    assert torch.equal(lse2[..., sq:], torch.full((b, h, pad - sq), math.inf))


@pytest.mark.parametrize("head_dim,sq,tile_m,ctas,zero_dq,chunk",
                         [(256, 300, 64, 4, True, 8), (256, 300, 64, 3, False, 2),
                          (128, 80, 80, 3, False, 8), (64, 37, 64, 1, True, 8)],
                         ids=["d256-5units-per-head", "d256-chunks-2-2-1", "d128-1unit",
                              "d64-one-cta"])
def test_persistent_preprocess_counts_every_row_once(monkeypatch, head_dim, sq, tile_m, ctas,
                                                     zero_dq, chunk):
    """Note [Preprocess beside the main kernel]: ``ctas`` persistent CTAs (O and dO by TMA, the
    LSE by ``cp.async``, PRE_STAGES units in flight) write the same Delta (bit for bit: the
    same operations per row) and LSE2 as one CTA per 16 rows, zero the dQ accumulator with
    ``zero_dq``, leave the dQ semaphores alone (they arrive zeroed) and add exactly
    seqlen_q_pad rows to each (batch, head)'s count, the last semaphore, whatever the split:
    units of 64 rows at hdim 256 (five per head: one chunk, or with PRE_CHUNK_UNITS = 2 chunks
    of 2, 2 and 1 units, the last with an empty slot), one unit per head at hdim 128 and 64,
    more units than CTAs and fewer. The emulator also holds every SMEM access within the
    launch's ``smem_bytes()`` and every LSE read behind its copy's wait."""
    from fa_sm100.hopper import bwd_prepost

    monkeypatch.setattr(bwd_prepost, "PRE_CHUNK_UNITS", chunk)
    torch.manual_seed(sq)
    b, h, n_sem = 2, 3, 4
    pad = -(-sq // tile_m) * tile_m
    dt, f32 = cutlass_dtype("bfloat16"), cutlass.Float32
    o = torch.randn(b, sq, h, head_dim).bfloat16()
    do = torch.randn(b, sq, h, head_dim).bfloat16()
    lse = torch.randn(b, h, sq) * 4
    lse[0, 1, sq // 2] = -math.inf
    fakes = (_rowmajor(dt, o.shape), _rowmajor(dt, do.shape), _rowmajor(f32, lse.shape),
             _rowmajor(f32, (b, h, pad)), _rowmajor(f32, (b, h, pad)),
             _rowmajor(f32, (b, h, pad // tile_m, tile_m * head_dim)),
             _rowmajor(cutlass.Int32, (b, h, n_sem), 4))
    out = {}
    for n in (0, ctas):
        lse2, delta = torch.full((b, h, pad), 7.0), torch.full((b, h, pad), 7.0)
        dq_acc = torch.full((b, h, pad // tile_m, tile_m * head_dim), math.nan)
        dq_sem = torch.full((b, h, n_sem), 5, dtype=torch.int32)
        dq_sem[..., -1] = 0  # the count arrives zeroed, the other semaphores too (5: untouched)
        _run(BwdPreprocess(head_dim, head_dim, pdl=True, zero_dq=zero_dq, ctas=n), fakes,
             (o, do, lse, lse2, delta, dq_acc, dq_sem), max_steps=20_000_000)
        out[n] = lse2, delta, dq_acc, dq_sem
    lse2, delta, dq_acc, dq_sem = out[ctas]
    assert torch.equal(lse2, out[0][0]) and torch.equal(delta, out[0][1])
    assert lse2[0, 1, sq // 2] == math.inf and (lse2[..., sq:] == math.inf).all()
    assert (delta[..., sq:] == 0).all()
    assert torch.equal(dq_acc, torch.zeros_like(dq_acc)) if zero_dq else dq_acc.isnan().all()
    assert torch.equal(dq_sem[..., :-1], torch.full((b, h, n_sem - 1), 5, dtype=torch.int32))
    assert torch.equal(dq_sem[..., -1], torch.full((b, h), pad, dtype=torch.int32))
    # one CTA per 16 rows zeroes every semaphore and counts nothing
    assert torch.equal(out[0][3], torch.zeros_like(dq_sem))


@pytest.mark.parametrize("head_dim,group,pitch,scale", [
    (128, 1, 128, 1.0),   # GQA dK/dV reduced with atomics: one buffer per KV head
    (96, 3, 96, 1.0),     # GQA dK/dV buffers: three query heads summed per KV head
    (64, 2, 72, 0.125),   # padded rows and a scale: the kernel's general contract
])
def test_postprocess_sums_groups_scales_and_converts(head_dim, group, pitch, scale):
    """out[b, i, h, :] = scale * sum_g acc[b, h G + g, i, :hdim] in float32, in group order,
    then rounded to bf16: bit for bit the same operations in torch, and within the error rule
    of the float64 sum. Accumulator rows past seqlen and columns past hdim are never read into
    the output (they hold NaN)."""
    torch.manual_seed(group)
    b, s, h, s_pad = 2, 21, 2, 64
    dt, f32 = cutlass_dtype("bfloat16"), cutlass.Float32
    acc = torch.full((b, h * group, s_pad, pitch), math.nan)
    acc[:, :, :s, :head_dim] = torch.randn(b, h * group, s, head_dim) * 3
    out = torch.full((b, s, h, head_dim), 7.0).bfloat16()
    _run(BwdPostprocess(head_dim, group, pdl=True), (_rowmajor(f32, acc.shape), _rowmajor(dt, out.shape)),
         (acc, out), scalars=(f32(scale),))
    parts = acc[:, :, :s, :head_dim].reshape(b, h, group, s, head_dim)
    total = parts[:, :, 0]
    for g in range(1, group):
        total = total + parts[:, :, g]
    want = (total * torch.tensor(scale, dtype=torch.float32)).bfloat16().transpose(1, 2)
    assert torch.equal(out, want)
    ref64 = (parts.double().sum(2) * scale).transpose(1, 2)
    check_against_reference(out, ref64, want, what="postprocess")


@pytest.mark.parametrize("overrides", [dict(head_dim=128, tile_m=64, sdp_swap_ab=False),
                                       dict(head_dim=64),
                                       dict(head_dim=96, dtype="float16"), dict(head_dim=192),
                                       dict(head_dim=256),
                                       dict(head_dim=128, tile_m=80, sdp_swap_ab=True),
                                       dict(head_dim=128, causal=True, early_dq_post=True),
                                       dict(head_dim=64, early_dq_post=True)],
                         ids=["d128-split-columns", "d64-tile_m128-split-rows", "d96-fp16",
                              "d192", "d256", "d128-tile_m80-transposed",
                              "d128-causal-early-post", "d64-early-post"])
def test_dq_postprocess_inverts_the_fragment_order(overrides):
    """Note [dQ in fragment order]: a row-major dQ tile written into the accumulator at
    ``dq_fragment_index`` (the PTX ISA's WGMMA accumulator layout, in Python) comes back out of
    ``DqPostprocess`` (which maps registers to rows and columns with the kernel's own tiled
    MMA) as scale * tile in the output dtype, bit for bit, for every row below seqlen_q of a
    ragged last block; two derivations of the same layout that must agree. With first stores
    (Note [dQ first store]; "red" dQ at hdim 256 has none) a block whose semaphore is 0 comes
    out as zeros whatever its accumulator holds (NaN here), the others as they are. With
    ``early_dq_post`` (Note [dQ postprocess in the tail]) each CTA first waits for the
    (batch, head)'s count of finished main-kernel CTAs, the last semaphore, to reach its number
    of key blocks: at that count it runs within a step limit of the emulator; one short, it
    polls until the limit stops it (the emulator runs no main kernel to finish)."""
    cfg = select_bwd_config(**overrides)
    tm, d = cfg.tile_m, cfg.head_dim
    b, h, s = 1, 2, tm + 37
    n_m = -(-s // tm)
    torch.manual_seed(d)
    tiles = torch.randn(b, h, n_m, tm, d) * 2
    index = torch.tensor([[dq_fragment_index(cfg, r, c) for c in range(d)] for r in range(tm)])
    acc = torch.empty(b, h, n_m, tm * d)
    acc[..., index.flatten()] = tiles.reshape(b, h, n_m, tm * d)
    sem = torch.full((b, h, cfg.dq_sem_slots(n_m)), 2, dtype=torch.int32)
    # the finished-CTA count: the last semaphore, or the one before the tile counter and the
    # persistent preprocess's row count (pre_ctas, hdim 128's default), where they are
    done = cfg.dq_sem_slots(n_m) - 1 - cfg.slots_after_finished_count
    if cfg.early_dq_post:  # every key block's CTA is done
        sem[:, :, done] = cfg.num_key_blocks(s)
    if cfg.first_stores_dq:  # head 1's first block: no CTA reached it
        sem[0, 1, 0] = 0
        acc[0, 1, 0] = math.nan
        tiles[0, 1, 0] = 0.0
    t = getattr(torch, cfg.dtype)
    out = torch.full((b, s, h, d), 7.0).to(t)
    dt, f32 = cutlass_dtype(cfg.dtype), cutlass.Float32
    fakes = (_rowmajor(f32, acc.shape), _rowmajor(cutlass.Int32, sem.shape, 4),
             _rowmajor(dt, out.shape))
    scalars = (f32(0.125), cutlass.Int32(s))
    steps = 30_000  # a CTA takes a few thousand; MAX_POLLS polls take several times this
    _run(DqPostprocess(cfg), fakes, (acc, sem, out), scalars, max_steps=steps)
    want = (tiles * 0.125).to(t).reshape(b, h, n_m * tm, d)[:, :, :s].transpose(1, 2)
    assert torch.equal(out, want)
    if cfg.early_dq_post:
        sem[0, 1, done] -= 1  # one CTA of head 1 not done yet
        with pytest.raises(EmulationError, match="step limit"):
            _run(DqPostprocess(cfg), fakes, (acc, sem, out), scalars, max_steps=steps)


def test_varlen_pre_and_postprocesses_use_each_sequences_packed_blocks():
    """Note [Varlen backward], Note [Packed workspace]: the preprocess reads each sequence's
    rows of packed O, dO and LSE (1, total, ...) into its own blocks of the packed workspace
    (from ``first_block``): rows past a sequence's end up to its last block are Delta 0,
    LSE2 +inf and zeroed dQ; the blocks between sequences and past the last are never written
    (a zero-length sequence has none); the dQ postprocess writes each sequence's rows of packed
    dq from its blocks; the GQA dK/dV postprocess writes each sequence's first ``seqused``
    rows of packed dK from its key blocks and leaves the unused rows alone."""
    torch.manual_seed(9)
    lens = [5, 0, 70, 12]
    cu = torch.tensor([0, 5, 5, 75, 87], dtype=torch.int32)
    total, h, d, n = 87, 3, 64, len(lens)
    cfg = select_bwd_config(head_dim=d, varlen=True)
    tm = cfg.tile_m
    blocks = packed_blocks(total, n, tm)
    firsts = [first_block(cu.tolist(), i, tm) for i in range(n)]
    dt, f32 = cutlass_dtype("bfloat16"), cutlass.Float32
    o, do = (torch.randn(1, total, h, d).bfloat16() for _ in range(2))
    lse = torch.randn(1, h, total) * 4
    lse2, delta = torch.full((1, h, blocks * tm), 7.0), torch.full((1, h, blocks * tm), 7.0)
    dq_acc = torch.full((1, h, blocks, tm * d), math.nan)
    dq_sem = torch.full((n, h, 1), 7, dtype=torch.int32)
    fakes = (_rowmajor(dt, o.shape), _rowmajor(dt, do.shape), _rowmajor(f32, lse.shape),
             _rowmajor(f32, lse2.shape), _rowmajor(f32, delta.shape),
             _rowmajor(f32, dq_acc.shape), _rowmajor(cutlass.Int32, dq_sem.shape, 4))
    _run(BwdPreprocess(d, d, pdl=True, tile_m=tm), fakes,
         (o, do, lse, lse2, delta, dq_acc, dq_sem), varlen=[cu], max_seqlen=max(lens))
    assert not dq_sem.any()
    log2e = torch.tensor(math.log2(math.e), dtype=torch.float32)
    written = torch.zeros(blocks, dtype=torch.bool)
    for i, length in enumerate(lens):
        own = -(-length // tm)
        written[firsts[i]:firsts[i] + own] = True
        r0, pad = firsts[i] * tm, own * tm
        rows = slice(int(cu[i]), int(cu[i + 1]))
        ref64 = (o[0, rows].double() * do[0, rows].double()).sum(-1).T
        plain = (o[0, rows].float() * do[0, rows].float()).sum(-1).T
        check_against_reference(delta[0, :, r0:r0 + length], ref64, plain, what=f"Delta {i}")
        assert torch.equal(lse2[0, :, r0:r0 + length], lse[0, :, rows] * log2e)
        assert not delta[0, :, r0 + length:r0 + pad].any()
        assert (lse2[0, :, r0 + length:r0 + pad] == math.inf).all()
    assert not dq_acc[:, :, written].any()
    assert dq_acc[:, :, ~written].isnan().all()  # nobody's blocks: untouched
    rows_left = lse2.view(1, h, blocks, tm)[:, :, ~written]
    assert (rows_left == 7.0).all()
    # dQ: each sequence's blocks (in fragment order) to its rows of packed dq
    tiles = torch.randn(1, h, blocks, tm, d)
    index = torch.tensor([[dq_fragment_index(cfg, r, c) for c in range(d)] for r in range(tm)])
    acc = torch.full((1, h, blocks, tm * d), math.nan)
    acc[..., index.flatten()] = tiles.reshape(1, h, blocks, tm * d)
    acc[:, :, ~written] = math.nan
    dq = torch.full((1, total, h, d), 7.0).bfloat16()
    fakes = (_rowmajor(f32, acc.shape), _rowmajor(cutlass.Int32, dq_sem.shape, 4),
             _rowmajor(dt, dq.shape))
    _run(DqPostprocess(cfg), fakes, (acc, dq_sem, dq),
         (f32(0.5), cutlass.Int32(1)), varlen=[cu], max_seqlen=max(lens))
    for i, length in enumerate(lens):
        seq_tiles = tiles[0, :, firsts[i]:].reshape(h, -1, d)[:, :length]
        want = (seq_tiles * 0.5).bfloat16().transpose(0, 1)
        assert torch.equal(dq[0, int(cu[i]):int(cu[i + 1])], want), f"sequence {i}"
    # GQA dK: 2 query heads per KV head, keys used in part
    group, hk, tn = 2, 2, cfg.tile_n
    used = torch.tensor([5, 0, 30, 12], dtype=torch.int32)
    k_blocks = packed_blocks(total, n, tn)
    acc = torch.full((1, hk * group, k_blocks * tn, d), math.nan)
    for i, length in enumerate(used.tolist()):
        r0 = first_block(cu.tolist(), i, tn) * tn
        acc[0, :, r0:r0 + length] = torch.randn(hk * group, length, d)
    out = torch.full((1, total, hk, d), 7.0).bfloat16()
    _run(BwdPostprocess(d, group, pdl=True, tile_n=tn),
         (_rowmajor(f32, acc.shape), _rowmajor(dt, out.shape)), (acc, out),
         scalars=(f32(1.0),), varlen=[cu, used], max_seqlen=max(lens))
    for i, length in enumerate(used.tolist()):
        first, r0 = int(cu[i]), first_block(cu.tolist(), i, tn) * tn
        parts = acc[0, :, r0:r0 + length].reshape(hk, group, length, d)
        want = (parts[:, 0] + parts[:, 1]).bfloat16().transpose(0, 1)
        assert torch.equal(out[0, first:first + length], want), f"sequence {i}"
        assert (out[0, first + length:int(cu[i + 1])] == 7.0).all(), f"unused rows of {i}"
