"""Our mbarrier pipeline classes (CuTe DSL) for the SM100 forward kernel.

One class per protocol; each is built from a row of ``pipelines.spec.PIPELINES`` by
``pipelines.spec.build_pipelines`` (never constructed by hand in the kernel):

=====================  ==================  ===================================================
class                  producer arrives    consumer releases
=====================  ==================  ===================================================
TmaUmmaPipeline        expect-tx (leader)  tcgen05.commit (multicast to both CTAs of the pair)
UmmaThreadsPipeline    tcgen05.commit      thread arrive (on the leader CTA under 2-CTA)
ThreadsUmmaPipeline    thread arrive       tcgen05.commit
ThreadsThreadsPipeline thread arrive       thread arrive (local)
=====================  ==================  ===================================================

API (the same on every class). ``stage`` is an index (a Python int for a compile-time stage
such as the Q stage of a per-Q-stage pipeline, or a run-time Int32) with an explicit run-time
``phase`` -- or a ``PipelineState`` in place of both. ``stage_hint`` names the compile-time
stage for the record when the index is a run-time value::

    pipe.producer_acquire(stage, phase, expected_tx=None, stage_hint=None)
        wait until the stage is empty; TMA pipelines: the leader CTA also arrives expecting
        ``expected_tx`` bytes (default: the table's bytes of one stage across the pair)
    pipe.producer_commit(stage, stage_hint=None, note="")
        arrive on the full barrier (nothing for TMA pipelines: the bytes complete the phase)
    pipe.consumer_wait(stage, phase, stage_hint=None)
    pipe.consumer_release(stage, stage_hint=None, note="")
    pipe.full_barrier(stage)          pointer for TMA copies and gemm-internal waits
    pipe.make_producer_state(stage=None) / pipe.make_consumer_state(stage=None)
        PipelineState at the start (a ring state; with ``stage``, a state fixed on that
        compile-time stage whose phase flips on each advance). The recording logs its creation
        and advances, so the model checks the parity of every wait that uses it.

``producer_commit`` on a thread-arrive pipeline is a plain ``mbarrier.arrive`` (no expect-tx):
the reference implementation routed it through the TMA-load arrive, a known defect; the
test tests/test_pipelines_ptx.py checks our PTX and the protocol model checks the protocol.

Every method first calls ``record.emit`` with how it arrives, so tracing the kernel inside
``record.recording()`` yields the protocol the model (pipelines/model.py) checks. Inside
``record.recording(dry=True)`` the methods only record (no DSL code), which lets plain Python
programs drive the same classes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from fa_sm100.config import FmhaConfig, WarpRoles
from pipelines import record
from pipelines.dsl_values import NoLoopCarriedValues
from pipelines.spec import PIPELINE_NAMES, active_specs, barrier_offsets, names_of

# ---------------------------------------------------------------------------------------------
# Elect-one helpers


def elect_one():
    """``with elect_one(): ...`` runs the body on one thread of the warp."""
    import cutlass.cute as cute

    return cute.arch.elect_one()


def warp_elect_one():
    """``__syncwarp`` then elect one thread: the warp's writes happen-before the elected op."""
    import cutlass.cute as cute

    cute.arch.sync_warp()
    return cute.arch.elect_one()


def _dsl_active() -> bool:
    return not record.is_dry()


# ---------------------------------------------------------------------------------------------
# Pipeline state


