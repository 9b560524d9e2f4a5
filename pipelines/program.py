"""Turn recorded role programs into the straight-line operation lists the model executes.

A ``Recording`` (pipelines/record.py) holds, per role, a tree of events, run-time loops and
run-time branches. ``flatten`` unrolls it for concrete trip counts (``bindings``, e.g.
``{"n_blocks": 3, "work_tiles": 2}``) and one branch policy, and resolves each pipeline
operation's stage and round statically: the k-th ``acquire`` of a role on a ring pipeline
uses stage ``k % stages`` in round ``k // stages``; with a stage hint (a compile-time Q
stage) it uses that stage and counts rounds per stage. Acquire/commit and wait/release keep
separate counters, which is what in-order (index, phase) pipeline states produce. Each
wait/acquire also gets the parity the code passes where the recording knows it: a
compile-time int, or the replayed value of the ``PipelineState`` it used (its recorded
creation, advances and clones); the model checks it against the round.

``inject`` applies the faults the CLI and tests use: ``drop-release:P`` removes every release
of P, ``skip-wait:P`` every consumer wait of P, ``extra-arrive:P`` adds a second arrival
after every producer commit of P. ``flip_initial_phase(programs, P)`` starts every state of P
with the other phase (the wrong-initial-phase fault).

``drop-commit:P`` (every producer commit of P removed) and ``short-tx:P`` (every expect-tx
acquire of P expects half its bytes) are further faults for tests and the CLI
(``FAULT_KINDS``); short-tx shows where the copies' bytes come from the pipeline table
(``PipelineSpec.buffer_tx``: the backward's rows), not from the acquire itself.

Access regions: TMEM regions come from the config's ``TmemPlan`` (compared by columns, so P0
aliases S0's upper half). SMEM buffers are those the pipeline table's rows hand over
(``PipelineSpec.smem``: the forward's ``sQ``, ``sKV``, ``sO``, ``stats``; the backward's
``sK``, ``sV``, ``sQ``, ``sdO``, ``sLSE2``, ``sDelta``, ``sdS``, and under 2-CTA ``sKt``, ``sQt``,
``sdOt``); a thread access may name another CTA of the pair (``Event.cta``) and move its
columns by the accessing CTA's rank (``Event.cols_per_cta``); a trailing digit or
``stage_of`` gives the stage. ``stage_of="kv"`` means the stage of the role's latest
wait/acquire on kv; ``"kv-1"`` the one before it (the MMA warp reads V[i] after it already
waited on K[i-1]). A ``part`` event (``record.part``) only names the actor; flattening skips it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Callable, Optional

from pipelines.record import Branch, Event, Loop
from pipelines.spec import BWD_PIPELINES, PIPELINES

INJECTION_KINDS = ("drop-release", "extra-arrive", "skip-wait")
# faults beyond the CLI grid's three (each reported where it applies: short-tx only changes a
# TMA pipeline, drop-commit of a TMA pipeline removes a no-op)
FAULT_KINDS = INJECTION_KINDS + ("drop-commit", "short-tx")
# Conditions the model binds per CTA instead of exploring both ways.
CTA_CONDITIONS = ("is_leader_cta",)


@dataclass(frozen=True)
class Op:
    """One executable operation of one actor (a role in one CTA)."""

    kind: str  # acquire | commit | wait | release | extra_arrive | access | named_sync
    index: int  # position in the role's flattened program (for messages)
    pipe: Optional[str] = None
    stage: int = 0
    round: int = 0
    arrive: Optional[str] = None
    dst: Optional[str] = None
    tx: int = 0
    region: Optional[str] = None
    mode: Optional[str] = None
    unit: Optional[str] = None
    done_by: Optional[str] = None
    cols: Optional[tuple] = None
    note: str = ""
    # TMA accesses: the barrier their bytes complete (latest acquire on done_by)
    bar_stage: int = 0
    bar_round: int = 0
    bar_tx: int = 0
    # acquire / wait: the parity the code passes (None: a run-time value the recording cannot
    # see); state_index: the index of the PipelineState it used (None: no state / unknown)
    phase: Optional[int] = None
    state_index: Optional[int] = None
    # named_sync: the thread count the bar.sync declares (0: not recorded)
    threads: int = 0
    # access: the pair rank of the CTA whose buffer it touches (None: the actor's own)
    cta: Optional[int] = None

    def describe(self) -> str:
        if self.kind == "access":
            cols = f" cols {self.cols[0]}..{self.cols[1] - 1}" if self.cols else ""
            st = f"[{self.stage}]" if self.stage is not None else ""
            return f"access {self.region}{st}{cols} {self.mode} by {self.unit}"
        if self.kind == "named_sync":
            return f"named_sync {self.pipe}"
        return f"{self.kind} {self.pipe}[stage {self.stage}, round {self.round}]"


def eval_trips(trips: str, bindings: dict) -> int:
    """Evaluate a loop's trip-count symbol ("n_blocks - 1") with ``bindings``."""
    names = set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", trips))
    missing = names - set(bindings)
    if missing:
        raise ValueError(f"loop trips {trips!r}: no value for {sorted(missing)} (bindings: {sorted(bindings)})")
    if not re.fullmatch(r"[A-Za-z_0-9\s+\-*/()]*", trips):
        raise ValueError(f"loop trips {trips!r}: only names, integers and + - * / ( ) are allowed")
    value = eval(trips, {"__builtins__": {}}, dict(bindings))  # noqa: S307 -- checked above
    value = int(value)
    if value < 0:
        raise ValueError(f"loop trips {trips!r} = {value} < 0 for {bindings}")
    return value


