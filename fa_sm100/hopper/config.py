"""The frozen configuration of the Hopper (SM90) forward kernel.

One compiled kernel per value. Problem-shaped fields (head dims, dtype, causal) are static
parts of the problem; the rest are the kernel's design choices, each a switch a benchmark can
flip: the tile shape, the number of consumer warpgroups, K/V stages, the ping-pong between
consumer warpgroups, the intra-warpgroup overlap of softmax with the next GEMM, and the
``setmaxnreg`` budgets that move registers from the producer to the consumers.

``Sm90FwdConfig.validate()`` raises ``ValueError`` naming the violated rule.
``select_sm90_fwd_config`` picks the defaults for a problem.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable

from fa_sm100.config import (
    DTYPE_BYTES,
    DTYPES,
    WARP_SIZE,
    WARPGROUP_WARPS,
    check_register_budget,
    check_setmaxnreg,
    default_head_dim_v,
    normalize_dtype,
    parse_overrides,
)
from fa_sm100 import softmax_math
from layouts.smem import ALIGN, SMEM_BUDGET, align_up

SM90_ARCH = "sm_90a"
# (qk, v) head-dimension pairs the SM90 forward supports.
SM90_HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256))
# Dynamic SMEM one CTA may opt into on sm_90a (227 KiB).
SM90_SMEM_BUDGET = SMEM_BUDGET[SM90_ARCH]
SMEM_ALIGN = ALIGN  # every buffer starts on a 1 KiB boundary (128-byte swizzle atoms repeat)
WARPGROUP_THREADS = WARPGROUP_WARPS * WARP_SIZE  # 128
WGMMA_M = 64  # rows of one warpgroup MMA
KV_CLUSTER = 2  # CTAs that share each K/V tile under kv_multicast, by default
KV_CLUSTERS = (2, 4)  # cluster sizes kv_multicast accepts (kv_cluster)


@dataclass(frozen=True)
class Sm90FwdConfig:
    """Compile-time configuration of the warp-specialized SM90 forward.

    CTA = 1 producer warpgroup (warp 0 issues every TMA load; the other three warps only give
    their registers away) + ``num_consumer_wg`` consumer warpgroups. Consumer warpgroup ``w``
    owns rows ``[64 w, 64 w + 64)`` of the ``m_block`` query rows and runs S = Q K^T, the
    online softmax and O += P V for them with P kept in registers (RS WGMMA).
    """

    # problem
    head_dim: int = 128
    head_dim_v: int = 128
    dtype: str = "bfloat16"
    causal: bool = False
    # a sliding window (``fa_sm100.bands``): its bounds are run-time arguments of the launch,
    # so one kernel serves every window; causal with a window is this kernel too (right <= 0)
    local: bool = False
    # logit softcapping (fa_sm100.softmax_math): the cap is a run-time argument; scores pass
    # through softcap_tanh before the mask and the softmax
    softcap: bool = False
    # variable-length batches (Note [Varlen] in fwd_kernel.py): packed sequences, each work
    # tile's offsets and lengths read from cu_seqlens; always a ``local`` kernel (causal and
    # windows are the run-time band of each sequence)
    varlen: bool = False
    write_lse: bool = True
    # tiles
    m_block: int = 128
    n_block: int = 128
    num_consumer_wg: int = 2
    kv_stage: int = 2
    # Q stages (persistent with O's own buffer only, for 2): with 2 the producer loads the next
    # work tile's Q while this tile's QK GEMMs still read its own (Note [Two Q stages] in
    # fwd_kernel.py)
    q_stage: int = 1
    # switches
    intra_wg_overlap: bool = True  # softmax of tile j overlaps the QK GEMM of tile j+1 and PV of j
    pingpong: bool = True  # named barriers order the consumer warpgroups' GEMM issue
    rescale_o_before_pv: bool = False  # rescale O while the QK GEMM runs (intra_wg_overlap only)
    persistent: bool = False  # one CTA per SM loops over work tiles (see o_in_q_buffer for O)
    # persistent only: a CTA takes its next work tile from a global counter when it is about to
    # need one (Note [Dynamic tile schedule] in fwd_kernel.py) instead of every gridDim.x-th tile
    dynamic_schedule: bool = False
    # persistent only: stage O in Q's buffer instead of its own; the next tile's Q then loads
    # once O's store has read it (Note [O in Q's buffer] in fwd_consumer.py)
    o_in_q_buffer: bool = False
    # persistent with O's own buffer only: each consumer warpgroup stages its own 64 rows of O
    # and issues their TMA store itself, synchronised only within the warpgroup, so a
    # warpgroup that finishes its tile first goes on to the next one instead of waiting for
    # the others (Note [Warpgroup epilogues] in fwd_consumer.py)
    wg_epilogue: bool = False
    ex2_emu_fraction: float = 0.0  # share of exp2 done by a polynomial on the FMA pipe
    # log2 units a row max may grow before O is rescaled (fa_sm100.softmax_math's rule, as
    # FmhaConfig.rescale_threshold): 0 multiplies O by its factor at every KV tile (by 1 where
    # the max did not grow); above 0 a row keeps its stale max until it grows by more, and a
    # warp skips O's multiply when none of its rows moved (Note [Rescale threshold] in
    # fwd_consumer.py)
    rescale_threshold: float = 0.0
    # a consumer warpgroup whose 64 rows all lie past seqlen_q (the last m block of a head)
    # issues no GEMM and computes no softmax; it only keeps the tile's pipeline and ping-pong
    # protocol (Note [Empty warpgroups] in fwd_consumer.py). H100, paired over off, hdim 64
    # (192-row tiles): non-causal +10.1% (1k), +2.0% (2k), +2.8% (4k), +1.1% (8k); causal
    # +5.2% (2k), +1.6% (4k). select_sm90_fwd_config: on only where the last m block has an
    # empty warpgroup (the branch around the main loop measured 0.8-2.7% slower at hdim 128
    # non-causal 4k / 16k, where none is empty).
    skip_empty_wg: bool = True
    # the producer issues a work tile's first K tile before its Q (FlashAttention-4's order)
    k_before_q: bool = False
    # CTAs of neighbouring m blocks of one (batch, head) run as a cluster of kv_cluster; each
    # loads its share of every K/V tile and multicasts it to all (Note [K/V multicast] in
    # fwd_kernel.py). Non-causal, a whole number of clusters of m blocks per head, and one
    # tile per CTA or persistent pairs on the static schedule (Note [Persistent multicast]).
    kv_multicast: bool = False
    # CTAs per cluster under kv_multicast: each loads 1/kv_cluster of every K / V tile (4
    # measured 6-8% slower than 2 on the H100: CHANGELOG.md)
    kv_cluster: int = KV_CLUSTER
    # Under kv_multicast with clusters of 2, an odd number of m blocks per head no longer rules
    # multicast out: the even part pairs as before, and the last m blocks of two (batch, head)
    # pairs share a cluster whose CTAs load their own K/V (Note [Odd m blocks] in
    # fwd_kernel.py). Needs an even number of (batch, head) pairs. select_sm90_fwd_config: on
    # only for an odd number of m blocks (the consumers' main loop came out 4 instructions
    # longer per KV tile at hdim 256 with it, though it changes nothing for an even number).
    multicast_odd_m: bool = True
    # Under kv_multicast, the consumers release K/V stages on the cluster's empty barriers
    # through addresses mapped once, not re-derived at every release (Note [Peer release] in
    # fa_sm100/hopper/common.py): 15 fewer instructions per KV tile at hdim 64; H200, paired
    # over off, hdim 64 non-causal 16k +0.7%, 8k +0.0%, hdim 128 / 256 within +-0.5%. No
    # effect without multicast.
    peer_release: bool = True
    # Causal scheduling: (batch, head) pairs are cut into sections whose K and V take at most
    # this many MiB, so a section's K/V stay in L2 (50 MB on H100/H200) while its tiles run.
    # 16 measured best of 8/16/24/40 on H200 in 5 of 8 causal cells (docs/hopper.md).
    l2_section_mib: int = 16
    # registers per thread after setmaxnreg
    regs_consumer: int = 240
    regs_producer: int = 24

    @property
    def num_threads(self) -> int:
        return WARPGROUP_THREADS * (1 + self.num_consumer_wg)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def cluster(self) -> tuple[int, int, int]:
        """The launch's cluster shape (Note [K/V multicast] in fwd_kernel.py)."""
        return (self.kv_cluster, 1, 1) if self.kv_multicast else (1, 1, 1)

    def num_m_blocks(self, seqlen_q: int) -> int:
        """Query blocks of ``m_block`` rows per (batch, head)."""
        return -(-seqlen_q // self.m_block)

    def has_empty_wg(self, seqlen_q: int) -> bool:
        """Whether the last m block leaves a consumer warpgroup's 64 rows all past
        ``seqlen_q`` (Note [Empty warpgroups] in fwd_consumer.py)."""
        return (-seqlen_q) % self.m_block >= WGMMA_M

    @property
    def odd_m_pairs(self) -> bool:
        """Whether the kernel pairs the last m blocks of two heads when a head has an odd
        number of them (Note [Odd m blocks] in fwd_kernel.py): ``multicast_odd_m`` under
        ``kv_multicast`` with clusters of 2."""
        return self.kv_multicast and self.multicast_odd_m and self.kv_cluster == 2

    def multicast_fits(self, seqlen_q: int, batch_heads=None) -> bool:
        """Whether ``kv_multicast`` can group the work tiles of a problem with ``seqlen_q``
        rows and ``batch_heads`` (batch, head) pairs into clusters of ``kv_cluster``: a whole
        number of clusters of m blocks per head (Note [K/V multicast]), or, with
        ``multicast_odd_m`` and clusters of 2, an odd number of m blocks and an even number of
        pairs (Note [Odd m blocks]; ``batch_heads=None``: unknown, so no)."""
        m_blocks = self.num_m_blocks(seqlen_q)
        if m_blocks % self.kv_cluster == 0:
            return True
        return (self.multicast_odd_m and self.kv_cluster == 2 and batch_heads is not None
                and batch_heads % 2 == 0)

    @property
    def own_o_buffer(self) -> bool:
        """Whether O is staged in an SMEM buffer of its own rather than in Q's: persistent CTAs
        without ``o_in_q_buffer`` (Note [O in Q's buffer] in fwd_consumer.py)."""
        return self.persistent and not self.o_in_q_buffer

    @property
    def causal_schedule(self) -> bool:
        """Causal without a window: tiles run longest first in L2 sections (``tile_coords``).
        A windowed tile's length follows its band, not its m block."""
        return self.causal and not self.local

    def replace(self, **changes) -> "Sm90FwdConfig":
        return dataclasses.replace(self, **changes)

    def effective(self) -> "Sm90FwdConfig":
        """This config with the switches that its kernel does not read set to their defaults:
        ``kv_cluster``, ``peer_release`` and ``multicast_odd_m`` without ``kv_multicast``,
        ``multicast_odd_m`` in clusters of 4, ``l2_section_mib`` without ``causal`` (only the
        causal tile order has sections; the kernel gets their size as an argument that it then
        never reads), ``k_before_q`` with ``o_in_q_buffer`` (which loads K first anyway). Two
        configs with equal ``effective()`` build the same kernel (a compile test holds their
        SASS equal), so timing one against the other measures noise (``scripts/ab_bench.py``
        says so)."""
        cls = Sm90FwdConfig
        changes = {}
        if not self.kv_multicast:
            changes.update(kv_cluster=cls.kv_cluster, peer_release=cls.peer_release)
        if not self.odd_m_pairs:
            changes["multicast_odd_m"] = cls.multicast_odd_m
        if not self.causal_schedule:
            changes["l2_section_mib"] = cls.l2_section_mib
        if self.o_in_q_buffer:
            changes["k_before_q"] = cls.k_before_q
        return self.replace(**changes)

    def setmaxnreg(self) -> dict[str, int]:
        """Role -> registers per thread after ``setmaxnreg`` (the compile contract checks these)."""
        return {"producer": self.regs_producer, "consumer": self.regs_consumer}

    def registers_used(self) -> int:
        return WARPGROUP_THREADS * (self.regs_producer + self.num_consumer_wg * self.regs_consumer)

    def smem_parts(self) -> dict[str, int]:
        """Bytes of each SMEM buffer (O is staged in Q's buffer; barriers are 8 bytes each)."""
        e = self.dtype_bytes
        if self.own_o_buffer:
            # O's own buffer: the next tile's Q may land while this tile's O is stored
            q_o = {"q": align_up(self.q_stage * self.m_block * self.head_dim * e),
                   "o": align_up(self.m_block * self.head_dim_v * e)}
        else:
            q_o = {"q_and_o": align_up(self.m_block * max(self.head_dim, self.head_dim_v) * e)}
        return {
            **q_o,
            "k": align_up(self.kv_stage * self.n_block * self.head_dim * e),
            "v": align_up(self.kv_stage * self.n_block * self.head_dim_v * e),
            # q, k, v pipelines; with the dynamic schedule also the tile pipeline (2 stages)
            # and its two tile-index slots
            "mbarriers": align_up(8 * (2 * self.q_stage + 4 * self.kv_stage)
                                  + (8 * 4 + 4 * 2 if self.dynamic_schedule else 0)),
        }

    def smem_bytes(self) -> int:
        return sum(self.smem_parts().values())

    def validate(self) -> "Sm90FwdConfig":
        """Raise ValueError naming the first violated rule; return self when all hold."""
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: must be one of {DTYPES}")
        if (self.head_dim, self.head_dim_v) not in SM90_HEAD_DIMS:
            raise ValueError(
                f"head dims (qk={self.head_dim}, v={self.head_dim_v}) are not supported on SM90: "
                f"use one of {SM90_HEAD_DIMS}"
            )
        if self.num_consumer_wg not in (2, 3):
            raise ValueError(
                f"num_consumer_wg={self.num_consumer_wg}: must be 2 or 3 (four consumer "
                "warpgroups launch 640 threads with 96 registers each, which leaves 112 per "
                "consumer thread after the producer's 24: room for 64-key tiles only, measured "
                "0.90x of three warpgroups at hdim 64, CHANGELOG.md)")
        if self.m_block != WGMMA_M * self.num_consumer_wg:
            raise ValueError(
                f"m_block={self.m_block}: must be 64 x num_consumer_wg = "
                f"{WGMMA_M * self.num_consumer_wg} (each consumer warpgroup owns 64 rows)"
            )
        if self.n_block % 16 or not 16 <= self.n_block <= 256:
            raise ValueError(
                f"n_block={self.n_block}: must be a multiple of 16 in [16, 256] (it is the N of "
                "the QK WGMMA and the K of the PV WGMMA)"
            )
        if self.kv_stage < 1:
            raise ValueError(f"kv_stage={self.kv_stage}: must be at least 1")
        if self.intra_wg_overlap and self.kv_stage < 2:
            raise ValueError(
                f"kv_stage={self.kv_stage}: the intra-warpgroup overlap keeps K[j-1] and V[j] in "
                "flight together and needs at least 2 stages"
            )
        if self.dynamic_schedule and not self.persistent:
            raise ValueError("dynamic_schedule=True needs persistent=True (without persistence "
                             "every work tile is its own CTA, which the hardware already "
                             "dispatches to the first free SM)")
        if self.o_in_q_buffer and not self.persistent:
            raise ValueError("o_in_q_buffer=True needs persistent=True (one tile per CTA always "
                             "stages O in Q's buffer)")
        if self.q_stage not in (1, 2):
            raise ValueError(f"q_stage={self.q_stage}: must be 1 or 2")
        if self.q_stage == 2 and not self.own_o_buffer:
            raise ValueError("q_stage=2 needs persistent=True and o_in_q_buffer=False (one tile "
                             "per CTA has no next Q to load; O staged in Q's buffer would "
                             "overwrite it)")
        if self.wg_epilogue and not self.own_o_buffer:
            raise ValueError("wg_epilogue=True needs persistent=True and o_in_q_buffer=False (O "
                             "in its own SMEM buffer: a warpgroup may store its O while another "
                             "warpgroup's QK GEMMs still read Q)")
        if self.kv_multicast and (self.causal or self.local):
            raise ValueError("kv_multicast=True needs causal=False and local=False (the CTAs of "
                             "a cluster load the same K/V tiles; causal or windowed tiles of "
                             "neighbouring m blocks see different ones)")
        if self.varlen and not self.local:
            raise ValueError("varlen=True needs local=True (each sequence's causal mask or "
                             "window is its run-time band: Note [Varlen] in fwd_kernel.py)")
        if self.varlen and self.kv_multicast:
            raise ValueError("varlen=True needs kv_multicast=False (neighbouring m blocks may "
                             "belong to different sequences)")
        if self.kv_multicast and self.dynamic_schedule:
            raise ValueError("kv_multicast=True needs dynamic_schedule=False (the CTAs of a "
                             "cluster must take neighbouring m blocks of one head, tile after "
                             "tile: every gridDim.x-th tile, not the next from a counter)")
        if self.kv_multicast and self.persistent and self.kv_cluster != KV_CLUSTER:
            raise ValueError(f"kv_cluster={self.kv_cluster} with persistent=True: persistent "
                             f"multicast CTAs come in clusters of {KV_CLUSTER} (the "
                             "persistent grid is sized for every CTA to run at once, which "
                             "clusters of 4 may not: a GPC whose SM count is not a multiple of "
                             "4 leaves SMs out)")
        if isinstance(self.kv_cluster, bool) or self.kv_cluster not in KV_CLUSTERS:
            raise ValueError(f"kv_cluster={self.kv_cluster!r}: must be one of {KV_CLUSTERS}")
        if self.rescale_o_before_pv and not self.intra_wg_overlap:
            raise ValueError("rescale_o_before_pv=True needs intra_wg_overlap=True (it moves the "
                             "rescale into the shadow of the overlapped QK GEMM)")
        if not 1 <= self.l2_section_mib <= 1024:
            raise ValueError(f"l2_section_mib={self.l2_section_mib}: must lie in [1, 1024] "
                             "(the kernel computes the section in 32-bit bytes)")
        if not 0.0 <= self.ex2_emu_fraction <= 1.0:
            raise ValueError(f"ex2_emu_fraction={self.ex2_emu_fraction}: must lie in [0, 1]")
        softmax_math.check_rescale_threshold(self.rescale_threshold, self.dtype)
        for name in ("regs_consumer", "regs_producer"):
            check_setmaxnreg(name, getattr(self, name))
        check_register_budget(
            self.registers_used(),
            f"{WARPGROUP_THREADS} x ({self.regs_producer} + {self.num_consumer_wg} x "
            f"{self.regs_consumer})",
            self.num_threads,
        )
        if self.smem_bytes() > SM90_SMEM_BUDGET:
            raise ValueError(
                f"SMEM {self.smem_bytes()} bytes ({self.smem_parts()}) exceeds the sm_90a budget "
                f"of {SM90_SMEM_BUDGET}: lower kv_stage or n_block"
            )
        return self


# Register split per consumer count: the producer keeps just enough for address math.
_REGS = {2: (240, 24), 3: (160, 32)}


def default_tile(head_dim: int) -> tuple[int, int]:
    """(num_consumer_wg, n_block) for a head dim: the largest tiles the registers and SMEM allow.
    (Short causal problems narrow the tile in ``select_sm90_fwd_config``.)"""
    if head_dim <= 64:
        return 3, 128  # 192 x 128: small accumulators leave room for a third consumer
    if head_dim <= 128:
        return 2, 128
    if head_dim <= 192:
        return 2, 112
    return 2, 80  # hdim 256: O alone is 128 registers per thread


# Persistent CTAs hide each work tile's start (Q and first K load) and end (epilogue) behind
# the neighbouring tiles; with the dynamic schedule (Note [Dynamic tile schedule] in
# fwd_kernel.py) they also balance tiles of uneven length or speed like the hardware's CTA
# dispatch. Their price is the persistent loop's extra descriptor arithmetic (ptxas keeps
# fewer WGMMA descriptors in uniform registers inside the nested tile loop: 493 instead of 457
# instructions per KV step at hdim 128). Measured on H100 (bf16, 16k tokens; paired timing,
# persistent + dynamic over one tile per CTA):
#   causal, hdim 128: 1.197x (1k), 1.068x (2k), 1.033x (4k), 1.002x (8k), 1.007x (16k);
#   causal, hdim 64: 1.074x (2k), 1.037x (4k), 1.044x (8k), 1.028x (16k);
#   non-causal, hdim 128: 1.028x (2k, over static persistent), 1.027x-1.033x (4k), 1.008x
#     (8k), 1.002x-1.017x (16k);
#   non-causal, hdim 64: 1.001x (2k, over static persistent), 1.015x-1.016x (4k), 0.998x (8k),
#     0.988x-0.991x (16k).
#   hdim 256 (O staged in Q's buffer: its own does not fit): causal 1.042x (1k), 1.029x (2k),
#     1.013x (4k), 1.010x (8k), 1.005x (16k); non-causal 1.022x (1k), 0.994x (2k), 0.998x-1.003x
#     (4k-16k).
# (Every gridDim.x-th tile instead, causal: 0.79x-0.98x; non-causal on H200: 1.005x / 0.995x
# at 4k / 16k.) So: causal always, 128-row non-causal tiles (hdim 96, 128) always, the others
# up to PERSISTENT_MAX_SEQLEN_K; with O in its own SMEM buffer where it fits (hdim 128 causal,
# O in Q's buffer instead: 0.938x at 1k, 0.994x at 4k), else in Q's. hdim 64 non-causal 8k
# (43 m blocks: no multicast pairs): persistent + dynamic with both tile-boundary
# switches over one tile per CTA +1.5% / +2.1% / -0.9% (H100, paired, 20 / 12 / 12 rounds;
# +0.5%), 1.6% fewer cycles under Nsight Compute: a small gain at best. Multicast
# pairs are persistent too (Note [Persistent multicast], MULTICAST_MIN_SEQLEN_K below).
PERSISTENT_MAX_SEQLEN_K = {64: 8192, 96: None, 128: None, 192: 2048, 256: 1024}  # None: any
# Causal problems up to this seqlen_k use 128-row tiles even where 192 is the default.
SHORT_CAUSAL_SEQLEN_K = 1024
# Ping-pong (Note [Ping-pong] in fwd_consumer.py) by default up to this head dim: hdim 64's
# three consumer warpgroups keep it (H100, paired, off: 0.997x-1.000x non-causal 8k / 16k,
# 0.998x causal 1k). At hdim 128 off measured faster in every cell tried (H100,
# paired, 12-16 rounds): non-causal +0.7% (1k), +1.4% (2k), +0.7% (4k), +1.3% / +1.7% (8k),
# +1.8% / +2.2% (16k); causal +2.4% (4k), +2.4% (16k). hdim 96 follows hdim 128 unmeasured;
# above 128 it was off already (O's registers).
PINGPONG_MAX_HEAD_DIM = 64
# Non-causal problems from this seqlen_k on run CTA pairs that multicast K/V (Note [K/V
# multicast] in fwd_kernel.py), when seqlen_q gives an even number of m blocks. Measured on
# H100 (bf16, 16k tokens; paired timing, multicast over the previous default): hdim 128
# 0.999x (4k), 1.004x (8k), 1.015x (16k) over persistent + dynamic; hdim 256 1.018x (2k, wide
# rounds), 1.010x (4k), 1.004x (16k) and hdim 64 1.005x (16k) over one tile per CTA (all with
# one tile per CTA). The pairs are persistent (Note [Persistent multicast]:
# static schedule, clusters of 2), over one multicast tile per CTA (10 rounds, two runs where
# two numbers): hdim 64 16k +2.6% / +1.0%; hdim 256 2k +2.4%, 4k +3.0%, 8k +0.8%, 16k +1.8%;
# hdim 128 16k +2.9% / +2.7%; and hdim 128 from 8k again: with the tile-boundary switches
# +2.6% over persistent + dynamic there. Not at hdim 128 2k / 4k (-0.8% to +0.2% over
# persistent + dynamic), hdim 64 4k (-1.5% / -0.3%) or hdim 256 1k (+0.1%).
MULTICAST_MIN_SEQLEN_K = {64: 8192, 128: 8192, 256: 2048}
# Persistent CTAs with O's own buffer cross work tiles faster with ``wg_epilogue`` (Note
# [Warpgroup epilogues] in fwd_consumer.py) and two Q stages (Note [Two Q stages] in
# fwd_kernel.py), where both fit in SMEM, up to this seqlen_k. Measured on H100 (bf16, 16k
# tokens; paired, 10-12 rounds, both over neither): hdim 64 causal +6.2% (1k), +3.6% (2k),
# +0.9% (4k), +0.1% (8k), -0.5% (16k); non-causal +3.2% (1k), +2.4% (2k), +1.0% (4k); hdim 128
# causal +4.3% (1k), +2.2% (2k), +1.3% (4k), +1.1% (8k), +0.3% (16k); non-causal +4.0% (1k),
# +1.6% (2k), +2.0% (4k). Alone, each gained less in most cells (wg_epilogue +0.4% to +2.7%;
# q_stage=2 -0.9% to +5.6%). hdim 96 follows hdim 128 unmeasured; (192, 128) has no room for
# two Q stages and keeps neither.
TILE_BOUNDARY_MAX_SEQLEN_K = 8192
# O is rescaled only where a row max grows by more than softmax_math.RESCALE_THRESHOLD_16BIT
# (Note [Rescale threshold] in fwd_consumer.py) from this head_dim_v on. Measured on H100
# (bf16, 16k tokens; paired, 10 rounds, threshold 8 over 0): hdim 128 non-causal +1.7% (1k),
# +0.8% (4k), +0.3% (16k), causal +1.1% (1k), +1.6% (4k), +2.9% (16k); hdim 256 non-causal
# -0.6% (1k, rounds 0.81-1.14), +2.2% (2k), +1.9% (4k), +4.9% (16k), causal +1.4% (1k), +1.5%
# (4k), +1.0% (8k), +1.8% (16k); hdim 64 -1.3% to +1.3% (7 cells, mean -0.1%: its O rescale
# is 32 FMULs, the vote and branch cost about half that), so not there. (192, 128) follows
# hdim 128 unmeasured; hdim 96 is left as hdim 64.
RESCALE_THRESHOLD_MIN_HEAD_DIM_V = 128


def select_sm90_fwd_config(head_dim: int = 128, head_dim_v=None, dtype="bfloat16", causal=False,
                           write_lse=True, seqlen_k=None, seqlen_q=None, batch_heads=None,
                           local=False, softcap=False, varlen=False,
                           **overrides) -> Sm90FwdConfig:
    """The default SM90 config for a problem, with ``overrides`` applied, validated.

    ``head_dim_v`` defaults to ``fa_sm100.config.default_head_dim_v(head_dim)`` (128 for 192).
    ``kv_multicast`` for non-causal problems from ``MULTICAST_MIN_SEQLEN_K`` keys whose
    ``seqlen_q`` (optional: without it, no) and ``batch_heads`` ((batch, head) pairs,
    optional) fit clusters (``Sm90FwdConfig.multicast_fits``), unless ``persistent`` or it is
    given; multicast pairs are persistent on the static
    schedule where they fit (Note [Persistent multicast]; clusters of 2 only). Otherwise
    persistent CTAs with the dynamic schedule, where they fit in SMEM: for causal problems
    always; for non-causal ones when ``PERSISTENT_MAX_SEQLEN_K`` of the head dim is None or
    ``seqlen_k`` (optional: without it, no) is at most that. ``dynamic_schedule`` follows
    ``persistent`` (but not under multicast), and ``o_in_q_buffer`` "persistent, and O's own
    buffer does not fit", unless overridden themselves.
    ``skip_empty_wg`` where the last m block has an empty consumer warpgroup, and
    ``multicast_odd_m`` where the m blocks are odd in number (each also where ``seqlen_q`` is
    not given), unless given. ``wg_epilogue`` and ``q_stage=2`` for persistent CTAs with
    O's own buffer up to ``TILE_BOUNDARY_MAX_SEQLEN_K`` keys (optional: without it, no) where
    two Q stages fit, each unless given. ``rescale_threshold`` 8 from head_dim_v 128 on
    (``RESCALE_THRESHOLD_MIN_HEAD_DIM_V``), else 0. ``local`` (a sliding window) is scheduled as
    causal is: no multicast, persistent CTAs with the dynamic schedule (band tiles differ in
    length at the sequence's start and end). ``varlen`` is ``local`` (packed sequences: pass
    the longest lengths as ``seqlen_q`` / ``seqlen_k``, or None).
    """
    local = local or varlen
    head_dim_v = default_head_dim_v(head_dim) if head_dim_v is None else head_dim_v
    num_wg, n_block = default_tile(head_dim)
    if num_wg == 3 and causal and seqlen_k is not None and seqlen_k <= SHORT_CAUSAL_SEQLEN_K:
        # Short causal rows: 192-row tiles waste most of the diagonal tile; measured on H200
        # (hdim 64, seqlen 1k, persistent): 303 TFLOP/s with 128-row tiles vs 274 with 192.
        num_wg = 2
    num_wg = overrides.pop("num_consumer_wg", num_wg)
    schedule = {k: overrides.pop(k) for k in ("persistent", "dynamic_schedule", "o_in_q_buffer",
                                              "kv_multicast", "wg_epilogue", "q_stage")
                if k in overrides}
    regs_consumer, regs_producer = _REGS.get(num_wg, _REGS[2])
    cfg = Sm90FwdConfig(
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        dtype=normalize_dtype(dtype),
        causal=causal,
        local=local,
        softcap=softcap,
        varlen=varlen,
        write_lse=write_lse,
        m_block=WGMMA_M * num_wg,
        n_block=n_block,
        num_consumer_wg=num_wg,
        pingpong=head_dim <= PINGPONG_MAX_HEAD_DIM,
        rescale_o_before_pv=head_dim_v > 128,
        rescale_threshold=(softmax_math.RESCALE_THRESHOLD_16BIT
                           if head_dim_v >= RESCALE_THRESHOLD_MIN_HEAD_DIM_V else 0.0),
        regs_consumer=regs_consumer,
        regs_producer=regs_producer,
    ).replace(**overrides)
    # The schedule is picked for the tiles and stages chosen above (overrides included).
    # O gets its own buffer where it fits, else it is staged in Q's (Note [O in Q's buffer]).
    own_o = cfg.replace(persistent=True, dynamic_schedule=True)
    fits_own_o = own_o.smem_bytes() <= SM90_SMEM_BUDGET
    fits = fits_own_o or own_o.replace(o_in_q_buffer=True).smem_bytes() <= SM90_SMEM_BUDGET
    if "multicast_odd_m" not in overrides:  # Note [Odd m blocks]: only where the count is odd
        cfg = cfg.replace(multicast_odd_m=seqlen_q is None or cfg.num_m_blocks(seqlen_q) % 2 == 1)
    multicast = schedule.get("kv_multicast")
    if multicast is None:
        shortest = MULTICAST_MIN_SEQLEN_K.get(head_dim)
        multicast = (not (causal or local) and shortest is not None and seqlen_k is not None
                     and seqlen_k >= shortest and seqlen_q is not None
                     and cfg.multicast_fits(seqlen_q, batch_heads)
                     and not schedule.get("persistent"))
    if "skip_empty_wg" not in overrides:  # Note [Empty warpgroups]: only if there is one
        cfg = cfg.replace(skip_empty_wg=seqlen_q is None or cfg.has_empty_wg(seqlen_q))
    persistent = schedule.get("persistent")
    if persistent is None and multicast:  # Note [Persistent multicast]: pairs of 2 only
        persistent = fits and cfg.kv_cluster == KV_CLUSTER
    elif persistent is None:
        longest = PERSISTENT_MAX_SEQLEN_K.get(head_dim, 0)  # unknown head dims: validate() says
        wanted = causal or local or longest is None or (seqlen_k is not None and seqlen_k <= longest)
        persistent = wanted and fits
    cfg = cfg.replace(
        kv_multicast=multicast,
        persistent=persistent,
        # a multicast cluster's CTAs walk their tiles together: the static schedule
        dynamic_schedule=schedule.get("dynamic_schedule", persistent and not multicast),
        o_in_q_buffer=schedule.get("o_in_q_buffer", persistent and not fits_own_o),
    )
    # Crossing work tiles (TILE_BOUNDARY_MAX_SEQLEN_K): both switches where both fit.
    boundary = cfg.replace(wg_epilogue=True, q_stage=2)
    fast_boundary = (cfg.own_o_buffer and seqlen_k is not None
                     and seqlen_k <= TILE_BOUNDARY_MAX_SEQLEN_K
                     and boundary.smem_bytes() <= SM90_SMEM_BUDGET)
    return cfg.replace(
        wg_epilogue=schedule.get("wg_epilogue", fast_boundary),
        q_stage=schedule.get("q_stage", 2 if fast_boundary else 1),
    ).validate()


def sm90_fwd_config_from_overrides(items: Iterable[str]) -> Sm90FwdConfig:
    """The default config (hdim 128, bf16) with CLI ``--set field=value`` overrides, validated."""
    changes = parse_overrides(items, cls=Sm90FwdConfig)
    problem = {k: changes.pop(k) for k in ("head_dim", "head_dim_v", "dtype", "causal", "local",
                                           "softcap", "varlen", "write_lse") if k in changes}
    return select_sm90_fwd_config(**problem, **changes)  # head_dim_v: default_head_dim_v
