"""A tiny sm_100a kernel that exercises our pipeline classes, for PTX-level checks.

``make_probe(cfg, calls)`` returns ``(fn, args)`` for ``fa_sm100.compile_tools.cross_compile``:
a 16-warp CTA (a 2-CTA cluster when ``cfg.use_2cta``) that builds every pipeline of the table
from ``pipelines.mbarrier.build_pipelines`` and then performs only the listed calls, each on the
warps of the role that owns it in the real kernel. Compiling a probe with a single call shows
exactly which PTX that call generates (e.g. ``p_lastsplit.producer_commit`` -> one
``mbarrier.arrive``, no ``expect_tx``).

calls: sequence of (pipeline name, method name, role) with method one of producer_acquire,
producer_commit, consumer_wait, consumer_release; stage 0, phase 0.
"""



from typing import Sequence

from fa_sm100.config import FmhaConfig, WarpRoles
from pipelines.mbarrier import build_pipelines
from pipelines.spec import barrier_count

METHODS = ("producer_acquire", "producer_commit", "consumer_wait", "consumer_release")


def _check_calls(cfg: FmhaConfig, calls):
    from pipelines.spec import active_specs

    names = {s.name for s in active_specs(cfg)}
    roles = WarpRoles().role_warps()
    for pipe, method, role in calls:
        if pipe not in names:
            raise ValueError(f"probe: pipeline {pipe!r} is not built for this config ({sorted(names)})")
        if method not in METHODS:
            raise ValueError(f"probe: method {method!r} not in {METHODS}")
        if role not in roles:
            raise ValueError(f"probe: unknown role {role!r}")


def make_probe(cfg: FmhaConfig, calls: Sequence[tuple[str, str, str]], ring_trips: int = 0):
    """(jit function, fake args) of a probe kernel performing ``calls``.

    ring_trips > 0 adds a run-time loop in which the load warp walks the kv ring with a
    loop-carried ``PipelineState`` (acquire, commit, advance), to compile the state's
    index/phase arithmetic through a dynamic loop.
    """
    cfg = cfg.validate()
    calls = tuple(tuple(c) for c in calls)
    _check_calls(cfg, calls)
    import cutlass
    import cutlass.memory
    import cutlass.cute as cute
    from cutlass.cutlass_dsl import if_generate

    from pipelines.mbarrier import pipeline_init_sync

    n_bar = barrier_count(cfg)
    warps = WarpRoles().role_warps()
    threads = WarpRoles().threads_per_cta
    cluster = list(cfg.cluster_shape)

    @cute.struct
    class Storage:
        mbar: cute.struct.MemRange[cutlass.Int64, n_bar]

    def body(pipes, warp):
        for pipe, method, role in calls:
            p = pipes[pipe]
            lo, hi = warps[role][0], warps[role][-1]

            def run(p=p, method=method):
                if method in ("producer_acquire", "consumer_wait"):
                    getattr(p, method)(0, cutlass.Int32(0))
                else:
                    getattr(p, method)(0)

            if_generate((warp >= lo) & (warp <= hi), run)

    @cute.jit
    def walk_ring(kv):
        st = kv.make_producer_state()
        for _ in cutlass.range(ring_trips, unroll=1):
            kv.producer_acquire(st)
            kv.producer_commit(st)
            st.advance()

    @cute.kernel
    def probe_kernel():
        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(Storage)
        pipes = build_pipelines(cfg, barrier_storage=storage.mbar.data_ptr())
        pipeline_init_sync(cfg)
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        body(pipes, warp)
        if cutlass.const_expr(ring_trips > 0):
            if warp == warps["load"][0]:
                walk_ring(pipes.kv)

    @cute.jit
    def probe_host():
        probe_kernel().launch(grid=[cfg.cta_group, 1, 1], block=[threads, 1, 1], cluster=cluster,
                              smem=Storage.size_in_bytes())

    return probe_host, ()


def signal_instructions(ptx: str) -> list[str]:
    """The PTX instructions that signal an mbarrier (arrives and tcgen05.commit), in order,
    without operands and guard predicates; inits and waits are left out."""
    out = []
    for line in ptx.splitlines():
        tok = line.strip().split()
        if tok and tok[0].startswith("@"):
            tok = tok[1:]
        if tok and (tok[0].startswith("mbarrier.arrive") or tok[0].startswith("tcgen05.commit")):
            out.append(tok[0])
    return out