def table_buffers(pipes) -> frozenset:
    """The SMEM buffers the table rows named ``pipes`` hand over (``PipelineSpec.smem``)."""
    return frozenset(b for p in PIPELINES + BWD_PIPELINES if p.name in pipes for b in p.smem)


def split_region(name: str, stage: Optional[int], buffers=frozenset()):
    """(SMEM buffer, stage) for a buffer of ``buffers`` (the stage a trailing digit names,
    else ``stage``, else 0); (name, None) for anything else (a TMEM region)."""
    if name in buffers:
        return name, stage if stage is not None else 0
    m = re.fullmatch(r"([A-Za-z_]+?)(\d+)", name)
    if m and m.group(1) in buffers:
        return m.group(1), int(m.group(2))
    return name, None


BranchPolicy = Callable[[str, int], bool]


def policy_then(cond: str, k: int) -> bool:
    return True


def policy_else(cond: str, k: int) -> bool:
    return False


def policy_alternate(cond: str, k: int) -> bool:
    return k % 2 == 0


BRANCH_POLICIES = {"then": policy_then, "else": policy_else, "alternate": policy_alternate}


def uses_condition(nodes, cond: str) -> bool:
    for n in nodes:
        if isinstance(n, Branch):
            if n.cond == cond or uses_condition(n.then, cond) or uses_condition(n.orelse, cond):
                return True
        elif isinstance(n, Loop) and uses_condition(n.body, cond):
            return True
    return False


