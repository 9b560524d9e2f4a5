"""The one table of the SM100 forward's mbarrier pipelines, and the function that builds them.

Each row of ``PIPELINES`` declares a pipeline: who produces, who consumes, how many stages,
how each side arrives on the mbarriers, and (derived, never typed) how many arrivals complete
a phase. The kernel builds its pipelines from this table only (``mbarrier.build_pipelines``), and the
protocol model (pipelines/model.py) reads the same rows to initialise its simulated barriers.

Arrival kinds (``Side.arrive``):

- ``expect_tx``  one elected thread of the leader CTA arrives and sets the expected TMA bytes;
                 the TMA loads of both CTAs of the pair complete the phase by transaction bytes;
- ``umma``       ``tcgen05.commit`` by the MMA warp's elected thread: one arrival once every
                 UMMA issued before it completed; under 2-CTA it is multicast to both CTAs;
- ``thread``     every thread of the arriving role(s) arrives (128 per warpgroup);
- ``warp``       one elected thread per warp arrives, after ``__syncwarp``.

Where the waiting side is the MMA warp (which runs only in the leader CTA under 2-CTA), the
threads of both CTAs arrive on the leader's barrier, so the count doubles. Waiting side of
threads: every CTA waits on its own barrier.

Note [Split-P arrival]: softmax writes P over S in TMEM in two parts. The first
``cfg.split_p_col`` columns of P (3/4 by default) are released with the s_p_o release (which
also carries the correction warps' "O rescaled"), so the PV MMA starts on them; the last
columns arrive on their own pipeline ``p_lastsplit``, which the MMA warp waits on before
issuing the K-chunks of the PV MMA that read them. With ``split_p`` off, all of P is released
through s_p_o and ``p_lastsplit`` is not built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from fa_sm100.config import WARP_SIZE, FmhaConfig, WarpRoles

# An mbarrier phase counts at most 2^20 - 1 pending arrivals.
MBARRIER_MAX_ARRIVALS = (1 << 20) - 1
ARRIVE_KINDS = ("expect_tx", "umma", "thread", "warp")
# "softmax" in a Side stands for the softmax warpgroup that owns the pipeline stage (Q stage).
SOFTMAX = "softmax"


@dataclass(frozen=True)
class Side:
    """One side of a pipeline: the roles that act on it and how they arrive."""

    roles: tuple[str, ...]
    arrive: str


@dataclass(frozen=True)
class PipelineSpec:
    """One row of the pipeline table.

    kind: "tma_umma" | "umma_threads" | "threads_umma" | "threads_threads" (the DSL class)
    stages: the FmhaConfig field giving the stage count
    per_q_stage: stage i belongs to Q stage i (the kernel passes the index as a constant)
    producer_starts_empty: the producer's first acquire of each stage passes at once (the
        usual ring). False for s_p_o, whose producer (MMA) commits S before its first acquire.
    enabled_if: the FmhaConfig bool field that switches the pipeline on (None = always built)
    """

    name: str
    kind: str
    producer: Side
    consumer: Side
    stages: str
    per_q_stage: bool
    doc: str
    producer_starts_empty: bool = True
    enabled_if: Optional[str] = None
    # bytes of one stage per TMA operand (None = the whole stage): a table row's own rule
    # (the backward's rows); the forward's q and kv rows use the rule in ``tx_bytes``
    tx: Optional[Callable] = None
    # the SMEM buffers whose stages the pipeline hands over, as ``record.access`` names them
    # (the model tracks races on them per stage); buffer ``s<X>`` holds the tile ``<X>`` of
    # a row's own ``tx`` rule
    smem: tuple[str, ...] = ()
    # under 2-CTA the producers' thread arrivals release at cluster scope: what they order
    # before the consumer includes their stores into the other CTA's SMEM (the backward's dS
    # exchange, Note [Backward 2-CTA] in fa_sm100/sm100/bwd_config.py)
    cluster_release: bool = False

    def num_stages(self, cfg: FmhaConfig) -> int:
        return int(getattr(cfg, self.stages))

    def enabled(self, cfg: FmhaConfig) -> bool:
        return self.enabled_if is None or bool(getattr(cfg, self.enabled_if))

    def waits_on_leader(self, side: str) -> bool:
        """True when the barrier ``side`` ("full"/"empty") is waited on by the MMA warp only."""
        waiter = self.consumer if side == "full" else self.producer
        return waiter.roles == ("mma",)

    def arrivals(self, side: str, cfg: FmhaConfig, roles: Optional[WarpRoles] = None) -> int:
        """Arrivals that complete one phase of the ``side`` ("full" or "empty") barrier."""
        roles = roles or cfg.warp_roles()
        arriving = self.producer if side == "full" else self.consumer
        if arriving.arrive in ("expect_tx", "umma"):
            return 1  # one elected thread (of the leader CTA, for expect_tx)
        warps = 0
        role_warps = roles.role_warps()
        for r in arriving.roles:
            warps += len(role_warps["softmax0" if r == SOFTMAX else r])
        per_warp = WARP_SIZE if arriving.arrive == "thread" else 1
        ctas = cfg.cta_group if self.waits_on_leader(side) else 1
        return warps * per_warp * ctas

    def tx_ctas(self, cfg) -> int:
        """CTAs whose TMA bytes complete one phase of a full barrier: both CTAs of the pair
        when the MMA warp waits there (the leader's barrier), else each CTA's own."""
        return cfg.cta_group if self.waits_on_leader("full") else 1

    def tx_bytes(self, cfg: FmhaConfig, operand: Optional[str] = None) -> int:
        """Transaction bytes of one stage (both CTAs of the pair where the leader's barrier
        counts them), for TMA-fed pipelines. A row's own ``tx`` rule gives one CTA's tiles."""
        if self.producer.arrive != "expect_tx":
            return 0
        if self.tx is not None:
            return self.tx(cfg, operand) * self.tx_ctas(cfg)
        e = cfg.dtype_bytes
        if self.name == "q":
            return cfg.m_block * cfg.head_dim * e * cfg.cta_group
        if self.name == "kv":
            if operand in (None, "K"):
                return cfg.n_block * cfg.head_dim * e
            if operand == "V":
                return cfg.n_block * cfg.head_dim_v * e
        raise ValueError(f"pipeline {self.name}: no TMA operand {operand!r}")

    def buffer_tx(self, cfg, buffer: str) -> Optional[int]:
        """Bytes a TMA copy lands in one stage of ``buffer`` (both CTAs of the pair), from the
        row's own ``tx`` rule; None for a row without one (the forward's q and kv: one copy per
        acquire, which lands the acquire's bytes)."""
        if buffer not in self.smem:
            raise ValueError(f"pipeline {self.name}: no SMEM buffer {buffer!r} (buffers: {self.smem})")
        if self.tx is None or self.producer.arrive != "expect_tx":
            return None
        return self.tx(cfg, buffer[1:]) * self.tx_ctas(cfg)

    def check(self, cfg: FmhaConfig, roles: Optional[WarpRoles] = None) -> "PipelineSpec":
        """Raise ValueError naming the rule this row breaks for ``cfg``."""
        roles = roles or cfg.warp_roles()
        known = set(roles.role_warps()) | {SOFTMAX}
        for side_name, side in (("producer", self.producer), ("consumer", self.consumer)):
            if side.arrive not in ARRIVE_KINDS:
                raise ValueError(f"pipeline {self.name}: {side_name} arrive {side.arrive!r} not in {ARRIVE_KINDS}")
            for r in side.roles:
                if r not in known:
                    raise ValueError(f"pipeline {self.name}: unknown {side_name} role {r!r}")
            if side.arrive == "umma" and side.roles != ("mma",):
                raise ValueError(f"pipeline {self.name}: only the MMA warp arrives by tcgen05.commit")
        if self.producer.arrive == "expect_tx" and self.producer.roles != ("load",):
            raise ValueError(f"pipeline {self.name}: only the load warp arrives with expect-tx")
        if self.consumer.arrive == "expect_tx":
            raise ValueError(f"pipeline {self.name}: a consumer never arrives with expect-tx")
        expected_kind = {
            ("expect_tx", "umma"): "tma_umma",
            ("expect_tx", "thread"): "tma_threads",
            ("umma", "thread"): "umma_threads",
            ("umma", "warp"): "umma_threads",
            ("thread", "umma"): "threads_umma",
            ("warp", "umma"): "threads_umma",
            ("thread", "thread"): "threads_threads",
            ("thread", "warp"): "threads_threads",
            ("warp", "thread"): "threads_threads",
            ("warp", "warp"): "threads_threads",
        }.get((self.producer.arrive, self.consumer.arrive))
        if expected_kind != self.kind:
            raise ValueError(
                f"pipeline {self.name}: kind {self.kind!r} does not match its arrivals "
                f"({self.producer.arrive} -> {self.consumer.arrive}; expected {expected_kind!r})"
            )
        n = self.num_stages(cfg)
        if n < 1:
            raise ValueError(f"pipeline {self.name}: {self.stages}={n} stages, need at least 1")
        if self.per_q_stage and n != cfg.q_stage:
            raise ValueError(f"pipeline {self.name}: one stage per Q stage, got {n} != q_stage={cfg.q_stage}")
        for side in ("full", "empty"):
            a = self.arrivals(side, cfg, roles)
            if not 0 < a <= MBARRIER_MAX_ARRIVALS:
                raise ValueError(f"pipeline {self.name}: {side} barrier arrival count {a} out of range")
        if self.tx_bytes(cfg) >= 1 << 20:
            raise ValueError(f"pipeline {self.name}: {self.tx_bytes(cfg)} transaction bytes exceed the mbarrier tx range")
        return self


PIPELINES: tuple[PipelineSpec, ...] = (
    PipelineSpec(
        "q", "tma_umma", Side(("load",), "expect_tx"), Side(("mma",), "umma"), "q_stage", True,
        "Q tile of each Q stage, TMA -> SMEM; the MMA warp reads it for every S = Q K^T of the tile",
        smem=("sQ",),
    ),
    PipelineSpec(
        "kv", "tma_umma", Side(("load",), "expect_tx"), Side(("mma",), "umma"), "kv_stage", False,
        "ring of K and V tiles (K[n-1], V[n-1], K[n-2], V[n-2], ...), TMA -> SMEM -> UMMA",
        smem=("sKV",),
    ),
    PipelineSpec(
        "s_p_o", "umma_threads", Side(("mma",), "umma"), Side((SOFTMAX, "correction"), "thread"),
        "q_stage", True,
        "full: S of Q stage i is in TMEM (MMA -> softmax); empty: the first split_p_col columns "
        "of P are in TMEM (softmax) and O is rescaled (correction), so the PV MMA may start and "
        "the next S may overwrite the region",
        producer_starts_empty=False,
    ),
    PipelineSpec(
        "p_lastsplit", "threads_umma", Side((SOFTMAX,), "thread"), Side(("mma",), "umma"),
        "q_stage", True,
        "the last columns of P (after split_p_col) are in TMEM; the MMA warp waits before the "
        "PV K-chunks that read them (Note [Split-P arrival])",
        enabled_if="split_p",
    ),
    PipelineSpec(
        "o_acc", "umma_threads", Side(("mma",), "umma"), Side(("correction",), "thread"),
        "q_stage", True,
        "the final O of a work tile is accumulated in TMEM (MMA -> correction); the release "
        "hands the O region back to the next tile's first PV",
    ),
    PipelineSpec(
        "sm_stats", "threads_threads", Side((SOFTMAX,), "thread"), Side(("correction",), "thread"),
        "q_stage", True,
        "row max / row sum of one KV block in SMEM (softmax -> correction)",
        smem=("stats",),
    ),
    PipelineSpec(
        "o_epi", "threads_threads", Side(("correction",), "thread"), Side(("epilogue",), "warp"),
        "q_stage", True,
        "normalized O of a Q stage in SMEM (correction -> epilogue TMA store); the epilogue's "
        "elected thread releases once the store has read SMEM",
        smem=("sO",),
    ),
)

PIPELINE_NAMES = tuple(p.name for p in PIPELINES)


def _bwd_tx(*operands):
    """Bytes one CTA lands in one backward stage: the named tiles the config loads
    (``Sm100BwdConfig.tma_tiles``; Qt, dOt and Kt only under 2-CTA)."""
    def tx(cfg, operand=None):
        tiles = cfg.tma_tiles()
        if operand is None:
            return sum(tiles[n] for n in operands if n in tiles)
        if operand not in tiles:
            raise ValueError(f"{cfg.__class__.__name__} loads no {operand} tile (tiles: "
                             f"{sorted(tiles)})")
        return tiles[operand]
    return tx


# The SM100 backward's pipelines (fa_sm100/sm100/bwd_*.py; Note [Backward MMA order] in
# fa_sm100/sm100/bwd_mma.py). "compute" is both compute warpgroups (256 threads), "dq" the
# dQ warpgroup. Stage counts name fields of ``Sm100BwdConfig``; ``one_stage`` is 1.
BWD_PIPELINES: tuple[PipelineSpec, ...] = (
    PipelineSpec(
        "bwd_kv", "tma_umma", Side(("load",), "expect_tx"), Side(("mma",), "umma"), "one_stage",
        False, "K and V of the work tile (the CTA's key block; under 2-CTA also Kt, the pair's "
        "keys x half the head dim, dQ's B operand), TMA -> SMEM; released by a UMMA commit "
        "after the tile's last MMA",
        tx=_bwd_tx("K", "V", "Kt"), smem=("sK", "sV", "sKt"),
    ),
    PipelineSpec(
        "bwd_q", "tma_umma", Side(("load",), "expect_tx"), Side(("mma",), "umma"), "q_stage",
        False, "ring of Q_j and dO_j tiles (one query block of one query head; under 2-CTA "
        "each CTA's half of the rows), TMA -> SMEM; released once the last MMA reading them "
        "completed: dK += dS^T Q (1-CTA: dV and dK read the same bytes), or under 2-CTA "
        "dP^T = V dO^T (dV and dK read bwd_qt's)",
        tx=_bwd_tx("Q", "dO"), smem=("sQ", "sdO"),
    ),
    PipelineSpec(
        "bwd_lse", "tma_threads", Side(("load",), "expect_tx"), Side(("compute",), "thread"),
        "q_stage", False, "ring of LSE2_j and Delta_j (the preprocess's float32 rows of query "
        "block j), TMA -> SMEM -> the compute warpgroups",
        tx=_bwd_tx("LSE2", "Delta"), smem=("sLSE2", "sDelta"),
    ),
    PipelineSpec(
        "bwd_s_dp", "umma_threads", Side(("mma",), "umma"), Side(("compute",), "thread"),
        "one_stage", False,
        "full: S^T_j = K Q_j^T and dP^T_j = V dO_j^T are in TMEM; empty: the compute warpgroups "
        "have read both and written P^T_j and dS^T_j over them, so the next S^T may be issued",
    ),
    PipelineSpec(
        "bwd_ds", "threads_umma", Side(("compute",), "thread"), Side(("mma",), "umma"),
        "one_stage", False,
        "full: P^T_j and dS^T_j are in TMEM and dS_j in SMEM (the MMA warp issues dV, dK, dQ); "
        "empty: dQ_j = dS_j K, the MMA reading sdS, completed",
        smem=("sdS",), cluster_release=True,
    ),
    PipelineSpec(
        "bwd_dq", "umma_threads", Side(("mma",), "umma"), Side(("dq",), "thread"), "one_stage",
        False, "full: dQ_j is in TMEM (over dP^T); empty: the dQ warpgroup has read it out, so "
        "the next dP^T may overwrite the region",
    ),
    PipelineSpec(
        "bwd_dkv", "umma_threads", Side(("mma",), "umma"), Side(("compute",), "thread"),
        "one_stage", False,
        "full: dK and dV of the work tile are final in TMEM (compute warpgroups -> global); "
        "empty: read out",
    ),
    PipelineSpec(
        "bwd_qt", "tma_umma", Side(("load",), "expect_tx"), Side(("mma",), "umma"),
        "one_stage", False,
        "2-CTA only: Q^T_j and dO^T_j (every query row of step j, the CTA's half of the head "
        "dim), the B operands of dK and dV, TMA -> SMEM; one stage: released once dK_j "
        "completed, reloaded while S^T_j+1, dP^T_j+1 and the compute warps run",
        enabled_if="use_2cta", tx=_bwd_tx("Qt", "dOt"), smem=("sQt", "sdOt"),
    ),
)


def table_of(cfg) -> tuple[PipelineSpec, ...]:
    """The pipeline table of ``cfg``'s kernel: the forward's, or the one its config names
    (``pipeline_table = "backward"`` on the SM100 backward's config)."""
    return BWD_PIPELINES if getattr(cfg, "pipeline_table", "forward") == "backward" else PIPELINES


def names_of(cfg) -> tuple[str, ...]:
    return tuple(p.name for p in table_of(cfg))


def get_spec(name: str) -> PipelineSpec:
    for p in PIPELINES + BWD_PIPELINES:
        if p.name == name:
            return p
    raise KeyError(f"no pipeline {name!r}; pipelines: {PIPELINE_NAMES} and "
                   f"{tuple(p.name for p in BWD_PIPELINES)}")


def active_specs(cfg: FmhaConfig, roles: Optional[WarpRoles] = None) -> tuple[PipelineSpec, ...]:
    """The rows ``cfg`` builds, each checked against ``cfg`` and its warp roles."""
    roles = roles or cfg.warp_roles()
    return tuple(p.check(cfg, roles) for p in table_of(cfg) if p.enabled(cfg))


def smem_buffers(specs) -> dict[str, str]:
    """SMEM buffer name -> the pipeline whose stages hand it over, over table rows ``specs``."""
    out = {}
    for p in specs:
        for b in p.smem:
            if b in out:
                raise ValueError(f"SMEM buffer {b} is handed over by both {out[b]} and {p.name}")
            out[b] = p.name
    return out


def barrier_count(cfg: FmhaConfig) -> int:
    """mbarriers (8 bytes each) the kernel must reserve in SMEM for ``build_pipelines``."""
    return sum(2 * p.num_stages(cfg) for p in table_of(cfg) if p.enabled(cfg))


def barrier_offsets(cfg: FmhaConfig) -> dict[str, int]:
    """Pipeline name -> index of its first mbarrier (full[0..n), then empty[0..n))."""
    out, off = {}, 0
    for p in table_of(cfg):
        if p.enabled(cfg):
            out[p.name] = off
            off += 2 * p.num_stages(cfg)
    return out
