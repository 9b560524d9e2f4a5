"""The frozen configuration of the SM100 forward kernel and its warp roles.

Every optimization of the design is a field here, so one benchmark run can flip them one at a
time: ``q_stage``, ``use_2cta``, ``split_p``, ``ex2_emu_fraction``, ``rescale_threshold``,
``kv_stage`` and ``persistent``. The kernel reads these fields at trace time
(``if const_expr(cfg.split_p): ...``); nothing else decides what the kernel does.

``FmhaConfig.validate()`` raises ``ValueError`` naming the violated rule; ``select_config``
chooses the defaults for a problem the way the reference design does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Iterable, Optional

from fa_sm100 import softmax_math
from fa_sm100.machines import B200_SMS

# Register file of one SM (sm_90 and sm_100): 64K 32-bit registers.
REGISTER_FILE = 64 * 1024
WARP_SIZE = 32
WARPGROUP_WARPS = 4

# Head-dimension pairs (qk, v) the SM100 forward supports.
SM100_HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (192, 128))
DTYPES = ("bfloat16", "float16")
DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "float16": "float16",
}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2}

# Largest ex2-emulation fraction: every element on the FMA pipe.
MAX_EX2_EMU_FRACTION = 1.0


def check_setmaxnreg(name: str, regs: int) -> None:
    """setmaxnreg takes a register count that is a multiple of 8 in [24, 256]."""
    if regs % 8 or not 24 <= regs <= 256:
        raise ValueError(f"{name}={regs}: setmaxnreg takes a multiple of 8 in [24, 256]")


# ptxas gives a thread at most 255 registers, allocated in steps of 8 (256 per warp).
MAX_REGS_PER_THREAD = 255
REG_ALLOC_STEP = 8


def launch_registers(threads: int) -> int:
    """Registers per thread that ptxas gives a kernel of ``threads`` threads per CTA
    (``.reqntid``) with one CTA per SM (``.minnctapersm 1``): as many as fit the register file,
    rounded down to the allocation step, at most ptxas's 255. 384 threads -> 168, 512 -> 128,
    640 -> 96, as in the cubins of ``tests/test_sm90_fwd_compile.py`` and
    ``tests/test_sm90_bwd.py``; CTAs of 256 threads or fewer are not checked against ptxas."""
    per_thread = min(REGISTER_FILE // threads, MAX_REGS_PER_THREAD)
    return per_thread // REG_ALLOC_STEP * REG_ALLOC_STEP


def check_register_budget(used: int, formula: str, threads: int) -> None:
    """The registers a CTA holds after every setmaxnreg must fit the pool it launched with.

    A CTA launches with ``threads x launch_registers(threads)`` registers, not the whole
    register file: 384 threads hold 64512 of the 65536. ``setmaxnreg.inc`` waits until the
    registers it asks for are free in that pool, so a budget beyond it never completes and the
    kernel hangs (seen on an H200: 128 x (32 + 2 x 240) = 65536 with 384 threads,
    CHANGELOG.md)."""
    pool = threads * launch_registers(threads)
    if used > pool:
        raise ValueError(
            f"register budget {used} exceeds the {pool} registers a CTA of {threads} threads "
            f"launches with ({threads} x {launch_registers(threads)}; setmaxnreg.inc would wait "
            f"for registers that never free up and the kernel would hang): {formula}"
        )


def cutlass_dtype(name: str):
    """The CuTe-DSL element type of a DTYPES name ('bfloat16' -> cutlass.BFloat16)."""
    import cutlass

    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[normalize_dtype(name)]


@dataclass(frozen=True)
class WarpRoles:
    """Which warps of the 16-warp CTA do what, and the registers each role keeps.

    Warp ids never change with options: with ``q_stage == 1`` the softmax-1 warpgroup still
    exists and simply has no Q stage to work on. ``setmaxnreg`` acts per warpgroup, so the
    register counts are per warpgroup: softmax 0, softmax 1, correction, and "other"
    (MMA, epilogue, load and the empty padding warp share warpgroup 3).
    """

    softmax0: tuple[int, ...] = (0, 1, 2, 3)
    softmax1: tuple[int, ...] = (4, 5, 6, 7)
    correction: tuple[int, ...] = (8, 9, 10, 11)
    mma: int = 12
    epilogue: int = 13
    load: int = 14
    empty: int = 15
    regs_softmax: int = 192
    regs_correction: int = 80
    regs_other: int = 48

    num_warps: int = field(default=16, init=False)

    @property
    def threads_per_cta(self) -> int:
        return self.num_warps * WARP_SIZE

    def softmax(self, stage: int) -> tuple[int, ...]:
        """The warps of the softmax warpgroup that owns Q stage ``stage``."""
        return (self.softmax0, self.softmax1)[stage]

    def role_warps(self) -> dict[str, tuple[int, ...]]:
        """Role name -> warp ids, in the order the kernel dispatches them."""
        return {
            "softmax0": self.softmax0,
            "softmax1": self.softmax1,
            "correction": self.correction,
            "mma": (self.mma,),
            "epilogue": (self.epilogue,),
            "load": (self.load,),
            "empty": (self.empty,),
        }

    def role_of_warp(self, warp: int) -> str:
        for role, warps in self.role_warps().items():
            if warp in warps:
                return role
        raise ValueError(f"warp {warp} has no role (the CTA has {self.num_warps} warps)")

    def setmaxnreg(self) -> dict[str, int]:
        """Role -> registers per thread after ``setmaxnreg`` (the compile contract checks these)."""
        return {
            "softmax": self.regs_softmax,
            "correction": self.regs_correction,
            "other": self.regs_other,
        }

    def registers_used(self) -> int:
        """Registers the whole CTA holds after every warpgroup's ``setmaxnreg``."""
        per_wg_threads = WARPGROUP_WARPS * WARP_SIZE
        return per_wg_threads * (2 * self.regs_softmax + self.regs_correction + self.regs_other)

    def validate(self) -> "WarpRoles":
        warps = [w for ws in self.role_warps().values() for w in ws]
        if sorted(warps) != list(range(self.num_warps)):
            raise ValueError(
                f"warp roles must cover warps 0..{self.num_warps - 1} exactly once, got {sorted(warps)}"
            )
        for name in ("softmax0", "softmax1", "correction"):
            ws = getattr(self, name)
            if len(ws) != WARPGROUP_WARPS or ws[0] % WARPGROUP_WARPS or list(ws) != list(
                range(ws[0], ws[0] + WARPGROUP_WARPS)
            ):
                raise ValueError(
                    f"role {name} must be one aligned warpgroup (4 consecutive warps starting at a "
                    f"multiple of 4), got {ws}"
                )
        singles = (self.mma, self.epilogue, self.load, self.empty)
        if len({w // WARPGROUP_WARPS for w in singles}) != 1:
            raise ValueError(
                "the mma, epilogue, load and empty warps must share one warpgroup "
                f"(setmaxnreg acts per warpgroup), got warps {singles}"
            )
        for name in ("regs_softmax", "regs_correction", "regs_other"):
            check_setmaxnreg(name, getattr(self, name))
        check_register_budget(
            self.registers_used(),
            f"128 x (2 x {self.regs_softmax} + {self.regs_correction} + {self.regs_other})",
            self.threads_per_cta,
        )
        return self


def normalize_dtype(dtype) -> str:
    """Accept 'bf16', 'bfloat16', torch.bfloat16, cutlass.BFloat16 ... and return a DTYPES name."""
    name = str(dtype).split(".")[-1].strip("'>").lower()
    if name in DTYPE_ALIASES:
        return DTYPE_ALIASES[name]
    raise ValueError(f"dtype {dtype!r} is not supported: use one of {DTYPES}")


class CtaPairShape:
    """The launch shape that a config's ``use_2cta`` field decides (the SM100 forward's and
    backward's): ``cta_group`` CTAs issue one MMA together, as one cluster."""

    @property
    def cta_group(self) -> int:
        """CTAs that issue one MMA together (tcgen05 cta_group::2 when 2-CTA is on)."""
        return 2 if self.use_2cta else 1

    @property
    def cluster_shape(self) -> tuple[int, int, int]:
        return (self.cta_group, 1, 1)


@dataclass(frozen=True)
class FmhaConfig(CtaPairShape):
    """Compile-time configuration of the SM100 forward kernel (one compiled kernel per value).

    Problem-shaped fields (head dims, dtype, causal, window, GQA ratio) are static parts of the
    problem; switch fields are the design's optimizations, each of which can be turned off.
    """

    # problem
    head_dim: int = 128
    head_dim_v: int = 128
    dtype: str = "bfloat16"
    causal: bool = False
    # sliding window: keys within [q - left, q + right] (fa_sm100.bands); the kernel reads only
    # whether there is a window and takes the bounds at launch (kernel_config)
    window_left: Optional[int] = None
    window_right: Optional[int] = None
    # logit softcapping (fa_sm100.softmax_math): the cap is a launch argument; the softmax
    # warps pass S through softcap_tanh before the mask
    softcap: bool = False
    # packed variable-length batches (fa_sm100.varlen): each work tile's sequence offsets and
    # lengths come from cu_seqlens; a windowed kernel (causal masks and windows are each
    # sequence's run-time band)
    varlen: bool = False
    # a paged K/V cache (varlen only): keys in pages of this many tokens, each sequence's pages
    # named by a page table (load.py: the load warp reads each key block's page); 0 = not
    # paged. A multiple of n_block, so that a key block lies in one page (one TMA box)
    page_size: int = 0
    qhead_per_kvhead: int = 1  # GQA ratio; 1 = MHA, num_heads = MQA
    write_lse: bool = True
    # tiles
    m_block: int = 128
    n_block: int = 128
    # switches
    q_stage: int = 2
    kv_stage: int = 6
    use_2cta: bool = True
    split_p: bool = True
    split_p_col: int = 96  # first P columns released early; the rest arrive on p_lastsplit
    ex2_emu_fraction: float = 0.125  # share of exp2 done by the FMA-pipe polynomial; 0 = off
    rescale_threshold: float = 8.0  # log2 units the row max may grow before O is rescaled
    persistent: bool = True
    # machine (cross-compiling cannot ask the driver)
    num_sms: int = B200_SMS
    debug: bool = False

    @property
    def mma_tile_qk(self) -> tuple[int, int, int]:
        """(M, N, K) of one S = Q K^T MMA instruction across the CTA pair."""
        return (self.m_block * self.cta_group, self.n_block, 16)

    @property
    def tile_q_rows(self) -> int:
        """Query rows one CTA works on per work tile (all its Q stages)."""
        return self.m_block * self.q_stage

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def is_local(self) -> bool:
        return self.window_left is not None or self.window_right is not None

    def kernel_config(self) -> "FmhaConfig":
        """The config the kernel is compiled from: with a window, both sides' values become 0,
        since the kernel takes the bounds as run-time arguments (``fa_sm100.bands``; an
        unbounded side arrives as a bound that covers every key) and reads only whether there
        is a window. Problems whose windows differ in size or in which sides are bounded share
        one kernel."""
        return self.replace(window_left=0, window_right=0) if self.is_local else self

    @property
    def ex2_emulation(self) -> bool:
        return self.ex2_emu_fraction > 0.0

    def replace(self, **changes) -> "FmhaConfig":
        return dataclasses.replace(self, **changes)

    def warp_roles(self) -> WarpRoles:
        """The warp roles and register budgets this config compiles with.

        The same for every config: with q_stage 1 the softmax-1 warpgroup has no work but keeps
        its warp ids and its budget (no warp id moves with an option).
        """
        return WarpRoles(regs_softmax=192, regs_correction=80, regs_other=48)

    def validate(self) -> "FmhaConfig":
        """Raise ValueError naming the first violated rule; return self when all hold."""
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: must be one of {DTYPES}")
        if (self.head_dim, self.head_dim_v) not in SM100_HEAD_DIMS:
            raise ValueError(
                f"head dims (qk={self.head_dim}, v={self.head_dim_v}) are not supported: "
                f"use one of {SM100_HEAD_DIMS}"
            )
        if self.page_size and (not self.varlen or self.page_size < 0
                               or self.page_size % self.n_block):
            raise ValueError(f"page_size={self.page_size}: a paged cache needs varlen=True and "
                             f"pages of a multiple of n_block={self.n_block} tokens (a key block "
                             f"is loaded from one page by one TMA copy)")
        if self.varlen and not self.is_local:
            raise ValueError("varlen=True needs a window (window_left / window_right not None): "
                             "each sequence's causal mask or window is its run-time band")
        if self.m_block != 128:
            raise ValueError(f"m_block={self.m_block}: the TMEM plan needs m_block == 128 (TMEM lanes)")
        if self.n_block != 128:
            raise ValueError(f"n_block={self.n_block}: the TMEM plan needs n_block == 128")
        if self.q_stage not in (1, 2):
            raise ValueError(f"q_stage={self.q_stage}: must be 1 or 2 (one per softmax warpgroup)")
        if self.kv_stage < 1:
            raise ValueError(f"kv_stage={self.kv_stage}: must be at least 1")
        if self.use_2cta and self.kv_stage < 2:
            raise ValueError(
                f"kv_stage={self.kv_stage}: 2-CTA needs at least 2 K/V stages (K and V of one "
                "tile are in flight together)"
            )
        if self.split_p:
            if self.split_p_col % 32 or not 0 < self.split_p_col < self.n_block:
                raise ValueError(
                    f"split_p_col={self.split_p_col}: must be a multiple of 32 strictly between 0 "
                    f"and n_block={self.n_block}"
                )
        if not 0.0 <= self.ex2_emu_fraction <= MAX_EX2_EMU_FRACTION:
            raise ValueError(
                f"ex2_emu_fraction={self.ex2_emu_fraction}: must lie in [0, {MAX_EX2_EMU_FRACTION}]"
            )
        softmax_math.check_rescale_threshold(self.rescale_threshold, self.dtype)
        if self.qhead_per_kvhead < 1:
            raise ValueError(f"qhead_per_kvhead={self.qhead_per_kvhead}: must be >= 1")
        for name in ("window_left", "window_right"):
            w = getattr(self, name)
            if w is not None and (isinstance(w, bool) or not isinstance(w, int)):
                raise ValueError(f"{name}={w!r}: a window bound is an int (None = unbounded; "
                                 "fa_sm100.bands)")
        if self.num_sms < 1:
            raise ValueError(f"num_sms={self.num_sms}: must be >= 1")
        # Plans that derive from the fields above; imported here to keep layouts/ independent.
        from layouts.smem import SmemPlan
        from layouts.tmem import TmemPlan

        TmemPlan.for_config(self)  # raises ValueError when the columns don't fit
        SmemPlan.for_config(self).check()
        self.warp_roles().validate()
        return self


def default_head_dim_v(head_dim: int) -> int:
    """The V head dim that goes with a QK head dim by default: (192, 128), else equal."""
    return 128 if head_dim == 192 else head_dim


def default_split_p_col(n_block: int) -> int:
    """3/4 of the P columns, rounded down to a multiple of 32 (the tcgen05.st granularity)."""
    col = (n_block * 3 // 4) // 32 * 32
    if not 0 < col < n_block:
        raise ValueError(f"n_block={n_block} is too small to split P at a multiple of 32")
    return col


def select_config(
    head_dim: int = 128,
    head_dim_v: Optional[int] = None,
    dtype="bfloat16",
    seqlen_q: int = 8192,
    seqlen_k: Optional[int] = None,
    causal: bool = False,
    qhead_per_kvhead: int = 1,
    window_left: Optional[int] = None,
    window_right: Optional[int] = None,
    num_sms: int = B200_SMS,
    softcap: bool = False,
    varlen: bool = False,
    **overrides,
) -> FmhaConfig:
    """Pick the reference design's defaults for a problem, then apply ``overrides``.

    - q_stage 2 when seqlen_q > m_block (two Q tiles per CTA to ping-pong), else 1;
    - 2-CTA MMA whenever there are two Q stages;
    - kv_stage: as many K/V stages as the SMEM budget holds (capped at 32);
    - split_p_col: 3/4 of n_block rounded down to a multiple of 32.

    ``varlen``: packed sequences (pass the longest as ``seqlen_q``); the config then carries a
    window, (0, 0) where none is given (the bounds are launch arguments).
    """
    if varlen and window_left is None and window_right is None:
        window_left = window_right = 0
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    m_block = overrides.get("m_block", 128)
    n_block = overrides.get("n_block", 128)
    q_stage = overrides.get("q_stage", 2 if seqlen_q > m_block else 1)
    use_2cta = overrides.get("use_2cta", q_stage == 2)
    base = FmhaConfig(
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        dtype=normalize_dtype(dtype),
        causal=causal,
        window_left=window_left,
        window_right=window_right,
        softcap=softcap,
        varlen=varlen,
        qhead_per_kvhead=qhead_per_kvhead,
        m_block=m_block,
        n_block=n_block,
        q_stage=q_stage,
        use_2cta=use_2cta,
        split_p_col=default_split_p_col(n_block),
        num_sms=num_sms,
        kv_stage=1,
    )
    if "kv_stage" not in overrides:
        from layouts.smem import SmemPlan

        base = base.replace(kv_stage=SmemPlan.max_kv_stage(base))
    cfg = base.replace(**{k: v for k, v in overrides.items()})
    return cfg.validate()


def parse_bool(text: str) -> bool:
    """A command-line boolean: 1/true/on/yes or 0/false/off/no, any case; else ValueError."""
    low = text.lower()
    if low in ("1", "true", "on", "yes"):
        return True
    if low in ("0", "false", "off", "no"):
        return False
    raise ValueError(f"{text!r} is not a boolean (use true/false)")


def _parse_value(text: str, kind):
    if kind is bool or isinstance(kind, bool):
        return parse_bool(text)
    if text.lower() == "none":
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def parse_overrides(items: Iterable[str], cls=FmhaConfig) -> dict:
    """Parse ``["use_2cta=false", "kv_stage=3"]`` (the CLIs' ``--set``) into typed fields."""
    names = {f.name: f for f in dataclasses.fields(cls) if f.init}
    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--set {item!r}: expected field=value")
        key, text = item.split("=", 1)
        key = key.strip()
        if key not in names:
            raise ValueError(f"--set {key}: {cls.__name__} has no field {key!r}; fields: {sorted(names)}")
        default = getattr(cls(), key)
        if isinstance(default, bool):
            out[key] = _parse_value(text, bool)
        elif key == "dtype":
            out[key] = normalize_dtype(text)
        else:
            value = _parse_value(text, type(default))
            if isinstance(default, float) and isinstance(value, int):
                value = float(value)
            out[key] = value
    return out


# config fields that name the problem, not a switch: a benchmark's cell or the defaults'
# arguments set them (``parse_variant``, ``config_from_overrides``)
PROBLEM_FIELDS = ("head_dim", "head_dim_v", "dtype", "causal", "window_left", "window_right",
                  "softcap", "deterministic", "qhead_per_kvhead", "num_sms")


def parse_variant(spec: str, cls=FmhaConfig) -> tuple:
    """``"NAME:field=value,field=value"`` (the benchmarks' config variants) -> (NAME, the
    typed fields of ``cls`` as ``parse_overrides`` reads them). A field that names the problem
    (``PROBLEM_FIELDS``) raises ValueError: the kernels take the problem from the
    call, so such a variant would run under its name what it does not say (a deterministic
    variant, for one, ran non-deterministic kernels). So does a name ending in "_rounds": the
    backward grid's row keys ``ours:NAME_rounds_ms`` could not tell it from another variant's
    round times."""
    name, _, fields = spec.partition(":")
    if name.endswith("_rounds"):
        raise ValueError(f"variant name {name!r}: a name may not end in '_rounds' (the grid's "
                         f"row keys could not tell it from another variant's round times)")
    out = parse_overrides([f for f in fields.split(",") if f], cls)
    named = sorted(set(out) & set(PROBLEM_FIELDS))
    if named:
        raise ValueError(f"variant {name}: {', '.join(named)} "
                         f"{'names' if len(named) == 1 else 'name'} the problem, not a switch "
                         "(every run of a cell solves the same problem): set it with the "
                         "script's own flags")
    return name, out


def config_from_overrides(items: Iterable[str]) -> FmhaConfig:
    """The default config for hdim 128 bf16 with ``--set`` overrides applied, validated.

    Switching 2-CTA off or changing head dims re-derives kv_stage from the SMEM budget unless
    kv_stage is set explicitly, as ``select_config`` does.
    """
    changes = parse_overrides(items)  # FmhaConfig's fields only (no ``deterministic``)
    problem = {k: changes.pop(k) for k in PROBLEM_FIELDS if k in changes}
    if "head_dim" in problem and "head_dim_v" not in problem:
        problem["head_dim_v"] = default_head_dim_v(problem["head_dim"])
    return select_config(**problem, **changes)


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
