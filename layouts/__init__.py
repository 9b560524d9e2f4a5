"""Layouts of the SM100 forward: the TMEM column plan, the SMEM budget, and CuTe SMEM layouts."""

from layouts.smem import SMEM_BUDGET, SmemPlan
from layouts.tmem import TMEM_COLS, TmemPlan, TmemRegion

__all__ = ["SMEM_BUDGET", "SmemPlan", "TMEM_COLS", "TmemPlan", "TmemRegion"]
