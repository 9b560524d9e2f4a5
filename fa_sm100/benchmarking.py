"""The timing method shared by the forward and backward benchmarks (``scripts/benchmark.py``,
``fa_sm100.hopper.bwd_bench``): providers prepared and checked first, a discarded warm-up,
then rounds in a rotated order, each timed with ``triton.testing.do_bench`` (CUDA events when
triton is missing). Nothing here needs a GPU except what the callables do."""

from __future__ import annotations

import time
from typing import Callable, Optional


def error_text(e: Exception) -> str:
    """``Type: first line`` of an exception, at most 120 characters of message."""
    msg = str(e).splitlines()[0][:120] if str(e) else ""
    return f"{type(e).__name__}: {msg}"


def run_cell(prepares: dict, check: Callable, repeat: int, measure: Callable,
             sync: Optional[Callable] = None, on_step: Optional[Callable] = None):
    """Time every provider on one cell: ``repeat`` rounds, provider order rotated each round.

    ``prepares[name]()`` returns ``run``, the no-argument call to time (work done by prepare,
    such as a compile, is not timed). First every provider is prepared and its first output
    checked (``check(out)`` returns None or the reason it is wrong; ``sync`` runs between the
    call and the check), all untimed; then one discarded ``measure`` of the first good
    provider brings the GPU's clocks back up after the compiles (which leave it idle for
    seconds), so the first timed provider is not the one that pays for the ramp. Then the
    rounds; a provider that raises while timed is dropped from the cell.
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
        # Rotate the order each round so no provider always runs first (clocks, caches).
        for name in names[rnd % len(names):] + names[:rnd % len(names)]:
            if on_step is not None:
                on_step(name)
            if name not in runs:  # failed its check, or an earlier round
                continue
            try:
                times[name].append(measure(runs[name]))
            except Exception as e:  # noqa: BLE001
                errors[name] = error_text(e)
                times[name] = []
                del runs[name]
    return times, errors


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
