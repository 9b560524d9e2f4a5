"""What the SM90 backward's roles share, as small frozen bundles of traced values.

``Sm90FlashBackward.kernel`` builds them once per CTA and hands each role only the ones it
reads (``bwd_load.load``, ``bwd_store.dq_store``, ``bwd_mma.mma``); they exist only while the
kernel is traced. The SM100 forward's roles take theirs the same way (fa_sm100/sm100/context.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import cutlass.cute as cute


@dataclass(frozen=True)
class BwdProblem:
    """Run-time sizes and scales of one CTA's problem (its sequence's under varlen, Note
    [Varlen backward] in bwd_kernel.py): ``group`` query heads per KV head; ``band``: the
    (left, right) bounds every role masks and walks with (``bands.traced_bounds``: None for
    an unbounded side); ``softcap_k``: softmax_scale / softcap of a softcapped kernel, else
    None (Note [softcap in the backward] in bwd_scores.py)."""

    seqlen_q: object
    seqlen_k: object
    group: object
    band: tuple
    softmax_scale: object
    scale_log2: object  # softmax_scale * log2(e), or softcap * log2(e) with softcap
    softcap_k: object = None


@dataclass(frozen=True)
class BwdGmem:
    """Global tensors: the TMA views of Q, K (s, d, h, b), V and dO (s, dv, h, b); LSE2 and
    Delta (b, h, seqlen_q_pad) float32; the float32 dQ accumulator (b, h, m_blocks, fragment
    order); dK, dV (MHA: b, s, h, d in the input dtype; GQA buffers: float32 b, h, s_pad, d);
    the dQ semaphores (b, h, ``BwdConfig.dq_sem_slots``)."""

    mQ: cute.Tensor
    mK: cute.Tensor
    mV: cute.Tensor
    mdO: cute.Tensor
    mLSE2: cute.Tensor
    mDelta: cute.Tensor
    mdQacc: cute.Tensor
    mdK: cute.Tensor
    mdV: cute.Tensor
    mdQsem: cute.Tensor


@dataclass(frozen=True)
class BwdSmem:
    """SMEM tensors: sQ (q_stage), sdO (do_stage), sK, sV (the tile's keys), sP (p_stage;
    None when swapped: Note [swapped S/dP] in bwd_mma.py), sdS (ds_stage), sdQ (the "bulk" dQ
    tile in fragment order), sLSE2 / sDelta ((tile_m, stage) with ``stats_smem``, else None)."""

    sQ: cute.Tensor
    sdO: cute.Tensor
    sK: cute.Tensor
    sV: cute.Tensor
    sP: Optional[cute.Tensor]
    sdS: cute.Tensor
    sdQ: cute.Tensor
    sLSE2: Optional[cute.Tensor]
    sDelta: Optional[cute.Tensor]


@dataclass(frozen=True)
class BwdPipes:
    """The load warp's hand-offs to the MMA warpgroups: the ``q`` and ``do`` pipelines
    (``PipelineTmaAsync``, each stage with its block's LSE2 / Delta with ``stats_smem``) and
    ``kv``, the K/V full mbarrier (with persistent CTAs K/V empty follows it, ``kv + 1``)."""

    q: object
    do: object
    kv: object


@dataclass(frozen=True)
class BwdLoadAtoms:
    """The TMA atoms of the load warp: Q, K, V, dO."""

    q: cute.CopyAtom
    k: cute.CopyAtom
    v: cute.CopyAtom
    do: cute.CopyAtom


@dataclass(frozen=True)
class BwdMmas:
    """The tiled WGMMAs of S and dP (``sdp``), dK, dV and dQ, and ``tidx``, this thread's
    index among the MMA warpgroups' (0 .. 255)."""

    sdp: cute.TiledMma
    dk: cute.TiledMma
    dv: cute.TiledMma
    dq: cute.TiledMma
    tidx: object


@dataclass(frozen=True)
class BwdDkvOut:
    """Where the MMA warpgroups' epilogue puts dK and dV besides ``BwdGmem.mdK`` / ``mdV``:
    with ``dkv_tma_store`` the TMA store atoms and their GMEM views (else None), and
    ``staging``, the (dK, dV) SMEM tiles the TMA stores read (Note [dK/dV by TMA] in
    bwd_store.py)."""

    tma_dk: Optional[cute.CopyAtom]
    tma_mdk: Optional[cute.Tensor]
    tma_dv: Optional[cute.CopyAtom]
    tma_mdv: Optional[cute.Tensor]
    staging: tuple