def flatten(nodes, bindings: dict, stages: dict, cta: int = 0,
            policy: BranchPolicy = policy_then, role: str = "?") -> list[Op]:
    """Unroll ``nodes`` into a list of ``Op`` with stages and rounds resolved.

    stages: pipeline name -> stage count (from the table for the config); the SMEM buffers
    are those these pipelines hand over.
    """
    buffers = table_buffers(stages)
    out: list[Op] = []
    counters: dict = {}
    history: dict = {}  # pipe -> stages of this role's waits/acquires, in order
    last_commit: dict = {}  # pipe -> (stage, round, arrive, dst)
    last_acquire: dict = {}  # pipe -> (stage, round, tx)
    branch_count: dict = {}
    pstates: dict = {}  # PipelineState id -> [stages, index, phase] (None where unknown)

    def resolve(ev: Event):
        if ev.pipeline not in stages:
            raise ValueError(f"role {role}: {ev.op} on pipeline {ev.pipeline!r}, which this config does "
                             f"not build (pipelines: {sorted(stages)})")
        n = stages[ev.pipeline]
        if ev.stage_hint is not None:
            if not 0 <= ev.stage_hint < n:
                raise ValueError(f"role {role}: stage {ev.stage_hint} of {ev.pipeline} out of range ({n} stages)")
            key = (ev.pipeline, ev.op, ev.stage_hint)
            k = counters.get(key, 0)
            counters[key] = k + 1
            return ev.stage_hint, k
        key = (ev.pipeline, ev.op, None)
        k = counters.get(key, 0)
        counters[key] = k + 1
        return k % n, k // n

    def walk(seq):
        for node in seq:
            if isinstance(node, Loop):
                for _ in range(eval_trips(node.trips, bindings)):
                    walk(node.body)
            elif isinstance(node, Branch):
                if node.cond in CTA_CONDITIONS:
                    take = cta == 0
                elif node.cond in bindings:
                    take = bool(bindings[node.cond])
                else:
                    k = branch_count.get(node.cond, 0)
                    branch_count[node.cond] = k + 1
                    take = policy(node.cond, k)
                walk(node.then if take else node.orelse)
            else:
                emit(node)

    def state_of(ev: Event):
        """(index, phase) of the PipelineState ``ev`` used, each None where unknown."""
        if ev.state is None or ev.state not in pstates:
            return None, ev.phase
        _, index, phase = pstates[ev.state]
        return index, phase

    def emit(ev: Event):
        idx = len(out)
        if ev.op == "part":
            return
        if ev.op == "state_new":
            pstates[ev.state] = [ev.stages, ev.stage_hint, ev.phase]
            return
        if ev.op == "state_clone":
            pstates[ev.state] = list(pstates[ev.src]) if ev.src in pstates else [1, None, None]
            return
        if ev.op == "state_advance":
            if ev.state in pstates:
                n, index, phase = pstates[ev.state]
                if n == 1:  # one stage, or a state fixed on a compile-time stage
                    phase = None if phase is None else phase ^ 1
                elif index is not None:
                    index += 1
                    wrap = index // n
                    index -= wrap * n
                    phase = None if phase is None else phase ^ wrap
                else:
                    phase = None
                pstates[ev.state] = [n, index, phase]
            return
        if ev.op == "skipped_wait":
            stage, _ = resolve(replace(ev, op="wait"))
            history.setdefault(ev.pipeline, []).append(stage)
        elif ev.op in ("acquire", "commit", "wait", "release"):
            stage, rnd = resolve(ev)
            if ev.op in ("acquire", "wait"):
                history.setdefault(ev.pipeline, []).append(stage)
            if ev.op == "commit":
                last_commit[ev.pipeline] = (stage, rnd, ev.arrive, ev.dst)
            if ev.op == "acquire":
                last_acquire[ev.pipeline] = (stage, rnd, ev.tx)
            index, phase = state_of(ev)
            if ev.op in ("commit", "release"):
                phase = None  # arrivals carry no parity
            elif ev.stage_hint is not None and ev.state in pstates and pstates[ev.state][0] == 1:
                index = ev.stage_hint  # a fixed-stage state: its index is the hint itself
            out.append(Op(ev.op, idx, ev.pipeline, stage, rnd, ev.arrive, ev.dst, ev.tx, note=ev.note,
                          phase=phase, state_index=index))
        elif ev.op == "extra_arrive":
            if ev.pipeline not in last_commit:
                return  # nothing committed yet: nothing to duplicate
            stage, rnd, arrive, dst = last_commit[ev.pipeline]
            out.append(Op("extra_arrive", idx, ev.pipeline, stage, rnd, arrive, dst, note="injected"))
        elif ev.op == "access":
            stage = None
            if ev.stage_of is not None:
                m = re.fullmatch(r"(\w+?)(?:-(\d+))?", ev.stage_of)
                pipe, back = m.group(1), int(m.group(2) or 0)
                hist = history.get(pipe, [])
                if len(hist) <= back:
                    raise ValueError(f"role {role}: access {ev.region} with stage_of={ev.stage_of!r} "
                                     f"before {back + 1} wait/acquire on {pipe}")
                stage = hist[-1 - back]
            region, stage = split_region(ev.region, stage, buffers)
            bar = (0, 0, 0)
            if ev.unit == "tma":
                if ev.done_by not in last_acquire:
                    raise ValueError(f"role {role}: TMA access {ev.region} done_by={ev.done_by!r} before any "
                                     f"acquire on {ev.done_by}")
                bar = last_acquire[ev.done_by]
            cols = ev.cols
            if cols is not None and ev.cols_per_cta:  # the accessing CTA's part of the buffer
                cols = (cols[0] + ev.cols_per_cta * cta, cols[1] + ev.cols_per_cta * cta)
            out.append(Op("access", idx, None, stage, 0, region=region, mode=ev.mode, unit=ev.unit,
                          done_by=ev.done_by, cols=cols, tx=ev.tx, note=ev.note,
                          bar_stage=bar[0], bar_round=bar[1], bar_tx=bar[2], cta=ev.cta))
        elif ev.op == "named_sync":
            out.append(Op("named_sync", idx, ev.pipeline, note=ev.note, threads=ev.threads))
        else:
            raise ValueError(f"role {role}: unknown recorded op {ev.op!r}")

    walk(nodes)
    return out


