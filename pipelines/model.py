"""The protocol model: the SM100 kernels' synchronization, simulated exactly on the CPU.

The pipelines, their arrival counts, SMEM buffers and TMA bytes come from the config's table
(``spec.table_of``: the forward's or the backward's), TMEM regions from its ``TmemPlan``,
warps from its warp roles (a part of a role, ``record.part``, from its recorded warps).

Actors are the roles of each CTA of the pair (``softmax0@1`` is softmax 0 of CTA 1; the MMA
warp runs only in the leader CTA 0 unless its program branches on ``is_leader_cta``), plus
two asynchronous units: the UMMA unit (in-order: tcgen05.commit arrives once every earlier
MMA of the warp completed) and the TMA unit (each load completes its bytes independently).

mbarriers are simulated exactly: pending arrival count, phase (completed phases), transaction
bytes. A wait for round r passes once the barrier completed phase r (``phase > r``).
A named barrier blocks each arriving actor until the arrived threads of its CTA (warps x 32
per actor) reach the count the ``bar.sync`` declares, as the hardware counts. The MMA warp
of a non-leader CTA is an actor when the MMA program branches on ``is_leader_cta``.

Each scheduler step runs one enabled action (an actor's next operation, the UMMA unit's next
commit, or one pending TMA completion). ``run_random`` draws schedules; ``explore`` searches
every interleaving (depth-first, with visited states; accesses, which never change the
synchronization state, run eagerly). Findings:

- ``deadlock``: no action is enabled but an actor has not finished (each blocked operation
  is listed with its barrier's state); ``never-completing-wait`` when no remaining operation
  of any actor or unit can arrive on the barrier a blocked actor waits on;
- ``over-arrival``: an arrival for a phase the barrier already completed or has not reached,
  more arrivals than pending, or more bytes than expected;
- ``phase-overrun``: a wait finds its barrier two or more phases ahead (parity aliasing);
- ``race``: two accesses to the same TMEM columns or SMEM stage, at least one a write, not
  ordered by happens-before (vector clocks carried by arrivals, completions and waits);
- ``dangling-arrival``: a phase left partly arrived when every actor finished;
- ``wrong-phase``: a wait whose recorded parity (a compile-time int or a tracked
  ``PipelineState``) is not the parity of the round it waits for; ``wrong-stage``: a
  tracked state whose index is not the stage the operation takes (both static checks).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional

from fa_sm100.config import WARP_SIZE, FmhaConfig
from layouts.tmem import TmemPlan
from pipelines.named_barriers import NamedBarrier, num_threads
from pipelines.program import Op, flatten, policy_then, uses_condition
from pipelines.record import Event
from pipelines.spec import active_specs, smem_buffers

TMEM_CELL = 8  # column granularity of TMEM race tracking
MAX_FINDINGS = 40


@dataclass
class Finding:
    kind: str
    message: str


@dataclass
class Report:
    findings: list = field(default_factory=list)
    schedules: int = 0
    states: int = 0
    steps: int = 0
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return not self.findings

    def kinds(self) -> set:
        return {f.kind for f in self.findings}

    def merge(self, other: "Report") -> "Report":
        seen = {(f.kind, f.message) for f in self.findings}
        for f in other.findings:
            if (f.kind, f.message) not in seen and len(self.findings) < MAX_FINDINGS:
                self.findings.append(f)
                seen.add((f.kind, f.message))
        self.schedules += other.schedules
        self.states += other.states
        self.steps += other.steps
        self.truncated |= other.truncated
        return self


def join(a: dict, b: dict) -> dict:
    if not a:
        return b
    if not b:
        return a
    out = dict(a)
    for k, v in b.items():
        if out.get(k, 0) < v:
            out[k] = v
    return out


def _actor_warps(role: str, nodes: list, role_warps: dict) -> int:
    """Warps of the actor that runs ``nodes``: a warp role's, or a part's (its first event,
    ``record.part``, names the role and the part's threads)."""
    if nodes and isinstance(nodes[0], Event) and nodes[0].op == "part":
        parent, threads = nodes[0].note, nodes[0].threads
        if parent not in role_warps or not 0 < threads <= len(role_warps[parent]) * WARP_SIZE:
            raise ValueError(f"part {role!r}: {threads} threads of role {parent!r} ({sorted(role_warps)})")
        return threads // WARP_SIZE
    if role not in role_warps:
        raise ValueError(f"recorded role {role!r} is not a warp role ({sorted(role_warps)})")
    return len(role_warps[role])


@dataclass(frozen=True)
class Access:
    aid: str
    clock: int
    vc: dict
    mode: str
    desc: str

    def before(self, other: "Access") -> bool:
        return self.clock <= other.vc.get(self.aid, 0)


@dataclass
class Actor:
    name: str
    role: str
    cta: int
    ops: list
    warps: int


class State:
    """Everything that changes during a run. ``clone`` copies containers; values inside are
    never mutated in place (they are replaced), so clones share them safely."""

    __slots__ = ("pcs", "nb_reg", "bars", "bar_vc", "done_vc", "vcs", "umma_vc", "umma_q", "tma",
                 "nb", "nb_done", "cells", "tma_seq")

    def __init__(self, n_actors: int, names: list):
        self.pcs = [0] * n_actors
        self.nb_reg = [None] * n_actors
        self.bars = {}
        self.bar_vc = {}
        self.done_vc = {}
        self.vcs = [{n: 1} for n in names]
        self.umma_vc = {}
        self.umma_q = ()
        self.tma = ()
        self.nb = {}
        self.nb_done = {}
        self.cells = {}
        self.tma_seq = 0

    def clone(self) -> "State":
        s = object.__new__(State)
        for k in ("pcs", "nb_reg", "vcs"):
            setattr(s, k, list(getattr(self, k)))
        for k in ("bars", "bar_vc", "done_vc", "nb", "nb_done", "cells"):
            setattr(s, k, dict(getattr(self, k)))
        s.umma_vc, s.umma_q, s.tma, s.tma_seq = self.umma_vc, self.umma_q, self.tma, self.tma_seq
        return s

    def key(self):
        return (tuple(self.pcs), tuple(self.nb_reg), tuple(sorted(self.bars.items())),
                tuple((t, r) for t, r, _, _ in self.umma_q),
                tuple(sorted((k, b, r) for k, b, r, _, _ in self.tma)),
                tuple(sorted((k, v[0], v[1]) for k, v in self.nb.items())))


class ProtocolModel:
    """The protocol of ``programs`` (role -> recorded nodes) for ``cfg`` and trip ``bindings``."""

    def __init__(self, cfg: FmhaConfig, programs: dict, bindings: dict, policy=policy_then):
        self.cfg = cfg
        self.specs = {s.name: s for s in active_specs(cfg)}
        self.stages = {n: s.num_stages(cfg) for n, s in self.specs.items()}
        self.ctas = cfg.cta_group
        self.plan = TmemPlan.of(cfg)
        self.buffers = smem_buffers(self.specs.values())
        role_warps = cfg.warp_roles().role_warps()
        self.actors: list[Actor] = []
        for role, nodes in programs.items():
            warps = _actor_warps(role, nodes, role_warps)
            for cta in range(self.ctas):
                # The MMA warp of a non-leader CTA exists (it joins named barriers) only when
                # its program says what it does there (a branch on is_leader_cta).
                if role == "mma" and cta > 0 and not uses_condition(nodes, "is_leader_cta"):
                    continue
                ops = flatten(nodes, bindings, self.stages, cta, policy, role)
                self.actors.append(Actor(f"{role}@{cta}", role, cta, ops, warps))
        # SMEM buffers some access covers only in part (``cols``): their column extent
        self.smem_cols = {}
        for a in self.actors:
            for op in a.ops:
                if op.kind == "access" and op.cols is not None and op.region in self.buffers:
                    self.smem_cols[op.region] = max(self.smem_cols.get(op.region, 0), op.cols[1])
        self.names = [a.name for a in self.actors]
        self.expected = {}
        for name, spec in self.specs.items():
            for side in ("full", "empty"):
                count = spec.arrivals(side, cfg)
                for st in range(self.stages[name]):
                    for cta in range(self.ctas):
                        self.expected[(name, side, st, cta)] = count
        self.findings: list[Finding] = []
        self._seen: set = set()
        roles = cfg.warp_roles()
        self.nb_threads = {b.name: num_threads(b, roles) for b in NamedBarrier}
        self._check_parities()

    # -- findings ---------------------------------------------------------------------------
    def _find(self, kind: str, message: str) -> None:
        if (kind, message) not in self._seen and len(self.findings) < MAX_FINDINGS:
            self._seen.add((kind, message))
            self.findings.append(Finding(kind, message))

    def _where(self, i: int, op: Op) -> str:
        return f"{self.names[i]} op #{op.index} ({op.describe()})"

    # -- phases -----------------------------------------------------------------------------
    def _check_parities(self) -> None:
        """Every wait/acquire whose parity the recording knows (a compile-time int, or a
        tracked PipelineState) must pass the parity of the round it waits for: round r of a
        barrier completes phase r, so the parity is r % 2 (r = -1, parity 1, for a producer's
        first acquire of an initially empty stage). A tracked state's index must be the stage
        the operation uses. Static: the same for every schedule."""
        for a in self.actors:
            for op in a.ops:
                if op.kind not in ("wait", "acquire"):
                    continue
                who = f"{a.name} op #{op.index} ({op.describe()})"
                if op.state_index is not None and op.state_index != op.stage:
                    self._find("wrong-stage", f"{who} uses stage {op.state_index} of its pipeline "
                               f"state, but this is the pipeline's stage {op.stage} in program order")
                if op.phase is None:
                    continue
                r = op.round
                if op.kind == "acquire" and self.specs[op.pipe].producer_starts_empty:
                    r -= 1
                if op.phase != r % 2:
                    side = "full" if op.kind == "wait" else "empty"
                    what = (f"phase {r} of {op.pipe}.{side}[{op.stage}]" if r >= 0 else
                            f"the initially empty {op.pipe}.{side}[{op.stage}]")
                    self._find("wrong-phase", f"{who} waits with parity {op.phase} for {what}, which "
                               f"needs parity {r % 2}: the wait passes a phase early or never")

    # -- barriers ---------------------------------------------------------------------------
    def _bar(self, st: State, key):
        return st.bars.get(key) or (0, self.expected[key], 0)

    @staticmethod
    def _bar_name(key) -> str:
        pipe, side, stage, cta = key
        return f"{pipe}.{side}[{stage}]@CTA{cta}"

    def _complete(self, st: State, key, phase, pending, tx):
        st.done_vc[(key, phase)] = st.bar_vc.get(key, {})
        st.bar_vc[key] = {}
        st.bars[key] = (phase + 1, self.expected[key] + min(pending, 0), 0)

    def _arrive(self, st: State, key, n: int, tx: int, rnd: int, vc: dict, who: str) -> None:
        phase, pending, txp = self._bar(st, key)
        bname = self._bar_name(key)
        if rnd < phase:
            self._find("over-arrival", f"{who} arrives on {bname} for phase {rnd}, which already "
                       f"completed (the barrier is at phase {phase}): an extra arrival completed it early")
        elif rnd > phase:
            self._find("over-arrival", f"{who} arrives on {bname} for phase {rnd} while it is still in "
                       f"phase {phase}: the arrival is counted in the wrong phase")
        if n > pending:
            self._find("over-arrival", f"{who} brings {n} arrivals to {bname} but only {pending} "
                       f"are pending in phase {phase}")
        pending -= n
        txp += tx
        st.bar_vc[key] = join(st.bar_vc.get(key, {}), vc)
        if pending <= 0 and txp == 0:
            self._complete(st, key, phase, pending, txp)
        else:
            st.bars[key] = (phase, pending, txp)

    def _complete_tx(self, st: State, key, nbytes: int, rnd: int, vc: dict, who: str) -> None:
        phase, pending, txp = self._bar(st, key)
        bname = self._bar_name(key)
        if rnd != phase:
            self._find("over-arrival", f"{who}: {nbytes} TMA bytes for phase {rnd} land on {bname} in "
                       f"phase {phase}")
        txp -= nbytes
        if pending <= 0 and txp < 0:
            self._find("over-arrival", f"{who}: {bname} received {-txp} more TMA bytes than expected")
        st.bar_vc[key] = join(st.bar_vc.get(key, {}), vc)
        if pending <= 0 and txp <= 0:
            self._complete(st, key, phase, pending, txp)
        else:
            st.bars[key] = (phase, pending, txp)

    def _targets(self, actor: Actor, pipe: str, side: str, stage: int, dst: Optional[str]):
        if dst == "pair":
            return [(pipe, side, stage, c) for c in range(self.ctas)]
        if dst == "leader":
            return [(pipe, side, stage, 0)]
        return [(pipe, side, stage, actor.cta)]

    def _count(self, actor: Actor, arrive: Optional[str]) -> int:
        if arrive == "thread":
            return actor.warps * WARP_SIZE
        if arrive == "warp":
            return actor.warps
        return 1

    def _wait_target(self, actor: Actor, op: Op):
        """(barrier key, round the wait needs completed) or None when it passes at once."""
        if op.kind == "wait":
            return (op.pipe, "full", op.stage, actor.cta), op.round
        if op.kind == "acquire":
            r = op.round - (1 if self.specs[op.pipe].producer_starts_empty else 0)
            return ((op.pipe, "empty", op.stage, actor.cta), r) if r >= 0 else None
        return None

    # -- scheduling -------------------------------------------------------------------------
    def initial(self) -> State:
        return State(len(self.actors), self.names)

    def enabled(self, st: State) -> list:
        acts = []
        for i, a in enumerate(self.actors):
            pc = st.pcs[i]
            if pc >= len(a.ops):
                continue
            op = a.ops[pc]
            if op.kind in ("wait", "acquire"):
                tgt = self._wait_target(a, op)
                if tgt is not None and self._bar(st, tgt[0])[0] <= tgt[1]:
                    continue
            elif op.kind == "named_sync" and st.nb_reg[i] is not None:
                key, gen = st.nb_reg[i]
                if st.nb.get(key, (0,))[0] <= gen:
                    continue
            acts.append(("actor", i))
        if st.umma_q:
            acts.append(("umma", 0))
        for j in range(len(st.tma)):
            acts.append(("tma", j))
        return acts

    def _bump(self, st: State, i: int) -> dict:
        vc = st.vcs[i]
        name = self.names[i]
        st.vcs[i] = {**vc, name: vc[name] + 1}
        return vc

    def apply(self, st: State, act) -> None:
        kind, i = act
        if kind == "umma":
            targets, rnd, vc, who = st.umma_q[0]
            st.umma_q = st.umma_q[1:]
            for key in targets:
                self._arrive(st, key, 1, 0, rnd, vc, who)
            return
        if kind == "tma":
            key, nbytes, rnd, vc, who = st.tma[i]
            st.tma = st.tma[:i] + st.tma[i + 1:]
            self._complete_tx(st, key, nbytes, rnd, vc, who)
            return
        a = self.actors[i]
        op = a.ops[st.pcs[i]]
        who = self._where(i, op)
        if op.kind in ("wait", "acquire"):
            tgt = self._wait_target(a, op)
            if tgt is not None:
                key, r = tgt
                phase = self._bar(st, key)[0]
                if phase >= r + 2:
                    self._find("phase-overrun", f"{who} waits for phase {r} of {self._bar_name(key)}, "
                               f"which is already at phase {phase}: the parity wait sees the wrong phase")
                st.vcs[i] = join(st.vcs[i], st.done_vc.get((key, r), {}))
            # expect-tx: the leader's for the pair where the MMA warp waits, else each CTA's
            pair_tx = self.ctas == 2 and self.specs[op.pipe].waits_on_leader("full")
            if op.kind == "acquire" and op.arrive == "expect_tx" and (a.cta == 0 or not pair_tx):
                vc = self._bump(st, i)
                self._arrive(st, (op.pipe, "full", op.stage, a.cta), 1, op.tx, op.round, vc, who)
        elif op.kind in ("commit", "release", "extra_arrive"):
            side = "empty" if op.kind == "release" else "full"
            arrive = op.arrive
            if op.kind == "extra_arrive" and arrive in (None, "expect_tx"):
                arrive = "warp"  # one elected thread arrives once more
                targets = self._targets(a, op.pipe, side, op.stage,
                                        "leader" if self.specs[op.pipe].waits_on_leader(side) else "local")
            else:
                targets = self._targets(a, op.pipe, side, op.stage, op.dst)
            if arrive is None:
                pass  # TMA commit: the bytes complete the phase
            elif arrive == "umma":
                vc = join(st.umma_vc, self._bump(st, i))
                st.umma_q = st.umma_q + ((tuple(targets), op.round, vc, who),)
            else:
                n = 1 if op.kind == "extra_arrive" and op.arrive in (None, "expect_tx") else self._count(a, arrive)
                vc = self._bump(st, i)
                for key in targets:
                    self._arrive(st, key, n, 0, op.round, vc, who)
        elif op.kind == "access":
            self._access(st, i, a, op, who)
        elif op.kind == "named_sync":
            if self._named_sync(st, i, a, op):
                return  # registered; the actor stays on this op until the barrier opens
        st.pcs[i] += 1

    def _named_sync(self, st: State, i: int, a: Actor, op: Op) -> bool:
        """bar.sync: the barrier opens once the arrived threads reach the count it declares
        (the recorded count, else ``num_threads``), whoever they are, as in hardware."""
        key = (op.pipe, a.cta)
        if st.nb_reg[i] is not None:
            _, gen = st.nb_reg[i]
            st.vcs[i] = join(st.vcs[i], st.nb_done[(key, gen)])
            st.nb_reg[i] = None
            return False
        need = self._nb_need(op)
        gen, arrived, vc = st.nb.get(key, (0, frozenset(), {}))
        arrived = arrived | {i}
        vc = join(vc, self._bump(st, i))
        st.nb_reg[i] = (key, gen)
        have = self._nb_threads(arrived)
        if have > need:
            self._find("over-arrival", f"{self._where(i, op)}: {have} threads arrive at named barrier "
                       f"{op.pipe} (CTA {a.cta}), which declares {need}")
        if have >= need:
            st.nb_done[(key, gen)] = vc
            st.nb[key] = (gen + 1, frozenset(), {})
        else:
            st.nb[key] = (gen, arrived, vc)
        return True

    def _nb_need(self, op: Op) -> int:
        return op.threads or self.nb_threads[op.pipe]

    def _nb_threads(self, arrived) -> int:
        return sum(self.actors[j].warps * WARP_SIZE for j in arrived)

    # -- races ------------------------------------------------------------------------------
    def _tma_bytes(self, op: Op) -> int:
        """Bytes one CTA's TMA copy lands: the recorded ``tx``, else the table's bytes of the
        buffer (rows with a rule per buffer), else the acquire's bytes; per CTA of the pair."""
        if op.tx:
            return op.tx
        spec = self.specs[op.done_by]
        nbytes = spec.buffer_tx(self.cfg, op.region) if op.region in spec.smem else None
        return (op.bar_tx if nbytes is None else nbytes) // spec.tx_ctas(self.cfg)

    def _cells(self, a: Actor, op: Op):
        ctas = range(self.ctas) if op.unit == "umma" else (a.cta if op.cta is None else op.cta,)
        if op.region in self.plan.names:
            r = self.plan[op.region]
            lo, hi = r.start, r.stop
            if op.cols is not None:
                lo, hi = r.start + op.cols[0], r.start + op.cols[1]
                if not (r.start <= lo < hi <= r.stop):
                    raise ValueError(f"{a.name}: columns {op.cols} outside TMEM region {op.region}")
            return [(("tmem", c), cta) for cta in ctas
                    for c in range(lo // TMEM_CELL, -(-hi // TMEM_CELL))], f"{op.region}"
        if op.region not in self.buffers:
            raise ValueError(f"{a.name}: access region {op.region} is neither a TMEM region of this "
                             f"config's plan {self.plan.names} nor an SMEM buffer of its pipeline "
                             f"table {sorted(self.buffers)}")
        stage = op.stage
        label = f"{op.region}[{stage}]"
        width = self.smem_cols.get(op.region)
        if width is None:
            return [((op.region, stage), cta) for cta in ctas], label
        lo, hi = op.cols if op.cols is not None else (0, width)
        if op.cols is not None:
            label += f" cols {lo}..{hi - 1}"
        return [((op.region, stage, c), cta) for cta in ctas
                for c in range(lo // TMEM_CELL, -(-hi // TMEM_CELL))], label

    def _access(self, st: State, i: int, a: Actor, op: Op, who: str) -> None:
        if op.unit == "umma":
            uvc = join(st.umma_vc, st.vcs[i])
            uvc = {**uvc, "umma": uvc.get("umma", 0) + 1}
            st.umma_vc = uvc
            acc = Access("umma", uvc["umma"], uvc, op.mode, f"UMMA issued by {who}")
        elif op.unit == "tma":
            st.tma_seq += 1
            aid = f"tma#{st.tma_seq}"
            vc = {**st.vcs[i], aid: 1}
            acc = Access(aid, 1, vc, op.mode, f"TMA issued by {who}")
            nbytes = self._tma_bytes(op)
            pair_tx = self.ctas == 2 and self.specs[op.done_by].waits_on_leader("full")
            key = (op.done_by, "full", op.bar_stage, 0 if pair_tx else a.cta)
            st.tma = st.tma + ((key, nbytes, op.bar_round, vc, f"TMA of {who}"),)
        else:
            vc = st.vcs[i]
            acc = Access(self.names[i], vc[self.names[i]], vc, op.mode, who)
        cells, label = self._cells(a, op)
        for cell in cells:
            w, reads = st.cells.get(cell, (None, ()))
            if w is not None and not w.before(acc):
                self._race(label, cell[1], w, acc)
            if op.mode == "w":
                for r in reads:
                    if not r.before(acc):
                        self._race(label, cell[1], r, acc)
                st.cells[cell] = (acc, ())
            else:
                st.cells[cell] = (w, tuple(r for r in reads if r.aid != acc.aid) + (acc,))

    def _race(self, label: str, cta: int, a: Access, b: Access) -> None:
        self._find("race", f"race on {label} (CTA {cta}): {a.desc} [{a.mode}] and {b.desc} "
                   f"[{b.mode}] are not ordered by happens-before")

    # -- end states -------------------------------------------------------------------------
    def _can_still_arrive(self, st: State, key) -> bool:
        for t, _, _, _ in st.umma_q:
            if key in t:
                return True
        if any(k == key for k, *_ in st.tma):
            return True
        for i, a in enumerate(self.actors):
            for op in a.ops[st.pcs[i]:]:
                if op.kind in ("commit", "release", "extra_arrive") and op.pipe == key[0]:
                    side = "empty" if op.kind == "release" else "full"
                    if side == key[1] and op.stage == key[2]:
                        return True
                if op.kind == "acquire" and op.arrive == "expect_tx" and key[:3] == (op.pipe, "full", op.stage):
                    return True
                if op.kind == "access" and op.unit == "tma" and key[:3] == (op.done_by, "full", op.bar_stage):
                    return True
        return False

    def finish(self, st: State) -> None:
        """Report a deadlock (or dangling arrivals) for a state with no enabled action."""
        blocked = []
        for i, a in enumerate(self.actors):
            if st.pcs[i] >= len(a.ops):
                continue
            op = a.ops[st.pcs[i]]
            tgt = self._wait_target(a, op)
            if tgt is not None:
                key, r = tgt
                ph, pend, tx = self._bar(st, key)
                blocked.append(f"{self._where(i, op)} waits for phase {r} of {self._bar_name(key)} "
                               f"(at phase {ph}, {pend} of {self.expected[key]} arrivals pending"
                               f"{f', {tx} bytes pending' if tx else ''})")
                if not self._can_still_arrive(st, key):
                    self._find("never-completing-wait", f"{self._where(i, op)}: no remaining operation "
                               f"of any role arrives on {self._bar_name(key)}, so phase {r} never completes")
            else:
                key = (op.pipe, a.cta)
                have = self._nb_threads(st.nb.get(key, (0, frozenset(), {}))[1]) if st.nb_reg[i] else 0
                blocked.append(f"{self._where(i, op)} waits at the named barrier {op.pipe} "
                               f"({have} of {self._nb_need(op)} threads arrived)")
        if blocked:
            self._find("deadlock", "deadlock: " + "; ".join(blocked))
            return
        for key, (ph, pend, tx) in st.bars.items():
            if pend != self.expected[key] or tx:
                self._find("dangling-arrival", f"{self._bar_name(key)} is left in phase {ph} with "
                           f"{self.expected[key] - pend} of {self.expected[key]} arrivals when every role finished")

    # -- drivers ----------------------------------------------------------------------------
    def _is_wait(self, st: State, act) -> bool:
        if act[0] != "actor":
            return False
        a = self.actors[act[1]]
        return a.ops[st.pcs[act[1]]].kind in ("wait", "acquire", "named_sync")

    def run_random(self, seed: int = 0, max_steps: int = 1_000_000, waits_last: bool = False) -> Report:
        """One schedule: each step a uniformly drawn enabled action. ``waits_last`` draws a
        wait/acquire only when nothing else is enabled: every other role runs as far ahead as
        the protocol lets it, the schedule that exposes phase overruns."""
        rng = random.Random(seed)
        st = self.initial()
        steps = 0
        while steps < max_steps:
            acts = self.enabled(st)
            if not acts:
                self.finish(st)
                break
            if waits_last:
                others = [a for a in acts if not self._is_wait(st, a)]
                acts = others or acts
            self.apply(st, acts[rng.randrange(len(acts))])
            steps += 1
        return Report(list(self.findings), schedules=1, steps=steps, truncated=steps >= max_steps)

    def _invisible(self, st: State, i: int, eager_waits: bool) -> bool:
        """Operations ``explore`` runs eagerly instead of branching on: accesses and commits
        that issue nothing (they never change the synchronization state), and with
        ``eager_waits`` also waits / named-barrier exits whose condition already holds
        (barrier phases only grow, so they stay enabled; but a late wait is what sees a phase
        overrun, so the default keeps them as interleaving points)."""
        a = self.actors[i]
        if st.pcs[i] >= len(a.ops):
            return False
        op = a.ops[st.pcs[i]]
        if op.kind == "access" or (op.kind == "commit" and op.arrive is None):
            return True
        if not eager_waits:
            return False
        if op.kind == "wait" or (op.kind == "acquire" and op.arrive is None):
            tgt = self._wait_target(a, op)
            return tgt is None or self._bar(st, tgt[0])[0] > tgt[1]
        if op.kind == "named_sync" and st.nb_reg[i] is not None:
            key, gen = st.nb_reg[i]
            return st.nb.get(key, (0,))[0] > gen
        return False

    def _eager(self, st: State, eager_waits: bool) -> None:
        progress = True
        while progress:
            progress = False
            for i in range(len(self.actors)):
                while self._invisible(st, i, eager_waits):
                    self.apply(st, ("actor", i))
                    progress = True

    def explore(self, max_states: int = 20000, eager_waits: bool = False) -> Report:
        """Every interleaving, depth-first with visited states (up to ``max_states``)."""
        stack = [self.initial()]
        seen = set()
        truncated = False
        while stack:
            st = stack.pop()
            self._eager(st, eager_waits)
            k = st.key()
            if k in seen:
                continue
            if len(seen) >= max_states:
                truncated = True
                break
            seen.add(k)
            acts = self.enabled(st)
            if not acts:
                self.finish(st)
                continue
            for act in acts:
                nxt = st.clone()
                self.apply(nxt, act)
                stack.append(nxt)
        return Report(list(self.findings), schedules=0, states=len(seen), truncated=truncated)
