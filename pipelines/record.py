"""Record mode: the pipeline objects log each protocol operation while the kernel is traced.

The protocol model (``pipelines.model``) checks programs of these events, so the protocol it
checks is the one the kernel's code performs: change the kernel's protocol and the recorded
program changes with it.

While a kernel is traced, every role's code runs once in Python. Within ``recording()``:

- ``role(name)``          a context manager around one warp role's code;
- pipeline methods        call ``emit(op, pipeline)`` (acquire, commit, wait, release, ...);
- ``access(...)``         declares a read or write of a named TMEM region or SMEM buffer,
                          by the threads themselves or by an asynchronous unit (UMMA, TMA)
                          whose completion is signalled through a pipeline;
- ``part(name, warps)``   inside a role, the code only some of its warps run (a run-time
                          branch on the warp index: the backward's compute warpgroup h); the
                          part is an actor of its own (``warps`` warps) whose program starts
                          with what the role recorded before it;
- ``loop(trips)``         marks a run-time loop (``trips`` is a symbol such as "n_blocks - 1"
                          or "work_tiles" that the model binds to concrete trip counts);
- ``branch(cond)``        marks a run-time branch whose condition the model explores both ways
                          (``is_leader_cta`` is bound per CTA instead);
- ``new_state`` / ``advance_state`` / ``clone_state``  log a ``PipelineState``'s creation,
                          advances and copies (called by ``pipelines.mbarrier``), so the model
                          knows the parity of every wait that uses the state.

Compile-time loops and ``const_expr`` branches are unrolled or resolved by tracing itself and
need no marks. Outside ``recording()`` every call here is a no-op that costs nothing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional, Union

from fa_sm100.config import WARP_SIZE
from pipelines.spec import ARRIVE_KINDS


@dataclass(frozen=True)
class Event:
    """One protocol operation of a role, in program order.

    op: "acquire" | "commit" | "wait" | "release" (pipeline ops), "access", "named_sync",
        "part" (first event of a part's program: ``note`` the role, ``threads`` its threads)
    pipeline: pipeline name for pipeline ops; the named barrier for "named_sync"
    stage_hint: optional compile-time stage (e.g. the Q stage of an s_p_o operation)
    region / mode / unit / done_by: for "access" (mode "r" or "w"; unit "threads", "umma"
    or "tma"; done_by names the pipeline whose commit signals the asynchronous access done)
    arrive / dst / tx: for pipeline ops that arrive on an mbarrier, how they arrive:
        arrive "thread" (every thread of the role), "warp" (one elected thread per warp),
        "umma" (tcgen05.commit: one arrival once the prior UMMAs completed),
        "expect_tx" (one arrival that also expects ``tx`` transaction bytes);
        dst "local" (own CTA), "leader" (the leader CTA of the pair), "pair" (multicast to
        both CTAs of the pair; same as "local" without 2-CTA)
    stage_of: for "access", the stage index of the buffer is the stage of the role's latest
        operation on this pipeline (e.g. sKV with stage_of="kv")
    cols: for "access", a column sub-range (start, stop) inside a TMEM region
    phase: for "acquire"/"wait", the parity passed to the wait when it is a compile-time
        Python int (None for a run-time value); "state_new": the state's initial phase
    state: the id of the ``PipelineState`` an operation used ("state_new", "state_advance"
        and "state_clone" track that state's (index, phase) through the program)
    threads: for "named_sync", the thread count the ``bar.sync`` declares
    """

    op: str
    pipeline: Optional[str] = None
    stage_hint: Optional[int] = None
    region: Optional[str] = None
    mode: Optional[str] = None
    unit: Optional[str] = None
    done_by: Optional[str] = None
    note: str = ""
    arrive: Optional[str] = None
    dst: Optional[str] = None
    tx: int = 0
    stage_of: Optional[str] = None
    cols: Optional[tuple] = None
    phase: Optional[int] = None
    state: Optional[int] = None
    threads: int = 0
    stages: int = 0  # "state_new": the state's ring size (1 for a fixed-stage state)
    src: Optional[int] = None  # "state_clone": the id of the state it copies
    # "access" under 2-CTA: the pair rank of the CTA whose SMEM buffer is accessed (None: the
    # actor's own), and how far ``cols`` move per pair rank of the accessing actor (a CTA's
    # keys in a buffer over the pair's keys: the backward's sdS)
    cta: Optional[int] = None
    cols_per_cta: int = 0


@dataclass
class Loop:
    trips: str
    body: list = field(default_factory=list)


@dataclass
class Branch:
    cond: str
    then: list = field(default_factory=list)
    orelse: list = field(default_factory=list)


Node = Union[Event, Loop, Branch]


@dataclass
class Recording:
    """Role name -> program (a list of Event / Loop / Branch nodes). A role split into parts
    (``part``) is replaced by its parts once its block ends."""

    programs: dict = field(default_factory=dict)
    parts: dict = field(default_factory=dict)  # role -> its parts, in order
    forks: dict = field(default_factory=dict)  # role -> length of its program at its first part


class _Recorder:
    def __init__(self):
        self.dry = False
        self.active: Optional[Recording] = None
        self._stack: list[list] = []
        self._role: Optional[str] = None
        self._next_state = 0

    def _append(self, node):
        if self.active is None or self._role is None:
            return
        self._stack[-1].append(node)


_REC = _Recorder()


@contextlib.contextmanager
def recording(dry: bool = False):
    """Record every role's protocol while the kernel is traced inside this block.

    ``dry=True`` records without tracing: the pipeline classes then only log their operations
    and issue no DSL code (used to run protocol programs written in plain Python).
    """
    prev = (_REC.active, _REC._stack, _REC._role, _REC.dry)
    _REC.active, _REC._stack, _REC._role, _REC.dry = Recording(), [], None, dry
    _REC._next_state = 0
    try:
        yield _REC.active
    finally:
        _REC.active, _REC._stack, _REC._role, _REC.dry = prev


def is_recording() -> bool:
    return _REC.active is not None


def is_dry() -> bool:
    """True inside ``recording(dry=True)``: log operations, emit no DSL code."""
    return _REC.dry


@contextlib.contextmanager
def _recording_into(name: str, body: list):
    """Operations traced inside this block are recorded into ``body``, as actor ``name``."""
    saved = (_REC._role, _REC._stack)
    _REC._role, _REC._stack = name, [body]
    try:
        yield
    finally:
        _REC._role, _REC._stack = saved


@contextlib.contextmanager
def role(name: str):
    if _REC.active is None:
        yield
        return
    rec = _REC.active
    try:
        with _recording_into(name, rec.programs.setdefault(name, [])):
            yield
    finally:
        if name in rec.parts and name in rec.programs:
            rest = rec.programs.pop(name)[rec.forks[name]:]
            for p in rec.parts[name]:
                rec.programs[p].extend(rest)


ARRIVE_DSTS = ("local", "leader", "pair")


def compile_time_int(value) -> Optional[int]:
    """``value`` when it is a Python int known while tracing (a compile-time stage or phase),
    else None (a run-time DSL value, whose value the recording cannot see)."""
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def emit(op: str, pipeline: Optional[str] = None, stage_hint: Optional[int] = None, note: str = "",
         arrive: Optional[str] = None, dst: Optional[str] = None, tx: int = 0,
         phase=None, state: Optional[int] = None, threads: int = 0):
    """Log one operation. ``phase`` is kept only when it is a compile-time int; ``state`` is
    the id of the ``PipelineState`` the operation used (from ``new_state``)."""
    if arrive is not None and arrive not in ARRIVE_KINDS:
        raise ValueError(f"arrive must be one of {ARRIVE_KINDS}, got {arrive!r}")
    if dst is not None and dst not in ARRIVE_DSTS:
        raise ValueError(f"dst must be one of {ARRIVE_DSTS}, got {dst!r}")
    _REC._append(Event(op, pipeline=pipeline, stage_hint=stage_hint, note=note, arrive=arrive,
                       dst=dst, tx=tx, phase=compile_time_int(phase), state=state, threads=threads))


def new_state(pipeline: str, stages: int, index, phase) -> Optional[int]:
    """Log the creation of a ``PipelineState`` of ``pipeline`` (``stages`` 1 for a state fixed
    on one stage); returns its id, or None outside a role being recorded. The initial index and
    phase are kept when they are compile-time ints."""
    if _REC.active is None or _REC._role is None:
        return None
    _REC._next_state += 1
    sid = _REC._next_state
    _REC._append(Event("state_new", pipeline=pipeline, stage_hint=compile_time_int(index),
                       phase=compile_time_int(phase), state=sid, stages=stages))
    return sid


def advance_state(sid: Optional[int]) -> None:
    """Log ``PipelineState.advance()`` of the state ``sid``."""
    if sid is not None:
        _REC._append(Event("state_advance", state=sid))


def clone_state(sid: Optional[int]) -> Optional[int]:
    """Log ``PipelineState.clone()``: a new state id starting from ``sid``'s current value."""
    if sid is None or _REC.active is None or _REC._role is None:
        return None
    _REC._next_state += 1
    _REC._append(Event("state_clone", state=_REC._next_state, src=sid))
    return _REC._next_state


def access(region: str, mode: str, unit: str = "threads", done_by: Optional[str] = None,
           note: str = "", stage_of: Optional[str] = None, cols: Optional[tuple] = None,
           tx: int = 0, cta: Optional[int] = None, cols_per_cta: int = 0):
    """``cta`` / ``cols_per_cta``: a thread access to the SMEM of the pair's CTA ``cta`` at
    ``cols`` moved by ``cols_per_cta`` times the accessing CTA's pair rank (``Event``)."""
    if mode not in ("r", "w"):
        raise ValueError(f"access mode must be 'r' or 'w', got {mode!r}")
    if unit not in ("threads", "umma", "tma"):
        raise ValueError(f"access unit must be 'threads', 'umma' or 'tma', got {unit!r}")
    if unit == "tma" and done_by is None:
        raise ValueError("a TMA access needs done_by: the pipeline whose barrier its bytes complete")
    if (cta is not None or cols_per_cta) and unit != "threads":
        raise ValueError("only a thread access names another CTA's buffer (cta, cols_per_cta)")
    _REC._append(Event("access", region=region, mode=mode, unit=unit, done_by=done_by, note=note,
                       stage_of=stage_of, cols=tuple(cols) if cols is not None else None, tx=tx,
                       cta=cta, cols_per_cta=cols_per_cta))


@contextlib.contextmanager
def part(name: str, warps: int):
    """The code of this block is run by ``warps`` of the current role's warps only, as the
    actor ``name``: its program is a ``part`` event, then everything the role recorded before
    (at its top level), then this block. The role itself is replaced by its parts (events the
    role records after a part are appended to every part). Only at a role's top level."""
    rec = _REC.active
    if rec is None or _REC._role is None:
        yield
        return
    parent = _REC._role
    if len(_REC._stack) != 1:
        raise ValueError(f"record.part({name!r}) inside a loop or branch of role {parent!r}: a "
                         "part starts at the role's top level")
    if name in rec.programs:
        raise ValueError(f"record.part({name!r}): a role or part of that name was recorded already")
    prefix = rec.forks.setdefault(parent, len(rec.programs[parent]))
    body = [Event("part", note=parent, threads=warps * WARP_SIZE)] + list(rec.programs[parent][:prefix])
    rec.programs[name] = body
    rec.parts.setdefault(parent, []).append(name)
    with _recording_into(name, body):
        yield


@contextlib.contextmanager
def loop(trips: str):
    if _REC.active is None or _REC._role is None:
        yield
        return
    node = Loop(trips)
    _REC._append(node)
    _REC._stack.append(node.body)
    try:
        yield
    finally:
        _REC._stack.pop()


class _BranchCtx:
    def __init__(self, node: Optional[Branch]):
        self.node = node

    @contextlib.contextmanager
    def orelse(self):
        if self.node is None:
            yield
            return
        _REC._stack.append(self.node.orelse)
        try:
            yield
        finally:
            _REC._stack.pop()


@contextlib.contextmanager
def branch(cond: str):
    """``with branch("rescale") as b: ...then...``; ``with b.orelse(): ...``  (else optional)."""
    if _REC.active is None or _REC._role is None:
        yield _BranchCtx(None)
        return
    node = Branch(cond)
    _REC._append(node)
    _REC._stack.append(node.then)
    try:
        yield _BranchCtx(node)
    finally:
        _REC._stack.pop()
