"""The seven pipelines of the SM100 forward, as the roles hold them.

The pipeline objects are built once, from the table ``pipelines.spec.PIPELINES``, by
``pipelines.mbarrier.build_pipelines`` (classes in ``pipelines/mbarrier.py``; arrival counts derived
from the warp roles). Every role talks to them through four verbs with an explicit
(stage, phase), each logged to ``pipelines.record`` while the kernel is traced:

    producer_acquire(stage, phase)   wait until the consumers freed ``stage``
    producer_commit(stage)           signal ``stage`` full
    consumer_wait(stage, phase)      wait until ``stage`` is full
    consumer_release(stage)          signal ``stage`` free

``Pipes`` is a frozen dataclass on purpose: the DSL treats an object whose methods are called
inside a run-time loop as loop-carried state unless it is a frozen dataclass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Int32
from cutlass._mlir.dialects import nvvm

from pipelines.mbarrier import build_pipelines
from pipelines.spec import PIPELINE_NAMES, barrier_count

__all__ = ["PIPELINE_NAMES", "Pipes", "barrier_count", "build", "producer_tail"]


@dataclass(frozen=True)
class Pipes:
    q: object
    kv: object
    s_p_o: object
    p_lastsplit: Optional[object]  # None when split_p is off
    o_acc: object
    sm_stats: object
    o_epi: object


def build(cfg, roles, barrier_storage) -> Pipes:
    """Create (and initialise) every pipeline of the table over ``barrier_storage``
    (``barrier_count(cfg)`` Int64 mbarriers in SMEM)."""
    made = build_pipelines(cfg, roles, barrier_storage)
    return Pipes(**{name: made[name] for name in PIPELINE_NAMES})


@cute.jit
def acquire_at_cluster_scope(pipe, index: Int32, phase: Int32):
    """After ``pipe.consumer_wait(index, phase)`` passed: wait for the same completed phase
    again with ``mbarrier.try_wait.acquire.cluster``, so that the memory operations the
    arrivals of another CTA of the pair released (at cluster scope, ``PipelineSpec.
    cluster_release``) are visible to this thread, not only its own CTA's: the plain wait
    acquires at CTA scope. It passes at its first try. Not part of the recorded protocol (the
    model records the wait itself)."""
    bar = pipe.full_barrier(index)
    done = _try_wait_cluster(bar, phase)
    while not done:
        done = _try_wait_cluster(bar, phase)


def _try_wait_cluster(bar, phase) -> Boolean:
    """``mbarrier.try_wait.parity.acquire.cluster`` of ``bar``'s phase ``phase``."""
    return Boolean(nvvm.mbarrier_wait_parity(
        bar.to_llvm_ptr(), Int32(phase).ir_value(), nvvm.MBarrierWaitKind.TRY,
        scope=nvvm.MemScopeKind.CLUSTER))


@cute.jit
def producer_tail(pipe, index: Int32, phase: Int32):
    """Before a producer exits: wait until the consumers freed every stage, so no arrival
    (a UMMA commit from the peer CTA, say) lands on a CTA that has finished. ``(index,
    phase)`` is the producer's next, unused position. Not part of the recorded protocol (the
    model ends every actor when its program ends)."""
    for _ in cutlass.range_constexpr(pipe.stages):
        cute.arch.mbarrier_wait(pipe.empty_barrier(index), phase)
        index = index + 1
        if index == pipe.stages:
            index = Int32(0)
            phase = phase ^ 1
