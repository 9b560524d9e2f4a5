"""Cost probes of the SM90 kernels: what does one piece of the kernel's work cost?

A config switch (``BwdConfig``) changes how the kernel does its work and keeps the results
right; ``scripts/ab_bench.py`` checks every variant's gradients before it times them. A probe
instead takes a piece of the work out, or replaces it with a cheaper one, so the time without
it can be measured: an upper bound on what any change to that piece could win. A probe's
results are wrong by design and nobody checks them.

Note [cost probes]: a probe is active inside ``with probe(name, value):``. The kernel code
reads it while it is traced (``active(name)``, a plain Python value: the probe picks code at
compile time, nothing at run time), and ``bwd_interface.launch_plan`` adds the active probes
to the main kernel's compile key (``compile_tag()``). So a probed kernel is compiled and
cached apart from the plain one: every call of the probed kernel must be made inside the
``with`` block (outside, the same arguments find the plain kernel), and a plain call never
gets a probed kernel. Probes:

- ``dq_reduce`` ("bulk" dQ only: the dq-store warp's bulk operations, bwd_store.py):
  ``none``: neither the bulk reduce nor the first store's copy is issued, so the float32 dQ
  accumulator is never written (the semaphores and barriers run as usual);
  ``half``: each reduce (and first-store copy) moves half of its part's bytes, half of the dQ
  traffic into L2;
  ``copy``: each reduce is a plain bulk copy of the same bytes: the writes without the
  additions at L2.
- ``ds_barrier`` (the MMA loop, bwd_mma.py): ``none``: the 256-thread ``DS_READY``
  barrier, where the two MMA warpgroups meet once per query block before the dQ GEMM reads
  both halves of dS, is left out. They are then still coupled through the Q / dO stages they
  both release and, with "bulk" dQ, through the dq-store warp, which takes the two halves of
  a block's dQ tile in order before it frees the tile for the next block; so they may drift
  apart by about a block. What this measures is the cost of the barrier itself: it bounds
  what decoupling the warpgroups at that point could win, not what removing every coupling
  (each warpgroup's own dQ, its own handoff) would.
- ``pointwise`` (the MMA loop, bwd_mma.py): ``none``: the per-element work between the
  GEMMs is left out: no mask, no P = exp2(S * scale_log2 - LSE2), no dS = P (dP - Delta), and
  so no LSE2 / Delta reads (the load warp still stages them). S and dP are converted to 16 bits
  as they came from the tensor cores and go where P and dS go, so every GEMM, store, barrier
  and handoff stays. What is left is the loop of GEMMs and data movement: T(none) over T(plain)
  says how much of a block's time the math adds on top of them, the most that hiding it (a
  faster exp2, the warpgroups out of step) could win. The data differ (values of S instead of
  P in [0, 1]), and the tensor cores' power, and so the clock, may follow the data (time it at
  the top clock: ``scripts/ab_bench.py --top-clock``). Taking out only one of the two halves
  (P's or dS's math) was tried and is not offered: without dS's math ptxas serialized the S
  and dP WGMMAs, a different kernel rather than the same one with less math.
- ``sweep`` (all three roles' loops, bwd_tiles.py ``sweep_end`` / ``m_block_at``):
  ``twice``: every CTA sweeps its query blocks twice, the second sweep the first again (dK,
  dV and dQ get every block's share twice), between one K/V load and one dK/dV epilogue. With
  T1 the plain time and T2 the probed one, T2 - T1 is what the sweeps cost and 2 T1 - T2 what
  the CTAs cost beyond them: launch, K/V load, pipeline fill and drain, dK/dV epilogue, the
  last wave, and the pre/postprocess where they do not overlap. That bounds what persistent
  CTAs (Note [persistent CTAs] in bwd_tiles.py: the next tile's loads under this one's
  epilogue) could win; with them on (the default up to 2k) the epilogue is still counted.
  Non-causal and not deterministic only: under a causal mask with Q/dO multicast a CTA
  first waits through its cluster's blocks before its own, which the second sweep would not
  repeat; in deterministic mode the second sweep would wait for dQ turns the first has
  already taken, forever.
- ``stats`` (bwd_scores.py ``_query_stat``): ``unshuffled``: with shuffled statistics (wide
  query blocks with ``stats_shuffle``, Note [tile_m 128]: hdim 64's default, hdim 128's
  with ``stats_shuffle=True``) each lane takes the LSE2 / Delta value from its own
  register instead of shuffling the query's value from the lane that holds it: the loop
  without its 40 SHFL per thread per block (hdim 128), all its math kept, the values wrong.
  T(plain) over T(unshuffled) bounds what fetching the statistics another way could win.
  The Nsight Compute profile is why it exists: at hdim 128 16k the MMA warps of ours
  were sampled waiting on the short scoreboard (a shuffle's result, at the FFMA of P) 102k
  times against FA4's 78k, in a loop that is otherwise FA4's instruction for instruction.
- ``dq_post`` (``bwd_interface.launch_plan``): ``none``: the dQ postprocess (float32
  accumulator -> dq) is not launched, so dq is left as it was: what the postprocess adds to
  the call beyond what overlaps the main kernel (Note [dQ postprocess in the tail]). The
  main kernel does not read it, so it is not in the main kernel's compile key.

The forward has one probe, of another kind: the kernel as it was before a correctness fix, to
time the fix in the same run (``scripts/ab_bench.py --mode fwd --probe ...``):

- ``correction_vote`` (fwd_math.py ``rescale_o``): ``skip_zero``: the warp's rescale vote
  does not count rows whose factor is exactly 0, as before the max-jump fix (Note [Correction
  vote] in softmax_math). Wrong when a row max jumps by more than about 149 log2 units between
  two KV tiles; the same results otherwise. Only where the vote exists (a rescale threshold
  above 0).
"""

