"""The timing method shared by the forward and backward benchmarks (``scripts/benchmark.py``,
``fa_sm100.hopper.bwd_bench``): providers prepared and checked first, a discarded warm-up,
then rounds in a carry-over balanced order (``round_order``), each timed with
``triton.testing.do_bench`` (CUDA events when triton is missing), and the GPU's SM clock and
power recorded while each round runs (``ClockSampler``). Nothing here needs a GPU except what
the callables do."""

from __future__ import annotations

import math
import shutil
import subprocess
import time
from typing import Callable, NamedTuple, Optional


def error_text(e: Exception) -> str:
    """``Type: first line`` of an exception, at most 120 characters of message."""
    msg = str(e).splitlines()[0][:120] if str(e) else ""
    return f"{type(e).__name__}: {msg}"


MIN_ROUNDS = 6  # the benchmark's default: at least this many rounds per cell, whole cycles


def order_cycle(n: int) -> int:
    """Rounds after which ``round_order`` of ``n`` providers repeats: n when n is even, 2n when
    it is odd (each row is then also run reversed)."""
    return n if n % 2 == 0 else 2 * n


def whole_cycles(rounds: int, n: int) -> int:
    """``rounds`` rounded up to whole cycles of ``round_order`` for ``n`` providers: only
    whole cycles balance the order (the benchmark's default, with ``MIN_ROUNDS``: 6 rounds
    for three providers, 8 for four)."""
    cycle = order_cycle(n)
    return -(-rounds // cycle) * cycle


def round_order(names: list, rnd: int) -> list:
    """The order of round ``rnd`` in ``run_cell`` and ``paired_rounds``: a row of a Williams
    design, a Latin square balanced for carry-over. Over every ``len(names)`` rounds (twice
    that for an odd count, where each row is also run reversed) each provider runs first
    equally often, and each ordered pair of providers runs back to back equally often.

    Why not a rotation: rotated, every provider always runs right after the same one, and
    what that one leaves behind (a GPU that a slow kernel let cool, the L2's contents) falls
    on it in every round, so it cancels in no paired ratio. One rotated grid timed the backward's
    zero fill (``dq_first_store=False``) faster than the default in four cells where, rotated,
    it ran right after a kernel at 0.6x speed in every round; shuffled, beside the same kernel,
    the gap halved, and with no such kernel in the cell it was gone."""
    n = len(names)
    first, lo, hi = [0], 1, n - 1  # 0, 1, n-1, 2, n-2, ...
    while len(first) < n:
        first.append(lo)
        lo += 1
        if len(first) < n:
            first.append(hi)
            hi -= 1
    r = rnd % order_cycle(n)
    row = [(i + r) % n for i in first]
    if r >= n:
        row.reverse()
    return [names[i] for i in row]


def run_cell(prepares: dict, check: Callable, repeat: int, measure: Callable,
             sync: Optional[Callable] = None, on_step: Optional[Callable] = None,
             monitor: Optional[Callable] = None, conditions: Optional[dict] = None):
    """Time every provider on one cell: ``repeat`` rounds, each in the order ``round_order``
    gives.

    ``prepares[name]()`` returns ``run``, the no-argument call to time (work done by prepare,
    such as a compile, is not timed). First every provider is prepared and its first output
    checked (``check(out)`` returns None or the reason it is wrong; ``sync`` runs between the
    call and the check), all untimed; then one discarded ``measure`` of the first good
    provider brings the GPU's clocks back up after the compiles (which leave it idle for
    seconds), so the first timed provider is not the one that pays for the ramp. Then the
    rounds; a provider that raises while timed is dropped from the cell.
    ``monitor()`` (optional) returns a context manager entered around each timed round, whose
    ``result()`` is appended to ``conditions[name]`` (e.g. ``ClockSampler``).
    Returns ({name: [ms, ...]}, {name: error}).
    """
    names = list(prepares)
    times = {name: [] for name in names}
    runs, errors = {}, {}
    for name in names:
        try:
            run = prepares[name]()
            out = run()
            if sync is not None:
                sync()
            wrong = check(out)
            if wrong is not None:
                errors[name] = f"wrong output: {wrong}"
            else:
                runs[name] = run
        except Exception as e:  # noqa: BLE001 - a provider that cannot run a cell says why
            errors[name] = error_text(e)
    for name in list(runs):  # warm-up, discarded: the first provider that measures
        try:
            measure(runs[name])
            break
        except Exception as e:  # noqa: BLE001
            errors[name] = error_text(e)
            del runs[name]
    for rnd in range(repeat):
        for name in round_order(names, rnd):
            if on_step is not None:
                on_step(name)
            if name not in runs:  # failed its check, or an earlier round
                continue
            try:
                if monitor is None:
                    times[name].append(measure(runs[name]))
                else:
                    with monitor() as watch:
                        times[name].append(measure(runs[name]))
                    if conditions is not None:
                        conditions.setdefault(name, []).append(watch.result())
            except Exception as e:  # noqa: BLE001
                errors[name] = error_text(e)
                times[name] = []
                del runs[name]
    return times, errors


class ClockSampler:
    """The GPU's SM clock (MHz) and board power (W) while a measurement runs.

    ``nvidia-smi`` polls them every ``interval_ms`` in a child process between ``__enter__``
    and ``__exit__``; ``result()`` is (median MHz, median W), or None when nvidia-smi is absent
    or gave no sample (measurements shorter than one interval). Why record them: under
    sustained load the lent H200 reaches its power limit and lowers its clock, which would
    make a provider look slower for what ran before it; the record shows whether a grid's
    cells ran at the same clock (docs/hopper_backward.md, "Clocks, power and noise").
    """

    QUERY = "--query-gpu=clocks.sm,power.draw"

    def __init__(self, device_index: int = 0, interval_ms: int = 100, command: str = "nvidia-smi"):
        self.argv = None
        exe = shutil.which(command)
        if exe is not None:
            self.argv = [exe, self.QUERY, "--format=csv,noheader,nounits", f"-i={device_index}",
                         f"-lms={interval_ms}"]
        self._proc = None
        self._samples: list = []

    def __enter__(self):
        if self.argv is not None:
            self._proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc):
        if self._proc is not None:
            self._proc.terminate()
            out, _ = self._proc.communicate()
            self._samples = parse_clock_samples(out)
            self._proc = None
        return False

    def result(self):
        return summarize_conditions(self._samples)


