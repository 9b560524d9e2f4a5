"""Packed variable-length batches: what the SM90 and SM100 forwards share (Note [Varlen] in
fa_sm100/hopper/fwd_kernel.py, docs/varlen.md).

A batch of sequences lies along the token axis, sequence i at rows cu_seqlens[i] ..
cu_seqlens[i + 1]. A kernel reads each work tile's offsets and lengths from cu_seqlens and
runs the tile as a batch-1 problem of those lengths. Q loads offset the TMA coordinates to
the sequence's first row; K and V load, and O is stored, through ``ragged_rows``, so the rows
of a tile past its sequence's (used) end are out of bounds: zeros when loaded, never
written when stored.
"""

from __future__ import annotations

# The row extent of O's ragged view, and the extent of the mode that carries each sequence's
# end (both within the TMA's 32-bit coordinates)
RAGGED_ROWS = 1 << 30
RAGGED_OFFSETS = (1 << 31) - 1
# An unbounded window side of a varlen launch (``bands.kernel_window`` with these lengths):
# past every sequence's keys, far below 32-bit overflow in the band arithmetic
VARLEN_UNBOUNDED = 1 << 29


def ragged_rows(t, row_mode: int = 0):
    """``t`` with the token rows in mode ``row_mode`` ((rows, d, h) or (d, rows, h)) -> the
    same memory, seen with that mode RAGGED_ROWS long and a last mode of RAGGED_OFFSETS, so
    that a TMA copy at row coordinate RAGGED_ROWS - length + r and last coordinate offset +
    length addresses row offset + r, and the rows r >= length are out of bounds: a store clips
    them, a load fills them with zeros. The base moves back by RAGGED_ROWS rows and the last
    mode steps by one row: RAGGED_ROWS - length + r + offset + length - RAGGED_ROWS =
    offset + r. Traced inside a kernel's host function (``t`` a CuTe tensor)."""
    import cutlass
    import cutlass.cute as cute

    # run-time 64-bit values: RAGGED_ROWS rows lie past 32-bit element offsets, and a layout
    # of static extents this large would overflow where its size is computed at compile time
    row = cutlass.Int64(t.stride[row_mode])
    base = t.iterator + cutlass.Int64(-RAGGED_ROWS) * row
    shape, stride = list(t.shape), list(t.stride)
    shape[row_mode], stride[row_mode] = cutlass.Int32(RAGGED_ROWS), row
    shape.append(cutlass.Int32(RAGGED_OFFSETS))
    stride.append(row)
    return cute.make_tensor(base, cute.make_layout(tuple(shape), stride=tuple(stride)))


def ragged_tile_rows(m_view, seqlen, offset, row_mode: int = 0):
    """``m_view`` (a ragged view with its head chosen: (RAGGED_ROWS, d, offsets), or with
    ``row_mode`` 1 (d, RAGGED_ROWS, offsets)) at the sequence (offset, seqlen): a tensor
    whose row r is the sequence's row r, out of bounds from r = seqlen on."""
    import cutlass.cute as cute

    rank = len(m_view.shape)
    start = [0] * (rank - 1)
    start[row_mode] = RAGGED_ROWS - seqlen
    return cute.domain_offset(tuple(start), m_view[(None,) * (rank - 1) + (offset + seqlen,)])


def sequence_rows(cu_seqlens, seq_used, seq, *tensors):
    """Sequence ``seq`` of a packed batch, inside a kernel that indexes its tensors by
    (batch, row) as a padded batch would (Note [Varlen backward] in
    fa_sm100/hopper/bwd_kernel.py). ``tensors``: (tensor, row mode, batch mode), the packed
    tensor's batch mode of extent 1; each comes back seen so that batch index ``seq`` and row r
    address the sequence's row r. Then the sequence's length (``seq_used[seq]`` where given).
    Traced inline."""
    first = cu_seqlens[seq]
    length = cu_seqlens[seq + 1] - first
    if seq_used is not None:
        length = seq_used[seq]
    return (*sequence_views(seq, first, *tensors), length)