import contextlib

PROBES = {
    "dq_reduce": {
        "none": "no dQ bulk reduce or first-store copy: the dQ accumulator is not written",
        "half": "each dQ bulk reduce and copy moves half its bytes",
        "copy": "each dQ bulk reduce is a plain bulk copy (the same bytes, no add in L2)",
    },
    "ds_barrier": {
        "none": "the MMA warpgroups do not meet at DS_READY before the dQ GEMM",
    },
    "dq_post": {
        "none": "the dQ postprocess is not launched: dq is not written",
    },
    "pointwise": {
        "none": "no mask, exp2, dS math or LSE2 / Delta reads: P is S, dS is dP, converted",
    },
    "sweep": {
        "twice": "every CTA sweeps its query blocks twice between one K/V load and one epilogue",
    },
    "stats": {
        "unshuffled": "no SHFL of LSE2 / Delta: each lane uses a value it holds (wrong values)",
    },
    "correction_vote": {
        "skip_zero": "forward: the vote before the max-jump fix (factors of 0 not counted)",
    },
}
# read while the main kernel traces
MAIN_KERNEL_PROBES = ("dq_reduce", "ds_barrier", "pointwise", "sweep", "stats")
# read while the forward kernel traces
FWD_KERNEL_PROBES = ("correction_vote",)

_active: dict = {}  # name -> value while a ``probe`` block is open


def check_probe(name: str, value: str) -> None:
    """Raise ValueError unless ``name=value`` is a probe of ``PROBES``."""
    if name not in PROBES:
        raise ValueError(f"unknown probe {name!r}: probes are {sorted(PROBES)}")
    if value not in PROBES[name]:
        raise ValueError(f"probe {name}={value!r}: values are {sorted(PROBES[name])}")


def parse_probe(spec: str):
    """``(name, value)`` from ``name=value`` (the ``--probe`` argument of ab_bench), checked."""
    name, sep, value = spec.partition("=")
    if not sep:
        raise ValueError(f"probe {spec!r}: expected name=value, e.g. dq_reduce=none")
    check_probe(name, value)
    return name, value


