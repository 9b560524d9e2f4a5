"""Host side of the SM90 backward: validation, buffers, compile cache, the three launches.

``sm90_bwd(dout, q, k, v, out, lse, ...)`` returns (dq, dk, dv) for BSHD inputs:

1. preprocess: Delta = rowsum(O * dO), LSE in log2 units (padded rows: Delta 0, LSE +inf);
2. main kernel (``Sm90FlashBackward``): dK, dV per key block, dQ added into float32;
3. postprocess: dQ (and GQA dK/dV) float32 -> input dtype, BSHD, GQA heads summed; dQ times
   the softmax scale.

Everything that can be wrong with the inputs raises ValueError before anything is compiled
or launched. Compiled kernels are cached per (config, kind); shapes other than the head dims
are run-time values, so one compile serves every batch, sequence length and head count.
"""

import math
from typing import Optional

import torch

from fa_sm100 import kernel_cache
from fa_sm100.bands import kernel_window
from fa_sm100.call_plans import PlanTable, current_stream_id, stream_capturing
from fa_sm100.compile_tools import fake_rowmajor
from fa_sm100.config import normalize_dtype
from fa_sm100.devices import sm_count
from fa_sm100.hopper import probes
from fa_sm100.hopper.bwd_config import SM90_BWD_HEAD_DIMS, BwdConfig
from fa_sm100.hopper.bwd_defaults import select_bwd_config
from fa_sm100.hopper.config import SM90_ARCH
from fa_sm100.sm100.bwd_config import SM100_BWD_HEAD_DIMS
from fa_sm100.validation import (SUPPORTED_DTYPES, check_softcap, check_softmax_scale,
                                 normalize_window,
                                 require_sm90)
from fa_sm100.varlen import VARLEN_UNBOUNDED, packed_blocks
from layouts.smem import align_up

