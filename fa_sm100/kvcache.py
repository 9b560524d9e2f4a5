"""Attention against a KV cache (decode and chunked prefill): ``flash_attn_with_kvcache``,
flash-attn's entry point, with split-KV, pack-GQA and a paged cache (docs/kvcache.md).

Every call is one varlen forward (``flash_attn_varlen_func``'s kernel, Note [Varlen] in
fa_sm100/hopper/fwd_kernel.py, or its paged variant, Note [Paged K/V]) between two small
launches (fa_sm100/kvcache_kernels.py), and nothing in it waits for the GPU:

- **plan** (``KvcachePlan``, once per metadata and options): shapes, dtypes and options
  checked; the path, the chunks and the forward decided.
- **prepare** (``_prepare``): from the lengths and the page table, on the device, the keys
  each chunk of each sequence reads (``seqused_k``), a bad flag per sequence (a length below 0
  or past the capacity, a used page outside the cache: ``bad_sequences``), and for one token
  the pack-GQA rows of q. A bad sequence reads no key and its output and LSE are NaN; with
  ``check_values`` the values are read to the host first and raise ValueError instead.
- **new tokens** (``k``, ``v``): written into the cache in place at ``cache_seqlens`` (through
  the page table when paged) before the attention, which then sees them.
- **the cache as keys**: a contiguous cache (batch, capacity, heads_kv, d) is already a
  packed key tensor: sequence i starts at row i x capacity. A paged cache (pages, page_size,
  heads_kv, d) with ``page_table`` (batch, pages per sequence) is read page by page by the
  kernel where its page size allows (``paged_forward_for``), else gathered whole first.
- **one query token** (decode, ``seqlen_q == 1``): the token sees a contiguous range of keys
  (the band of causal masks and windows, bottom-right aligned, is a range for a single
  row), so the call is non-causal over per-sequence key ranges. Pack-GQA: the query heads of
  one KV head become that KV head's rows (a sequence of ``group`` rows), so each K/V tile is
  read once per KV head instead of once per query head. Split-KV: each sequence's range is
  cut into chunks (whole pages when the kernel reads the pages), each a sequence of the
  varlen call with its own output and LSE; ``_combine`` merges them by LSE in float32
  (``merge_splits``: one softmax over the union). ``num_splits=0`` chooses
  (``choose_num_splits``, from the capacity): enough chunks to fill the SMs when the (batch,
  KV head) pairs do not.
- **several query tokens**: a varlen call with the cache's lengths (the new tokens' causal
  diagonal bottom-right aligned to each sequence's keys), no splits, no packing.

On the CPU (the tests' models of the kernels) prepare and combine are tensor operations with
the same results.
"""
from __future__ import annotations

import functools
import math
from typing import Callable, Optional

import numpy as np
import torch

from fa_sm100.bands import effective_bounds
from fa_sm100.call_plans import PlanTable
from fa_sm100.validation import check_softcap, check_softmax_scale, normalize_window

# split-KV: at most this many chunks per sequence, each at least MIN_SPLIT_KEYS keys
MAX_SPLITS = 64
MIN_SPLIT_KEYS = 256
# split until the (batch, KV head, chunk) tiles fill this share of the SMs' one wave
FILL_TARGET = 0.8


@functools.lru_cache(maxsize=1024)
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
    """The call's lengths and page table on the host, in one transfer (``check_values``: a
    synchronization with the GPU): (lengths (batch,) int64, page table or None)."""
    if page_table is None:
        return cache_seqlens.cpu().numpy().astype(np.int64), None
    b = cache_seqlens.shape[0]
    both = torch.cat([cache_seqlens, page_table.flatten()]).cpu().numpy().astype(np.int64)
    return both[:b], both[b:].reshape(b, -1)


