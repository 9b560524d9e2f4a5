"""Attention against a KV cache (decode and chunked prefill): ``flash_attn_with_kvcache``,
flash-attn's entry point, with split-KV, pack-GQA and a paged cache (docs/kvcache.md).

Every call becomes one varlen forward (``flash_attn_varlen_func``'s kernel, Note [Varlen] in
fa_sm100/hopper/fwd_kernel.py) over the cache seen as packed keys, and, with splits, one LSE
merge:

- **the cache as packed keys**: a contiguous cache (batch, capacity, heads_kv, d) is already a
  packed key tensor: sequence i starts at row i x capacity and uses its first
  ``cache_seqlens[i]`` (+ the new tokens) rows (``seqused_k``). A paged cache (pages,
  page_size, heads_kv, d) with ``page_table`` (batch, pages per sequence) is first gathered
  into that layout, the used pages only.
- **one query token** (decode, ``seqlen_q == 1``): the token sees a contiguous range of keys
  (the band of causal masks and windows, bottom-right aligned, is a range for a single
  row), so the call is non-causal over per-sequence key ranges. Pack-GQA: the query heads of
  one KV head become that KV head's rows (a sequence of ``group`` rows), so each K/V tile is
  read once per KV head instead of once per query head. Split-KV: each sequence's range is
  cut into ``num_splits`` chunks, each chunk a sequence of the varlen call with its own
  output and LSE; the chunks merge by LSE in float32 (``merge_splits``), exactly as one
  softmax over the union. ``num_splits=0`` chooses (``choose_num_splits``): enough chunks to
  fill the SMs when the (batch, KV head) pairs do not.
- **several query tokens**: a varlen call with the cache's lengths (the new tokens' causal
  diagonal bottom-right aligned to each sequence's keys), no splits, no packing.
- **new tokens** (``k``, ``v``): written into the cache in place at ``cache_seqlens`` (through
  the page table when paged) before the attention, which then sees them.

Inputs are checked before anything runs. The lengths and the page table are read to the
host once per call (one synchronization with the GPU): their values are checked there (cache
lengths within the capacity, the pages used within the cache), and the varlen call's
offsets are computed from them there and sent back in one copy.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import numpy as np
import torch

from fa_sm100.bands import effective_bounds
from fa_sm100.validation import check_softcap, check_softmax_scale, normalize_window

# split-KV: at most this many chunks per sequence, each at least MIN_SPLIT_KEYS keys
MAX_SPLITS = 64
MIN_SPLIT_KEYS = 256
# split until the (batch, KV head, chunk) tiles fill this share of the SMs' one wave
FILL_TARGET = 0.8


def choose_num_splits(tiles: int, sms: int, max_keys: int) -> int:
    """Chunks per sequence for ``tiles`` (batch, KV head) pairs of one query token each on
    ``sms`` SMs: 1 when the pairs already fill FILL_TARGET of the SMs; else the fewest chunks
    whose tiles fill the SMs' waves best (within 5% of the best fill), at most MAX_SPLITS
    and at least MIN_SPLIT_KEYS keys per chunk."""
    if tiles >= FILL_TARGET * sms or max_keys <= MIN_SPLIT_KEYS:
        return 1
    most = max(1, min(MAX_SPLITS, max_keys // MIN_SPLIT_KEYS))

    def fill(s):  # the share of the last wave's SMs busy, over all waves
        ctas = tiles * s
        return ctas / (math.ceil(ctas / sms) * sms)

    best = max(fill(s) for s in range(1, most + 1))
    return next(s for s in range(1, most + 1) if fill(s) >= 0.95 * best)


def merge_splits(out, lse):
    """One attention from ``splits`` partial ones over disjoint key sets: ``out`` (batch,
    splits, rows, heads, dv), ``lse`` (batch, splits, rows, heads) float32, natural log, -inf
    for a chunk without keys. Returns (out (batch, rows, heads, dv) float32, lse (batch, rows,
    heads)); rows with no key in any chunk: 0 and -inf."""
    total = torch.logsumexp(lse, dim=1)  # -inf where no chunk has a key
    w = torch.exp(lse - torch.where(torch.isinf(total), 0.0, total).unsqueeze(1))
    merged = torch.einsum("bsrhd,bsrh->brhd", out.to(w.dtype), w)
    return merged, total


def _check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, page_table):
    """Shapes, dtypes and devices (no values): ValueError naming the first problem. Returns
    (batch, capacity per sequence, page size or None)."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor, got "
                             f"{tuple(getattr(t, 'shape', ())) or type(t).__name__}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must have q's dtype and device ({q.dtype}, {q.device})")
    b, _, hq, d = q.shape
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[3] != d:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} "
                         f"must match in all but v's head dim, with q's head dim {d}")
    if hq % k_cache.shape[2]:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads "
                         f"({k_cache.shape[2]})")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (new tokens are written into it in "
                             f"place)")
    if (k is None) != (v is None):
        raise ValueError("pass k and v together (the new tokens), or neither")
    if k is not None:
        for name, t, cache in (("k", k, k_cache), ("v", v, v_cache)):
            if (not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[0] != b
                    or t.shape[2:] != cache.shape[2:] or t.dtype != q.dtype
                    or t.device != q.device):
                raise ValueError(f"{name} must be (batch={b}, new tokens, "
                                 f"{cache.shape[2]}, {cache.shape[3]}) of q's dtype and device, "
                                 f"got {tuple(getattr(t, 'shape', ()))}")
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"k and v must bring the same number of new tokens, got "
                             f"{k.shape[1]} and {v.shape[1]}")
    if (not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype != torch.int32
            or tuple(cache_seqlens.shape) != (b,) or cache_seqlens.device != q.device):
        raise ValueError(f"cache_seqlens must be an int32 tensor of shape ({b},) on q's device, "
                         f"or an int")
    if page_table is None:
        if k_cache.shape[0] != b:
            raise ValueError(f"a contiguous cache holds one sequence per batch entry: "
                             f"k_cache's batch {k_cache.shape[0]} != q's {b}")
        return b, k_cache.shape[1], None
    if (not isinstance(page_table, torch.Tensor) or page_table.dtype != torch.int32
            or page_table.dim() != 2 or page_table.shape[0] != b
            or page_table.device != q.device):
        raise ValueError(f"page_table must be an int32 (batch={b}, pages per sequence) tensor on "
                         f"q's device, got {getattr(page_table, 'dtype', type(page_table))} "
                         f"{tuple(getattr(page_table, 'shape', ()))}")
    page = k_cache.shape[1]
    return b, page * page_table.shape[1], page


