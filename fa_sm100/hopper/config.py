"""The frozen configuration of the Hopper (SM90) forward kernel.

One compiled kernel per value. Problem-shaped fields (head dims, dtype, causal) are static
parts of the problem; the rest are the kernel's design choices, each a switch a benchmark can
flip: the tile shape, the number of consumer warpgroups, K/V stages, the ping-pong between
consumer warpgroups, the intra-warpgroup overlap of softmax with the next GEMM, and the
``setmaxnreg`` budgets that move registers from the producer to the consumers.

``Sm90FwdConfig.validate()`` raises ``ValueError`` naming the violated rule.
``select_sm90_fwd_config`` picks the defaults for a problem: a lookup over the tuning table
(``FWD_TUNING`` in fwd_tuning.py, which sits below this module) and ``validate()``. Selection
reads the problem's shape and the caller's overrides only (no tensor contents, no device query,
no allocation).
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
# the table, and where its rows apply (defined in fwd_tuning.py, imported from here by callers
# and tests)
from fa_sm100.hopper.fwd_tuning import (  # noqa: F401
    FWD_TUNING,
    MULTICAST_MIN_SEQLEN_K,
    PERSISTENT_MAX_SEQLEN_K,
    PINGPONG_MAX_HEAD_DIM,
    RESCALE_THRESHOLD_MIN_HEAD_DIM_V,
    SHORT_CAUSAL_SEQLEN_K,
    TILE_BOUNDARY_MAX_SEQLEN_K,
    FwdProblem,
    lookup,
)
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
# Key blocks of a paged kernel (page_size), largest first: one TMA copy loads a block from one
# page, so a page size must be a multiple of the block; a kernel takes the largest that divides.
SM90_PAGE_BLOCKS = (128, 64)


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
    # a paged K/V cache (varlen only): K and V are rows of pages of this many keys, and key
    # block n of a sequence is read from the page its page-table row names (Note [Paged K/V]
    # in fwd_kernel.py); a multiple of n_block. 0: K and V are packed sequences
    page_size: int = 0
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
    # protocol (Note [Empty warpgroups] in fwd_consumer.py). The defaults turn it off where no
    # warpgroup is empty (row "empty warpgroups: off where none" of FWD_TUNING).
    skip_empty_wg: bool = True
    # the producer issues a work tile's first K tile before its Q (FlashAttention-4's order)
    k_before_q: bool = False
    # CTAs of neighbouring m blocks of one (batch, head) run as a cluster of kv_cluster; each
    # loads its share of every K/V tile and multicasts it to all (Note [K/V multicast] in
    # fwd_kernel.py). Non-causal, a whole number of clusters of m blocks per head, and one
    # tile per CTA or persistent pairs on the static schedule (Note [Persistent multicast]).
    kv_multicast: bool = False
    # CTAs per cluster under kv_multicast: each loads 1/kv_cluster of every K / V tile (4 is
    # measured slower: CHANGELOG.md, docs/hopper.md's switch table)
    kv_cluster: int = KV_CLUSTER
    # Under kv_multicast with clusters of 2, an odd number of m blocks per head no longer rules
    # multicast out: the even part pairs as before, and the last m blocks of two (batch, head)
    # pairs share a cluster whose CTAs load their own K/V (Note [Odd m blocks] in
    # fwd_kernel.py). Needs an even number of (batch, head) pairs. The defaults turn it off
    # for an even number of m blocks (row "odd m blocks: off for an even count" of FWD_TUNING).
    multicast_odd_m: bool = True
    # Under kv_multicast, the consumers release K/V stages on the cluster's empty barriers
    # through addresses mapped once, not re-derived at every release (Note [Peer release] in
    # fa_sm100/hopper/common.py; its measurement: CHANGELOG.md). No effect without multicast.
    peer_release: bool = True
    # Causal scheduling: (batch, head) pairs are cut into sections whose K and V take at most
    # this many MiB, so a section's K/V stay in L2 (50 MB on H100/H200) while its tiles run
    # (the default's measurement: docs/hopper.md's switch table).
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
        if self.page_size < 0 or self.page_size and (not self.varlen
                                                 or self.page_size % self.n_block):
            raise ValueError(f"page_size={self.page_size}: a paged kernel is a varlen kernel "
                             f"whose n_block ({self.n_block}) divides the page size (one TMA "
                             f"copy loads a key block from one page)")
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


def select_sm90_fwd_config(head_dim: int = 128, head_dim_v=None, dtype="bfloat16", causal=False,
                           write_lse=True, seqlen_k=None, seqlen_q=None, batch_heads=None,
                           local=False, softcap=False, varlen=False,
                           **overrides) -> Sm90FwdConfig:
    """The default SM90 config for a problem, with ``overrides`` applied, validated.

    A lookup over the tuning table (``FWD_TUNING`` in fwd_tuning.py: where each default
    applies, what it sets, the measurement or rule behind it; docs/tuning.md shows it) followed
    by ``Sm90FwdConfig.validate``. An override replaces any field, and the table never changes
    a field the caller set; the schedule rows read the tiles and stages after the overrides.
    ``head_dim_v`` defaults to ``fa_sm100.config.default_head_dim_v(head_dim)`` (128 for 192).
    ``seqlen_q``, ``seqlen_k`` and ``batch_heads`` ((batch, head) pairs) are optional: the rows
    that read them (multicast, persistent CTAs, the tile-boundary switches, the odd-m and
    empty-warpgroup switches) apply as the table says for an unknown one. ``varlen`` is
    ``local`` (packed sequences: pass the longest lengths, or None).
    """
    problem = FwdProblem(
        head_dim=head_dim,
        head_dim_v=default_head_dim_v(head_dim) if head_dim_v is None else head_dim_v,
        dtype=normalize_dtype(dtype), causal=causal, local=local or varlen, softcap=softcap,
        varlen=varlen, write_lse=write_lse, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
        batch_heads=batch_heads, asked=tuple(overrides.items()))
    return lookup(problem, Sm90FwdConfig).validate()


def sm90_fwd_config_from_overrides(items: Iterable[str]) -> Sm90FwdConfig:
    """The default config (hdim 128, bf16) with CLI ``--set field=value`` overrides, validated."""
    changes = parse_overrides(items, cls=Sm90FwdConfig)
    problem = {k: changes.pop(k) for k in ("head_dim", "head_dim_v", "dtype", "causal", "local",
                                           "softcap", "varlen", "write_lse") if k in changes}
    return select_sm90_fwd_config(**problem, **changes)  # head_dim_v: default_head_dim_v
