"""The SM100 forward protocol of DESIGN.md, written with our pipeline classes.

Each function below is one warp role's per-CTA protocol, in plain Python: it drives the same
pipeline objects the kernel uses (built by ``pipelines.mbarrier.build_pipelines`` inside
``record.recording(dry=True)``, so they log and emit nothing), marks run-time loops and
branches, and declares its TMEM/SMEM accesses. ``design_recording(cfg)`` returns the
``Recording`` the protocol model checks until (and besides) the kernel's own recording.
Every wait and acquire passes a ``PipelineState`` (per-Q-stage pipelines: one state fixed on
each Q stage), so the recording knows each parity and the model checks it.

Per work tile with n K/V blocks (iteration j = 0..n-1 visits block n-1-j):

- load:       K[n-1], Q[0..q_stage), V[n-1], then (K[i], V[i]) for i = n-2..0 (TMA)
- MMA:        S_s(0) for each Q stage; then per iteration: for each s: acquire s_p_o(s)
              (P ready, O rescaled), O_s += P_s V (split P: wait p_lastsplit mid-PV),
              S_s(j+1); finally O_s += P_s V[0] and commit o_acc(s)
- softmax s:  per block: wait S, read S, row stats -> sm_stats, write P (first split_p_col
              columns -> release s_p_o; the rest -> commit p_lastsplit); per tile a last
              sm_stats hand-off with the row sum
- correction: per block and Q stage: wait sm_stats, rescale O when the max moved (run-time
              branch "rescale"), release s_p_o; per tile: wait o_acc, read O, write sO,
              commit o_epi, release o_acc
- epilogue:   per Q stage: wait o_epi, TMA-store sO (waited), release o_epi
"""

from __future__ import annotations

from fa_sm100.config import FmhaConfig
from pipelines import record
from pipelines.named_barriers import NamedBarrier, named_sync
from pipelines.mbarrier import build_pipelines
from pipelines.spec import get_spec


