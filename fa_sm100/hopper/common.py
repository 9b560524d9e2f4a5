"""What the SM90 forward and backward share.

Kernel side (trace time): the rows/columns view of a WGMMA accumulator, the transposed view of
an SMEM operand, a pointer with its alignment declared, and the helper that issues one
warpgroup GEMM. Host side: the switch that
makes the DSL build a launchable function for sm_90a, and the registry build of an SM90 kernel
for ``scripts/inspect.py`` and the compile-contract tests.

Importing this module imports CuTe DSL; host modules import it lazily, where they compile.
"""

from __future__ import annotations

import contextlib
import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import dsl_user_op

from fa_sm100.hopper.config import SM90_ARCH

# ``wgmma(..., wait=NO_WAIT)`` commits the GEMM and returns; the caller waits later.
NO_WAIT = -1
MBARRIER_BYTES = 8  # one mbarrier (the stages of a pipeline's barriers lie side by side)


# ---- kernel side -------------------------------------------------------------------------------

def rows_cols_view(t: cute.Tensor) -> cute.Tensor:
    """View an accumulator-shaped tensor ``((2, 2, V), M, N)`` as ``((2, M), (2, V, N))``.

    Within one 64 x N WGMMA atom a thread holds two rows (r, r + 8) and pairs of adjacent
    columns: mode 0 of the value is (column pair, row half, column group). In the view, mode 0
    indexes the thread's rows and mode 1 its columns. Works for register fragments and for
    identity (coordinate) tensors partitioned the same way.
    """
    c = cute.make_layout(t.layout.shape)  # compact: strides count elements of the fragment
    view = cute.make_layout(
        ((c.shape[0][1], c.shape[1]), (c.shape[0][0], c.shape[0][2], c.shape[2])),
        stride=((c.stride[0][1], c.stride[1]), (c.stride[0][0], c.stride[0][2], c.stride[2])),
    )
    return cute.make_tensor(t.iterator, cute.composition(t.layout, view))


def assume_aligned(ptr, align: int = 16):
    """``ptr`` with ``align`` bytes of alignment declared: the caller knows it (a padded or
    aligned buffer), the DSL cannot prove it through run-time offsets, and copies through the
    pointer vectorize only with it. No instruction is added."""
    return cute.make_ptr(ptr.dtype, ptr.toint(), ptr.memspace, assumed_align=align)


