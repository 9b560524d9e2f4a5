"""The frozen configuration of the SM100 backward kernel (``sm100_bwd``) and its warp roles.

One CTA owns one work tile: a block of ``n_block`` keys of one KV head of one batch entry. It
loads K and V of the block once and walks every query block of every query head of the KV
head's group (``qhead_per_kvhead``), accumulating dK and dV in TMEM across the whole group
(no float32 copy per query head) and adding each query block's dQ into a float32 accumulator
in global memory. Every choice is a field; the kernel reads them at trace time.

Head dims: 64, 96 and 128 (qk = v). (192, 128) does not fit the TMEM plan with 128-row query
blocks: S^T and dP^T take 128 columns each and the dK and dV accumulators 192 + 128, 576 of the
512 columns (``layouts.tmem.TmemPlan.for_backward`` raises with the numbers).

Note [Backward 2-CTA] (``use_2cta``): a cluster of two CTAs, pair ranks r = 0, 1, owns key
blocks 2p + r (2 x 128 keys) of one KV head; both walk the query blocks whose band reaches the
pair's keys (a block one CTA's keys miss is a step of masked scores there), and the leader
(r = 0) issues every MMA for both. tcgen05 takes one cta_group per kernel, so all five MMAs
are cta_group::2; what each CTA holds:

    S^T = K Q^T, dP^T = V dO^T   M = 256 keys: its own 128 in its TMEM lanes, as 1-CTA;
                                 N = 128 queries: B split, it loads query rows [64r, 64r + 64)
    dV += P^T dO, dK += dS^T Q   M = 256 keys, A = its P^T / dS^T in TMEM (dK, dV stay per CTA
                                 over the group walk, as 1-CTA); N = head dim split: it loads
                                 Q^T / dO^T's columns [d r / 2, d (r + 1) / 2) of all 128 rows
                                 (sQt, sdOt: other bytes than sQ / sdO's rows, so buffers of
                                 their own, one stage, pipeline bwd_qt)
    dQ = dS K                    M = 128 queries: rows [64r, 64r + 64) in its TMEM (the ISA's
                                 data path for M = 128 with cta_group::2 folds them into 128
                                 lanes x d / 2 columns); K = the pair's 256 keys

dQ's reduction over the pair's keys is the MMA's: each CTA red.global.adds 64 x d floats per
step, half of what a 1-CTA CTA adds for its 128 keys. The price is the dS exchange: the dQ
MMA's A operand in CTA r is dS of query rows [64r, 64r + 64) over all 256 keys, and compute
warpgroup h of either CTA holds exactly query columns [64h, 64h + 64) of its keys, so it stores
its dS into CTA h's sdS at its keys' offset: one warpgroup per CTA writes its own SMEM, the
other the peer's (st.shared::cluster, 16 KiB per step), fenced for the async proxy at cluster
scope and handed over by bwd_ds's thread arrivals, which release at cluster scope; the
leader's MMA warp acquires them at cluster scope before the dQ MMA (in the SASS the fence and
the release are each a MEMBAR.ALL.GPU per compute warp and step). K^T (dQ's B: d / 2 columns
x 256 keys, sKt) is loaded by TMA beside sK.

SMEM per CTA (bytes, 16-bit, two Q stages): the same as 1-CTA at every head dim (232448 at
128, 183296 at 96, 134144 at 64): sQ and sdO halve (rows), sQt + sdOt (one stage) and sKt take
what they free. TMEM: the 1-CTA plan (512 columns at head dim 128) with dQ in d / 2 columns.
Registers: compute 200, dQ 64, others 48 (at 192 / 64 / 64 the compute warps spill 64 bytes:
the dS stores' eight shared::cluster addresses are 64-bit and stay live over the walk).

Where it pays (docs/sm100_backward.md, "2-CTA: where it pays", MODEL OUTPUT): the timing model
has the pair faster per step at head dims 96 and 128 with the default cost table (its 1-CTA
step is bound by the dQ warps' adds), slower once the dQ hand-off does not bound the step; the
sign depends on the unmeasured red.global.add and SM-to-SM rates, so ``use_2cta`` stays off by
default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fa_sm100.config import (DTYPE_BYTES, DTYPES, WARP_SIZE, WARPGROUP_WARPS, CtaPairShape,
                             check_register_budget, check_setmaxnreg)
from layouts.smem import ALIGN, SMEM_BUDGET, align_up

SM100_BWD_HEAD_DIMS = ((64, 64), (96, 96), (128, 128))
SMEM_BYTES = SMEM_BUDGET["sm_100a"]  # per CTA, the same budget as the forward's SmemPlan
STATS_ALIGN = 128  # the float32 rows sLSE2 / sDelta


@dataclass(frozen=True)
class BwdWarpRoles:
    """Which warps of the 16-warp CTA do what, and the registers each warpgroup keeps.

    compute (warps 0-7, two warpgroups): warpgroup h owns query columns [64h, 64h + 64) of every
    S^T / dP^T tile; each thread one key row (TMEM lane). dq (8-11): dQ out of TMEM into the
    float32 accumulator. mma (12), load (14); warps 13 and 15 idle (warp ids match the
    forward's: the MMA and load warps share warpgroup 3)."""

    compute: tuple[int, ...] = (0, 1, 2, 3, 4, 5, 6, 7)
    dq: tuple[int, ...] = (8, 9, 10, 11)
    mma: int = 12
    load: int = 14
    empty: tuple[int, ...] = (13, 15)
    regs_compute: int = 192
    regs_dq: int = 64
    regs_other: int = 64
    num_warps: int = field(default=16, init=False)

    @property
    def threads_per_cta(self) -> int:
        return self.num_warps * WARP_SIZE

    def role_warps(self) -> dict[str, tuple[int, ...]]:
        return {"compute": self.compute, "dq": self.dq, "mma": (self.mma,),
                "load": (self.load,), "empty": self.empty}

    def setmaxnreg(self) -> dict[str, int]:
        return {"compute": self.regs_compute, "dq": self.regs_dq, "other": self.regs_other}

    def registers_used(self) -> int:
        wg = WARPGROUP_WARPS * WARP_SIZE
        return wg * (2 * self.regs_compute + self.regs_dq + self.regs_other)

    def validate(self) -> "BwdWarpRoles":
        warps = sorted(w for ws in self.role_warps().values() for w in ws)
        if warps != list(range(self.num_warps)):
            raise ValueError(f"backward warp roles must cover warps 0..{self.num_warps - 1} "
                             f"once each, got {warps}")
        for name, regs in self.setmaxnreg().items():
            check_setmaxnreg(f"regs_{name}", regs)
        check_register_budget(self.registers_used(),
                              f"128 x (2 x {self.regs_compute} + {self.regs_dq} + "
                              f"{self.regs_other})", self.threads_per_cta)
        return self


@dataclass(frozen=True)
class Sm100BwdConfig(CtaPairShape):
    """Compile-time configuration of the SM100 backward (one compiled kernel per value)."""

    # problem
    head_dim: int = 128
    head_dim_v: int = 128
    dtype: str = "bfloat16"
    causal: bool = False  # bottom-right aligned, as the forward
    # sliding window (fa_sm100.bands): only "has a window" is compile-time; the bounds are
    # launch arguments (bands.kernel_window: an unbounded side covers every key, causal caps
    # the right one), so every window of a problem shares one kernel
    local: bool = False
    # logit softcapping (fa_sm100.softmax_math): the cap is a launch argument; dS takes tanh's
    # derivative (Note [softcap in the SM100 backward] in bwd_compute.py)
    softcap: bool = False
    qhead_per_kvhead: int = 1  # GQA ratio; 1 = MHA, num_heads = MQA
    # deterministic dQ: the adds into a query block's accumulator take turns in key-block
    # order through a per-(batch, head, query block) semaphore (Note [Deterministic dQ] in
    # bwd_dq.py), so dq is bitwise reproducible run to run
    deterministic: bool = False
    # tiles
    m_block: int = 128  # query rows per step (TMEM lanes of dQ; columns of S^T)
    n_block: int = 128  # keys per CTA (TMEM lanes of S^T, dP^T, dK, dV)
    # switches
    q_stage: int = 2  # stages of the Q / dO and LSE2 / Delta rings
    # a cluster of two CTAs over 2 x n_block keys, every MMA cta_group::2 (Note [Backward
    # 2-CTA] above); off by default, the Note says why
    use_2cta: bool = False

    pipeline_table = "backward"  # pipelines.spec.table_of
    one_stage = 1

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def is_local(self) -> bool:
        """Whether the kernel takes a window's bounds (``bands.traced_bounds`` reads this)."""
        return self.local

    def replace(self, **changes) -> "Sm100BwdConfig":
        return dataclasses.replace(self, **changes)

    def warp_roles(self) -> BwdWarpRoles:
        if self.use_2cta:
            return BwdWarpRoles(regs_compute=200, regs_dq=64, regs_other=48)
        return BwdWarpRoles()

    def tma_tiles(self) -> dict[str, int]:
        """Bytes of each TMA tile one CTA loads: K, V (its n_block keys), Q, dO (m_block rows),
        LSE2 and Delta (m_block float32). Under ``use_2cta`` (Note [Backward 2-CTA]) Q and dO
        are the CTA's m_block / 2 rows, and Qt, dOt (m_block rows x half the head dim) and Kt
        (the pair's 2 n_block keys x half the head dim) are tiles of their own."""
        e, g = self.dtype_bytes, self.cta_group
        tiles = {"K": self.n_block * self.head_dim * e, "V": self.n_block * self.head_dim_v * e,
                 "Q": self.m_block // g * self.head_dim * e,
                 "dO": self.m_block // g * self.head_dim_v * e,
                 "LSE2": self.m_block * 4, "Delta": self.m_block * 4}
        if self.use_2cta:
            tiles.update(Qt=self.m_block * self.head_dim // g * e,
                         dOt=self.m_block * self.head_dim_v // g * e,
                         Kt=g * self.n_block * (self.head_dim // g) * e)
        return tiles

    def smem_buffers(self) -> dict[str, int]:
        """Bytes of each SMEM buffer (every stage), in the order of the kernel's shared
        storage (after its mbarriers and the TMEM base address). sdS is the dQ MMA's A
        operand: m_block / cta_group query rows x the cta_group x n_block keys of the MMA."""
        t = self.tma_tiles()
        out = {"sLSE2": self.q_stage * t["LSE2"], "sDelta": self.q_stage * t["Delta"],
               "sK": t["K"], "sV": t["V"], "sQ": self.q_stage * t["Q"],
               "sdO": self.q_stage * t["dO"],
               "sdS": self.m_block * self.n_block * self.dtype_bytes}
        if self.use_2cta:  # one stage (bwd_qt)
            out.update(sQt=t["Qt"], sdOt=t["dOt"], sKt=t["Kt"])
        return out

    def dq_releases_per_turn(self) -> int:
        """How much one key block's turn (a pair's under 2-CTA) adds to a deterministic dQ
        semaphore: one release per warp of the dQ role of each CTA (Note [Deterministic dQ]
        in bwd_dq.py)."""
        return len(self.warp_roles().dq) * self.cta_group

    def smem_bytes(self) -> int:
        """The kernel's shared storage, laid out as ``bwd_kernel.SharedStorage`` lays it out:
        mbarriers, the TMEM base address (4 bytes), the float32 rows on 128-byte boundaries,
        then every 16-bit tile on a 1 KiB boundary (the kernel checks that the two agree)."""
        from pipelines.spec import barrier_count

        # the 2-CTA TMEM deallocation's mbarrier (cutlass TmemAllocator) after the pipelines'
        end = (barrier_count(self) + (1 if self.use_2cta else 0)) * 8 + 4
        for name, size in self.smem_buffers().items():
            end = align_up(end, STATS_ALIGN if name in ("sLSE2", "sDelta") else ALIGN) + size
        return end

    def validate(self) -> "Sm100BwdConfig":
        """Raise ValueError naming the first violated rule; return self when all hold."""
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: must be one of {DTYPES}")
        for name in ("causal", "local", "softcap", "deterministic", "use_2cta"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: a compile-time switch is a "
                                 "bool (a window's bounds and the cap are launch arguments)")
        if (self.head_dim, self.head_dim_v) not in SM100_BWD_HEAD_DIMS:
            # the TMEM plan says why (192, 128) does not fit
            from layouts.tmem import TmemPlan

            TmemPlan.for_backward(self)
            raise ValueError(f"head dims (qk={self.head_dim}, v={self.head_dim_v}) have no SM100 "
                             f"backward: use one of {SM100_BWD_HEAD_DIMS}")
        if self.m_block != 128 or self.n_block != 128:
            raise ValueError(f"(m_block, n_block)=({self.m_block}, {self.n_block}): the TMEM "
                             "plan needs 128 x 128 (TMEM lanes are the 128 keys of S^T, and "
                             "the 128 query rows of dQ)")
        if self.q_stage not in (1, 2):
            raise ValueError(f"q_stage={self.q_stage}: must be 1 or 2")
        if self.qhead_per_kvhead < 1:
            raise ValueError(f"qhead_per_kvhead={self.qhead_per_kvhead}: must be >= 1")
        from layouts.tmem import TmemPlan

        TmemPlan.for_backward(self)
        if self.smem_bytes() > SMEM_BYTES:
            raise ValueError(f"SMEM: {self.smem_bytes()} bytes ({self.smem_buffers()}) exceed "
                             f"the {SMEM_BYTES} of an SM; use q_stage=1")
        self.warp_roles().validate()
        return self


def select_sm100_bwd_config(head_dim: int, head_dim_v: int, dtype: str, causal: bool,
                            qhead_per_kvhead: int, deterministic: bool = False,
                            local: bool = False, softcap: bool = False,
                            **overrides) -> Sm100BwdConfig:
    """The default config of a problem: two Q / dO stages where they fit the SMEM, else one.
    ``local`` / ``softcap``: whether the problem has a window / a cap (never their values)."""
    base = Sm100BwdConfig(head_dim=head_dim, head_dim_v=head_dim_v, dtype=dtype, causal=causal,
                          local=local, softcap=softcap, qhead_per_kvhead=qhead_per_kvhead,
                          deterministic=deterministic,
                          use_2cta=overrides.get("use_2cta", False))
    if "q_stage" not in overrides:
        two = base.replace(q_stage=2)
        overrides["q_stage"] = 2 if two.smem_bytes() <= SMEM_BYTES else 1
    return base.replace(**overrides).validate()