class PipelineState:
    """(index, phase) of a circular buffer of ``stages`` stages, for 1..N stages.

    The phase is the parity the next wait expects. ``advance()`` moves to the next stage and
    flips the phase when it wraps. Works with Python ints (dry recording) and DSL Int32
    values (loop-carried through dynamic loops).

    ``fixed=True``: a state that stays on the compile-time stage ``index`` (a Python int) of a
    per-Q-stage pipeline and only flips its phase on ``advance()`` (``stages`` is then 1);
    only the phase is a run-time value. ``rid`` is the id under which the recording
    (``record.new_state``) tracks this state, so the model can check every wait's parity.
    """

    def __init__(self, stages: int, index: Any, phase: Any, fixed: bool = False,
                 rid: Optional[int] = None):
        if stages < 1:
            raise ValueError(f"PipelineState: stages={stages} must be >= 1")
        if fixed and (stages != 1 or not isinstance(index, int)):
            raise ValueError("PipelineState: a fixed-stage state has stages=1 and a Python int index")
        self.stages = stages
        self.index = index
        self.phase = phase
        self.fixed = fixed
        self.rid = rid

    def advance(self) -> None:
        record.advance_state(self.rid)
        if self.stages == 1:
            self.phase = self.phase ^ 1
            return
        nxt = self.index + 1
        wrap = nxt // self.stages  # 0 or 1
        self.index = nxt - wrap * self.stages
        self.phase = self.phase ^ wrap

    def clone(self) -> "PipelineState":
        return PipelineState(self.stages, self.index, self.phase, self.fixed,
                             record.clone_state(self.rid))

    def __get_mlir_types__(self):
        if self.fixed:
            return [self.phase.type]
        return [self.index.type, self.phase.type]

    def __extract_mlir_values__(self):
        if self.fixed:
            return [self.phase.ir_value()]
        return [self.index.ir_value(), self.phase.ir_value()]

    def __new_from_mlir_values__(self, values):
        from cutlass import Int32

        if self.fixed:
            return PipelineState(1, self.index, Int32(values[0]), True, self.rid)
        return PipelineState(self.stages, Int32(values[0]), Int32(values[1]), False, self.rid)


def _int(v: int):
    if record.is_dry():
        return v
    from cutlass import Int32

    return Int32(v)


# ---------------------------------------------------------------------------------------------
# The CTA pair


@dataclass
class PairInfo:
    """Where this CTA sits in its 2-CTA pair (cta_group 1: a pair of one)."""

    cta_group: int
    is_leader: Any  # Python True for 1-CTA; a run-time Boolean under 2-CTA
    leader_rank: Any  # rank in the cluster of the pair's leader CTA
    pair_mask: Any  # tcgen05.commit multicast mask of both CTAs of the pair

    @classmethod
    def current(cls, cfg) -> "PairInfo":
        if cfg.cta_group == 1 or record.is_dry():
            return cls(cfg.cta_group, True, 0, 0b11 if cfg.cta_group == 2 else 0b1)
        import cutlass.cute as cute

        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        if tuple(cfg.cluster_shape) == (2, 1, 1):
            # The cluster is exactly one pair: the leader is rank 0 and the multicast mask
            # 0b11, as compile-time constants (a run-time rank would stay live in every
            # role's registers).
            return cls(2, rank == 0, 0, 0b11)
        leader = rank // 2 * 2
        return cls(2, rank % 2 == 0, leader, 3 << leader)


# ---------------------------------------------------------------------------------------------
# Pipelines


