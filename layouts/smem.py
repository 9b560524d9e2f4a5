"""Shared-memory budget of the forward kernels: bytes per buffer and the K/V stage count.

Per CTA, for the SM100 forward:

    sQ   q_stage x m_block x head_dim            (each CTA of a pair holds its own 128 Q rows)
    sKV  kv_stage x max(K tile, V tile)          (K and V of a tile share one ring of stages;
                                                  under 2-CTA each CTA holds half of each tile)
    sO   q_stage x m_block x head_dim_v          (the correction warps stage O for the TMA store)
    misc mbarriers and the softmax -> correction row statistics

Every buffer starts on a 1024-byte boundary (the 128-byte swizzle's atom repeats every 1 KiB).
"""

from __future__ import annotations

from dataclasses import dataclass

# Largest dynamic SMEM one CTA may opt into: 227 KiB on both sm_90a and sm_100a.
SMEM_BUDGET = {"sm_100a": 232448, "sm_90a": 232448}
ALIGN = 1024
MAX_KV_STAGE = 32


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class SmemPlan:
    arch: str
    q_bytes: int
    kv_stage_bytes: int
    kv_stage: int
    o_bytes: int
    misc_bytes: int

    @staticmethod
    def _parts(cfg) -> tuple[int, int, int, int]:
        e = cfg.dtype_bytes
        k_rows = cfg.n_block // cfg.cta_group  # K rows per CTA: the pair splits the N of S = Q K^T
        v_cols = cfg.head_dim_v // cfg.cta_group  # V: the pair splits the N of O = P V
        q = cfg.q_stage * cfg.m_block * cfg.head_dim * e
        kv = max(k_rows * cfg.head_dim * e, cfg.n_block * v_cols * e)
        o = cfg.q_stage * cfg.m_block * cfg.head_dim_v * e
        # Every pipeline's mbarriers (8 bytes each, counted by the pipeline table), the TMEM
        # dealloc mbarrier and the 4-byte TMEM base address, and per-row max/sum per Q stage.
        from pipelines.spec import barrier_count  # lazy: layouts import no pipeline code at load

        misc = (barrier_count(cfg) + 1) * 8 + 4 + 2 * cfg.q_stage * cfg.m_block * 4
        return align_up(q), align_up(kv), align_up(o), align_up(misc)

    @classmethod
    def for_config(cls, cfg, arch: str = "sm_100a") -> "SmemPlan":
        q, kv, o, misc = cls._parts(cfg)
        return cls(arch, q, kv, cfg.kv_stage, o, misc)

    @classmethod
    def max_kv_stage(cls, cfg, arch: str = "sm_100a") -> int:
        """As many K/V stages as fit next to Q, O and the barriers (at most MAX_KV_STAGE)."""
        # The barrier count (in misc) grows with kv_stage: try the largest stage count first.
        for n in range(MAX_KV_STAGE, 0, -1):
            if cls.for_config(cfg.replace(kv_stage=n), arch).total <= SMEM_BUDGET[arch]:
                return n
        raise ValueError(f"SMEM: not even one K/V stage fits for {cfg}")

    @property
    def kv_bytes(self) -> int:
        return self.kv_stage * self.kv_stage_bytes

    @property
    def total(self) -> int:
        return self.q_bytes + self.kv_bytes + self.o_bytes + self.misc_bytes

    @property
    def budget(self) -> int:
        return SMEM_BUDGET[self.arch]

    def check(self) -> "SmemPlan":
        if self.total > self.budget:
            raise ValueError(
                f"SMEM budget: {self.total} bytes (Q {self.q_bytes} + K/V {self.kv_stage} x "
                f"{self.kv_stage_bytes} + O {self.o_bytes} + misc {self.misc_bytes}) exceeds "
                f"{self.budget} bytes on {self.arch}; lower kv_stage"
            )
        return self

    def table(self) -> str:
        rows = [
            ("sQ", self.q_bytes),
            (f"sK/sV ring ({self.kv_stage} x {self.kv_stage_bytes})", self.kv_bytes),
            ("sO", self.o_bytes),
            ("barriers + row stats", self.misc_bytes),
            ("total", self.total),
            (f"budget ({self.arch})", self.budget),
        ]
        return "\n".join(f"{name:34} {b:>8} B" for name, b in rows)
