"""The cells of ``scripts/benchmark.py``'s grids: one attention problem each.

The default grid is MHA: ``--total-tokens`` tokens and a model of ``--hidden`` = heads x head
dim in every cell (``default_grid_cell``). ``--grid models`` (``MODEL_CELLS``) is the cells
models run (issue 54): GQA 4:1 and 8:1 at head dims 128 and 64, MQA prefill, and the
(192, 128) head dims of MLA-style prefill, each a fixed batch, length and head count. In both,
V's head dim is the forward's default for the head dim (``default_head_dim_v``: 128 with 192,
else the head dim), so the forward and the backward benchmarks, which derive it the same way,
time one problem per cell. ``sdpa_refusal`` says where SDPA's backends do not take a cell (it
needs a GPU); nothing else here needs torch or a GPU.
"""

from __future__ import annotations

from typing import NamedTuple

from fa_sm100.config import default_head_dim_v


class BenchCell(NamedTuple):
    """One problem: BSHD q (batch, seqlen, heads, head_dim), k and v with ``heads_kv`` heads
    (a divisor of ``heads``: MHA, GQA or MQA), self-attention (seqlen_q = seqlen_k)."""

    batch: int
    seqlen: int
    heads: int
    heads_kv: int
    head_dim: int
    causal: bool

    @property
    def head_dim_v(self) -> int:
        return default_head_dim_v(self.head_dim)

    @property
    def shapes(self) -> tuple:
        """The BSHD shapes of q, k and v."""
        b, s = self.batch, self.seqlen
        return ((b, s, self.heads, self.head_dim), (b, s, self.heads_kv, self.head_dim),
                (b, s, self.heads_kv, self.head_dim_v))

    @property
    def label(self) -> str:
        """A short name that tells the cells of a grid apart, e.g. "32q/8kv d128 8k causal
        b2" (GQA) or "16h d192/128 4k full b4" (MHA)."""
        heads = (f"{self.heads}h" if self.heads == self.heads_kv
                 else f"{self.heads}q/{self.heads_kv}kv")
        dims = (f"d{self.head_dim}" if self.head_dim == self.head_dim_v
                else f"d{self.head_dim}/{self.head_dim_v}")
        length = f"{self.seqlen // 1024}k" if self.seqlen % 1024 == 0 else str(self.seqlen)
        return (f"{heads} {dims} {length} {'causal' if self.causal else 'full'} "
                f"b{self.batch}")


def default_grid_cell(head_dim: int, seqlen: int, causal: bool, total_tokens: int,
                      hidden: int) -> BenchCell:
    """A cell of the default grid: batch = total_tokens / seqlen, heads = hidden / head_dim,
    MHA."""
    heads = hidden // head_dim
    return BenchCell(total_tokens // seqlen, seqlen, heads, heads, head_dim, causal)


# The six cells (GQA at hdim 128, (192, 128) prefill), then GQA 4:1 at hdim 64 and
# MQA prefill.
MODEL_CELLS = (
    BenchCell(batch=2, seqlen=8192, heads=32, heads_kv=8, head_dim=128, causal=True),
    BenchCell(batch=2, seqlen=8192, heads=64, heads_kv=8, head_dim=128, causal=True),
    BenchCell(batch=8, seqlen=2048, heads=32, heads_kv=8, head_dim=128, causal=True),
    BenchCell(batch=4, seqlen=4096, heads=16, heads_kv=16, head_dim=192, causal=False),
    BenchCell(batch=4, seqlen=4096, heads=16, heads_kv=16, head_dim=192, causal=True),
    BenchCell(batch=1, seqlen=16384, heads=16, heads_kv=16, head_dim=192, causal=True),
    BenchCell(batch=2, seqlen=8192, heads=16, heads_kv=4, head_dim=64, causal=True),
    BenchCell(batch=2, seqlen=4096, heads=32, heads_kv=1, head_dim=128, causal=True),
)

# SDPA's providers in the benchmark: the backend each forces, and torch's check of whether it
# takes a problem
SDPA_BACKENDS = {"cudnn": ("CUDNN_ATTENTION", "can_use_cudnn_attention"),
                 "flash": ("FLASH_ATTENTION", "can_use_flash_attention")}


def sdpa_refusal(name, cell, dtype, torch):
    """Why SDPA's backend of provider ``name`` ("cudnn", "flash") does not take ``cell``, or
    None when it does: torch's own check (``torch.backends.cuda.can_use_*_attention``, its
    warnings as the reason) on empty CUDA tensors of the cell's shapes, laid out as the
    provider passes them, with ``enable_gqa`` where K/V have fewer heads than Q."""
    import warnings

    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend, check = SDPA_BACKENDS[name]
    q, k, v = (torch.empty(shape, device="cuda", dtype=dtype).transpose(1, 2)
               for shape in cell.shapes)
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, cell.causal,
                                            cell.heads_kv != cell.heads)
    with sdpa_kernel(getattr(SDPBackend, backend)), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        if getattr(torch.backends.cuda, check)(params, debug=True):
            return None
    reasons = [str(w.message).splitlines()[0] for w in said]
    return "; ".join(reasons) or f"SDPA's {backend} backend does not take this problem"