class MbarrierPipeline(NoLoopCarriedValues):
    """A producer/consumer pipeline over ``stages`` pairs of mbarriers (full[i], empty[i]).

    Barrier layout from ``base``: full[0..stages), then empty[0..stages). Subclasses fix how
    each side arrives; ``spec`` (a PipelineSpec row) gives the counts.
    """

    kind = ""  # the PipelineSpec.kind this class implements; arrivals come from the spec

    def __init__(self, spec, cfg, roles, base, pair: PairInfo):
        if spec.kind != self.kind:
            raise ValueError(f"pipeline {spec.name} is a {spec.kind} pipeline, not {self.kind}")
        self.spec = spec
        self.name = spec.name
        self.stages = spec.num_stages(cfg)
        self.cta_group = cfg.cta_group
        self.full_count = spec.arrivals("full", cfg, roles)
        self.empty_count = spec.arrivals("empty", cfg, roles)
        self.tx_count = spec.tx_bytes(cfg)
        self.base = base
        self.pair = pair
        self.full_arrive = spec.producer.arrive
        self.empty_arrive = spec.consumer.arrive
        self.full_dst = self._dst(self.full_arrive, spec.waits_on_leader("full"))
        self.empty_dst = self._dst(self.empty_arrive, spec.waits_on_leader("empty"))

    @staticmethod
    def _dst(arrive: str, waiter_is_mma: bool) -> str:
        if arrive == "umma":
            return "pair"
        if arrive == "expect_tx":
            return "local"
        return "leader" if waiter_is_mma else "local"

    # -- barriers --------------------------------------------------------------------------
    def full_barrier(self, index):
        """Pointer to full[index] (TMA copies complete their bytes here); None when dry."""
        return None if self.base is None else self.base + index

    def empty_barrier(self, index):
        return None if self.base is None else self.base + self.stages + index

    def barrier_inits(self):
        """(pointer, arrival count) for every barrier of this pipeline."""
        return [(self.full_barrier(i), self.full_count) for i in range(self.stages)] + [
            (self.empty_barrier(i), self.empty_count) for i in range(self.stages)
        ]

    def make_producer_state(self, stage: Optional[int] = None) -> PipelineState:
        """Producer starts on stage 0 with phase 1 (every stage empty) -- or phase 0 when the
        table says the producer commits before its first acquire (s_p_o). ``stage``: a state
        fixed on that compile-time stage (per-Q-stage pipelines)."""
        return self._state(stage, 1 if self.spec.producer_starts_empty else 0)

    def make_consumer_state(self, stage: Optional[int] = None) -> PipelineState:
        """Consumer starts on stage 0 with phase 0 (nothing full yet); ``stage`` as above."""
        return self._state(stage, 0)

    def _state(self, stage: Optional[int], phase: int) -> PipelineState:
        if stage is None:
            rid = record.new_state(self.name, self.stages, 0, phase)
            return PipelineState(self.stages, _int(0), _int(phase), rid=rid)
        if not (isinstance(stage, int) and 0 <= stage < self.stages):
            raise ValueError(f"pipeline {self.name}: fixed stage {stage!r} not in 0..{self.stages - 1}")
        rid = record.new_state(self.name, 1, stage, phase)
        return PipelineState(1, stage, _int(phase), fixed=True, rid=rid)

    # -- low-level arrive / wait -----------------------------------------------------------
    def _arrive(self, ptr, kind: str, dst: str, tx: int = 0) -> None:
        if not _dsl_active():
            return
        import cutlass.cute as cute
        from cutlass.cute.nvgpu import tcgen05

        two = self.cta_group == 2
        if kind == "umma":
            with elect_one():
                if two:
                    tcgen05.commit(ptr, self.pair.pair_mask, tcgen05.CtaGroup.TWO)
                else:
                    tcgen05.commit(ptr)
        elif kind == "expect_tx":
            # the leader's barrier counts the pair's bytes; a barrier each CTA waits on
            # itself (TmaThreadsPipeline) expects its own CTA's
            if two and self.spec.waits_on_leader("full"):
                from cutlass.cutlass_dsl import if_generate

                def arrive_leader():
                    with elect_one():
                        cute.arch.mbarrier_arrive_and_expect_tx(ptr, tx)

                if_generate(self.pair.is_leader, arrive_leader)
            else:
                with elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(ptr, tx)
        elif kind in ("thread", "warp"):
            peer = self.pair.leader_rank if (two and dst == "leader") else None
            scope = {}
            if two and self.spec.cluster_release:
                from cutlass._mlir.dialects import nvvm

                scope = {"scope": nvvm.MemScopeKind.CLUSTER}
            if kind == "warp":
                with warp_elect_one():
                    cute.arch.mbarrier_arrive(ptr, peer, **scope)
            else:
                cute.arch.mbarrier_arrive(ptr, peer, **scope)
        else:
            raise ValueError(f"pipeline {self.name}: unknown arrive kind {kind!r}")

    def _wait(self, ptr, phase) -> None:
        if _dsl_active():
            import cutlass.cute as cute

            cute.arch.mbarrier_wait(ptr, phase)

    @staticmethod
    def _split(stage, phase=None, stage_hint=None):
        """(index, phase, stage hint for the record). A PipelineState's index is a run-time
        ring position (no hint); a Python int index is a compile-time stage (its own hint)."""
        if isinstance(stage, PipelineState):
            if stage.fixed and stage_hint is None:
                stage_hint = stage.index
            return stage.index, stage.phase, stage_hint
        if stage_hint is None and isinstance(stage, int):
            stage_hint = stage
        return stage, phase, stage_hint

    @staticmethod
    def _rid(stage) -> Optional[int]:
        return stage.rid if isinstance(stage, PipelineState) else None

    @staticmethod
    def _literal(stage, phase):
        """The phase to record as a literal: an explicit (stage, phase) call's phase; None for
        a PipelineState, whose phase the recording tracks through its creation and advances
        (its value while tracing is only that of the first pass through a loop body)."""
        return None if isinstance(stage, PipelineState) else phase

    # -- producer --------------------------------------------------------------------------
    def producer_acquire(self, stage, phase=None, expected_tx: Optional[int] = None,
                         stage_hint: Optional[int] = None) -> None:
        """Wait until ``stage`` is empty (its empty barrier completed the phase of parity
        ``phase``). TMA pipelines: the leader CTA then arrives expecting ``expected_tx`` bytes
        (default: the table's bytes for one stage, both CTAs of the pair)."""
        index, phase, hint = self._split(stage, phase, stage_hint)
        tma = self.full_arrive == "expect_tx"
        tx = (self.tx_count if expected_tx is None else int(expected_tx)) if tma else 0
        record.emit("acquire", self.name, hint,
                    arrive="expect_tx" if tma else None, dst="local" if tma else None, tx=tx,
                    phase=self._literal(stage, phase), state=self._rid(stage))
        self._wait(self.empty_barrier(index), phase)
        if tma:
            self._arrive(self.full_barrier(index), "expect_tx", "local", tx)

    def producer_commit(self, stage, stage_hint: Optional[int] = None, note: str = "") -> None:
        """Signal ``stage`` full. TMA pipelines: nothing to issue (the bytes complete it)."""
        index, _, hint = self._split(stage, None, stage_hint)
        if self.full_arrive == "expect_tx":
            record.emit("commit", self.name, hint, note=note or "tx-completed", state=self._rid(stage))
            return
        record.emit("commit", self.name, hint, note=note, arrive=self.full_arrive, dst=self.full_dst,
                    state=self._rid(stage))
        self._arrive(self.full_barrier(index), self.full_arrive, self.full_dst)

    # -- consumer --------------------------------------------------------------------------
    def consumer_wait(self, stage, phase=None, stage_hint: Optional[int] = None) -> None:
        """Wait until ``stage`` is full (its full barrier completed the phase of parity ``phase``)."""
        index, phase, hint = self._split(stage, phase, stage_hint)
        record.emit("wait", self.name, hint, phase=self._literal(stage, phase), state=self._rid(stage))
        self._wait(self.full_barrier(index), phase)

    def consumer_release(self, stage, stage_hint: Optional[int] = None, note: str = "") -> None:
        """Hand ``stage`` back to the producer (arrive on its empty barrier)."""
        index, _, hint = self._split(stage, None, stage_hint)
        record.emit("release", self.name, hint, note=note,
                    arrive=self.empty_arrive, dst=self.empty_dst, state=self._rid(stage))
        self._arrive(self.empty_barrier(index), self.empty_arrive, self.empty_dst)