def sequence_views(seq, first, *tensors):
    """``tensors`` ((tensor, row mode, batch mode), the batch mode of extent 1) seen so that
    batch index ``seq`` and row r address row ``first`` + r. Traced inline."""
    import cutlass.cute as cute

    views = []
    for t, row_mode, batch_mode in tensors:
        offset = [0] * len(t.shape)
        offset[batch_mode], offset[row_mode] = -seq, first
        views.append(cute.domain_offset(tuple(offset), t))
    return views


# Note [Packed workspace]: the varlen backward's float32 buffers (LSE2, Delta, the dQ
# accumulator, GQA's dK / dV accumulators) hold each sequence's rows in whole blocks of the
# kernel's tile, packed along one row axis: sequence s starts at block
#     first_block(s) = (cu_seqlens[s] + s (tile - 1)) // tile
# and takes ceil(len_s / tile) blocks, which end at or before first_block(s + 1):
#     first_block(s + 1) = floor((cu_s + s (tile - 1) + len_s + tile - 1) / tile)
#                       >= floor((cu_s + s (tile - 1)) / tile) + floor((len_s + tile - 1) / tile),
# so no two sequences share a block and the last one ends by ``packed_blocks(total, n, tile)``
# = first_block(n). The buffers grow with the tokens (plus at most one block per sequence),
# not with sequences x the longest one, and a kernel reaches sequence s's rows through
# ``sequence_views`` at first_block(s) * tile (rows) or first_block(s) (blocks). The same
# bound counts the key blocks of a pack: sum ceil(len_s / tile) <= packed_blocks.


def packed_blocks(total, sequences, tile: int):
    """Blocks of ``tile`` rows that hold ``sequences`` sequences of ``total`` rows in all, each
    from a block of its own (Note [Packed workspace]). Python or DSL integers."""
    return (total + sequences * (tile - 1)) // tile


def first_block(cu_seqlens, seq, tile: int):
    """The block where sequence ``seq``'s rows start in a packed workspace (Note [Packed
    workspace]). ``cu_seqlens``: a sequence of ints, or a tensor inside a kernel."""
    return (cu_seqlens[seq] + seq * (tile - 1)) // tile


