"""The two small kernels around a KV-cache attention (``fa_sm100.kvcache``): what the call
needs before the attention and after it, each one launch, so a decode step is three launches
and nothing waits for the GPU.

- ``KvcachePrepare``, before: from each sequence's cache length (and the page table) the keys
  each chunk of the split-KV call reads, and whether the sequence's values are bad (a length
  below 0, the new tokens past the capacity, a page it uses outside the cache). One thread per
  sequence.
- ``SplitCombine``, after: the chunks' partial outputs merged by their LSE (one softmax over
  the union of the chunks' keys, in float32), pack-GQA's rows back to heads, and NaN for a bad
  sequence. One CTA per (sequence, query head), a thread per output column.

Plain SIMT code for any architecture: compiled for the device's (sm_90a or sm_100a), launched
through TVM FFI on the current stream. The PTX emulator runs both on the CPU
(tests/test_kvcache_kernels.py).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from fa_sm100.compile_tools import fake_rowmajor
from fa_sm100.softmax_math import LOG2_E

PREPARE_THREADS = 128
PACK_VEC = 8  # elements of q one thread copies at a time (16 bytes of bf16 / fp16)
NAN = float("nan")


class KvcachePrepare:
    """mUsed (b, splits) int32: chunk s of sequence i reads keys [s x chunk, s x chunk +
    mUsed[i, s]) of its first min(max(mSeqlens[i] + new, 0), capacity) keys; mBad (b,) int32:
    1 where mSeqlens[i] < 0, mSeqlens[i] + new > capacity, or (``paged``) one of the
    ceil(length / page_size) page-table slots the sequence uses names no page in [0, pages);
    a bad sequence reads no key.
    With ``group`` (one query token's pack-GQA, ``fa_sm100.kvcache._pack_gqa``): mQ (b, hq,
    d) is also copied to mPacked (b x splits x group, hk, d), query head k x group + j of
    sequence i to row (i x splits + s) x group + j of KV head k for every split s, by the CTAs
    after the first ceil(b / PREPARE_THREADS), one per (sequence, split)."""

    def __init__(self, paged: bool, group: int = 0, head_dim: int = 0):
        self.paged, self.group, self.head_dim = paged, group, head_dim

    @cute.jit
    def __call__(self, mSeqlens: cute.Tensor, mTable, mUsed: cute.Tensor, mBad: cute.Tensor,
                 mQ, mPacked, new: Int32, capacity: Int32, chunk: Int32, page_size: Int32,
                 pages: Int32, stream):
        grid = cute.ceil_div(mSeqlens.shape[0], PREPARE_THREADS)
        if const_expr(self.group):
            grid = grid + mUsed.shape[0] * mUsed.shape[1]
        self.kernel(mSeqlens, mTable, mUsed, mBad, mQ, mPacked, new, capacity, chunk,
                    page_size, pages).launch(grid=[grid, 1, 1], block=[PREPARE_THREADS, 1, 1],
                                             stream=stream)

    @cute.kernel
    def kernel(self, mSeqlens: cute.Tensor, mTable, mUsed: cute.Tensor, mBad: cute.Tensor,
               mQ, mPacked, new: Int32, capacity: Int32, chunk: Int32, page_size: Int32,
               pages: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lengths_ctas = cute.ceil_div(mSeqlens.shape[0], PREPARE_THREADS)
        if bidx < lengths_ctas:
            self.lengths(mSeqlens, mTable, mUsed, mBad, bidx * PREPARE_THREADS + tidx, new,
                         capacity, chunk, page_size, pages)
        elif const_expr(self.group):
            self.pack(mQ, mPacked, bidx - lengths_ctas, mUsed.shape[1], tidx)

    @cute.jit
    def lengths(self, mSeqlens, mTable, mUsed, mBad, i: Int32, new: Int32, capacity: Int32,
                chunk: Int32, page_size: Int32, pages: Int32):
        """Sequence i's used keys per chunk and its bad flag."""
        if i < mSeqlens.shape[0]:
            cached = mSeqlens[i]
            bad = Int32(0)
            if cached < 0 or cached + new > capacity:
                bad = Int32(1)
            length = cutlass.max(cutlass.min(cached + new, capacity), 0)
            if const_expr(self.paged):
                for j in cutlass.range(cute.ceil_div(length, page_size), unroll=1):
                    page = mTable[i, j]
                    if page < 0 or page >= pages:
                        bad = Int32(1)
            if bad != 0:  # reads no key (its pages may lie outside the cache)
                length = Int32(0)
            for s in cutlass.range(mUsed.shape[1], unroll=1):
                mUsed[i, s] = cutlass.max(cutlass.min(length - s * chunk, chunk), 0)
            mBad[i] = bad

    @cute.jit
    def pack(self, mQ, mPacked, chunk_index: Int32, splits: Int32, tidx: Int32):
        """The query heads of (sequence, split) ``chunk_index`` into their pack-GQA rows, a
        vector of PACK_VEC elements per thread and step."""
        i = chunk_index // splits
        first_row = chunk_index * self.group
        heads = mQ.shape[1]
        pieces = self.head_dim // PACK_VEC
        for e in cutlass.range(tidx, heads * pieces, PREPARE_THREADS, unroll=1):
            head = e // pieces
            piece = e - head * pieces
            kv_head = head // self.group
            row = first_row + head - kv_head * self.group
            cute.autovec_copy(cute.local_tile(mQ[i, head, None], (PACK_VEC,), (piece,)),
                              cute.local_tile(mPacked[row, kv_head, None], (PACK_VEC,),
                                              (piece,)))