def parse_clock_samples(text: str) -> list:
    """(MHz, W) pairs from ``nvidia-smi --query-gpu=clocks.sm,power.draw`` CSV lines without
    header or units; lines that do not hold two numbers ("[N/A]", a cut-off last line) are
    skipped."""
    samples = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2:
            continue
        try:
            samples.append((float(parts[0]), float(parts[1])))
        except ValueError:
            continue
    return samples


def summarize_conditions(conditions: list):
    """(median MHz, median W) over (MHz, W) pairs, None entries skipped: a provider's rounds
    (each a ``ClockSampler.result()``, None where no sample came) or one sampler's samples;
    None when there is no pair."""
    got = [c for c in conditions if c is not None]
    if not got:
        return None
    return median([mhz for mhz, _ in got]), median([watts for _, watts in got])


def clock_summary(pairs) -> str:
    """One line: median SM clock and power per provider over ``pairs`` of (provider, (MHz, W)
    or None), in first-seen provider order; empty when nothing was sampled."""
    by = {}
    for name, cond in pairs:
        by.setdefault(name, [])
        if cond is not None:
            by[name].append(cond)
    parts = []
    for name, conds in by.items():
        got = summarize_conditions(conds)
        if got is not None:
            parts.append(f"{name} {got[0]:.0f} MHz {got[1]:.0f} W")
    if not parts:
        return ""
    return "SM clock / board power, median over the timed rounds: " + ", ".join(parts)


def cell_seed(head_dim: int, seqlen: int, causal: bool) -> int:
    """The seed of a benchmark cell's random inputs (forward and backward grids alike), so a
    cell that fails its check, or times oddly, can be run again on the same data."""
    return 1000 * head_dim + seqlen + int(causal)