def packed_tile_model(lengths, heads: int, tile: int, t: int):
    """Tile ``t`` of the varlen backward's grid of ``heads`` x sum ceil(len_s / tile) key-block
    tiles, on a list of sequence lengths: (sequence, head, block, the sequence's blocks,
    valid), as the kernel decodes it (``fa_sm100.packed_tiles.packed_tile``); the
    tests' reference."""
    start = 0
    for s, length in enumerate(lengths):
        n = -(-length // tile)
        if t < start + n * heads:
            head, block = divmod(t - start, n)
            return s, head, block, n, 1
        start += n * heads
    return 0, 0, 0, 0, 0


def paged_rows(q, k_pages, v_pages, cu_seqlens_q, page_table, seqused_k, block: int,
               kernel: str):
    """What a paged forward (``sm90_fwd_paged``, ``sm100_fwd_paged``) checks before anything
    runs, and its cache seen as packed rows: k_pages / v_pages (pages, page_size, h_kv, d /
    dv) with a page size that is a multiple of the kernel's key ``block`` (one TMA copy per
    block), ``page_table`` int32 (sequences, pages per sequence) on q's device, ``seqused_k``
    given. Returns (page_size, k rows, v rows, the table contiguous)."""
    import torch

    for name, t in (("k_pages", k_pages), ("v_pages", v_pages)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be (pages, page_size, heads_kv, head_dim), got "
                             f"{tuple(getattr(t, 'shape', ()))}")
    page_size = k_pages.shape[1]
    if page_size % block or v_pages.shape[:3] != k_pages.shape[:3]:
        raise ValueError(f"pages of {page_size} tokens: the {kernel} kernel loads a key block "
                         f"from one page, so page_size must be a multiple of {block} (and "
                         f"k_pages, v_pages must agree in pages, page_size and heads)")
    sequences = cu_seqlens_q.shape[0] - 1 if isinstance(cu_seqlens_q, torch.Tensor) else None
    if (not isinstance(page_table, torch.Tensor) or page_table.dtype != torch.int32
            or page_table.dim() != 2 or page_table.shape[0] != sequences
            or page_table.device != q.device):
        raise ValueError(f"page_table must be an int32 (sequences={sequences}, pages per "
                         f"sequence) tensor on q's device")
    if seqused_k is None:
        raise ValueError("a paged cache needs seqused_k (each sequence's keys)")
    k, v = (t.reshape(-1, *t.shape[2:]) for t in (k_pages, v_pages))  # the pages as rows
    return page_size, k, v, page_table.contiguous()


class VarlenPlan:
    """What a varlen forward decided for one (metadata, options) pair (``fa_sm100.call_plans``):
    the config, its kernel, the window's launch bounds and the output shapes. Calling it checks
    or allocates out (total_q, h, dv) and LSE (h, total_q) and launches on packed q, k, v
    (``launch``, the backend's argument list, on the tensors as a batch of one). A pack with no
    rows or no keys launches nothing: out 0, LSE -inf."""

    __slots__ = ("cfg", "kernel", "scale", "softcap", "window", "return_lse", "out_shape",
                 "lse_shape", "dtype", "device", "max_seqlen_q", "config", "empty")

    def __init__(self, problem, cfg, return_lse: bool, device, config, compile_kernel):
        from fa_sm100.bands import kernel_window

        self.cfg = cfg
        self.config = config  # the caller's config, whose id is in the key (call_plans)
        self.empty = 0 in (problem.total_q, problem.total_k, problem.max_seqlen_q,
                           problem.max_seqlen_k)
        self.kernel = None if self.empty else compile_kernel()
        self.scale = problem.softmax_scale
        self.softcap = problem.softcap
        self.window = kernel_window(problem.causal, problem.window, VARLEN_UNBOUNDED,
                                    VARLEN_UNBOUNDED)
        self.return_lse = return_lse
        self.out_shape = (problem.total_q, problem.heads, problem.head_dim_v)
        self.lse_shape = (problem.heads, problem.total_q)
        self.dtype = problem.dtype
        self.device = device
        self.max_seqlen_q = problem.max_seqlen_q

    def launch(self, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k, **extra):
        raise NotImplementedError  # the backend's kernel call

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k=None, out=None,
                 lse=None, **extra):
        import torch

        from fa_sm100.call_plans import aligned, check_out_lse
        from fa_sm100.validation import tma_ready

        check_out_lse(out, lse, self.out_shape, self.lse_shape, self.dtype, self.device)
        if lse is not None and not self.return_lse:
            raise ValueError("an lse buffer needs return_lse=True")
        if self.empty:
            out = (torch.zeros(self.out_shape, dtype=self.dtype, device=self.device)
                   if out is None else out.zero_())
            if self.return_lse:
                lse = (torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
                       if lse is None else lse)
                lse.fill_(-torch.inf)
            return (out, lse) if self.return_lse else out
        if not aligned(q, k, v):
            q, k, v = (tma_ready(t) for t in (q, k, v))
        if out is None:
            out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        elif not aligned(out):
            raise ValueError("out must start on a 16-byte boundary (the TMA store)")
        if lse is None and self.cfg.write_lse:
            lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
        self.launch(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out.unsqueeze(0),
                    lse.unsqueeze(0) if lse is not None else None, cu_seqlens_q, cu_seqlens_k,
                    seqused_k, **extra)
        return (out, lse) if self.return_lse else out


def planned_varlen_call(table, build, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, options,
                        out=None, lse=None):
    """A varlen forward's call: the plan of these tensors' metadata and ``options`` from
    ``table`` (``build()`` makes it the first time), run on them."""
    tensors = (q, k, v, cu_seqlens_q, cu_seqlens_k) + (() if seqused_k is None else (seqused_k,))
    plan = table.plan(tensors, (*options, seqused_k is None), build)
    return plan(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, out, lse)