def transpose_view(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of an SMEM tensor, e.g. V (n, dv, STAGE) -> V^T (dv, n, STAGE):
    the MN-major operand view of a K-major buffer."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


@dsl_user_op
def arrive_cluster_if(addr, pred, *, loc=None, ip=None) -> None:
    """Arrive once on the mbarrier at shared::cluster address ``addr`` where ``pred`` is
    nonzero: one predicated ``mbarrier.arrive.shared::cluster.b64``, no branch."""
    llvm.inline_asm(
        None, [Int32(addr).ir_value(loc=loc, ip=ip), Int32(pred).ir_value(loc=loc, ip=ip)],
        "{\n.reg .pred p;\nsetp.ne.b32 p, $1, 0;\n"
        "@p mbarrier.arrive.shared::cluster.b64 _, [$0];\n}",
        "r,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


# Note [Peer release]
# ~~~~~~~~~~~~~~~~~~~
# Under multicast, every CTA of a cluster loads into every other's stages, so a stage is free
# only when the consumers of all of them are done: lane r (r < cluster size) of each consumer
# warp arrives on CTA r's empty barrier. The DSL's ``PipelineTmaAsync.consumer_release``
# computes that barrier's shared::cluster address at each release (stage offset, then
# ``mapa`` with the lane's target rank), and at 160 registers ptxas keeps none of it live: in
# the hdim 64 forward's main loop it re-reads ``SR_TID`` and rebuilds the lane, the predicate
# and both addresses at every KV tile, 26 instructions of 446. ``PeerReleasePipeline`` maps
# stage 0's address once, before any loop (``cute.arch.map_dsmem_ptr``); a release adds the
# stage offset and arrives with one predicated ``mbarrier.arrive`` of its own (the DSL's
# ``mbarrier_arrive`` on the mapped pointer, under ``if_generate``, costs 10 instructions more
# per KV tile at hdim 64). That is 15 fewer instructions per KV tile at hdim 64 (the lane
# predicate is still re-derived), 5 at hdim 128, 50 at hdim 256: a small gain at hdim 64 in
# paired timing on the H200, none measurable at 128 and 256 (CHANGELOG.md). The backward's
# Q/dO releases would lose 3 of 587 instructions, so it keeps the DSL's.


@dataclasses.dataclass(frozen=True)
class PeerReleasePipeline:
    """The consumer side of a multicast ``PipelineTmaAsync``, releasing through an address
    mapped once (Note [Peer release]); waits pass through. A dataclass, so the DSL can carry it
    through run-time loops."""

    pipe: object  # the PipelineTmaAsync
    peer_empty: Int32  # cluster address of stage 0's empty barrier in this lane's target CTA
    signal: Int32  # nonzero on the lanes that release (one per CTA of the cluster)

    @staticmethod
    def create(pipe) -> "PeerReleasePipeline":
        stage0 = cute.arch.map_dsmem_ptr(pipe.sync_object_empty.get_barrier(0),
                                         pipe.consumer_mask)
        return PeerReleasePipeline(pipe, Int32(stage0.toint()), Int32(pipe.is_signaling_thread))

    def consumer_try_wait(self, state):
        return self.pipe.consumer_try_wait(state)

    def consumer_wait(self, state, try_wait_token=None):
        self.pipe.consumer_wait(state, try_wait_token)

    def consumer_release(self, state):
        arrive_cluster_if(self.peer_empty + state.index * MBARRIER_BYTES, self.signal)


@cute.jit
def wgmma(tiled_mma: cute.TiledMma, acc: cute.Tensor, frag_a: cute.Tensor, frag_b: cute.Tensor,
          zero_init: cutlass.Constexpr[bool], wait: cutlass.Constexpr[int]):
    """Issue one warpgroup GEMM over every K slice of the fragments and commit it as one group;
    then wait until at most ``wait`` groups are pending (``NO_WAIT``: return at once)."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(frag_a.shape[2])):
        cute.gemm(atom, acc, frag_a[None, None, k], frag_b[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if const_expr(wait != NO_WAIT):
        warpgroup.wait_group(wait)


def stmatrix_to_smem(tiled_mma: cute.TiledMma, dtype, tidx, regs, smem,
                     transpose: cutlass.Constexpr = False):
    """Store a 16-bit register tensor shaped like ``tiled_mma``'s accumulator into an SMEM
    tile with stmatrix (8x8 matrices, four per instruction). The epilogues of both kernels
    (O; dK and dV) go to SMEM this way before their TMA store. ``transpose``: the
    accumulator is the tile's transpose (dK^T, dV^T), stored by ``stmatrix.trans`` through
    the transposed view of ``smem``."""
    atom = cute.make_copy_atom(
        cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=transpose, num_matrices=4), dtype)
    thr = cute.make_tiled_copy_C(atom, tiled_mma).get_slice(tidx)
    dst = transpose_view(smem) if const_expr(transpose) else smem
    cute.copy(atom, thr.retile(regs), thr.partition_D(dst))


# ---- host side ---------------------------------------------------------------------------------

@contextlib.contextmanager
def dsl_runtime_arch(arch: str):
    """Tell the DSL that the machine runs ``arch`` while compiling a launchable function.

    The DSL builds a launchable function only when its runtime arch (CUTE_DSL_ARCH, read once
    at import; the test suite defaults it to sm_100a for cross-compiles) equals the compile
    target. ``sm90_fwd`` and ``sm90_bwd`` compile only after the device was found to be sm_90,
    so this holds; the previous value is restored for other users of the process.
    """
    from cutlass.cutlass_dsl import CuTeDSL

    env = CuTeDSL._get_dsl().envar
    previous = env.arch
    env.arch = arch
    try:
        yield
    finally:
        env.arch = previous


def sm90_kernel_build(name: str, cfg, arch: str, make_kernel, make_args):
    """The registry's ``KernelBuild`` of an SM90 kernel (no TMEM; the config's ``cluster``:
    (2, 1, 1) or (4, 1, 1) under the forward's ``kv_multicast`` or the backward's
    ``qdo_multicast``, else (1, 1, 1)).

    ``make_kernel(cfg)`` gives the ``@cute.jit`` callable, ``make_args(cfg)`` its fake
    arguments; neither is called for an arch other than sm_90a (ValueError).
    """
    from fa_sm100.registry import KernelBuild

    if arch != SM90_ARCH:
        raise ValueError(f"{name} compiles for {SM90_ARCH} only, not {arch}")
    return KernelBuild(
        fn=make_kernel(cfg),
        args=make_args(cfg),
        arch=arch,
        config=cfg,
        smem_bytes=cfg.smem_bytes(),
        tmem_cols=None,
        setmaxnreg=cfg.setmaxnreg(),
        cluster=tuple(cfg.cluster),
    )