class TmaUmmaPipeline(MbarrierPipeline):
    """TMA -> UMMA (q, kv). Producer: the load warp; ``producer_acquire`` waits for the empty
    stage, then the leader CTA's elected thread arrives with expect-tx of both CTAs' bytes;
    the TMA loads (passed ``full_barrier(index)``; 2-CTA TMA routes completion to the leader)
    complete the phase. Consumer: the MMA warp; ``consumer_release`` is a tcgen05.commit,
    multicast to both CTAs of the pair under 2-CTA."""

    kind = "tma_umma"


class TmaThreadsPipeline(MbarrierPipeline):
    """TMA -> threads (the backward's bwd_lse). Producer: the load warp; under 2-CTA each
    CTA's load warp expects its own bytes on its own barrier (its threads wait there).
    Consumer: thread arrivals on the local empty barrier."""

    kind = "tma_threads"


class UmmaThreadsPipeline(MbarrierPipeline):
    """UMMA -> threads (s_p_o, o_acc). Producer: the MMA warp; ``producer_commit`` is a
    tcgen05.commit multicast to both CTAs of the pair. Consumer: thread arrivals of both CTAs
    on the leader CTA's empty barrier (the MMA warp waits there)."""

    kind = "umma_threads"


class ThreadsUmmaPipeline(MbarrierPipeline):
    """threads -> UMMA (p_lastsplit). ``producer_commit`` is a plain thread ``mbarrier.arrive``
    (never the TMA expect-tx arrive) on the leader CTA's full barrier; the MMA warp waits.
    ``consumer_release`` is a tcgen05.commit multicast to both CTAs."""

    kind = "threads_umma"