def median(values):
    """The middle value (the upper one of two): what a cell reports from its rounds."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def time_ms(fn, warmup: int, rep: int, torch):
    """Median milliseconds of ``fn``: ``triton.testing.do_bench`` with ``warmup`` / ``rep`` ms,
    or, without triton, CUDA events over at least ``rep`` ms and 5 calls."""
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    except ImportError:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        deadline = time.time() + rep / 1000
        while time.time() < deadline or len(times) < 5:
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return median(times)


def paired_rounds(runs: dict, rounds: int, measure: Callable, on_round: Optional[Callable] = None):
    """Interleaved timing for A/B comparisons (``scripts/ab_bench.py``): every round measures
    each of ``runs`` once (``measure(run)`` returns ms per call), in the order ``round_order``
    gives, so drifts of clock, power and caches fall on every run alike and the ratio of two
    runs within one round is a paired sample. Returns {name: [ms of round 0, ...]}."""
    names = list(runs)
    times = {name: [] for name in names}
    for rnd in range(rounds):
        for name in round_order(names, rnd):
            times[name].append(measure(runs[name]))
        if on_round is not None:
            on_round(rnd)
    return times


def paired_speedup_rounds(times: dict, base: str) -> dict:
    """{name: [base ms / name ms in each round]} over the rounds of ``paired_rounds`` (> 1:
    faster than ``base``)."""
    return {name: [b / m for b, m in zip(times[base], ms)] for name, ms in times.items()}


def paired_speedups(times: dict, base: str) -> dict:
    """{name: (median, lowest, highest)} of ``paired_speedup_rounds``. The median of paired
    ratios is what an A/B reports; the spread says how far one round can be trusted."""
    out = {}
    for name, ratios in paired_speedup_rounds(times, base).items():
        ratios = sorted(ratios)
        out[name] = (median(ratios), ratios[0], ratios[-1])
    return out


def paired_ratios(times: dict, ours: str, peers) -> list:
    """Ours over the best peer in each round of ``run_cell`` (or ``paired_rounds``): (the
    fastest peer's ms in that round) / (ours' ms in that round), for the rounds where some peer
    has a time (``run_cell`` empties a failed provider's list)."""
    ratios = []
    for r, mine in enumerate(times.get(ours, [])):
        peer_ms = [times[p][r] for p in peers if len(times.get(p, [])) > r]
        if peer_ms:
            ratios.append(min(peer_ms) / mine)
    return ratios


def paired_ratio(times: dict, ours: str, peers) -> Optional[float]:
    """Ours over the best peer, paired by round: the median of ``paired_ratios``. A drift
    shared by a round cancels in it, unlike in the ratio of per-provider medians. None when no
    round has both."""
    ratios = paired_ratios(times, ours, peers)
    return median(ratios) if ratios else None


CONFIDENCE = 0.95  # of the intervals the benchmarks report (median_interval)


def median_interval(values, confidence: float = CONFIDENCE) -> Optional[tuple]:
    """A distribution-free confidence interval for the median of what ``values`` sample:
    (x_(k), x_(n+1-k)) of the sorted values, with the largest k whose coverage
    1 - 2 P(B <= k - 1), B ~ Binomial(n, 1/2), is at least ``confidence`` (each value falls
    below the true median with probability 1/2, whatever the continuous distribution, when
    the rounds are independent; with ties the coverage is only higher). None when even
    (min, max) covers less: fewer than 6 values at 95%. The rounds of one run share that run's
    conditions, so the interval says how far the run's rounds agree, not where another run
    will land.

    Why: a cell of the grid is a handful of rounds and its rounds spread by about 1%
    (CHANGELOG.md), so "ours over the best peer is 1.004x" says nothing
    about the sign unless the interval says whether 1.00 is inside it."""
    ordered = sorted(values)
    n = len(ordered)
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    best, below = None, 0.0  # below: P(B <= k - 1)
    for k in range(1, n // 2 + 1):
        below += math.comb(n, k - 1) / 2.0 ** n
        if 1.0 - 2.0 * below < confidence:
            break
        best = k
    if best is None:
        return None
    return ordered[best - 1], ordered[n - best]


def paired_interval(times: dict, ours: str, peers,
                    confidence: float = CONFIDENCE) -> Optional[tuple]:
    """``median_interval`` of ``paired_ratios``: where the paired ratio's true median lies."""
    return median_interval(paired_ratios(times, ours, peers), confidence)


def interval_verdict(interval) -> str:
    """Where a ratio's interval puts ours against the peer: "above" (the whole interval is
    above 1), "below" (the whole interval is below 1), "parity" (1 is inside it: the rounds
    cannot tell which is faster) or "too few rounds" (no interval)."""
    if interval is None:
        return "too few rounds"
    lo, hi = interval
    if lo > 1.0:
        return "above"
    if hi < 1.0:
        return "below"
    return "parity"


def verdict_summary(intervals) -> str:
    """One line counting ``interval_verdict`` over a grid's paired intervals (None for a cell
    without one), e.g. "paired 95% intervals: 24 cells above 1.00, 6 at parity"."""
    counts = {}
    for interval in intervals:
        v = interval_verdict(interval)
        counts[v] = counts.get(v, 0) + 1
    words = {"above": "above 1.00", "parity": "at parity (1.00 inside)", "below": "below 1.00",
             "too few rounds": "with too few rounds for an interval"}
    parts = [f"{counts[v]} cell{'s' if counts[v] != 1 else ''} {words[v]}"
             for v in words if v in counts]
    return f"paired {CONFIDENCE:.0%} intervals: " + (", ".join(parts) if parts else "no cells")


def format_interval(interval) -> str:
    """``[lo, hi]`` with three decimals, or ``[n/a]``."""
    return "[n/a]" if interval is None else f"[{interval[0]:.3f}, {interval[1]:.3f}]"


def calls_per_round(ms_per_call: float, round_ms: float, minimum: int = 3) -> int:
    """Back-to-back calls one measurement makes so that it lasts about ``round_ms``."""
    if ms_per_call <= 0:
        return minimum
    return max(minimum, int(round_ms / ms_per_call))


def events_ms(fn, calls: int, torch) -> float:
    """Milliseconds per call of ``calls`` back-to-back calls of ``fn``, between two CUDA
    events (launch overhead included, as a training step sees it)."""
    return host_and_gpu_ms(fn, calls, torch)[1]


def host_and_gpu_ms(fn, calls: int, torch):
    """(host ms, GPU ms) per call of ``calls`` back-to-back calls: the time the host takes to
    issue them (before waiting for the GPU) and the CUDA-event time. When the two are close,
    back-to-back calls measure the host's launch path, not the kernels."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    host = (time.perf_counter() - t0) * 1000 / calls
    end.synchronize()
    return host, start.elapsed_time(end) / calls


# Note [top-clock timing]: back to back, the backward's long cells run the lent H200 at
# 520-620 W and below its top clock (medians of 1830-1965 MHz against 1980 in the grids), as
# the power manager sets it, and one run's rounds drift with it: an interval from one run did
# not cover the next (CHANGELOG.md). ``duty_cycled_ms`` follows every call
# with a GPU sleep at least as long as the call, so the board stays far below its limit and
# the clock at its top (1980 MHz throughout the runs): the time is then the work's
# own. An A/A pair measured 1.000x [0.999, 1.001] that way at hdim 128 16k, where back-to-back
# A/A runs have read 0.983x-1.007x. What it leaves out is the energy: a kernel that is faster
# at the top clock but spends more joules may lose that lead at the power limit, so a switch
# is kept on back-to-back timing (or the grid), with the top-clock ratio beside it.
SLEEP_CYCLES_PER_MS = 2.0e6  # GPU sleep cycles per ms of call: >= the top SM clock (1980 MHz)


def duty_cycled_calls(fn, calls: int, sleep_ms: float, torch) -> list:
    """Milliseconds of each of ``calls`` calls of ``fn``, each between its own two CUDA events
    and followed by a GPU sleep (``torch.cuda._sleep``) of at least ``sleep_ms`` (Note
    [top-clock timing]); ``fn`` None: the sleeps alone, and an empty list."""
    cycles = int(sleep_ms * SLEEP_CYCLES_PER_MS)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(calls)]
    torch.cuda.synchronize()
    for start, end in events:
        if fn is not None:
            start.record()
            fn()
            end.record()
        torch.cuda._sleep(cycles)
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events] if fn is not None else []


def duty_cycled_ms(fn, calls: int, sleep_ms: float, torch) -> float:
    """The median of ``duty_cycled_calls``: what ``scripts/ab_bench.py --top-clock`` times."""
    return median(duty_cycled_calls(fn, calls, sleep_ms, torch))


class NvmlDevice:
    """One GPU's energy counter and SM clock through NVML (``libnvidia-ml.so.1`` by ctypes:
    no Python package needed), for the measurement scripts of docs/data. Raises OSError where
    the library is missing."""

    SM_CLOCK = 1  # NVML_CLOCK_SM

    def __init__(self, index: int = 0):
        import ctypes

        self._ctypes = ctypes
        self._lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._check(self._lib.nvmlInit_v2(), "nvmlInit_v2")
        self._handle = ctypes.c_void_p()
        self._check(self._lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self._handle)),
                    "nvmlDeviceGetHandleByIndex_v2")

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise OSError(f"NVML {what} returned {status}")

    def energy_mj(self) -> int:
        """Millijoules the board has used since the driver loaded."""
        value = self._ctypes.c_ulonglong()
        self._check(self._lib.nvmlDeviceGetTotalEnergyConsumption(
            self._handle, self._ctypes.byref(value)), "nvmlDeviceGetTotalEnergyConsumption")
        return value.value

    def sm_mhz(self) -> int:
        """The SM clock now."""
        value = self._ctypes.c_uint()
        self._check(self._lib.nvmlDeviceGetClockInfo(self._handle, self.SM_CLOCK,
                                                     self._ctypes.byref(value)),
                    "nvmlDeviceGetClockInfo")
        return value.value


def duty_cycled_rounds(runs: dict, rounds: int, calls: int, torch, nvml: NvmlDevice,
                       on_round: Optional[Callable] = None) -> dict:
    """``paired_rounds`` of ``duty_cycled_energy``, the sleeps as long as one call of
    ``runs["default"]``: {name: [(joules per call, median ms, MHz) per round]}, the joules less
    those of the same sleeps alone, measured once per round (``on_round(rnd, joules per
    sleep)`` after each)."""
    sleep_ms = events_ms(runs["default"], 1, torch)
    res = {name: [] for name in runs}
    for rnd in range(rounds):
        sleeps = duty_cycled_energy(None, calls, sleep_ms, torch, nvml)[0]
        for name in round_order(list(runs), rnd):
            joules, ms, mhz = duty_cycled_energy(runs[name], calls, sleep_ms, torch, nvml)
            res[name].append(((joules - sleeps) / calls, ms, mhz))
        if on_round is not None:
            on_round(rnd, sleeps / calls)
    return res


def duty_cycled_energy(fn, calls: int, sleep_ms: float, torch, nvml: NvmlDevice):
    """(joules, median ms per call, SM MHz after) of ``duty_cycled_calls``: the board's energy
    over the whole sequence, sleeps included (``fn`` None: the sleeps alone, 0.0 ms)."""
    torch.cuda.synchronize()
    start_mj = nvml.energy_mj()
    ms = duty_cycled_calls(fn, calls, sleep_ms, torch)
    joules = (nvml.energy_mj() - start_mj) / 1000.0
    return joules, (median(ms) if ms else 0.0), nvml.sm_mhz()


def launch_bound(host_ms: float, gpu_ms: float, margin: float = 0.9) -> bool:
    """Whether back-to-back timing of a call is limited by the host: issuing a call takes at
    least ``margin`` of its GPU time, so the GPU waits for work between calls."""
    return host_ms >= margin * gpu_ms


GRID_TOKENS = 16384  # the benchmark grid's cells: batch x seqlen
GRID_HIDDEN = 2048  # heads x head dim


def cell_config(mode, d, s, causal, fields, heads=None, tokens=GRID_TOKENS, hidden=GRID_HIDDEN,
                dtype="bfloat16", problem=None):
    """The config ours runs in a benchmark cell ("fwd": ``Sm90FwdConfig``, "bwd":
    ``BwdConfig``) with the overrides ``fields`` (validated: bad fields raise ValueError).
    Forward only: ``heads``, the cell's query heads (default hidden / head dim), and with
    ``tokens`` the (batch, head) pairs, which decide whether an odd number of m blocks still
    multicasts (Note [Odd m blocks]); the backward's config does not depend on them. Backward
    only: ``problem``, the cell's ``window_left`` / ``window_right`` / ``deterministic``
    (``scripts/ab_bench.py --window / --deterministic``), from which the defaults are chosen
    as ``sm90_bwd`` chooses them."""
    if mode == "bwd":
        from fa_sm100.hopper.bwd_defaults import select_bwd_config

        return select_bwd_config(head_dim=d, dtype=dtype, causal=causal, seqlen_q=s,
                                 seqlen_k=s, **(problem or {}), **fields)
    if problem:
        raise ValueError(f"the forward's cells have no {sorted(problem)}")
    from fa_sm100.hopper.config import select_sm90_fwd_config

    fields = {"write_lse": False, **fields}  # as the benchmark: nobody reads the LSE
    batch_heads = tokens // s * (heads or hidden // d)
    return select_sm90_fwd_config(d, None, dtype, causal, seqlen_k=s, seqlen_q=s,
                                  batch_heads=batch_heads, **fields)


def same_kernel_variants(mode, d, s, causal, variants, heads=None, tokens=GRID_TOKENS,
                         hidden=GRID_HIDDEN, dtype="bfloat16", skip_invalid=False, problem=None):
    """{name: the fields it sets} of the ``variants`` ((name, fields) pairs) whose config
    builds the same kernels as the default's in this cell (equal ``effective()`` configs):
    their ratio over the default measures noise, an A/A check, not the switch. A variant
    whose config cannot be built here raises ValueError (TypeError for a field that names
    the problem), or with ``skip_invalid`` is left out; the default's always raises."""
    cell = lambda fields: cell_config(mode, d, s, causal, fields, heads, tokens, hidden,
                                      dtype, problem).effective()
    base = cell({})
    same = {}
    for name, fields in variants:
        try:
            if cell(fields) == base:
                same[name] = sorted(fields)
        except (ValueError, TypeError):
            if not skip_invalid:
                raise
    return same


def plot_grid(rows, providers, path: str, title: str):
    """TFLOP/s over seqlen (log 2), one panel per (head dim, causality), one line per provider,
    from ``rows`` of {"provider", "hdim", "causal", "seqlen", "tflops"} (the forward's rows;
    the backward's through ``bwd_bench.long_rows``). Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["hdim"], r["causal"]) for r in rows})
    cols = 2
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6 * cols, 4 * nrows), squeeze=False)
    for ax, (d, c) in zip(axes.flat, panels):
        for p in providers:
            pts = sorted((r["seqlen"], r["tflops"]) for r in rows
                         if r["provider"] == p and r["hdim"] == d and r["causal"] == c and r["tflops"])
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p)
        ax.set_xscale("log", base=2)
        ax.set_title(f"hdim {d}, {'causal' if c else 'non-causal'}")
        ax.set_xlabel("seqlen")
        ax.set_ylabel("TFLOP/s")
        ax.grid(alpha=0.3)
        ax.legend()
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)



class RatioPoint(NamedTuple):
    """Ours over the best peer in one cell of a grid: the paired ratio and its interval;
    ``cell``, the cell's label where the grid names its cells (``--grid models``)."""
    hdim: int
    causal: bool
    seqlen: int
    ratio: float
    interval: Optional[tuple]
    cell: Optional[str] = None


def ratio_points(rows) -> list:
    """The ``RatioPoint`` of every cell of a grid's rows that has a paired ratio: the
    forward's rows (one per provider; ``provider`` "ours", keys ``hdim`` / ``ratio_paired``)
    or the backward's (one per cell; ``head_dim``). The interval is ``ratio_paired_ci``, None
    where a row has none (older grids); ``cell`` the row's ``cell``, where it has one. Sorted
    by head dim, causality and seqlen; a grid of named cells keeps its own order."""
    points = []
    for r in rows:
        if r.get("provider", "ours") != "ours" or not r.get("ratio_paired"):
            continue
        interval = r.get("ratio_paired_ci")
        points.append(RatioPoint(r.get("hdim", r.get("head_dim")), bool(r["causal"]),
                                 r["seqlen"], r["ratio_paired"],
                                 tuple(interval) if interval else None, r.get("cell")))
    if any(p.cell for p in points):
        return points
    return sorted(points, key=lambda p: (p.hdim, p.causal, p.seqlen))


def plot_ratio_intervals(runs: dict, path: str, title: str):
    """Ours over the best peer, paired, with each cell's 95% interval as an error bar, over
    seqlen (log 2): one panel per head dim, one colour per causality, one marker per run
    (``runs``: {label: [RatioPoint, ...]}, several runs side by side so that run-to-run shifts
    show next to the intervals of single runs), and the line at 1.00. Grids that name their
    cells (``RatioPoint.cell``, ``--grid models``) get one panel, one slot per cell in the
    order first seen. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = list(dict.fromkeys(p.cell for pts in runs.values() for p in pts if p.cell))
    hdims = [None] if cells else sorted({p.hdim for pts in runs.values() for p in pts})
    if not hdims:
        raise ValueError("no cell with a paired ratio to plot")
    width = max(7.0, 1.2 * len(cells)) if cells else 5.5 * len(hdims)
    fig, axes = plt.subplots(1, len(hdims), figsize=(width, 4.5), squeeze=False)
    markers = "osD^vP*X"
    for ax, d in zip(axes.flat, hdims):
        ax.axhline(1.0, color="black", linewidth=0.8)
        slots = 2 * len(runs)
        for i, (label, pts) in enumerate(runs.items()):
            if cells:  # the runs side by side within a cell's slot
                shift = 0.6 * ((i + 0.5) / len(runs) - 0.5)
                _ratio_bars(ax, [cells.index(p.cell) + shift for p in pts], pts,
                            fmt=markers[i % len(markers)], label=label)
                continue
            for causal, color in ((False, "tab:blue"), (True, "tab:red")):
                sel = [p for p in pts if p.hdim == d and p.causal == causal]
                if not sel:
                    continue
                # runs and causalities side by side within a cell: a small factor along the
                # log axis
                shift = 2 ** (0.05 * (2 * i + causal - (slots - 1) / 2))
                _ratio_bars(ax, [p.seqlen * shift for p in sel], sel,
                            fmt=markers[i % len(markers)], color=color,
                            label=f"{'causal' if causal else 'non-causal'}, {label}")
        if cells:
            ax.set_xticks(range(len(cells)), cells, rotation=30, ha="right", fontsize=8)
        else:
            ax.set_xscale("log", base=2)
            ax.set_title(f"hdim {d}")
            ax.set_xlabel("seqlen")
        ax.set_ylabel("ours / best peer (paired, 95% interval)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _ratio_bars(ax, xs, points, **style):
    """``points`` (``RatioPoint``s) at ``xs``: each ratio with its interval as an error bar
    (none where it has no interval)."""
    lo = [p.ratio - p.interval[0] if p.interval else 0.0 for p in points]
    hi = [p.interval[1] - p.ratio if p.interval else 0.0 for p in points]
    ax.errorbar(xs, [p.ratio for p in points], yerr=[lo, hi], capsize=3, markersize=5, **style)


def plot_mode_bars(rows, providers, path: str, title: str, label, panel_title,
                   ylabel="TFLOP/s"):
    """One panel per mode ("fwd", then "bwd") of ``rows`` (dicts with "mode" and a "tflops"
    dict per provider), one group of bars per row, one bar per provider of ``providers`` that
    has a number: the feature benchmarks' figure (``scripts/window_bench.py``,
    ``scripts/softcap_bench.py``). ``label(row)`` names a group, ``panel_title(mode, rows)`` a
    panel. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({r["mode"] for r in rows}, key=["fwd", "bwd"].index)
    wide = max(7.0, 1.1 * max(sum(r["mode"] == m for r in rows) for m in modes))
    fig, axes = plt.subplots(1, len(modes), figsize=(wide * len(modes), 4.5), squeeze=False)
    for ax, mode in zip(axes.flat, modes):
        cells = [r for r in rows if r["mode"] == mode]
        names = [n for n in providers if any(n in r["tflops"] for r in cells)]
        width = 0.8 / max(len(names), 1)
        for j, name in enumerate(names):
            ax.bar([i + j * width for i in range(len(cells))],
                   [r["tflops"].get(name, 0.0) for r in cells], width, label=name)
        ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(cells))],
                      [label(r) for r in cells])
        ax.set_ylabel(ylabel)
        ax.set_title(panel_title(mode, cells))
        ax.grid(axis="y", alpha=0.3)
        ax.legend(loc="lower left", fontsize="small", framealpha=0.9)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save_results(path: str, script: str, argv, device: str, rows) -> None:
    """A feature benchmark's JSON: the command that made it, the device, the rows."""
    import json

    with open(path, "w") as f:
        json.dump({"command": f"python {script} " + " ".join(argv), "device": device,
                   "rows": rows}, f, indent=1)