def _check_values(lengths, new: int, capacity: int, table, page_size, pages: int):
    """``check_values``, on the host: cache lengths >= 0, with the new tokens within the
    capacity, and the pages they use (each sequence's first ceil(length / page_size) entries;
    unused slots may hold anything) pages of the cache. ValueError naming the first problem."""
    if len(lengths) and lengths.min() < 0:
        raise ValueError(f"cache_seqlens must be >= 0, got {int(lengths.min())}")
    total = lengths + new
    if len(total) and total.max() > capacity:
        raise ValueError(f"cache_seqlens + new tokens reach {int(total.max())} > the cache's "
                         f"capacity of {capacity} tokens per sequence")
    if table is not None:
        used = np.arange(table.shape[1]) < ((total + page_size - 1) // page_size)[:, None]
        bad = used & ((table < 0) | (table >= pages))
        if bad.any():
            raise ValueError(f"page_table holds page {int(table[bad][0])}, outside the cache's "
                             f"{pages} pages")


def bad_sequences(cache_seqlens, new: int, capacity: int, page_table, page_size, pages: int):
    """(batch,) bool: the sequences whose values are bad (a length below 0, the new tokens
    past the capacity, a used page-table slot outside the cache): ``_check_values``'s rule as
    tensor operations, which read no value on the host (the CPU model of
    ``kvcache_kernels.KvcachePrepare``'s flags)."""
    total = cache_seqlens + new
    bad = (cache_seqlens < 0) | (total > capacity)
    if page_table is not None:
        used_pages = torch.div(total + (page_size - 1), page_size, rounding_mode="floor")
        slots = _static(page_table.device, "slots", page_table.shape[1],
                        lambda: np.arange(page_table.shape[1]))
        outside = (page_table < 0) | (page_table >= pages)
        bad = bad | ((slots < used_pages.unsqueeze(1)) & outside).any(1)
    return bad


def append_kv(k_cache, v_cache, k, v, cache_seqlens, page_table=None, bad=None):
    """Write the new tokens ``k``, ``v`` (batch, new, heads_kv, d) into the cache in place,
    sequence i's from position ``cache_seqlens[i]`` on (through ``page_table`` when paged).
    ``bad`` (``bad_sequences``): those sequences write nothing (each writes its first cell's
    own value back, so every index stays inside the cache and no GPU wait is needed)."""
    b, new = k.shape[:2]
    pos = cache_seqlens.long().unsqueeze(1) + torch.arange(new, device=k.device)  # (b, new)
    if bad is not None:
        bad = bad != 0
        pos = torch.where(bad.unsqueeze(1), 0, pos)
    rows = torch.arange(b, device=k.device).unsqueeze(1).expand(b, new)
    if page_table is None:
        where = (rows, pos)
    else:
        page_size = k_cache.shape[1]
        pages = page_table.long().gather(1, pos // page_size)
        if bad is not None:
            pages = pages.clamp(0, k_cache.shape[0] - 1)
        where = (pages, pos % page_size)
    for cache, tokens in ((k_cache, k), (v_cache, v)):
        if bad is not None:
            tokens = torch.where(bad.view(b, 1, 1, 1), cache[where], tokens)
        cache[where] = tokens


def _static(device, kind: str, key, make):
    """A small int32 tensor on ``device`` that depends only on the call's shapes (offsets,
    split starts), made on the host once by ``make()`` and kept."""
    slot = (device, kind, key)
    got = _STATIC.get(slot)
    if got is None:
        got = _STATIC[slot] = torch.from_numpy(
            np.asarray(make(), dtype=np.int32)).to(device)
    return got


_STATIC: dict = {}


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False, *, page_table=None,
                            check_values: bool = False,
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
    ``check_values``: read the lengths and the page table to the host first and raise
    ValueError for bad values (one wait for the GPU per call); by default they are checked on
    the GPU and a bad sequence's output and LSE are NaN (its new tokens are not written).
    ``varlen_forward``: the varlen forward to run (default: ``flash_attn_varlen_func``'s
    kernel for q's device). ``paged_forward``: a forward that reads the pages itself
    (``sm90_fwd_paged``'s arguments; default: the kernel of q's device where the page size
    allows, ``paged_forward_for``), used instead of gathering the pages.
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
    tensors = [q, k_cache, v_cache, cache_seqlens]
    if k is not None or v is not None:
        tensors += [k, v]  # one of them None: no key, the plan's checks raise
    if page_table is not None:
        tensors.append(page_table)
    options = (softmax_scale, causal, window_size, softcap, num_splits, return_softmax_lse,
               check_values, varlen_forward, paged_forward, k is None, page_table is None)
    plan = _plans.plan(tensors, options, lambda: KvcachePlan(
        q, k_cache, v_cache, k, v, cache_seqlens, page_table, softmax_scale, causal,
        window_size, softcap, num_splits, return_softmax_lse, check_values, varlen_forward,
        paged_forward))
    return plan(q, k_cache, v_cache, k, v, cache_seqlens, page_table)


class KvcachePlan:
    """What ``flash_attn_with_kvcache`` decided for one (metadata, options) pair
    (``fa_sm100.call_plans``): the checks of shapes and options passed, the path (one token
    with pack-GQA and split-KV, or several; pages read by a kernel or gathered), the chunks,
    the forward. Calling it does a call's work: the values checked on the host
    (``check_values``) or flagged on the device (``_prepare``), the new tokens appended, the
    attention and, for one token, the combine."""

    def __init__(self, q, k_cache, v_cache, k, v, cache_seqlens, page_table, softmax_scale,
                 causal, window_size, softcap, num_splits, return_lse, check_values,
                 varlen_forward, paged_forward):
        b, capacity, page_size = _check_kvcache(q, k_cache, v_cache, k, v, cache_seqlens,
                                                page_table)
        if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 0:
            raise ValueError(f"num_splits must be an int >= 0 (0: chosen), got {num_splits!r}")
        if not isinstance(causal, bool):
            raise ValueError(f"causal must be a bool, got {causal!r}")
        sq, hq, d = q.shape[1:]
        self.scale = check_softmax_scale(softmax_scale, d)
        self.window = normalize_window(window_size)
        self.softcap = check_softcap(softcap)
        self.causal, self.return_lse, self.check_values = causal, return_lse, check_values
        self.new = 0 if k is None else k.shape[1]
        self.capacity, self.page_size, self.pages = capacity, page_size, k_cache.shape[0]
        self.hk = k_cache.shape[2]
        # one query token at the end of its keys sees a range [start, length): start 0, or
        # set by a left window (a band whose right edge lies before the token goes the
        # general way)
        self.left, right = effective_bounds(causal, *self.window)
        one_token = sq == 1 and (right is None or right >= 0)
        self.paged_forward = None
        if page_table is not None:
            self.paged_forward = paged_forward or paged_forward_for(
                q, page_size, self.window != (None, None))
        # a left window's ranges start at each sequence's own key: not a run of whole pages
        decode = one_token and (self.paged_forward is None or self.left is None)
        self.kind = ("paged_" if self.paged_forward is not None else "") + (
            "decode" if decode else "prefill")
        # split-KV for one token from its first key: chunks of whole pages when a kernel
        # reads the pages (a chunk is a run of page-table slots), else of any length
        # (a left window: ranges of at most left + 1 keys, each from its sequence's own key)
        self.splits, self.chunk = 1, capacity
        self.pack = one_token and self.left is None  # pack-GQA rows made by _prepare
        if self.kind.endswith("decode"):
            width = capacity if self.left is None else min(capacity, self.left + 1)
            unit = page_size if self.paged_forward is not None else 1
            self.splits, self.chunk = _chunks(num_splits or choose_num_splits(
                b * self.hk, _sms(q.device), width), width, unit)
        self.varlen_forward = None
        if self.paged_forward is None:
            if varlen_forward is None:
                from fa_sm100.interface import _varlen_forward_for

                varlen_forward = _varlen_forward_for(q)
            self.varlen_forward = varlen_forward

    def __call__(self, q, k_cache, v_cache, k, v, cache_seqlens, page_table):
        if self.check_values:
            lengths, table = _read_values(cache_seqlens, page_table)
            _check_values(lengths, self.new, self.capacity, table, self.page_size, self.pages)
        # the chunks of used keys from each sequence's first key (one chunk: its length)
        chunks = (self.splits, self.chunk) if self.pack else (1, self.capacity)
        used, bad, packed = _prepare(cache_seqlens, page_table, *chunks, self.new,
                                     self.capacity, self.page_size, self.pages,
                                     q if self.pack else None, self.hk)
        if k is not None:
            append_kv(k_cache, v_cache, k, v, cache_seqlens, page_table, bad)
        common = (self.scale, self.softcap, self.return_lse)
        if self.kind == "paged_decode":
            return _paged_decode(self.paged_forward, q, packed, k_cache, v_cache, page_table,
                                 used, bad, self.splits, self.chunk, *common)
        if self.kind == "paged_prefill":
            return _paged_prefill(self.paged_forward, q, k_cache, v_cache, page_table, used,
                                  bad, self.causal, self.window, *common)
        if page_table is not None:  # no kernel reads these pages: all of them, contiguous
            page_table = page_table.clamp(0, self.pages - 1)  # unused slots hold anything
            k_cache, v_cache = (c[page_table.long()].flatten(1, 2) for c in (k_cache, v_cache))
        if self.kind == "decode":
            return _decode(self.varlen_forward, q, packed, k_cache, v_cache, used, bad,
                           self.splits, self.chunk, self.left, *common)
        return _prefill(self.varlen_forward, q, k_cache, v_cache, used, bad, self.causal,
                        self.window, *common)


_plans = PlanTable()


def _prepare(seqlens, table, splits: int, chunk: int, new: int, capacity: int, page_size,
             pages: int, q=None, hk: int = 0):
    """(used (b, splits) int32: the keys chunk s of each sequence reads from key s x chunk on,
    of its min(max(length + new, 0), capacity); bad (b,): ``bad_sequences``; with q,
    ``_pack_gqa(q, hk, splits)``, else None). On the GPU one launch
    (``kvcache_kernels.KvcachePrepare``); on the CPU the same as tensor operations."""
    if seqlens.device.type == "cuda":
        from fa_sm100 import kvcache_kernels

        return kvcache_kernels.prepare(seqlens, table, splits, chunk, new, capacity,
                                       page_size, pages, q, hk)
    bad = bad_sequences(seqlens, new, capacity, table, page_size, pages)
    lengths = torch.where(bad, 0, (seqlens + new).clamp(0, capacity))  # bad: read no key
    firsts = torch.arange(splits, dtype=torch.int32, device=seqlens.device) * chunk
    used = (lengths.unsqueeze(1) - firsts).clamp(0, chunk).int()
    return used, bad, None if q is None else _pack_gqa(q, hk, splits)


def _nan_where_bad(out, lse, bad, return_lse: bool):
    """out (b, sq, hq, dv) and lse (b, hq, sq), NaN for the ``bad`` sequences."""
    out = torch.where(bad.view(-1, 1, 1, 1) != 0, math.nan, out)
    lse = torch.where(bad.view(-1, 1, 1) != 0, math.nan, lse)
    return (out, lse) if return_lse else out


def _prefill(varlen_forward, q, k_cache, v_cache, used, bad, causal, window, scale, softcap,
             return_lse):
    """Several query tokens (or one with a band the decode path does not take): a varlen call
    with each sequence's keys (``used``, one chunk) and its causal diagonal; no splits, no
    packing."""
    b, sq, hq, d = q.shape
    capacity, hk = k_cache.shape[1:3]
    cu_q = _static(q.device, "rows", (b, sq), lambda: np.arange(b + 1) * sq)
    cu_k = _static(q.device, "rows", (b, capacity), lambda: np.arange(b + 1) * capacity)
    keys, values = (c.reshape(b * capacity, hk, c.shape[3]) for c in (k_cache, v_cache))
    out, lse = varlen_forward(q.reshape(b * sq, hq, d), keys, values, cu_q, cu_k, sq, capacity,
                              used.view(b), scale, causal, window, softcap, True, None)
    return _nan_where_bad(*_unpack_prefill(out, lse, q), bad, return_lse)


def _decode(varlen_forward, q, packed, k_cache, v_cache, used, bad, splits: int, chunk: int,
            left, scale, softcap, return_lse):
    """One query token of a contiguous cache, pack-GQA and split-KV: chunk (i, s) is a
    sequence of the varlen call from row i x capacity + start_i + s x chunk, ``used`` keys
    long. Without a window start_i is 0 (``used`` says it all); under a left window the token
    sees keys [length - 1 - left, length), cut here into the plan's chunks (``used`` holds the
    lengths)."""
    b, _, hq, d = q.shape
    capacity, hk = k_cache.shape[1:3]
    group = hq // hk
    if left is None:
        cu_k = _static(q.device, "chunks", (b, capacity, splits, chunk), lambda: np.append(
            (np.arange(b)[:, None] * capacity + np.arange(splits) * chunk).ravel(), b * capacity))
    else:  # each sequence's keys: at most left + 1, from its own start
        lengths = used.view(b, 1)
        firsts = _static(q.device, "firsts", (splits, chunk), lambda: np.arange(splits) * chunk)
        starts = (lengths - 1 - left).clamp(min=0) + firsts  # (b, splits)
        bases = _static(q.device, "rows", (b, capacity), lambda: np.arange(b + 1) * capacity)
        cu_k = torch.cat([(bases[:-1].unsqueeze(1) + starts).flatten(), bases[-1:]])
        used = (lengths - starts).clamp(0, chunk).int()
        packed = _pack_gqa(q, hk, splits)
    cu_q = _static(q.device, "rows", (b * splits, group),
                   lambda: np.arange(b * splits + 1) * group)
    keys, values = (c.reshape(b * capacity, hk, c.shape[3]) for c in (k_cache, v_cache))
    out, lse = varlen_forward(packed, keys, values, cu_q, cu_k, group, chunk, used.flatten(),
                              scale, False, (None, None), softcap, True, None)
    return _combine(out, lse, bad, q, splits, return_lse)


def _chunks(splits: int, width: int, unit: int):
    """(splits, keys per chunk) of ``width`` keys cut into at most ``splits`` chunks of a
    whole number of ``unit`` keys (pages), none of them past the width."""
    chunk = -(-max(1, -(-width // splits)) // unit) * unit
    return max(1, -(-width // chunk)), chunk


def _pack_gqa(q, hk: int, splits: int):
    """One query token's heads as rows (pack-GQA), once per split: (b, 1, hk x g, d) ->
    (b x splits x g, hk, d), sequence (i, s) of the varlen call holding sequence i's g rows."""
    b, _, hq, d = q.shape
    group = hq // hk
    rows = q.reshape(b, hk, group, d).transpose(1, 2)  # (b, g, hk, d)
    return rows.unsqueeze(1).expand(b, splits, group, hk, d).reshape(b * splits * group, hk, d)


def _combine(out, lse, bad, q, splits: int, return_lse: bool):
    """``_pack_gqa``'s varlen output (b x splits x g, hk, dv) and LSE (hk, b x splits x g)
    merged over the splits, back to heads and NaN for the ``bad`` sequences: out (b, 1, hq,
    dv), lse (b, hq, 1). On the GPU one launch (``kvcache_kernels.SplitCombine``); on the CPU
    ``merge_splits``."""
    b, _, hq, _ = q.shape
    hk, dv = out.shape[1], out.shape[2]
    group = hq // hk
    if out.device.type == "cuda":
        from fa_sm100 import kvcache_kernels

        out, lse = kvcache_kernels.combine(out, lse, bad, b, hq, splits, group)
        out, lse = out.view(b, 1, hq, dv), lse.view(b, hq, 1)
        return (out, lse) if return_lse else out
    out = out.view(b, splits, group, hk, dv)
    lse = lse.view(hk, b, splits, group).permute(1, 2, 3, 0)
    out, lse = merge_splits(out, lse) if splits > 1 else (out[:, 0], lse[:, 0])
    out = out.transpose(1, 2).reshape(b, 1, hq, dv).to(q.dtype)  # rows (g, hk) -> heads
    return _nan_where_bad(out, lse.transpose(1, 2).reshape(b, hq, 1), bad, return_lse)


def _unpack_prefill(out, lse, q):
    """A several-token call's varlen output (b x sq, hq, dv) and LSE (hq, b x sq) as out (b,
    sq, hq, dv) and lse (b, hq, sq)."""
    b, sq, hq, _ = q.shape
    return out.view(b, sq, hq, out.shape[-1]), lse.view(hq, b, sq).permute(1, 0, 2)


def paged_forward_for(q, page_size: int, windowed: bool = False):
    """The forward that reads a paged cache itself on q's device, or None (then the pages are
    gathered): the SM100 kernel (``sm100_fwd_paged``) with pages of a multiple of its 128-key
    blocks and no window (its CPU layers hold no windowed paged run), the SM90 kernel
    (``sm90_fwd_paged``) with pages of a multiple of 64 keys."""
    if not isinstance(q, torch.Tensor) or q.device.type != "cuda":
        return None
    from fa_sm100.devices import is_sm100

    if is_sm100(q.device):
        if page_size % 128 or windowed:
            return None
        from fa_sm100.sm100.interface import sm100_fwd_paged

        return sm100_fwd_paged
    from fa_sm100.hopper.config import SM90_PAGE_BLOCKS

    if page_size % min(SM90_PAGE_BLOCKS):
        return None
    from fa_sm100.hopper.interface import sm90_fwd_paged

    return sm90_fwd_paged


def _paged_prefill(paged_forward, q, k_pages, v_pages, table, used, bad, causal, window, scale,
                   softcap, return_lse):
    """``_prefill`` through a forward that reads the pages itself."""
    b, sq, hq, d = q.shape
    cu_q = _static(q.device, "rows", (b, sq), lambda: np.arange(b + 1) * sq)
    out, lse = paged_forward(q.reshape(b * sq, hq, d), k_pages, v_pages, cu_q, sq, table,
                             used.view(b), table.shape[1] * k_pages.shape[1], scale, causal,
                             window, softcap, True)
    return _nan_where_bad(*_unpack_prefill(out, lse, q), bad, return_lse)


def _paged_decode(paged_forward, q, packed, k_pages, v_pages, table, used, bad, splits: int,
                  chunk: int, scale, softcap, return_lse):
    """One query token through a forward that reads the pages itself: pack-GQA and split-KV
    with chunks of whole pages, chunk (i, s) the sequence whose page-table row is sequence i's
    pages from s x pages per chunk on (the table seen as (batch x splits, pages per chunk))."""
    b, _, hq, d = q.shape
    hk, page_size = k_pages.shape[2], k_pages.shape[1]
    group = hq // hk
    per_chunk = chunk // page_size
    if splits * per_chunk > table.shape[1]:  # the last chunk's slots past the table: page 0
        table = torch.nn.functional.pad(table, (0, splits * per_chunk - table.shape[1]))
    rows = table.reshape(b * splits, per_chunk)
    cu_q = _static(q.device, "rows", (b * splits, group),
                   lambda: np.arange(b * splits + 1) * group)
    out, lse = paged_forward(packed, k_pages, v_pages, cu_q, group, rows, used.flatten(), chunk,
                             scale, False, (None, None), softcap, True)
    return _combine(out, lse, bad, q, splits, return_lse)


def _sms(device) -> int:
    if device.type != "cuda":
        from fa_sm100.machines import HOPPER_SMS

        return HOPPER_SMS
    from fa_sm100.devices import sm_count

    return sm_count(device)