def parse_injection(text: str) -> tuple[str, str]:
    """'drop-release:kv' -> ('drop-release', 'kv'); ValueError naming the allowed kinds."""
    if ":" not in text:
        raise ValueError(f"--inject {text!r}: expected KIND:PIPELINE with KIND in {FAULT_KINDS}")
    kind, pipe = text.split(":", 1)
    if kind not in FAULT_KINDS:
        raise ValueError(f"--inject {text!r}: unknown kind {kind!r}; use one of {FAULT_KINDS}")
    names = tuple(p.name for p in PIPELINES + BWD_PIPELINES)
    if pipe not in names:
        raise ValueError(f"--inject {text!r}: unknown pipeline {pipe!r}; pipelines: {names}")
    return kind, pipe


def flip_initial_phase(programs: dict, pipe: str) -> dict:
    """A copy of ``programs`` in which every ``PipelineState`` of ``pipe`` starts with the
    other phase, and every compile-time parity passed to ``pipe``'s waits is flipped (the
    "wrong initial phase" fault). ValueError when ``pipe`` has no recorded phase to flip (a
    kernel whose phases are all run-time values)."""
    flipped = 0

    def tx(seq):
        nonlocal flipped
        out = []
        for node in seq:
            if isinstance(node, Loop):
                out.append(Loop(node.trips, tx(node.body)))
            elif isinstance(node, Branch):
                out.append(Branch(node.cond, tx(node.then), tx(node.orelse)))
            elif node.pipeline == pipe and node.phase is not None and node.op in ("state_new", "acquire", "wait"):
                flipped += 1
                out.append(replace(node, phase=node.phase ^ 1, note="injected: initial phase flipped"))
            else:
                out.append(node)
        return out

    result = {role: tx(nodes) for role, nodes in programs.items()}
    if not flipped:
        raise ValueError(f"no recorded phase of pipeline {pipe!r} to flip (its phases are run-time values)")
    return result


def inject(programs: dict, kind: str, pipe: str) -> dict:
    """A copy of ``programs`` (role -> node list) with the fault ``kind`` applied to ``pipe``."""
    if kind not in FAULT_KINDS:
        raise ValueError(f"unknown fault {kind!r}; use one of {FAULT_KINDS}")

    def tx(seq):
        out = []
        for node in seq:
            if isinstance(node, Loop):
                out.append(Loop(node.trips, tx(node.body)))
            elif isinstance(node, Branch):
                out.append(Branch(node.cond, tx(node.then), tx(node.orelse)))
            elif node.pipeline != pipe or node.op not in ("release", "wait", "commit", "acquire"):
                out.append(node)
            elif kind == "drop-release" and node.op == "release":
                continue
            elif kind == "drop-commit" and node.op == "commit":
                continue
            elif kind == "short-tx" and node.op == "acquire" and node.tx:
                out.append(replace(node, tx=node.tx // 2, note="injected: expect-tx halved"))
            elif kind == "skip-wait" and node.op == "wait":
                # keeps the stage bookkeeping of the wait, never blocks
                out.append(replace(node, op="skipped_wait", note="injected: wait skipped"))
            elif kind == "extra-arrive" and node.op == "commit":
                out.append(node)
                out.append(replace(node, op="extra_arrive", note="injected extra arrive"))
            else:
                out.append(node)
        return out

    return {role: tx(nodes) for role, nodes in programs.items()}
