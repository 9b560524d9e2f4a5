"""The fixed TMEM column plan of the SM100 forward kernel.

TMEM holds 128 lanes x 512 columns of 32-bit cells per SM. One row of S (or O) lives in one
lane, so the softmax thread that owns a row reads it with no shuffles. The plan, for the
default n_block = 128 and head_dim_v = 128:

    columns   0..127   S0   scores of Q stage 0          (MMA writes, softmax 0 reads)
             64..127   P0   probabilities of Q stage 0   (alias inside S0; softmax 0 writes)
            128..255   S1   scores of Q stage 1
            192..255   P1   probabilities of Q stage 1   (alias inside S1)
            256..383   O0   output accumulator, stage 0  (MMA accumulates, correction rescales)
            384..511   O1   output accumulator, stage 1

P is 16-bit, two values per 32-bit column, so n_block values of P take n_block / 2 columns and
fit in the upper half of S: the softmax reads a chunk of S before it overwrites that chunk
with P. The offsets are named once here; kernel code reads ``plan.offset("P0")``.
"""

from __future__ import annotations

from dataclasses import dataclass

TMEM_COLS = 512
TMEM_LANES = 128


@dataclass(frozen=True)
class TmemRegion:
    name: str
    start: int
    cols: int
    host: str | None = None  # an alias lies inside its host region

    @property
    def stop(self) -> int:
        return self.start + self.cols

    def overlaps(self, other: "TmemRegion") -> bool:
        return self.start < other.stop and other.start < self.stop