def _p_cols(cfg: FmhaConfig) -> tuple[int, int]:
    """(columns of the first P split, columns of P) in TMEM (16-bit P: 2 values per column)."""
    per_col = 4 // cfg.dtype_bytes
    total = cfg.n_block // per_col
    first = (cfg.split_p_col // per_col) if cfg.split_p else total
    return first, total


def _states(pipe, cfg, producer: bool):
    """One phase-tracking state per Q stage of a per-Q-stage pipeline (fixed on that stage)."""
    make = pipe.make_producer_state if producer else pipe.make_consumer_state
    return [make(s) for s in range(cfg.q_stage)]


def load(cfg, p):
    kv_bytes = {"K": get_spec("kv").tx_bytes(cfg, "K"), "V": get_spec("kv").tx_bytes(cfg, "V")}
    kv = p.kv.make_producer_state()
    q = _states(p.q, cfg, producer=True)

    def load_kv(which):
        p.kv.producer_acquire(kv, expected_tx=kv_bytes[which])
        record.access("sKV", "w", unit="tma", done_by="kv", stage_of="kv", note=which)
        p.kv.producer_commit(kv)
        kv.advance()

    with record.loop("work_tiles"):
        load_kv("K")
        for s in range(cfg.q_stage):
            p.q.producer_acquire(q[s])
            record.access(f"sQ{s}", "w", unit="tma", done_by="q")
            p.q.producer_commit(q[s])
            q[s].advance()
        load_kv("V")
        with record.loop("n_blocks - 1"):
            load_kv("K")
            load_kv("V")


def mma(cfg, p):
    split, total = _p_cols(cfg)
    kv = p.kv.make_consumer_state()
    q = _states(p.q, cfg, producer=False)
    spo = _states(p.s_p_o, cfg, producer=True)
    o_acc = _states(p.o_acc, cfg, producer=True)
    last = _states(p.p_lastsplit, cfg, producer=False) if cfg.split_p else None

    def s_mma(s, kv_back):
        record.access(f"sQ{s}", "r", unit="umma")
        record.access("sKV", "r", unit="umma", stage_of="kv" if kv_back == 0 else f"kv-{kv_back}")
        record.access(f"S{s}", "w", unit="umma")
        p.s_p_o.producer_commit(s)

    def pv_mma(s, v_back):
        v_stage = "kv" if v_back == 0 else f"kv-{v_back}"
        p.s_p_o.producer_acquire(spo[s])
        spo[s].advance()
        record.access(f"P{s}", "r", unit="umma", cols=(0, split))
        record.access("sKV", "r", unit="umma", stage_of=v_stage)
        record.access(f"O{s}", "w", unit="umma")
        if cfg.split_p:
            p.p_lastsplit.consumer_wait(last[s])
            record.access(f"P{s}", "r", unit="umma", cols=(split, total))
            p.p_lastsplit.consumer_release(last[s])
            last[s].advance()

    named_sync(NamedBarrier.TMEM_ALLOC)
    # The non-leader CTA's MMA warp joins the named barrier and issues nothing.
    with record.branch("is_leader_cta"), record.loop("work_tiles"):
        for s in range(cfg.q_stage):
            p.q.consumer_wait(q[s])
        p.kv.consumer_wait(kv)  # K[n-1]
        for s in range(cfg.q_stage):
            s_mma(s, 0)
        p.kv.consumer_release(kv)
        kv.advance()
        for s in range(cfg.q_stage):
            p.o_acc.producer_acquire(o_acc[s])  # the previous tile's O was read out
            o_acc[s].advance()
        with record.loop("n_blocks - 1"):
            p.kv.consumer_wait(kv)  # V[i]
            v = kv.clone()
            kv.advance()
            if cfg.kv_stage == 1:
                # One K/V stage: V[i] must be handed back before K[i-1] can arrive, so both
                # PVs go first (with S_s(i-1) between them the model finds a deadlock).
                for s in range(cfg.q_stage):
                    pv_mma(s, 0)
                p.kv.consumer_release(v)
                p.kv.consumer_wait(kv)  # K[i-1]
                for s in range(cfg.q_stage):
                    s_mma(s, 0)
            else:
                for s in range(cfg.q_stage):
                    pv_mma(s, 0 if s == 0 else 1)
                    if s == cfg.q_stage - 1:
                        p.kv.consumer_release(v)  # the last PV reading V[i] is issued
                    if s == 0:
                        p.kv.consumer_wait(kv)  # K[i-1]
                    s_mma(s, 0)
            p.kv.consumer_release(kv)
            kv.advance()
        for s in range(cfg.q_stage):
            p.q.consumer_release(q[s])
            q[s].advance()
        p.kv.consumer_wait(kv)  # V[0]
        for s in range(cfg.q_stage):
            pv_mma(s, 0)
            p.o_acc.producer_commit(s)
        p.kv.consumer_release(kv)
        kv.advance()


def softmax(cfg, p, s):
    split, total = _p_cols(cfg)
    named_sync(NamedBarrier.TMEM_ALLOC)
    if s >= cfg.q_stage:
        return  # the warpgroup exists but has no Q stage to work on
    spo = p.s_p_o.make_consumer_state(s)
    stats = p.sm_stats.make_producer_state(s)
    last = p.p_lastsplit.make_producer_state(s) if cfg.split_p else None

    def hand_off_stats():
        p.sm_stats.producer_acquire(stats)
        record.access(f"stats{s}", "w")
        p.sm_stats.producer_commit(stats)
        stats.advance()

    def block():
        p.s_p_o.consumer_wait(spo)
        record.access(f"S{s}", "r")
        hand_off_stats()
        record.access(f"P{s}", "w", cols=(0, split))
        p.s_p_o.consumer_release(spo)
        spo.advance()
        if cfg.split_p:
            p.p_lastsplit.producer_acquire(last)
            record.access(f"P{s}", "w", cols=(split, total))
            p.p_lastsplit.producer_commit(last)
            last.advance()

    with record.loop("work_tiles"):
        with record.loop("n_blocks"):
            block()
        hand_off_stats()  # row sum and max of the tile


def correction(cfg, p):
    stats = _states(p.sm_stats, cfg, producer=False)
    o_acc = _states(p.o_acc, cfg, producer=False)
    o_epi = _states(p.o_epi, cfg, producer=True)

    def take_stats(s):
        p.sm_stats.consumer_wait(stats[s])
        record.access(f"stats{s}", "r")
        p.sm_stats.consumer_release(stats[s])
        stats[s].advance()

    named_sync(NamedBarrier.TMEM_ALLOC)
    with record.loop("work_tiles"):
        with record.loop("n_blocks"):
            for s in range(cfg.q_stage):
                take_stats(s)
                with record.branch("rescale"):
                    record.access(f"O{s}", "r")
                    record.access(f"O{s}", "w")
                p.s_p_o.consumer_release(s)
        for s in range(cfg.q_stage):
            take_stats(s)  # row sum
            p.o_acc.consumer_wait(o_acc[s])
            record.access(f"O{s}", "r")
            p.o_epi.producer_acquire(o_epi[s])
            record.access(f"sO{s}", "w")
            p.o_epi.producer_commit(o_epi[s])
            o_epi[s].advance()
            p.o_acc.consumer_release(o_acc[s])
            o_acc[s].advance()


def epilogue(cfg, p):
    o_epi = _states(p.o_epi, cfg, producer=False)
    with record.loop("work_tiles"):
        for s in range(cfg.q_stage):
            p.o_epi.consumer_wait(o_epi[s])
            record.access(f"sO{s}", "r", note="TMA store, waited before the release")
            p.o_epi.consumer_release(o_epi[s])
            o_epi[s].advance()


def design_recording(cfg: FmhaConfig) -> record.Recording:
    """Record every role of the DESIGN.md protocol for ``cfg`` (no DSL, no GPU)."""
    cfg = cfg.validate()
    with record.recording(dry=True) as rec:
        pipes = build_pipelines(cfg, cfg.warp_roles())
        with record.role("load"):
            load(cfg, pipes)
        with record.role("mma"):
            mma(cfg, pipes)
        for s in (0, 1):
            with record.role(f"softmax{s}"):
                softmax(cfg, pipes, s)
        with record.role("correction"):
            correction(cfg, pipes)
        with record.role("epilogue"):
            epilogue(cfg, pipes)
    return rec
