"""What emulated lanes block on (``Wait`` and its kinds) and the asynchronous operations the
machine completes on its schedule (``AsyncOp``): shared by the machine (fa_sm100/ptxemu/
machine.py) and the instruction handlers that create them (ops_sync, ops_tma, ops_tcgen05)."""

from __future__ import annotations

from typing import Callable


class Wait:
    """Something lanes block on. ``ready()`` is polled by the scheduler. ``at`` names the
    instruction when the PC has already moved past it (barriers)."""
    why = "wait"
    at = None

    def ready(self) -> bool:
        raise NotImplementedError


class BarrierWait(Wait):
    def __init__(self, bar, generation: int, at=None):
        self.bar, self.generation, self.at = bar, generation, at

    @property
    def why(self) -> str:
        b = self.bar
        return f"bar.sync {b.bid} ({b.arrived}/{b.expected} threads arrived)"

    def ready(self):
        return self.bar.generation > self.generation


class PredWait(Wait):
    """Wait until ``fn()``; ``why`` is a string or a callable evaluated for reports."""

    def __init__(self, fn: Callable[[], bool], why, at=None):
        self.fn, self._why, self.at = fn, why, at

    @property
    def why(self) -> str:
        return self._why() if callable(self._why) else self._why

    def ready(self):
        return self.fn()


class AsyncOp:
    """An operation the hardware runs asynchronously (TMA copy, tcgen05.mma, commit). The
    scheduler runs ready ones at random points between warp quanta; ``after`` orders an op
    behind earlier ones of the same issuer (tcgen05 ops of one thread complete in order)."""

    def __init__(self, fn, what: str, after=()):
        self.fn, self.what, self.after = fn, what, tuple(after)
        self.done = False
        self.serial = None                     # issue order, numbered by the machine

    def ready(self) -> bool:
        return all(a.done for a in self.after)

    def run(self):
        self.fn()