def check_probe_config(name: str, value: str, config) -> None:
    """Raise ValueError when probe ``name=value`` has nothing to probe in the backward built
    from ``config`` (a ``BwdConfig``), or cannot run it: ``dq_reduce`` needs "bulk" dQ,
    ``sweep`` a problem without a causal mask, not deterministic."""
    check_probe(name, value)
    if (name in FWD_KERNEL_PROBES) != hasattr(config, "intra_wg_overlap"):
        kernel = "forward" if name in FWD_KERNEL_PROBES else "backward"
        raise ValueError(f"probe {name}={value} probes the {kernel} kernel, not the one this "
                         f"config builds ({type(config).__name__})")
    if name == "correction_vote" and not config.rescale_threshold > 0:
        raise ValueError(f"probe correction_vote={value} probes the rescale vote, but this "
                         f"config rescales O at every KV tile (rescale_threshold=0): nothing "
                         f"to probe")
    if name == "sweep" and config.causal:
        raise ValueError(f"probe sweep={value} repeats non-causal sweeps only: under a causal "
                         f"mask a CTA's first blocks are its cluster's (Note [cost probes])")
    if name == "sweep" and config.deterministic:
        raise ValueError(f"probe sweep={value} cannot run deterministic: the second sweep "
                         f"would wait for dQ turns the first has taken (Note [cost probes])")
    if name == "stats" and not config.shuffled_stats:
        raise ValueError(f"probe stats={value} probes the shuffled LSE2 / Delta of wide query "
                         f"blocks (tile_m > 64 with stats_shuffle), but this config "
                         f"(tile_m={config.tile_m}, stats_shuffle={config.stats_shuffle}) "
                         f"reads them from SMEM: nothing to probe")
    if name == "dq_reduce" and config.dq_accum != "bulk":
        raise ValueError(f"probe dq_reduce={value} probes the bulk dQ reduce, but this "
                         f"config adds dQ with dq_accum={config.dq_accum!r} (the default at "
                         f"hdim {config.head_dim}): nothing to probe")


def parse_probe_set(spec: str) -> tuple:
    """``((name, value), ...)`` from ``name=value[+name=value...]``: probes active together
    (each name once), e.g. ``pointwise=none+dq_reduce=none``; each checked."""
    pairs = tuple(parse_probe(part) for part in spec.split("+"))
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(f"probes {spec!r}: each probe once in a set")
    return pairs


@contextlib.contextmanager
def probes_active(pairs):
    """Make every ``(name, value)`` of ``pairs`` active in this block (``probe`` each)."""
    with contextlib.ExitStack() as stack:
        for name, value in pairs:
            stack.enter_context(probe(name, value))
        yield


@contextlib.contextmanager
def probe(name: str, value: str):
    """Make ``name=value`` active in this block (Note [cost probes]); one value per name at a
    time, restored on exit."""
    check_probe(name, value)
    if name in _active:
        raise ValueError(f"probe {name} is already active ({name}={_active[name]})")
    _active[name] = value
    try:
        yield
    finally:
        del _active[name]


def active(name: str):
    """The active value of probe ``name`` (read while the kernel is traced), or None. Inside
    ``recording_reads`` the name is also recorded."""
    if _reads is not None:
        _reads.add(name)
    return _active.get(name)


_reads = None  # the names ``active`` was asked for, inside ``recording_reads``


@contextlib.contextmanager
def recording_reads():
    """Record the probe names ``active`` is asked for in this block (a set, yielded): which
    probes a kernel's code reads while it is traced, whatever their values. The compile keys
    must carry those (``MAIN_KERNEL_PROBES``, ``FWD_KERNEL_PROBES``; tests/test_probes.py)."""
    global _reads
    outer, _reads = _reads, set()
    try:
        yield _reads
    finally:
        outer_reads, _reads = _reads, outer
        if outer is not None:
            outer.update(outer_reads)


def any_active() -> bool:
    """True while some probe is active (calls then skip their cached plans: the probe may
    change which kernel a call compiles and launches)."""
    return bool(_active)


def compile_tag(names=None) -> tuple:
    """The active probes (of ``names``, default all) as a hashable tag for compile keys; ()
    when none is active."""
    return tuple(sorted((n, v) for n, v in _active.items() if names is None or n in names))