class ThreadsThreadsPipeline(MbarrierPipeline):
    """threads -> threads (sm_stats, o_epi): local mbarrier arrive / wait on both sides."""

    kind = "threads_threads"


PIPELINE_CLASSES = {c.kind: c for c in (TmaUmmaPipeline, TmaThreadsPipeline, UmmaThreadsPipeline,
                                        ThreadsUmmaPipeline, ThreadsThreadsPipeline)}


def make_pipeline(spec, cfg, roles, base, pair: PairInfo) -> MbarrierPipeline:
    return PIPELINE_CLASSES[spec.kind](spec, cfg, roles, base, pair)


def init_barriers(pipes) -> None:
    """Warp 0's elected thread initialises every barrier, then fences the init."""
    if not _dsl_active():
        return
    import cutlass.cute as cute
    from cutlass.cutlass_dsl import if_generate

    def init_all():
        with elect_one():
            for p in pipes:
                for ptr, count in p.barrier_inits():
                    cute.arch.mbarrier_init(ptr, count)

    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
    if_generate(warp == 0, init_all)
    cute.arch.mbarrier_init_fence()


def pipeline_init_sync(cfg) -> None:
    """Make barrier inits visible before first use: a cluster barrier under 2-CTA (the peer
    arrives on the leader's barriers), else ``__syncthreads``."""
    if not _dsl_active():
        return
    import cutlass.cute as cute

    if cfg.cta_group == 2:
        cute.arch.cluster_arrive_relaxed()
        cute.arch.cluster_wait()
    else:
        cute.arch.sync_threads()


# -----------------------------------------------------------------------------------------
# The table's pipelines, built


class PipelineSet(NoLoopCarriedValues):
    """The built pipelines: ``pipes.kv`` or ``pipes["kv"]``; a disabled one (p_lastsplit with
    split_p off) is None."""

    def __init__(self, pipes: dict, names: tuple = PIPELINE_NAMES):
        self._pipes = dict(pipes)
        self._names = names
        for name in names:
            setattr(self, name, self._pipes.get(name))

    def __getitem__(self, name: str):
        if name not in self._names:
            raise KeyError(f"no pipeline {name!r}; pipelines: {self._names}")
        return self._pipes.get(name)

    def __iter__(self):
        return iter(self._pipes.values())

    def names(self) -> tuple[str, ...]:
        return tuple(self._pipes)



def build_pipelines(cfg: FmhaConfig, roles: Optional[WarpRoles] = None, barrier_storage=None,
                    *, init: bool = True) -> PipelineSet:
    """Create every enabled pipeline of the table (a ``PipelineSet``).

    barrier_storage: a ``cute.Pointer`` to ``barrier_count(cfg)`` Int64 mbarriers in SMEM (laid
        out in table order, ``barrier_offsets``), or a mapping pipeline name -> pointer to its
        own ``2 * stages`` mbarriers; None inside ``record.recording(dry=True)``, where the
        objects only log operations.
    init: warp 0 initialises every barrier with its derived arrival count and fences the
        init. The kernel then makes the init visible to the pair before first use
        (``pipeline_init_sync(cfg)``).
    Call inside the kernel (the 2-CTA leader rank is read from the cluster).
    """
    roles = roles or cfg.warp_roles()
    specs = active_specs(cfg, roles)
    offsets = barrier_offsets(cfg)
    pair = PairInfo.current(cfg)
    out = {}
    for spec in specs:
        if barrier_storage is None:
            base = None
        elif isinstance(barrier_storage, dict):
            base = barrier_storage[spec.name]
        else:
            base = barrier_storage + offsets[spec.name]
        out[spec.name] = make_pipeline(spec, cfg, roles, base, pair)
    if init and barrier_storage is not None:
        init_barriers(list(out.values()))
    return PipelineSet(out, names_of(cfg))
