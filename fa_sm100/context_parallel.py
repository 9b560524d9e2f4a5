"""Context parallelism: one attention over a sequence sharded across the ranks of a process
group (torch.distributed: NCCL on GPUs, gloo on CPUs), forward and backward (docs/context_parallel.md).

Layout (``shard``): the sequence is cut into 2 W equal chunks for W ranks, and rank r holds
chunks r and 2W - 1 - r, one from each end, so under a causal mask every rank has the same
amount of work. Both functions take and return the local shard (batch, 2 x chunk, heads, dim).

- ``ring_attention``: K/V travel around the ring (rank r sends to r + 1) while each rank
  attends its Q to the K/V it holds; the send of the next step's K/V is posted before the
  local step, so the transfer overlaps the computation. Each step's partial output is merged
  into the running one by its LSE in float32 (``merge``). The backward sends K/V round again,
  and each block's float32 dK/dV accumulators follow it one step behind (a rank computes
  its share into fresh buffers while the running sums arrive, then adds them and sends them
  on); after the last step they reach the block's home. dQ stays local. GQA: K/V travel at their own head count.
- ``ulysses_attention`` (head-parallel): an all-to-all turns the sequence shards into head
  shards (all tokens, H / W heads per rank), one local attention runs, an all-to-all turns the
  result back. Needs the query and key/value head counts divisible by W.

The local step is a pair of functions: ``forward(q, k, v, causal, scale) -> (out, lse)`` and
``backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)``, where out and lse are the
whole attention's (the backward of a block pair needs the global LSE and Delta). ``kernel_steps``
gives ours (``flash_attn_func`` and the SM90 backward); ``reference_steps`` the PyTorch model of
the same arithmetic on any device (the CPU tests run it under gloo).
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist


class Steps(NamedTuple):
    """The local attention a parallel attention calls per block pair."""

    forward: Callable  # (q, k, v, causal, scale) -> (out, lse (b, h, s) float32)
    backward: Callable  # (dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)


def reference_steps() -> Steps:
    """The PyTorch model of the kernels' arithmetic (``fa_sm100.autograd``'s CPU path), on
    any device."""
    from fa_sm100.autograd import _cpu_backward, _cpu_forward

    return Steps(
        forward=lambda q, k, v, causal, scale: _cpu_forward(q, k, v, scale, causal, None, None,
                                                            0.0),
        backward=lambda dout, q, k, v, out, lse, causal, scale: _cpu_backward(
            dout, q, k, v, out, lse, scale, causal, None, None, 0.0))


def kernel_steps() -> Steps:
    """Ours: ``flash_attn_func`` (with LSE) and the SM90 backward."""
    from fa_sm100.hopper.bwd_interface import sm90_bwd
    from fa_sm100.interface import flash_attn_func

    def forward(q, k, v, causal, scale):
        with torch.no_grad():
            return flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_lse=True)

    def backward(dout, q, k, v, out, lse, causal, scale):
        return sm90_bwd(dout.contiguous(), q, k, v, out, lse, softmax_scale=scale, causal=causal)

    return Steps(forward, backward)


# ----------------------------------------------------------------------------- the layout

def shard(x: torch.Tensor, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s shard of the full sequence ``x`` (the layout above)."""
    chunks = x.chunk(2 * world, dim=dim)
    if len(chunks) != 2 * world or len({c.shape[dim] for c in chunks}) != 1:
        raise ValueError(f"the sequence ({x.shape[dim]} tokens) must split into {2 * world} "
                         f"equal chunks for {world} ranks")
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)