class SplitCombine:
    """out (b, hq, dv) and lse (b, hq) float32 from the split-KV call's partial results over
    pack-GQA rows: mPart (b x splits x group, hk, dv) in the output dtype and mPartLse (hk,
    b x splits x group) float32 (natural log; -inf for a chunk without keys), chunk s of
    sequence i holding query head h = k x group + j in row (i x splits + s) x group + j of KV
    head k. out = sum_s exp(lse_s - lse) part_s with lse = log sum_s exp(lse_s); a row no chunk
    has a key for: 0 and -inf; a sequence with mBad[i] != 0: NaN."""

    def __init__(self, splits: int, group: int, head_dim_v: int):
        self.splits, self.group, self.dv = splits, group, head_dim_v

    @cute.jit
    def __call__(self, mPart: cute.Tensor, mPartLse: cute.Tensor, mBad: cute.Tensor,
                 mOut: cute.Tensor, mLse: cute.Tensor, stream):
        self.kernel(mPart, mPartLse, mBad, mOut, mLse).launch(
            grid=[mOut.shape[1], mOut.shape[0], 1], block=[self.dv, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mPart: cute.Tensor, mPartLse: cute.Tensor, mBad: cute.Tensor,
               mOut: cute.Tensor, mLse: cute.Tensor):
        col, _, _ = cute.arch.thread_idx()
        head, i, _ = cute.arch.block_idx()
        kv_head = head // self.group
        first = i * self.splits * self.group + head - kv_head * self.group  # split 0's row
        top = -Float32.inf
        for s in cutlass.range_constexpr(self.splits):
            top = cutlass.max(top, mPartLse[kv_head, first + s * self.group])
        total = Float32(0.0)
        acc = Float32(0.0)
        if top != -Float32.inf:
            for s in cutlass.range_constexpr(self.splits):
                row = first + s * self.group
                w = cute.math.exp2((mPartLse[kv_head, row] - top) * LOG2_E, fastmath=False)
                total += w
                acc += w * mPart[row, kv_head, col].to(Float32)
            acc = acc / total
        lse = top
        if top != -Float32.inf:
            lse = top + cute.math.log2(total, fastmath=False) / LOG2_E
        if mBad[i] != 0:
            acc = Float32(NAN)
            lse = Float32(NAN)
        mOut[i, head, col] = acc.to(mOut.element_type)
        if col == 0:
            mLse[i, head] = lse


def prepare_arguments(paged: bool, dtype=None, head_dim: int = 0, env_stream: bool = True):
    """The compile-time signature of ``KvcachePrepare``: seqlens (b,), the table (b, slots)
    or None, used (b, splits), bad (b,), with ``dtype`` q (b, hq, head_dim) and the packed
    rows (rows, hk, head_dim) (else None, None), five int32 scalars, the stream (TVM FFI's
    current stream with ``env_stream``). The int32 vectors are 4-byte aligned (used and bad
    are views of one buffer)."""
    from cutlass.cute.runtime import make_fake_stream

    s = cute.sym_int
    ints = lambda *shape: fake_rowmajor(Int32, shape, align=4)  # noqa: E731
    q = packed = None
    if dtype is not None:
        q, packed = (fake_rowmajor(dtype, (s(), s(), head_dim)) for _ in range(2))
    return (ints(s()), ints(s(), s()) if paged else None, ints(s(), s()), ints(s()), q, packed,
            *(Int32(0) for _ in range(5)), make_fake_stream(use_tvm_ffi_env_stream=env_stream))


def combine_arguments(dtype, head_dim_v: int, env_stream: bool = True):
    """The compile-time signature of ``SplitCombine``: part (rows, hk, dv), part LSE (hk,
    rows), bad (b,), out (b, hq, dv), lse (b, hq), the stream (as ``prepare_arguments``)."""
    from cutlass.cute.runtime import make_fake_stream

    s = cute.sym_int
    hk, hq = s(), s()
    return (fake_rowmajor(dtype, (s(), hk, head_dim_v)),
            fake_rowmajor(Float32, (hk, s()), align=4), fake_rowmajor(Int32, (s(),), align=4),
            fake_rowmajor(dtype, (s(), hq, head_dim_v)),
            fake_rowmajor(Float32, (s(), hq), align=4),
            make_fake_stream(use_tvm_ffi_env_stream=env_stream))


def _launchable(kind: str, key, build, arguments, device):
    """The kernel of (kind, key) for ``device``'s architecture (``fa_sm100.kernel_cache``),
    taking torch tensors through TVM FFI on the current stream."""
    from fa_sm100 import kernel_cache
    from fa_sm100.devices import is_sm100
    from fa_sm100.hopper.common import dsl_runtime_arch

    arch = "sm_100a" if is_sm100(device) else "sm_90a"

    def compile_it():
        with dsl_runtime_arch(arch):
            return cute.compile(build(), *arguments(),
                                options=f"--gpu-arch {arch} --enable-tvm-ffi")

    return kernel_cache.kernel(kind, (key, arch), compile_it)


def prepare(seqlens, table, splits: int, chunk: int, new: int, capacity: int,
            page_size: int, pages: int, q=None, heads_kv: int = 0):
    """``KvcachePrepare`` on the GPU: (used (b, splits) int32, bad (b,) int32, and with q (b,
    1, hq, d) its pack-GQA rows (b x splits x group, heads_kv, d), else None)."""
    import torch

    from fa_sm100.config import cutlass_dtype, normalize_dtype

    paged = table is not None
    b = seqlens.shape[0]
    group = d = 0
    dtype = None
    if q is not None:
        group, d = q.shape[2] // heads_kv, q.shape[3]
        dtype = normalize_dtype(q.dtype)
    run = _launchable("kvcache_prepare", (paged, group, d, dtype),
                      lambda: KvcachePrepare(paged, group, d),
                      lambda: prepare_arguments(paged, dtype and cutlass_dtype(dtype), d),
                      seqlens.device)
    both = torch.empty(b * (splits + 1), dtype=torch.int32, device=seqlens.device)
    used, bad = both[:b * splits].view(b, splits), both[b * splits:]
    packed = None
    if q is not None:
        packed = torch.empty(b * splits * group, heads_kv, d, dtype=q.dtype, device=q.device)
    run(seqlens, table, used, bad, None if q is None else q.view(b, -1, d), packed, new,
        capacity, chunk, page_size or 1, pages)
    return used, bad, packed


def combine(part, part_lse, bad, batch: int, heads: int, splits: int, group: int):
    """``SplitCombine`` on the GPU: (out (batch, heads, dv) in part's dtype, lse (batch,
    heads) float32)."""
    import torch

    from fa_sm100.config import cutlass_dtype, normalize_dtype

    dv = part.shape[-1]
    dtype = normalize_dtype(part.dtype)
    run = _launchable("kvcache_combine", (splits, group, dv, dtype),
                      lambda: SplitCombine(splits, group, dv),
                      lambda: combine_arguments(cutlass_dtype(dtype), dv), part.device)
    out = torch.empty(batch, heads, dv, dtype=part.dtype, device=part.device)
    lse = torch.empty(batch, heads, dtype=torch.float32, device=part.device)
    run(part, part_lse, bad, out, lse)
    return out, lse