def _read_values(cache_seqlens, page_table):
    """The call's lengths and page table on the host, in one transfer (the call's one
    synchronization with the GPU): (lengths (batch,) int64, page table or None)."""
    if page_table is None:
        return cache_seqlens.cpu().numpy().astype(np.int64), None
    b = cache_seqlens.shape[0]
    both = torch.cat([cache_seqlens, page_table.flatten()]).cpu().numpy().astype(np.int64)
    return both[:b], both[b:].reshape(b, -1)


def _used_slots(table, lengths, page_size: int):
    """(batch, slots) bool: the page-table entries each sequence of ``lengths`` keys reads
    (its first ceil(length / page_size)); the others may hold anything."""
    return np.arange(table.shape[1]) < ((lengths + page_size - 1) // page_size)[:, None]


def _check_values(lengths, new: int, capacity: int, table, page_size, pages: int):
    """What the call depends on, on the host: cache lengths >= 0, with the new tokens within
    the capacity, and the pages they use (each sequence's first ceil(length / page_size)
    entries; unused slots may hold anything) pages of the cache. Returns the lengths with
    the new tokens."""
    if len(lengths) and lengths.min() < 0:
        raise ValueError(f"cache_seqlens must be >= 0, got {int(lengths.min())}")
    total = lengths + new
    if len(total) and total.max() > capacity:
        raise ValueError(f"cache_seqlens + new tokens reach {int(total.max())} > the cache's "
                         f"capacity of {capacity} tokens per sequence")
    if table is not None:
        bad = _used_slots(table, total, page_size) & ((table < 0) | (table >= pages))
        if bad.any():
            raise ValueError(f"page_table holds page {int(table[bad][0])}, outside the cache's "
                             f"{pages} pages")
    return total


def append_kv(k_cache, v_cache, k, v, cache_seqlens, page_table=None):
    """Write the new tokens ``k``, ``v`` (batch, new, heads_kv, d) into the cache in place,
    sequence i's from position ``cache_seqlens[i]`` on (through ``page_table`` when paged)."""
    b, new = k.shape[:2]
    pos = cache_seqlens.long().unsqueeze(1) + torch.arange(new, device=k.device)  # (b, new)
    rows = torch.arange(b, device=k.device).unsqueeze(1).expand(b, new)
    if page_table is None:
        k_cache[rows, pos] = k
        v_cache[rows, pos] = v
        return
    page_size = k_cache.shape[1]
    pages = page_table.long().gather(1, pos // page_size)
    k_cache[pages, pos % page_size] = k
    v_cache[pages, pos % page_size] = v


def _gather_pages(cache, page_table, used_pages: int):
    """The first ``used_pages`` pages of each sequence, contiguous: (batch, used_pages x
    page_size, heads_kv, d); ``page_table`` with its unused slots zeroed."""
    b = page_table.shape[0]
    got = cache[page_table[:, :used_pages].long()]  # (b, used_pages, page, h, d)
    return got.reshape(b, used_pages * cache.shape[1], *cache.shape[2:])


def decode_ranges(lengths, left: Optional[int], right: Optional[int]):
    """The key range [start, end) one query token sees in each sequence of ``lengths`` keys
    (numpy; the band rule bottom-right aligned: the token is at position length - 1)."""
    end = lengths
    start = np.zeros_like(lengths)
    if right is not None:
        end = np.clip(np.minimum(lengths, lengths + right), 0, None)
    if left is not None:
        start = np.clip(lengths - 1 - left, 0, None)
    return start, np.maximum(end, start)


def split_sequences(start, end, capacity: int, splits: int):
    """(cu_seqlens_k, seqused_k) (numpy int32) of ``splits`` chunks per sequence of the
    ranges [start, end) in a packed cache of ``capacity`` rows per sequence: chunk (i, s)
    starts at row i x capacity + start_i + s x chunk_i."""
    length = end - start
    chunk = (length + splits - 1) // splits
    first = start[:, None] + np.arange(splits) * chunk[:, None]  # (b, splits)
    used = np.clip(np.minimum(chunk[:, None], end[:, None] - first), 0, None).ravel()
    offsets = (np.arange(len(start))[:, None] * capacity + first).ravel()
    cu = np.append(offsets, offsets[-1] + used[-1])
    return cu.astype(np.int32), used.astype(np.int32)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, page_table=None,
                            varlen_forward: Optional[Callable] = None,
                            paged_forward: Optional[Callable] = None):
    """Attention of q (batch, seqlen_q, heads, d) against a KV cache, flash-attn 2's
    ``flash_attn_with_kvcache`` (the module docstring says how).

    k_cache / v_cache: (batch, capacity, heads_kv, d[_v]), or paged (pages, page_size,
    heads_kv, d[_v]) with ``page_table`` (``block_table`` in flash-attn 2) (batch, pages per
    sequence) int32. ``cache_seqlens``: int32 (batch,) or an int, each sequence's filled
    length. ``k``, ``v`` (batch, new, heads_kv, d[_v]): appended in place at cache_seqlens,
    then attended. ``num_splits``: split-KV chunks for one query token (0: chosen; ignored
    with several query tokens). Returns out (batch, seqlen_q, heads, d_v), and with
    ``return_softmax_lse`` also lse (batch, heads, seqlen_q) float32. Rotary embeddings,
    ``cache_batch_idx``, ``cache_leftpad`` and ALiBi are not implemented: ValueError.
    ``varlen_forward``: the varlen forward to run (default: ``flash_attn_varlen_func``'s
    kernel for q's device). ``paged_forward``: a forward that reads the pages itself
    (``sm100_fwd_paged``'s arguments; default: the SM100 kernel's on an sm_100 GPU, with pages
    of a multiple of 128 tokens and no window), used instead of gathering the pages.
    """
    for name, value in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                        ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad),
                        ("alibi_slopes", alibi_slopes)):
        if value is not None:
            raise ValueError(f"{name} is not implemented by fa_sm100's flash_attn_with_kvcache: "
                             f"pass None")
    if block_table is not None and page_table is not None:
        raise ValueError("pass the page table once (page_table, or flash-attn 2's block_table)")
    page_table = block_table if page_table is None else page_table
    if isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32,
                                   device=q.device)
    b, capacity, page_size = _check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens,
                                            page_table)
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
        raise ValueError(f"num_splits must be an int >= 0 (0: chosen), got {num_splits!r}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    sq, hq, d = q.shape[1:]
    hk = k_cache.shape[2]
    scale = check_softmax_scale(softmax_scale, d)
    left, right = normalize_window(window_size)
    softcap = check_softcap(softcap)
    new = 0 if k is None else k.shape[1]
    lengths, table = _read_values(cache_seqlens, page_table)
    lengths = _check_values(lengths, new, capacity, table, page_size, k_cache.shape[0])
    longest = int(lengths.max()) if len(lengths) else 0
    if k is not None:
        append_kv(k_cache, v_cache, k, v, cache_seqlens, page_table)
    if page_table is not None and (left, right) == (None, None):
        paged_forward = paged_forward or _kernel_paged_forward(q, page_size)
        if paged_forward is not None:  # the kernel reads each key block's page
            return _paged_call(paged_forward, q, k_cache, v_cache, table, lengths, page_size,
                               num_splits, scale, causal, softcap, return_softmax_lse)
    if varlen_forward is None:  # the device's, found once per device
        from fa_sm100.interface import _varlen_forward_for, _varlen_forwards

        varlen_forward = _varlen_forwards.get(q.device) or _varlen_forward_for(q)
    if page_table is not None:  # the used pages, contiguous (unused slots read page 0)
        used_pages = max(1, -(-longest // page_size))
        table = np.where(_used_slots(table, lengths, page_size), table, 0)[:, :used_pages]
        page_table = _to_device(table.astype(np.int32), q.device).view(b, used_pages)
        k_cache, v_cache = (_gather_pages(c, page_table, used_pages) for c in (k_cache, v_cache))
        capacity = used_pages * page_size
    keys, values = (c.reshape(b * capacity, hk, c.shape[3]) for c in (k_cache, v_cache))
    if sq != 1:  # several query tokens: each sequence's keys, its own causal diagonal
        meta = _to_device(np.concatenate([np.arange(b + 1) * sq, np.arange(b + 1) * capacity,
                                          lengths]).astype(np.int32), q.device)
        cu_q, cu_k, used = meta[:b + 1], meta[b + 1:2 * b + 2], meta[2 * b + 2:]
        out, lse = varlen_forward(q.reshape(b * sq, hq, d), keys, values, cu_q, cu_k, sq,
                                  longest, used, scale, causal, (left, right), softcap, True,
                                  None)
        return _prefill_result(out, lse, q, return_softmax_lse)
    # one query token: per-sequence key ranges, pack-GQA, split-KV
    group = hq // hk
    left, right = effective_bounds(causal, left, right)
    start, end = decode_ranges(lengths, left, right)
    splits = num_splits or choose_num_splits(b * hk, _sms(q.device), longest)
    cu_k, used = split_sequences(start, end, capacity, splits)
    cu_q = np.arange(b * splits + 1, dtype=np.int32) * group
    meta = _to_device(np.concatenate([cu_q, cu_k, used]), q.device)
    n = b * splits + 1
    cu_q, cu_k, used = meta[:n], meta[n:2 * n], meta[2 * n:]
    out, lse = varlen_forward(_pack_gqa(q, hk, splits), keys, values, cu_q, cu_k, group,
                              max(1, -(-longest // splits)), used, scale, False, (None, None),
                              softcap, True, None)
    return _decode_result(out, lse, q, splits, return_softmax_lse)


def _pack_gqa(q, hk: int, splits: int):
    """One query token's heads as rows (pack-GQA), once per split: (b, 1, hk x g, d) ->
    (b x splits x g, hk, d), sequence (i, s) of the varlen call holding sequence i's g rows."""
    b, _, hq, d = q.shape
    group = hq // hk
    rows = q.reshape(b, hk, group, d).transpose(1, 2)  # (b, g, hk, d)
    return rows.unsqueeze(1).expand(b, splits, group, hk, d).reshape(b * splits * group, hk, d)


def _decode_result(out, lse, q, splits: int, return_lse: bool):
    """``_pack_gqa``'s varlen output (b x splits x g, hk, dv) and LSE (hk, b x splits x g)
    merged over the splits and back to heads: out (b, 1, hq, dv), lse (b, hq, 1)."""
    b, _, hq, _ = q.shape
    hk, dv = out.shape[1], out.shape[2]
    group = hq // hk
    out = out.view(b, splits, group, hk, dv)
    lse = lse.view(hk, b, splits, group).permute(1, 2, 3, 0)
    out, lse = merge_splits(out, lse) if splits > 1 else (out[:, 0], lse[:, 0])
    out = out.transpose(1, 2).reshape(b, 1, hq, dv).to(q.dtype)  # rows (g, hk) -> heads
    lse = lse.transpose(1, 2).reshape(b, hq, 1)
    return (out, lse) if return_lse else out


def _prefill_result(out, lse, q, return_lse: bool):
    """A several-token call's varlen output (b x sq, hq, dv) and LSE (hq, b x sq) as out (b,
    sq, hq, dv) and lse (b, hq, sq)."""
    b, sq, hq, _ = q.shape
    out = out.view(b, sq, hq, out.shape[-1])
    lse = lse.view(hq, b, sq).permute(1, 0, 2)
    return (out, lse) if return_lse else out


def _kernel_paged_forward(q, page_size: int):
    """The forward that reads a paged cache itself on q's device, or None: the SM100 kernel
    (``sm100_fwd_paged``) with pages of a multiple of its 128-key blocks."""
    if q.device.type != "cuda" or page_size % 128:
        return None
    from fa_sm100.devices import is_sm100

    if not is_sm100(q.device):
        return None
    from fa_sm100.sm100.interface import sm100_fwd_paged

    return sm100_fwd_paged


def _paged_call(paged_forward, q, k_pages, v_pages, table, lengths, page_size: int,
                num_splits: int, scale: float, causal: bool, softcap: float, return_lse: bool):
    """``flash_attn_with_kvcache`` through a forward that reads the pages itself (no window):
    several query tokens as one packed call with each sequence's lengths; one query token with
    pack-GQA and split-KV, each chunk a whole number of pages, so that chunk (i, s) is the
    sequence whose page table row is sequence i's pages from s x pages per chunk on."""
    b, sq, hq, d = q.shape
    hk = k_pages.shape[2]
    longest = int(lengths.max()) if len(lengths) else 0
    if sq != 1:
        meta = _to_device(np.concatenate([np.arange(b + 1) * sq, lengths]).astype(np.int32),
                          q.device)
        out, lse = paged_forward(q.reshape(b * sq, hq, d), k_pages, v_pages, meta[:b + 1], sq,
                                 _to_device(table.astype(np.int32), q.device).view(b, -1),
                                 meta[b + 1:], max(longest, 1), scale, causal, (None, None),
                                 softcap, True)
        return _prefill_result(out, lse, q, return_lse)
    group = hq // hk
    splits = num_splits or choose_num_splits(b * hk, _sms(q.device), longest)
    keys_per_split = -(-longest // splits)
    pages_per_chunk = max(1, -(-keys_per_split // page_size))
    chunk = pages_per_chunk * page_size
    splits = max(1, -(-longest // chunk))  # no chunk past the longest sequence
    first = np.arange(splits) * chunk
    used = np.clip(np.minimum(chunk, lengths[:, None] - first), 0, None).ravel()
    slots = (np.arange(splits)[:, None] * pages_per_chunk + np.arange(pages_per_chunk)).ravel()
    padded = np.zeros((b, splits * pages_per_chunk), dtype=np.int64)
    width = min(table.shape[1], padded.shape[1])
    padded[:, :width] = np.where(_used_slots(table, lengths, page_size), table, 0)[:, :width]
    rows = padded[:, slots].reshape(b * splits, pages_per_chunk)
    cu_q = np.arange(b * splits + 1) * group
    meta = _to_device(np.concatenate([cu_q, used, rows.ravel()]).astype(np.int32), q.device)
    n = b * splits
    out, lse = paged_forward(_pack_gqa(q, hk, splits), k_pages, v_pages, meta[:n + 1], group,
                             meta[2 * n + 1:].view(n, pages_per_chunk), meta[n + 1:2 * n + 1],
                             chunk, scale, False, (None, None), softcap, True)
    return _decode_result(out, lse, q, splits, return_lse)


def _to_device(array, device):
    """A host int32 array as a tensor on ``device`` (one copy)."""
    return torch.from_numpy(array).to(device, non_blocking=True)


def _sms(device) -> int:
    if device.type != "cuda":
        from fa_sm100.machines import HOPPER_SMS

        return HOPPER_SMS
    from fa_sm100.devices import sm_count

    return sm_count(device)