def unshard(shards, dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's shard, in rank order (``shard``'s inverse)."""
    world = len(shards)
    halves = [s.chunk(2, dim=dim) for s in shards]
    order = [halves[r][0] for r in range(world)] + [halves[r][1] for r in reversed(range(world))]
    return torch.cat(order, dim=dim)


def _chunk_ids(rank: int, world: int) -> tuple:
    return rank, 2 * world - 1 - rank


# ----------------------------------------------------------------------------- merging

def merge(out, lse, part_out, part_lse):
    """Merge a partial (out, lse) into a running one by LSE, in float32: the weights are
    exp(lse_i - lse_new); rows where both are -inf (no key yet) stay 0 / -inf. ``out`` is
    (b, s, h, d) float32, ``lse`` (b, h, s) float32; returns the merged pair."""
    new = torch.logaddexp(lse, part_lse)
    finite = torch.isfinite(new)
    safe = torch.where(finite, new, torch.zeros_like(new))
    w_old = torch.where(finite, torch.exp(lse - safe), torch.zeros_like(new))
    w_new = torch.where(finite, torch.exp(part_lse - safe), torch.zeros_like(new))
    to_rows = lambda w: w.transpose(1, 2).unsqueeze(-1)  # noqa: E731  (b, s, h, 1)
    return out * to_rows(w_old) + part_out.float() * to_rows(w_new), new


# ----------------------------------------------------------------------------- the ring

def _send_recv(tensors, group, rank: int, world: int):
    """Post the send of ``tensors`` to the next rank and the receive of the previous rank's;
    returns (received buffers, the requests to wait on)."""
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), dist.get_global_rank(group, nxt)
                      if group is not None else nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, dist.get_global_rank(group, prv)
                       if group is not None else prv, group) for r in received]
    return received, dist.batch_isend_irecv(ops)


def _pairs(rank: int, src: int, world: int, causal: bool):
    """The (query half, key half, causal) block pairs rank ``rank`` computes against the K/V
    shard that came from rank ``src``: halves index the two chunks of a shard; under a causal
    mask a query chunk sees key chunks before it fully and its own diagonally."""
    mine, theirs = _chunk_ids(rank, world), _chunk_ids(src, world)
    out = []
    for qi, qc in enumerate(mine):
        for ki, kc in enumerate(theirs):
            if not causal or kc < qc:
                out.append((qi, ki, False))
            elif kc == qc:
                out.append((qi, ki, True))
    return out


def _ring_forward(q, k, v, group, causal, scale, steps: Steps):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    b, s, h, _ = q.shape
    half = s // 2
    out = torch.zeros(b, s, h, v.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, s), -math.inf, dtype=torch.float32, device=q.device)
    kv = (k, v)
    for step in range(world):
        reqs = None
        if step + 1 < world:  # the next step's K/V travel while this step computes
            nxt_kv, reqs = _send_recv(kv, group, rank, world)
        src = (rank - step) % world
        for qi, ki, diag in _pairs(rank, src, world, causal):
            qs = slice(qi * half, (qi + 1) * half)
            ks = slice(ki * half, (ki + 1) * half)
            o, l = steps.forward(q[:, qs], kv[0][:, ks], kv[1][:, ks], diag, scale)
            out[:, qs], lse[:, :, qs] = merge(out[:, qs], lse[:, :, qs], o, l)
        if reqs is not None:
            for req in reqs:
                req.wait()
            kv = tuple(nxt_kv)
    return out.to(q.dtype), lse


def _ring_backward(dout, q, k, v, out, lse, group, causal, scale, steps: Steps):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    half = q.shape[1] // 2
    dq = torch.zeros_like(q, dtype=torch.float32)
    kv = (k, v)
    acc, acc_reqs = None, None  # the visiting block's dK/dV accumulators, on their way here
    for step in range(world):
        src = (rank - step) % world
        kv_reqs = None
        if step + 1 < world:  # the next block's K/V travel while this step computes
            nxt_kv, kv_reqs = _send_recv(kv, group, rank, world)
        # this step's share of the block's dK/dV, in fresh buffers: the accumulators it adds
        # to (from the previous rank) arrive while it computes
        dkb = torch.zeros_like(k, dtype=torch.float32)
        dvb = torch.zeros_like(v, dtype=torch.float32)
        for qi, ki, diag in _pairs(rank, src, world, causal):
            qs = slice(qi * half, (qi + 1) * half)
            ks = slice(ki * half, (ki + 1) * half)
            g = steps.backward(dout[:, qs].contiguous(), q[:, qs].contiguous(),
                               kv[0][:, ks].contiguous(), kv[1][:, ks].contiguous(),
                               out[:, qs].contiguous(), lse[:, :, qs].contiguous(), diag, scale)
            dq[:, qs] += g[0].float()
            dkb[:, ks] += g[1].float()
            dvb[:, ks] += g[2].float()
        if acc_reqs is not None:
            for req in acc_reqs:
                req.wait()
            dkb += acc[0]
            dvb += acc[1]
        if world == 1:
            return dq.to(q.dtype), dkb.to(k.dtype), dvb.to(v.dtype)
        # the block's accumulators go on to the next rank, which adds its share while they
        # travel; after the last step that rank is the block's home (src = rank + 1)
        acc, acc_reqs = _send_recv((dkb, dvb), group, rank, world)
        if kv_reqs is not None:
            for req in kv_reqs:
                req.wait()
            kv = tuple(nxt_kv)
    for req in acc_reqs:
        req.wait()
    return dq.to(q.dtype), acc[0].to(k.dtype), acc[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, steps):
        out, lse = _ring_forward(q, k, v, group, causal, scale, steps)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.steps = group, causal, scale, steps
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(dout, q, k, v, out, lse, ctx.group, ctx.causal, ctx.scale,
                                    ctx.steps)
        return dq, dk, dv, None, None, None, None


def _check(q, k, v, group):
    if not dist.is_initialized():
        raise ValueError("context parallelism needs torch.distributed initialized "
                         "(dist.init_process_group)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D (batch, local seqlen, heads, dim) tensor")
    if q.shape[1] != k.shape[1] or q.shape[1] % 2:
        raise ValueError(f"each rank holds two equal chunks of q and of k / v (shard): local "
                         f"lengths {q.shape[1]} and {k.shape[1]} must be equal and even")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"query heads ({q.shape[2]}) must be a multiple of kv heads "
                         f"({k.shape[2]})")


def ring_attention(q, k, v, group=None, causal: bool = False,
                   softmax_scale: Optional[float] = None, steps: Optional[Steps] = None,
                   return_lse: bool = False):
    """Attention of this rank's shard of q over the whole sequence of k, v (the module
    docstring); differentiable. ``steps``: the local attention (default: ``kernel_steps`` on
    CUDA tensors, ``reference_steps`` elsewhere)."""
    _check(q, k, v, group)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    if steps is None:
        steps = kernel_steps() if q.is_cuda else reference_steps()
    out, lse = _RingAttention.apply(q, k, v, group, bool(causal), scale, steps)
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- all-to-all

def _seq_to_heads(x, group, world):
    """(b, s_local, H, d) shards of the balanced layout -> (b, s_total, H / W, d), the full
    sequence in order."""
    parts = [p.contiguous() for p in x.chunk(world, dim=2)]
    got = [torch.empty_like(p) for p in parts]
    dist.all_to_all(got, parts, group=group)
    return unshard(got)


def _heads_to_seq(x, group, world, rank):
    """The inverse of ``_seq_to_heads``: (b, s_total, H / W, d) -> this rank's (b, s_local,
    H, d) shard."""
    parts = [shard(x, r, world).contiguous() for r in range(world)]
    got = [torch.empty_like(p) for p in parts]
    dist.all_to_all(got, parts, group=group)
    return torch.cat(got, dim=2)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group, dist.get_world_size(group))

    @staticmethod
    def backward(ctx, g):
        world = dist.get_world_size(ctx.group)
        return _heads_to_seq(g.contiguous(), ctx.group, world, dist.get_rank(ctx.group)), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        world = dist.get_world_size(group)
        return _heads_to_seq(x, group, world, dist.get_rank(group))

    @staticmethod
    def backward(ctx, g):
        return _seq_to_heads(g.contiguous(), ctx.group, dist.get_world_size(ctx.group)), None


class _Local(torch.autograd.Function):
    """One local attention with the steps' forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, steps):
        out, lse = steps.forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale, ctx.steps = causal, scale, steps
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.steps.backward(dout.contiguous(), q, k, v, out, lse, ctx.causal,
                                        ctx.scale)
        return dq, dk, dv, None, None, None