def fill_ratio_row(row: dict, times: dict, tflops_of_ms) -> dict:
    """A feature benchmark's row from ``run_cell``'s times: each provider's median ms and its
    TFLOP/s (``tflops_of_ms``), and ours (and ``ours:launch``) over FA4 paired by round, with
    the interval; None where FA4 has no times."""
    for name, ms in times.items():
        if ms:
            med = sorted(ms)[len(ms) // 2]
            row["ms"][name] = med
            row["tflops"][name] = tflops_of_ms(med)
    peers = ["fa4"] if "fa4" in times else []
    row["ratio"] = paired_ratio(times, "ours", peers) if peers else None
    row["interval"] = paired_interval(times, "ours", peers) if peers else None
    row["ratio_launch"] = paired_ratio(times, "ours:launch", peers) if peers else None
    return row


def add_feature_bench_args(p) -> None:
    """The flags every feature benchmark takes: --no-fa4, --repeat, --warmup, --rep, --json,
    --png."""
    p.add_argument("--no-fa4", action="store_true")
    p.add_argument("--repeat", type=int, default=MIN_ROUNDS, help="interleaved rounds per cell")
    p.add_argument("--warmup", type=int, default=25, help="ms of warmup per measurement")
    p.add_argument("--rep", type=int, default=100, help="ms of timed calls per measurement")
    p.add_argument("--json")
    p.add_argument("--png")


def feature_bench_main(name: str, args, argv, run, plot) -> int:
    """A feature benchmark's command: ``run(args)`` its rows on the GPU, the JSON
    (``--json``) and the figure (``--png``); exit 1 when ours failed a cell, 2 without a GPU."""
    import sys

    import torch

    if not torch.cuda.is_available():
        print(f"{name}: needs a CUDA GPU (SM90)", file=sys.stderr)
        return 2
    rows = run(args)
    device = torch.cuda.get_device_name()
    if args.json:
        save_results(args.json, f"scripts/{name}.py", sys.argv[1:] if argv is None else argv,
                     device, rows)
    if args.png:
        plot(rows, args.png, device)
    return 1 if any("ours" in r["errors"] for r in rows) else 0


def optional_fa4(bench: str, name: str):
    """FA4's public function ``name`` (``flash_attn.cute.interface``), or None after saying on
    stderr why it is missing: the peer is optional, the benchmark then times ours alone."""
    import sys

    try:
        from flash_attn.cute import interface
        return getattr(interface, name)
    except Exception as e:  # noqa: BLE001 - any failure to import the peer is reported
        print(f"{bench}: FA4 unavailable ({error_text(e)}); timing ours alone", file=sys.stderr)
        return None