def validate_bwd_inputs(dout, q, k, v, out, lse, softmax_scale=None, causal=False,
                        window_size=(None, None), deterministic=False, softcap=0.0,
                        kernel: str = "sm90_bwd"):
    """Raise ValueError naming the first problem with the backward's inputs; otherwise return
    ``(softmax_scale, (window_left, window_right), softcap)`` with the default scale filled
    in.

    The rules that need no GPU come first (types, shapes, dtypes, head dims, options); the
    device rule comes last: CUDA tensors on an sm_90 GPU (``kernel="sm100_bwd"``: sm_100,
    with that kernel's head dims). So CPU tensors reach every other rule, and nothing is
    compiled for a device that cannot run the kernel.
    """
    head_dims, arch = ((SM90_BWD_HEAD_DIMS, "SM90") if kernel == "sm90_bwd"
                       else (SM100_BWD_HEAD_DIMS, "SM100"))
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seqlen, heads, head_dim), got {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}: use torch.bfloat16 or torch.float16")
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension")
    if not isinstance(lse, torch.Tensor):
        raise ValueError(f"lse must be a torch.Tensor, got {type(lse).__name__}")
    if len({t.dtype for t in (q, k, v, out, dout)}) != 1:
        raise ValueError("q, k, v, out and dout must share one dtype")
    if len({t.device for t in (q, k, v, out, dout, lse)}) != 1:
        raise ValueError("all tensors must be on the same device")
    b, sq, hq, d = q.shape
    bk, sk, hk, dk = k.shape
    dv = v.shape[3]
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same batch, seqlen, heads")
    if bk != b:
        raise ValueError(f"batch of k ({bk}) differs from batch of q ({b})")
    if dk != d:
        raise ValueError(f"head dims q={d}, k={dk}: the {arch} backward needs them equal")
    if (d, dv) not in head_dims:
        raise ValueError(f"head dims (qk={d}, v={dv}) are not supported by the {arch} backward: "
                         f"use (qk, v) in {head_dims}")
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hk})")
    o_shape = (b, sq, hq, dv)
    if out.shape != o_shape or dout.shape != o_shape:
        raise ValueError(f"out {tuple(out.shape)} and dout {tuple(dout.shape)} must be {o_shape} "
                         f"(q's batch, seqlen, heads; v's head dim)")
    if lse.shape != (b, hq, sq) or lse.dtype != torch.float32:
        raise ValueError(f"lse must be float32 of shape {(b, hq, sq)}, got {lse.dtype} {tuple(lse.shape)}")
    if sq < 1 or sk < 1:
        raise ValueError("sequence lengths must be >= 1")
    softmax_scale = check_softmax_scale(softmax_scale, d)
    for name, flag in (("causal", causal), ("deterministic", deterministic)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be a bool, got {flag!r}")
    window = normalize_window(window_size)
    softcap = check_softcap(softcap)
    if kernel == "sm90_bwd":
        require_sm90(q.device, "sm90_bwd")
    return softmax_scale, window, softcap


def _compiled(kind: str, key, build, make_fake_args):
    """The launchable kernel of (kind, key) for the sm_90 device (``fa_sm100.kernel_cache``:
    compiled once per machine), for TVM FFI: it takes torch tensors (checked against the fake
    arguments: dtypes, static head dims, compact strides, alignment) and launches on the
    current torch stream, with no per-call conversions. ``build`` and ``make_fake_args`` run
    only when the kernel is compiled, so a cached call does no trace-time work."""

    def compile_it():
        import cutlass.cute as cute

        from fa_sm100.hopper.common import dsl_runtime_arch

        with dsl_runtime_arch(SM90_ARCH):
            return cute.compile(build(), *make_fake_args(),
                                options=f"--gpu-arch {SM90_ARCH} --enable-tvm-ffi")

    return kernel_cache.kernel(f"sm90_bwd_{kind}", key, compile_it)


def select_sm90_bwd_config(q, k, v, causal, window, deterministic,
                           config: Optional[BwdConfig] = None, softcap: float = 0.0) -> BwdConfig:
    """The backward's config for validated inputs: the default one, or ``config`` with the
    problem's fields filled in and checked; fitted to the device's SMs."""
    left, right = window
    d, dv = q.shape[3], v.shape[3]
    group = q.shape[2] // k.shape[2]
    dtype = normalize_dtype(q.dtype)
    if config is None:
        config = select_bwd_config(head_dim=d, head_dim_v=dv, dtype=dtype, causal=causal,
                                   window_left=left, window_right=right,
                                   qhead_per_kvhead=group, deterministic=deterministic,
                                   seqlen_q=q.shape[1], seqlen_k=k.shape[1],
                                   softcap=softcap > 0)
    else:
        if not isinstance(config, BwdConfig):
            raise ValueError(f"config must be a BwdConfig, got {type(config).__name__}")
        config = config.replace(head_dim=d, head_dim_v=dv, dtype=dtype,
                                causal=causal, window_left=left, window_right=right,
                                qhead_per_kvhead=group, deterministic=deterministic,
                                softcap=softcap > 0).validate()
    if config.qdo_multicast and not config.pairs_key_blocks(k.shape[1]):
        raise ValueError(f"config.qdo_multicast=True groups the CTAs of neighbouring key blocks "
                         f"in clusters of {config.qdo_cluster}, but seqlen_k={k.shape[1]} gives "
                         f"{config.num_key_blocks(k.shape[1])} blocks of {config.tile_n} keys: use "
                         f"qdo_multicast=False")
    if config.persistent_ctas:
        config = fit_persistent_ctas(config, sm_count(q.device))
    return config


class Sm90BwdPlan:
    """What ``sm90_bwd`` decided for one (metadata, options) pair (``fa_sm100.call_plans``):
    the config and its kernels, in launch order. Calling it makes the inputs contiguous where
    they are not, allocates dq, dk, dv and the workspace, and launches."""

    __slots__ = ("config", "kernels", "scale", "contiguous", "user_config", "window", "softcap",
                 "layout")
    # user_config: the caller's config, whose id is in the key (call_plans)

    def __init__(self, config: BwdConfig, scale: float, tensors, user_config=None,
                 softcap: float = 0.0):
        self.config = config
        self.user_config = user_config
        self.scale = scale
        self.softcap = softcap
        # False: every input of this metadata is already contiguous, so no call copies
        self.contiguous = all(t.is_contiguous() for t in tensors)
        self.kernels = [_compiled(*spec) for spec in kernel_specs(config)]
        self.window = main_window(config, tensors[0], tensors[1])
        self.layout = WorkspaceLayout(config, tensors[0].shape, tensors[1].shape)

    def __call__(self, dout, q, k, v, out, lse):
        if not self.contiguous:
            q, k, v, out, dout, lse = (t.contiguous() for t in (q, k, v, out, dout, lse))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for fn, args in zip(self.kernels, launch_args(self.config, q, k, v, out, dout, lse,
                                                      dq, dk, dv, self.scale, self.window,
                                                      self.softcap, self.layout, kept=True)):
            fn(*args)
        return dq, dk, dv


_plans = PlanTable()


def build_sm90_bwd_plan(dout, q, k, v, out, lse, softmax_scale=None, causal=False,
                        window_size=(None, None), deterministic=False,
                        config: Optional[BwdConfig] = None, softcap=0.0) -> Sm90BwdPlan:
    """Validate, pick the config, fetch its kernels: the plan of one backward call."""
    softmax_scale, window, softcap = validate_bwd_inputs(dout, q, k, v, out, lse, softmax_scale,
                                                         causal, window_size, deterministic,
                                                         softcap)
    cfg = select_sm90_bwd_config(q, k, v, causal, window, deterministic, config, softcap)
    return Sm90BwdPlan(cfg, softmax_scale, (q, k, v, out, dout, lse), config, softcap)


def prepare_sm90_bwd(dout, q, k, v, out, lse, softmax_scale=None, causal=False,
                     window_size=(None, None), deterministic=False,
                     config: Optional[BwdConfig] = None, softcap=0.0):
    """The plan of this call and a no-argument callable that launches it on these tensors
    (the launch-only timing of ``scripts/benchmark.py --mode bwd``)."""
    plan = build_sm90_bwd_plan(dout, q, k, v, out, lse, softmax_scale, causal, window_size,
                               deterministic, config, softcap)
    return lambda: plan(dout, q, k, v, out, lse)


def sm90_bwd(dout, q, k, v, out, lse, softmax_scale: Optional[float] = None, causal: bool = False,
             window_size=(None, None), deterministic: bool = False,
             config: Optional[BwdConfig] = None, softcap: float = 0.0):
    """Gradients (dq, dk, dv) of attention on an SM90 GPU; see the module docstring. The
    second call with the same metadata and options reuses the first one's plan. ``softcap``
    > 0: the gradients of softcapped attention (``flash_attn_func``)."""
    def build():
        return build_sm90_bwd_plan(dout, q, k, v, out, lse, softmax_scale, causal, window_size,
                                   deterministic, config, softcap)

    if probes.any_active():
        return build()(dout, q, k, v, out, lse)
    plan = _plans.plan((dout, q, k, v, out, lse),
                       (softmax_scale, causal, window_size, deterministic, id(config), softcap),
                       build)
    return plan(dout, q, k, v, out, lse)


def fit_persistent_ctas(config: BwdConfig, num_sms: int) -> BwdConfig:
    """``config`` with ``persistent_ctas`` lowered to the SMs of the device, in whole clusters
    (Note [persistent CTAs] in bwd_tiles.py: one CTA per SM, and a CTA that finds no SM
    would start only when another has finished all its tiles)."""
    most = num_sms // config.cluster[0] * config.cluster[0]
    if config.persistent_ctas > most:
        return config.replace(persistent_ctas=most).validate()
    return config


def launch_plan(config: BwdConfig, q, k, v, out, dout, lse, dq, dk, dv, softmax_scale):
    """The kernel calls of one backward, in order, as (kind, compile key, build, fake
    arguments, arguments): preprocess, main kernel, dQ postprocess, and for GQA/MQA the dK and
    dV postprocess. ``sm90_bwd`` compiles (once per key) and runs them; the tests check that
    each call's arguments fit its fake compile arguments.

    Note [chained launches] (``BwdConfig.pdl``): every kernel of the chain is launched as a
    programmatic dependent of the kernel before it in the stream, so the GPU may start it
    while that kernel is still running; each thread calls ``griddepcontrol.wait`` (which
    returns once the kernel before has completed and its writes are visible) before it
    touches anything that kernel, or any kernel before it, wrote or read:
    - the preprocess waits first thing, and after its loads of O and dO lets the main kernel
      launch (``griddepcontrol.launch_dependents``);
    - the main kernel's load warp issues K's and V's TMA (inputs nobody in the chain writes)
      and then waits, before any Q / dO stage with its LSE2 / Delta; the MMA warpgroups and
      the dq-store warp wait first thing (they read LSE2 / Delta and the semaphores, add into
      the dQ accumulator, write dK / dV);
    - each postprocess waits first thing; except, with ``early_dq_post``, the dQ
      postprocess: the main kernel lets it launch from the start, each of its CTAs waits for
      its (batch, head)'s CTAs of the main kernel to count themselves done, and one CTA waits
      for the whole main kernel before it exits (Note [dQ postprocess in the tail] in
      bwd_prepost.py).
    With ``pre_ctas`` the preprocess runs beside the main kernel instead, whose load and
    dq-store warps wait for their (batch, head)'s rows (Note [Preprocess beside the main
    kernel] in bwd_prepost.py).
    Waiting is transitive (a kernel can only launch once the one before it has passed its
    own wait), so nothing in the chain overlaps a write it depends on. What overlaps is the
    launch and the CTAs' start-up: the preprocess's tail with the main kernel's K/V loads,
    and the main kernel's tail with the postprocess's launch. The preprocess zeroes the
    semaphores, and the dQ accumulator unless the first CTA at each query block stores its
    tile (Note [dQ first store] in bwd_store.py; FA4 zeroes it there), so no separate
    zero-fill kernel sits in the chain."""
    return [(*spec, args) for spec, args in zip(
        kernel_specs(config), launch_args(config, q, k, v, out, dout, lse, dq, dk, dv,
                                          softmax_scale))]


def kernel_specs(config: BwdConfig, seqused_k: bool = False) -> list:
    """The kernels of ``launch_plan``, in order, as (kind, compile key, build, fake arguments):
    what depends on the config alone (a plan computes it once). ``seqused_k``: a varlen
    backward that takes used key lengths (Note [Varlen backward] in bwd_kernel.py)."""
    from fa_sm100.config import cutlass_dtype
    from fa_sm100.hopper.bwd_kernel import Sm90FlashBackward
    from fa_sm100.hopper.bwd_prepost import BwdPostprocess, BwdPreprocess, DqPostprocess

    d, d_v, dtype = config.head_dim, config.head_dim_v, config.dtype
    dt = cutlass_dtype(dtype)
    pdl = config.pdl
    zero_dq = not config.first_stores_dq  # Note [dQ first store]: no zero fill needed
    ctas = config.pre_ctas  # Note [Preprocess beside the main kernel] in bwd_prepost.py
    varlen = config.varlen
    used = varlen and seqused_k
    # a varlen kernel's key says so, and the main one and dK / dV's whether keys are "used"
    tag = ("varlen", used) if varlen else ()
    # varlen: the tiles of the packed workspace (Note [Packed workspace] in varlen.py)
    tile_m, tile_n = (config.tile_m, config.tile_n) if varlen else (0, 0)
    specs = [
        ("pre", (d_v, d, dtype, pdl, zero_dq, ctas) + tag[:1] + (tile_m,) * varlen,
         lambda: BwdPreprocess(d_v, d, pdl, zero_dq, ctas, tile_m),
         lambda: fake_pre_arguments(dt, d_v, varlen)),
        ("main", main_compile_key(config) if not varlen else (main_compile_key(config), used),
         lambda: Sm90FlashBackward(config.kernel_config()),
         lambda: fake_arguments(config, env_stream=True, seqused_k=used)),
    ]
    if probes.active("dq_post") != "none":  # Note [cost probes]: the probe leaves dq unwritten
        # the fragment order depends on tile_m (which warpgroup split) and the head dim; the
        # main kernel's dQ tiles are unscaled; with first stores a block no CTA reached is
        # zero (its semaphore says so)
        specs.append(("post_dq", DqPostprocess.compile_key(config),
                      lambda: DqPostprocess(config), lambda: fake_dq_post_arguments(config)))
    if config.uses_gqa_buffers:
        g = config.qhead_per_kvhead if config.gqa_reduce == "buffers" else 1
        for cols in (d, d_v):  # dK arrives scaled
            specs.append(("post", (cols, g, dtype, cols, pdl) + tag + (tile_n,) * varlen,
                          lambda c=cols: BwdPostprocess(c, g, pdl, tile_n),
                          lambda c=cols: fake_post_arguments(dt, c, c, varlen, used)))
    return specs


def main_window(config: BwdConfig, q, k) -> tuple:
    """The main kernel's window arguments for q and k (``fa_sm100.bands.kernel_window``)."""
    return kernel_window(config.causal, (config.window_left, config.window_right), q.shape[1],
                         k.shape[1])


def launch_args(config: BwdConfig, q, k, v, out, dout, lse, dq, dk, dv, softmax_scale,
                window=None, softcap=0.0, layout: Optional["WorkspaceLayout"] = None,
                varlen=None, kept: bool = False) -> list:
    """The arguments of each kernel of ``kernel_specs``, in order, with the call's workspace:
    what a call computes (a warm call nothing else). ``window``: ``main_window`` of q and k,
    ``layout``: the workspace's, each computed here when not given. ``varlen``: (cu_seqlens_q,
    cu_seqlens_k, seqused_k or None, max_seqlen_q, max_seqlen_k) of a packed batch, whose
    tensors come as a batch of one (Note [Varlen backward] in bwd_kernel.py); ``layout`` is
    then required. ``kept``: the workspace may be the stream's kept one (Note [Kept
    workspace]), as a plan's call takes it."""
    ws = workspace(config, q, k, layout, kept)
    cu_q, cu_k, used, max_q, max_k = (None,) * 5 if varlen is None else varlen
    gqa = config.uses_gqa_buffers
    dk_arg, dv_arg = (ws["dk_acc"], ws["dv_acc"]) if gqa else (dk, dv)
    if window is None:
        window = main_window(config, q, k)
    args = [(out, dout, lse, ws["lse2"], ws["delta"], ws["dq_acc"], ws["dq_sem"], cu_q, max_q),
            (q, k, v, dout, ws["lse2"], ws["delta"], ws["dq_acc"], dk_arg, dv_arg, ws["dq_sem"],
             softmax_scale, softcap, *window, cu_q, cu_k, used)]
    if probes.active("dq_post") != "none":
        args.append((ws["dq_acc"], ws["dq_sem"], dq, softmax_scale, k.shape[1], cu_q, max_q))
    if gqa:
        args += [(dk_arg, dk, 1.0, cu_k, used, max_k), (dv_arg, dv, 1.0, cu_k, used, max_k)]
    return args


def main_compile_key(config: BwdConfig):
    """The main kernel's compile key: its config, with the active cost probes when there are
    any (Note [cost probes] in probes.py), so a probed kernel never serves a plain call.
    Raises ValueError for an active probe with nothing to probe in ``config``."""
    for name, value in probes.compile_tag():
        probes.check_probe_config(name, value, config)
    tag = probes.compile_tag(probes.MAIN_KERNEL_PROBES)
    config = config.kernel_config()  # the window's size is a launch argument
    return (config, tag) if tag else config


WORKSPACE_ALIGN = 32  # float32 elements: each workspace buffer starts on 128 bytes


class WorkspaceLayout:
    """The float32 buffers of one backward call and where each lies in one allocation: LSE2
    and Delta (rows padded to tile_m), the dQ accumulator (one block of tile_m * d floats per
    query block: Note [dQ in fragment order] in bwd_store.py) and the dQ semaphores (one per
    query block when deterministic or with first stores), zeroed by the preprocess (the
    accumulator only without first stores: Note [dQ first store]), and for GQA/MQA the dK/dV
    accumulators (one per query head with "buffers", zeroed and one per KV head with
    "atomic"). Each buffer starts on a 128-byte boundary. Computed once per plan: a call
    allocates once and takes a strided view per buffer. ``packed``: (sequences, total_q,
    total_k) of a varlen call, whose shapes give the sequences and the longest ones: the
    float32 buffers are then one batch of every sequence's blocks (Note [Packed workspace] in
    fa_sm100/varlen.py), the semaphores one row per sequence."""

    __slots__ = ("total", "parts", "sem", "zeroed_sem", "gqa", "gqa_zeroed")

    def __init__(self, config: BwdConfig, q_shape, k_shape, packed=None):
        b, sq, hq, d = q_shape
        sk, hk = k_shape[1], k_shape[2]
        sq_pad, sk_pad = align_up(sq, config.tile_m), align_up(sk, config.tile_n)
        n_m_blocks = sq_pad // config.tile_m
        sem_shape = (b, hq, config.dq_sem_slots(n_m_blocks))
        rows_b = b  # the float32 buffers' batch extent
        if packed is not None:
            seqs, total_q, total_k = packed
            rows_b, n_m_blocks = 1, packed_blocks(total_q, seqs, config.tile_m)
            sq_pad = n_m_blocks * config.tile_m
            sk_pad = packed_blocks(total_k, seqs, config.tile_n) * config.tile_n
        shapes = [("lse2", (rows_b, hq, sq_pad)), ("delta", (rows_b, hq, sq_pad)),
                  ("dq_acc", (rows_b, hq, n_m_blocks, config.dq_block_elems))]
        # where the preprocess runs beside the main kernel, the semaphores must arrive zeroed
        # (it counts its rows in the last one: Note [Preprocess beside the main kernel])
        self.zeroed_sem = config.pre_ctas
        if not self.zeroed_sem:
            shapes.append(("dq_sem", sem_shape))
        self.parts, start = [], 0
        for name, shape in shapes:
            self.parts.append((name, shape, _compact_strides(shape), start))
            start += align_up(math.prod(shape), WORKSPACE_ALIGN)
        self.total = start
        if self.zeroed_sem:
            self.sem = sem_shape
        else:
            self.sem = self.parts.pop()[1:]  # (shape, strides, offset) in the int32 view
        self.gqa = None
        if config.uses_gqa_buffers:
            h_acc = hq if config.gqa_reduce == "buffers" else hk
            self.gqa = ((rows_b, h_acc, sk_pad, d), (rows_b, h_acc, sk_pad, config.head_dim_v))
            self.gqa_zeroed = config.gqa_reduce != "buffers"

    def views(self, flat) -> dict:
        """{"lse2", "delta", "dq_acc"[, "dq_sem"]}: views of ``flat`` (float32, at least
        ``total`` elements); "dq_sem" only when the semaphores need not arrive zeroed."""
        ws = {name: flat.as_strided(shape, strides, offset)
              for name, shape, strides, offset in self.parts}
        if not self.zeroed_sem:
            ws["dq_sem"] = flat.view(torch.int32).as_strided(*self.sem)
        return ws

    def allocate(self, device, kept: bool = False) -> dict:
        """The buffers of one call: {"lse2", "delta", "dq_acc", "dq_sem"[, "dk_acc",
        "dv_acc"]}. ``kept``: the float32 part is this stream's kept workspace
        (``kept_workspace``) where it may be, else fresh; zeroed buffers are always fresh."""
        f32 = torch.float32
        ws = kept_workspace(self, device) if kept else None
        if ws is None:
            ws = self.views(torch.empty(self.total, device=device, dtype=f32))
        if not self.zeroed_sem and self.gqa is None:
            return ws
        ws = dict(ws)
        if self.zeroed_sem:
            ws["dq_sem"] = torch.zeros(self.sem, device=device, dtype=torch.int32)
        if self.gqa is not None:
            alloc = torch.zeros if self.gqa_zeroed else torch.empty
            ws["dk_acc"] = alloc(self.gqa[0], device=device, dtype=f32)
            ws["dv_acc"] = alloc(self.gqa[1], device=device, dtype=f32)
        return ws


# Note [Kept workspace]: a warm backward's host time is mostly allocations, views and
# launches, and a fresh workspace is one allocation plus a view per buffer. A plan's call
# instead takes its buffers from one float32 buffer kept per (device, stream), with the views
# of each layout kept beside it. That is as safe as the caching allocator's reuse of a freed
# block on its stream: every kernel that touches the workspace runs on that stream, and the
# first kernel of a call waits for everything before it (Note [chained launches]), so a call
# never overlaps the previous call's use. No kernel reads what a previous call left (the
# preprocess writes LSE2 and Delta, zeroes the semaphores and the accumulator as a fresh
# buffer needs). Not kept: workspaces above KEPT_WORKSPACE_BYTES (their kernels take far longer
# than an allocation), and calls under CUDA graph capture (a graph gets its own buffers, so a
# replay on another stream never shares one with eager calls).
KEPT_WORKSPACE_BYTES = 64 << 20  # the largest kept buffer, per (device, stream)
KEPT_LAYOUTS = 256  # layouts whose views are kept per buffer (cleared when full)
_kept: dict = {}  # (device, stream) -> [flat buffer, {layout: views}]


def kept_workspace(layout: WorkspaceLayout, device) -> Optional[dict]:
    """``layout``'s views on the kept buffer of ``device``'s current stream (grown to fit,
    Note [Kept workspace]), or None where a call takes a fresh workspace instead."""
    if layout.total * 4 > KEPT_WORKSPACE_BYTES or stream_capturing():
        return None
    key = (device, current_stream_id(device))
    entry = _kept.get(key)
    if entry is None or entry[0].numel() < layout.total:
        entry = _kept[key] = [torch.empty(layout.total, device=device, dtype=torch.float32), {}]
    ws = entry[1].get(layout)
    if ws is None:
        if len(entry[1]) >= KEPT_LAYOUTS:
            entry[1].clear()
        ws = entry[1][layout] = layout.views(entry[0])
    return ws


def _compact_strides(shape) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def workspace(config: BwdConfig, q, k, layout: Optional[WorkspaceLayout] = None,
              kept: bool = False) -> dict:
    """The workspace of one backward call on q's device (``WorkspaceLayout``; ``layout``: the
    plan's, computed here when not given; ``kept``: as ``WorkspaceLayout.allocate``)."""
    if layout is None:
        layout = WorkspaceLayout(config, q.shape, k.shape)
    return layout.allocate(q.device, kept)


def _fake_cu_seqlens(varlen: bool, seqused: bool = False):
    """Fake (cu_seqlens, seqused) of a varlen kernel: int32 vectors of run-time length, or
    None where the kernel takes none."""
    import cutlass
    import cutlass.cute as cute

    if not varlen:
        return None, None
    n = cute.sym_int()
    cu = fake_rowmajor(cutlass.Int32, (n,), 4)
    return cu, fake_rowmajor(cutlass.Int32, (cute.sym_int(),), 4) if seqused else None


def _fake_sem_batch(b, varlen: bool):
    """The dQ semaphores' batch extent: the float32 buffers' ``b``, or under varlen a symbol
    of its own (one row per sequence beside one packed batch: Note [Packed workspace])."""
    import cutlass.cute as cute

    return cute.sym_int() if varlen else b


def _fake_max_seqlen(varlen: bool):
    """The longest sequence's length that a varlen pre- or postprocess sizes its grid by (a
    run-time value), or None."""
    import cutlass

    return cutlass.Int32(1) if varlen else None


def fake_arguments(config: BwdConfig, env_stream: bool = False, seqused_k: bool = False):
    """Fake arguments of the main kernel with the run-time/static split ``sm90_bwd`` uses:
    batch, sequence lengths, head counts (and so strides) are run-time values, head dims
    static. ``sm90_bwd`` compiles with them for TVM FFI (``env_stream``: the launch takes the
    current torch stream); ``inspect_bwd`` and the compile contract cross-compile with them.
    A varlen config takes cu_seqlens_q / _k (and with ``seqused_k`` used key lengths); others
    None."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    from fa_sm100.config import cutlass_dtype

    dt = cutlass_dtype(config.dtype)
    d, dv = config.head_dim, config.head_dim_v
    b, sq, sk, h, hk = (cute.sym_int() for _ in range(5))
    # the dQ blocks and the semaphores: equal only with one semaphore per block (one symbol
    # each)
    sq_pad, sk_pad, h_acc, n_m, n_sem = (cute.sym_int() for _ in range(5))
    bd = cute.sym_int() if config.varlen else b  # varlen: the packed tensors are a batch of 1
    q, do = fake_rowmajor(dt, (bd, sq, h, d)), fake_rowmajor(dt, (bd, sq, h, dv))
    k, v = fake_rowmajor(dt, (bd, sk, hk, d)), fake_rowmajor(dt, (bd, sk, hk, dv))
    lse2, delta = fake_rowmajor(cutlass.Float32, (b, h, sq_pad)), fake_rowmajor(cutlass.Float32, (b, h, sq_pad))
    dq_acc = fake_rowmajor(cutlass.Float32, (b, h, n_m, config.dq_block_elems))
    if config.uses_gqa_buffers:
        dk_out = fake_rowmajor(cutlass.Float32, (b, h_acc, sk_pad, d))
        dv_out = fake_rowmajor(cutlass.Float32, (b, h_acc, sk_pad, dv))
    else:
        dk_out, dv_out = fake_rowmajor(dt, (bd, sk, h, d)), fake_rowmajor(dt, (bd, sk, h, dv))
    sem = fake_rowmajor(cutlass.Int32, (_fake_sem_batch(b, config.varlen), h, n_sem), 4)
    cu_q, _ = _fake_cu_seqlens(config.varlen)
    cu_k, used = _fake_cu_seqlens(config.varlen, seqused_k)
    return (q, k, v, do, lse2, delta, dq_acc, dk_out, dv_out, sem, cutlass.Float32(0.125),
            cutlass.Float32(0.0), cutlass.Int32(0), cutlass.Int32(0), cu_q, cu_k, used,
            make_fake_stream(use_tvm_ffi_env_stream=env_stream))


def fake_pre_arguments(dt, head_dim: int, varlen: bool = False):
    """Fake arguments of the preprocess: O, dO (b, sq, h, d); LSE (b, h, sq); LSE2, Delta
    (b, h, sq_pad); the dQ accumulator (b, h, m_blocks, block) and semaphores (b, h, n);
    cu_seqlens_q with ``varlen`` (else None); the current torch stream."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    b, sq, h, sq_pad, n_m, block, n_sem = (cute.sym_int() for _ in range(7))
    bd = cute.sym_int() if varlen else b  # varlen: the packed tensors are a batch of 1
    o, do = fake_rowmajor(dt, (bd, sq, h, head_dim)), fake_rowmajor(dt, (bd, sq, h, head_dim))
    lse = fake_rowmajor(cutlass.Float32, (bd, h, sq), 4)
    lse2, delta = fake_rowmajor(cutlass.Float32, (b, h, sq_pad)), fake_rowmajor(cutlass.Float32, (b, h, sq_pad))
    dq_acc = fake_rowmajor(cutlass.Float32, (b, h, n_m, block))
    sem = fake_rowmajor(cutlass.Int32, (_fake_sem_batch(b, varlen), h, n_sem), 4)
    return (o, do, lse, lse2, delta, dq_acc, sem, _fake_cu_seqlens(varlen)[0],
            _fake_max_seqlen(varlen), make_fake_stream(use_tvm_ffi_env_stream=True))


def fake_post_arguments(dt, head_dim: int, pitch: int, varlen: bool = False,
                        seqused: bool = False):
    """Fake arguments of the postprocess: the float32 accumulator (b, h_acc, s_pad, pitch),
    the output (b, s, h, d), the scale, cu_seqlens_k and used key lengths (``varlen``,
    ``seqused``; else None); the current torch stream."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    b, h_acc, s_pad, s, h = (cute.sym_int() for _ in range(5))
    bd = cute.sym_int() if varlen else b  # varlen: the packed output is a batch of 1
    return (fake_rowmajor(cutlass.Float32, (b, h_acc, s_pad, pitch)),
            fake_rowmajor(dt, (bd, s, h, head_dim)), cutlass.Float32(1.0),
            *_fake_cu_seqlens(varlen, seqused), _fake_max_seqlen(varlen),
            make_fake_stream(use_tvm_ffi_env_stream=True))


def fake_dq_post_arguments(config: BwdConfig):
    """Fake arguments of the dQ postprocess: the fragment-order accumulator (b, h, m_blocks,
    tile_m * hdim), the dQ semaphores (b, h, n), dq (b, s, h, d), the scale, seqlen_k; the
    current torch stream."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    from fa_sm100.config import cutlass_dtype

    b, h, n_m, s, n_sem = (cute.sym_int() for _ in range(5))
    bd = cute.sym_int() if config.varlen else b  # varlen: the packed dq is a batch of 1
    return (fake_rowmajor(cutlass.Float32, (b, h, n_m, config.dq_block_elems)),
            fake_rowmajor(cutlass.Int32, (_fake_sem_batch(b, config.varlen), h, n_sem), 4),
            fake_rowmajor(cutlass_dtype(config.dtype), (bd, s, h, config.head_dim)),
            cutlass.Float32(1.0), cutlass.Int32(1), _fake_cu_seqlens(config.varlen)[0],
            _fake_max_seqlen(config.varlen), make_fake_stream(use_tvm_ffi_env_stream=True))


# ----------------------------------------------------------------------------- varlen

class Sm90BwdVarlenPlan:
    """What ``sm90_bwd_varlen`` decided for one (metadata, options) pair: the config, its
    kernels, the window's launch bounds and the workspace, laid out as a padded batch of the
    longest sequences (Note [Varlen backward] in bwd_kernel.py). Calling it allocates dq, dk,
    dv (dk / dv zeroed where ``seqused_k`` leaves keys unused: their gradient is 0) and
    launches on the packed tensors as a batch of one. A pack with no rows or no keys launches
    nothing: zero gradients."""

    __slots__ = ("config", "kernels", "scale", "softcap", "window", "layout", "max_seqlen_q",
                 "max_seqlen_k", "empty")

    def __init__(self, problem, config: BwdConfig, seqused_k: bool):
        self.config = config
        self.scale, self.softcap = problem.softmax_scale, problem.softcap
        self.empty = 0 in (problem.total_q, problem.total_k, problem.max_seqlen_q,
                           problem.max_seqlen_k)
        self.kernels = [] if self.empty else [_compiled(*spec)
                                              for spec in kernel_specs(config, seqused_k)]
        self.window = kernel_window(problem.causal, problem.window, VARLEN_UNBOUNDED,
                                    VARLEN_UNBOUNDED)
        self.max_seqlen_q, self.max_seqlen_k = problem.max_seqlen_q, problem.max_seqlen_k
        d, dv = problem.head_dim, problem.head_dim_v
        self.layout = WorkspaceLayout(
            config, (problem.batch, max(problem.max_seqlen_q, 1), problem.heads, d),
            (problem.batch, max(problem.max_seqlen_k, 1), problem.heads_kv, dv),
            packed=(problem.batch, problem.total_q, problem.total_k))

    def __call__(self, dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k=None):
        from fa_sm100.call_plans import aligned
        from fa_sm100.validation import tma_ready

        if not aligned(q, k, v, out, dout):
            q, k, v, out, dout = (tma_ready(t) for t in (q, k, v, out, dout))
        lse = lse.contiguous()
        if seqused_k is not None and not self.empty:  # keys past seqused_k: zeros, not garbage
            k, v = zero_unused_keys(k, v, cu_seqlens_k, seqused_k)
        zero_kv = self.empty or seqused_k is not None
        dq = torch.zeros_like(q) if self.empty else torch.empty_like(q)
        dk, dv = (torch.zeros_like(t) if zero_kv else torch.empty_like(t) for t in (k, v))
        if self.empty:
            return dq, dk, dv
        one = lambda t: t.unsqueeze(0)  # noqa: E731  (a batch of one)
        for fn, args in zip(self.kernels, launch_args(
                self.config, one(q), one(k), one(v), one(out), one(dout), one(lse), one(dq),
                one(dk), one(dv), self.scale, self.window, self.softcap, self.layout,
                varlen=(cu_seqlens_q, cu_seqlens_k, seqused_k, self.max_seqlen_q,
                        self.max_seqlen_k), kept=True)):
            fn(*args)
        return dq, dk, dv


_varlen_plans = PlanTable()


def zero_unused_keys(k, v, cu_seqlens_k, seqused_k):
    """Copies of packed k and v with the rows past each sequence's ``seqused_k`` zeroed."""
    unused = unused_key_rows(cu_seqlens_k, seqused_k, k.shape[0])
    return tuple(t.masked_fill(unused[:, None, None], 0) for t in (k, v))


def unused_key_rows(cu_seqlens_k, seqused_k, total_k: int):
    """(total_k,) bool: the rows of packed keys past their sequence's ``seqused_k`` (on the
    device, no synchronization). Rows outside every sequence count as used."""
    rows = torch.arange(total_k, device=cu_seqlens_k.device, dtype=torch.int32)
    seq = torch.searchsorted(cu_seqlens_k, rows, right=True) - 1  # the sequence of each row
    seq = seq.clamp(0, seqused_k.shape[0] - 1)
    return (rows >= cu_seqlens_k[seq] + seqused_k[seq]) & (rows < cu_seqlens_k[seq + 1])


def validate_bwd_varlen_inputs(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                               max_seqlen_q, max_seqlen_k, seqused_k=None, softmax_scale=None,
                               causal=False, window_size=(None, None), softcap=0.0,
                               deterministic=False):
    """The forward's varlen checks (``validation.validate_varlen_inputs``) with the backward's
    head dims, then out / dout (total_q, heads, head_dim_v) of q's dtype and device, lse
    (heads, total_q) float32, and no deterministic mode; raise ValueError naming the first
    problem, else return the ``VarlenProblem``."""
    from fa_sm100.validation import validate_varlen_inputs

    problem = validate_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                     max_seqlen_k, seqused_k, softmax_scale, causal,
                                     window_size, softcap,
                                     head_dims=tuple(SM90_BWD_HEAD_DIMS))
    o_shape = (problem.total_q, problem.heads, problem.head_dim_v)
    for name, t in (("out", out), ("dout", dout)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != o_shape:
            raise ValueError(f"{name} must be a tensor of shape {o_shape} (q's tokens and heads, "
                             f"v's head dim), got {tuple(getattr(t, 'shape', ()))}")
        if t.dtype != q.dtype or t.device != q.device or t.stride(-1) != 1:
            raise ValueError(f"{name} must have q's dtype and device and a contiguous head dim")
    lse_shape = (problem.heads, problem.total_q)
    if (not isinstance(lse, torch.Tensor) or tuple(lse.shape) != lse_shape
            or lse.dtype != torch.float32 or lse.device != q.device):
        raise ValueError(f"lse must be float32 of shape {lse_shape} on q's device (the varlen "
                         f"forward's, return_lse=True)")
    if deterministic:
        raise ValueError("the varlen backward has no deterministic mode (its dQ adds are not "
                         "ordered): call it with deterministic=False")
    require_sm90(q.device, "sm90_bwd_varlen")
    return problem


def build_sm90_bwd_varlen_plan(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                               max_seqlen_q, max_seqlen_k, seqused_k=None, softmax_scale=None,
                               causal=False, window_size=(None, None), softcap=0.0,
                               deterministic=False, config: Optional[BwdConfig] = None):
    """Validate, pick the varlen config, fetch its kernels: the plan of one call."""
    problem = validate_bwd_varlen_inputs(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                         max_seqlen_q, max_seqlen_k, seqused_k, softmax_scale,
                                         causal, window_size, softcap, deterministic)
    left, right = problem.window
    fields = dict(head_dim=problem.head_dim, head_dim_v=problem.head_dim_v,
                  dtype=normalize_dtype(q.dtype), causal=problem.causal, window_left=left,
                  window_right=right, qhead_per_kvhead=problem.heads // problem.heads_kv,
                  softcap=problem.softcap > 0)
    if config is None:
        cfg = select_bwd_config(**fields, seqlen_q=problem.max_seqlen_q,
                                seqlen_k=problem.max_seqlen_k, varlen=True)
    elif not isinstance(config, BwdConfig):
        raise ValueError(f"config must be a BwdConfig, got {type(config).__name__}")
    else:
        cfg = config.replace(**fields, varlen=True).validate()
    return Sm90BwdVarlenPlan(problem, cfg, seqused_k is not None)


def sm90_bwd_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, seqused_k=None, softmax_scale: Optional[float] = None,
                    causal: bool = False, window_size=(None, None), softcap: float = 0.0,
                    deterministic: bool = False, config: Optional[BwdConfig] = None):
    """Gradients (dq, dk, dv) of ``flash_attn_varlen_func``'s attention on an SM90 GPU: packed
    q (total_q, h, d), k / v (total_k, h_kv, d / dv), out / dout (total_q, h, dv) and the
    forward's lse (h, total_q), sequences as the forward takes them (Note [Varlen backward]
    in bwd_kernel.py). The second call with the same metadata and options reuses the plan."""
    def build():
        return build_sm90_bwd_varlen_plan(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                          max_seqlen_q, max_seqlen_k, seqused_k, softmax_scale,
                                          causal, window_size, softcap, deterministic, config)

    tensors = (dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k) + (
        () if seqused_k is None else (seqused_k,))
    plan = _varlen_plans.plan(tensors, (max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                        window_size, softcap, deterministic, id(config),
                                        seqused_k is None), build)
    return plan(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k)