def ulysses_attention(q, k, v, group=None, causal: bool = False,
                      softmax_scale: Optional[float] = None, steps: Optional[Steps] = None):
    """Head-parallel attention of sequence shards (the module docstring); differentiable."""
    _check(q, k, v, group)
    world = dist.get_world_size(group)
    if q.shape[2] % world or k.shape[2] % world:
        raise ValueError(f"all-to-all attention splits heads over {world} ranks: query heads "
                         f"({q.shape[2]}) and kv heads ({k.shape[2]}) must divide by it (use "
                         f"ring_attention otherwise)")
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    if steps is None:
        steps = kernel_steps() if q.is_cuda else reference_steps()
    qh, kh, vh = (_SeqToHeads.apply(t, group) for t in (q, k, v))
    out = _Local.apply(qh, kh, vh, bool(causal), scale, steps)
    return _HeadsToSeq.apply(out, group)


# ----------------------------------------------------------------------------- one process

def simulate_ring(q, k, v, world: int, causal: bool = False,
                  softmax_scale: Optional[float] = None, steps: Optional[Steps] = None):
    """The ring's forward for ``world`` ranks driven in one process on full (batch, seqlen,
    heads, dim) tensors: each rank's shard, its steps over the K/V shards in ring order, the
    same block pairs and LSE merge as ``ring_attention``, with no communication (for one GPU,
    where NCCL cannot run two ranks). Returns the full (out, lse (b, h, s))."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    if steps is None:
        steps = kernel_steps() if q.is_cuda else reference_steps()
    outs, lses = [], []
    kv = [(shard(k, r, world), shard(v, r, world)) for r in range(world)]
    for rank in range(world):
        q_r = shard(q, rank, world)
        half = q_r.shape[1] // 2
        out = torch.zeros(*q_r.shape[:3], v.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.full((q.shape[0], q.shape[2], q_r.shape[1]), -math.inf,
                         dtype=torch.float32, device=q.device)
        for step in range(world):
            src = (rank - step) % world
            for qi, ki, diag in _pairs(rank, src, world, causal):
                qs, ks = slice(qi * half, (qi + 1) * half), slice(ki * half, (ki + 1) * half)
                o, l = steps.forward(q_r[:, qs].contiguous(), kv[src][0][:, ks].contiguous(),
                                     kv[src][1][:, ks].contiguous(), diag, scale)
                out[:, qs], lse[:, :, qs] = merge(out[:, qs], lse[:, :, qs], o, l)
        outs.append(out.to(q.dtype))
        lses.append(lse)
    return unshard(outs), unshard(lses, dim=2)