@dataclass(frozen=True)
class TmemPlan:
    regions: tuple[TmemRegion, ...]
    alloc_cols: int = TMEM_COLS

    @classmethod
    def for_config(cls, cfg) -> "TmemPlan":
        """S_i, O_i for each Q stage and the P_i aliases (P at S + n_block / 2).

        The S offsets are always 0 and n_block and the O offsets follow two S regions, so the
        plan is the same for one and two Q stages (q_stage 1 simply leaves S1/O1 unused).
        """
        n, dv = cfg.n_block, cfg.head_dim_v
        p_cols = n * cfg.dtype_bytes // 4  # 16-bit P: two values per 32-bit column
        regions = []
        for i in range(cfg.q_stage):
            s = TmemRegion(f"S{i}", i * n, n)
            regions.append(s)
            regions.append(TmemRegion(f"P{i}", s.start + n - p_cols, p_cols, host=s.name))
        for i in range(cfg.q_stage):
            regions.append(TmemRegion(f"O{i}", 2 * n + i * dv, dv))
        return cls(tuple(regions)).check()

    @classmethod
    def for_backward(cls, cfg) -> "TmemPlan":
        """The SM100 backward's columns (``fa_sm100.sm100.bwd_config``), for 128 keys (lanes)
        and 128-row query blocks:

            S    S^T = K Q^T          m_block columns     P0 / P1 alias inside it
            dP   dP^T = V dO^T        m_block columns     dS0 / dS1 and dQ alias inside it
            dV   dV accumulator       head_dim_v columns  (the whole work tile)
            dK   dK accumulator       head_dim columns

        Compute warpgroup h reads columns [64h, 64h + 64) of S^T and dP^T and writes its 64
        query columns of 16-bit P^T (dS^T) as 32 columns at the start of that range, over
        scores it has already read (``Ph`` / ``dSh``). dQ = dS K (128 query lanes x head_dim)
        lands over dP^T after dK += dS^T Q has read dS^T (one thread issues both MMAs, in
        order), and the next dP^T waits until the dQ warpgroup has read dQ out.

        Under 2-CTA (``cfg.use_2cta``, Note [Backward 2-CTA] in bwd_config.py) every region is
        the same per CTA except dQ: the pair's M = 128 dQ MMA leaves each CTA 64 query rows,
        which the ISA's data-path layout for M = 128 with cta_group::2 folds into 128 lanes of
        head_dim / 2 columns (lane 64 c + r: row r, columns [c d / 2, (c + 1) d / 2))."""
        m, d, dv = cfg.m_block, cfg.head_dim, cfg.head_dim_v
        dq_cols = d // cfg.cta_group
        if 2 * m + d + dv > TMEM_COLS:
            raise ValueError(
                f"TMEM: the backward needs S^T and dP^T ({m} columns each) and the dK and dV "
                f"accumulators ({d} + {dv}): {2 * m + d + dv} of {TMEM_COLS} columns")
        if dq_cols > m:
            raise ValueError(f"TMEM: dQ ({dq_cols} columns) must fit inside dP^T ({m})")
        half, p_cols = m // 2, m // 2 * cfg.dtype_bytes // 4
        regions = [TmemRegion("S", 0, m), TmemRegion("dP", m, m)]
        for h in range(2):
            regions.append(TmemRegion(f"P{h}", h * half, p_cols, host="S"))
            regions.append(TmemRegion(f"dS{h}", m + h * half, p_cols, host="dP"))
        regions += [TmemRegion("dQ", m, dq_cols, host="dP"), TmemRegion("dV", 2 * m, dv),
                    TmemRegion("dK", 2 * m + dv, d)]
        return cls(tuple(regions)).check()

    @classmethod
    def of(cls, cfg) -> "TmemPlan":
        """The plan of ``cfg``'s kernel: the backward's for a config that names the backward's
        pipeline table (``Sm100BwdConfig.pipeline_table``), else the forward's."""
        if getattr(cfg, "pipeline_table", "forward") == "backward":
            return cls.for_backward(cfg)
        return cls.for_config(cfg)

    def __getitem__(self, name: str) -> TmemRegion:
        for r in self.regions:
            if r.name == name:
                return r
        raise KeyError(f"TMEM plan has no region {name!r}; regions: {[r.name for r in self.regions]}")

    def offset(self, name: str) -> int:
        return self[name].start

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.regions)

    @property
    def cols_used(self) -> int:
        return max(r.stop for r in self.regions)

    def check(self) -> "TmemPlan":
        a = self.alloc_cols
        if a < 32 or a > TMEM_COLS or a & (a - 1):
            raise ValueError(f"TMEM allocation of {a} columns: must be a power of two in [32, {TMEM_COLS}]")
        seen = set()
        for r in self.regions:
            if r.name in seen:
                raise ValueError(f"TMEM region {r.name} is declared twice")
            seen.add(r.name)
            if r.cols <= 0 or r.start < 0:
                raise ValueError(f"TMEM region {r.name} has an empty or negative column range")
            if r.stop > a:
                raise ValueError(
                    f"TMEM region {r.name} ends at column {r.stop}, past the {a} allocated columns"
                )
        hosts = [r for r in self.regions if r.host is None]
        for r in self.regions:
            if r.host is not None:
                h = self[r.host]
                if h.host is not None:
                    raise ValueError(f"TMEM alias {r.name} must sit in a host region, not in alias {h.name}")
                if not (h.start <= r.start and r.stop <= h.stop):
                    raise ValueError(
                        f"TMEM alias {r.name} [{r.start}, {r.stop}) does not lie inside its host "
                        f"{h.name} [{h.start}, {h.stop})"
                    )
        for i, r in enumerate(hosts):
            for q in hosts[i + 1:]:
                if r.overlaps(q):
                    raise ValueError(
                        f"TMEM regions {r.name} [{r.start}, {r.stop}) and {q.name} "
                        f"[{q.start}, {q.stop}) overlap"
                    )
        return self

    def table(self) -> str:
        """A printable table of the plan, one region per line."""
        lines = [f"{'region':6} {'columns':>11} {'cols':>5}  note"]
        for r in sorted(self.regions, key=lambda r: (r.start, r.host is not None)):
            note = f"alias inside {r.host}" if r.host else ""
            lines.append(f"{r.name:6} {r.start:>5}..{r.stop - 1:<5} {r.cols:>5}  {note}")
        lines.append(f"allocated: {self.alloc_cols} columns, used: {self.cols_used}")
        return "\n".join(lines)
