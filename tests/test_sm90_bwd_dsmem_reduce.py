"""Why the two CTAs of a Q/dO multicast pair do not sum their dQ tiles before adding them
into L2 (CHANGELOG.md).

The experiment ``dq_pair_sum`` (commit 5ca4a84, reverted in the next one) had each CTA of a
pair send half of every dQ tile to the other through distributed SMEM (``st.async``), add
the half it received and bulk-reduce only its own half into global memory: half the float32
reductions into L2. The MMA warpgroups did the exchange, and it cost 15-18% at hdim 128 on an
H200. To take it off their path, the copy engine would have to do the adding:
``cp.reduce.async.bulk`` into another CTA's SMEM. That form takes integer and bitwise types
only, so float32 dQ cannot be summed there. This test holds that fact on sm_90a: the form
assembles for ``.u32`` and ptxas rejects it for ``.f32``.
"""

import pytest

pytestmark = pytest.mark.compile

DSMEM_REDUCE = ("cp.reduce.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes"
                ".add.{type} [$0], [$1], 16, [$2];")


def _compile_dsmem_reduce(elem_type: str):
    """Cross-compile, for sm_90a, a 2-CTA cluster kernel whose threads each issue one bulk
    reduce of 16 bytes of element type ``elem_type`` into the cluster's shared memory."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32
    from cutlass._mlir.dialects import llvm
    from cutlass.cute.runtime import make_fake_compact_tensor
    from cutlass.cutlass_dsl import dsl_user_op

    from fa_sm100.compile_tools import cross_compile

    ptx = DSMEM_REDUCE.format(type=elem_type)

    @dsl_user_op
    def dsmem_reduce(dst, src, mbar, *, loc=None, ip=None):
        llvm.inline_asm(None, [Int32(a).ir_value(loc=loc, ip=ip) for a in (dst, src, mbar)],
                        ptx, "r,r,r", has_side_effects=True, is_align_stack=False,
                        asm_dialect=llvm.AsmDialect.AD_ATT)

    @cute.kernel
    def kernel(addrs: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        dsmem_reduce(addrs[tidx], addrs[tidx + 1], addrs[tidx + 2])

    @cute.jit
    def host(addrs: cute.Tensor):
        kernel(addrs).launch(grid=[2, 1, 1], block=[32, 1, 1], cluster=[2, 1, 1])

    return cross_compile(host, (make_fake_compact_tensor(cutlass.Int32, (64,)),), "sm_90a")


def test_bulk_reduce_into_a_peer_cta_takes_no_float32_add():
    from fa_sm100.compile_tools import sass_full_histogram

    hist = sass_full_histogram(_compile_dsmem_reduce("u32").sass)
    assert hist.get("UBLKRED.S.S.ADD") == 1, hist  # SMEM -> SMEM bulk reduce, integer add
    with pytest.raises(Exception, match="Arguments mismatch for instruction"):
        _compile_dsmem_reduce("f32")
