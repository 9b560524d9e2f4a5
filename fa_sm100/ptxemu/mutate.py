"""Planted faults: which CPU layer catches each wrong edit of the SM100 forward's PTX?

Each mutation rewrites the kernel's own sm_100a PTX in one place a real bug could be (a wait
dropped, a parity flipped, a TMEM column moved, an arrive dropped, an arrival count or a byte
count changed, a proxy fence dropped, a K/V slot freed at issue instead of at completion, the
correction vote silenced) and runs it on the PTX emulator under each schedule policy (Note
[Schedule policies] in machine.py). A fault is caught when the emulator reports it (a race, a
deadlock, an uninitialized read, an invisible store...) or when the result is no longer the
numerics emulation's to the bit or breaks the float64 rule. ``scripts/mutate.py`` runs the
catalogue and writes the table of docs/verification.md; ``tests/test_mutations.py`` requires
every fault to be caught by at least one layer.

The inputs make every fault matter: scores that rise in the kernel's processing order by
12.8 log2 units per K/V block, so the correction must rescale O at every block (a silenced
vote changes values), over three K/V blocks (the pipelines wrap around).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable

import torch

POLICIES = ("late", "random", "early")
# the configs the catalogue runs (hdim 64 keeps each run to seconds)
CONFIGS = {
    "2cta": ("head_dim=64", "head_dim_v=64"),
    "1cta": ("head_dim=64", "head_dim_v=64", "use_2cta=false"),
}


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    edit: Callable[[str], str]
    config: str = "2cta"


def _lines_with(ptx: str, needle: str) -> list:
    idx = [i for i, line in enumerate(ptx.splitlines()) if needle in line]
    if not idx:
        raise ValueError(f"no PTX line contains {needle!r}: the mutation has nothing to edit")
    return idx


def _drop(needle: str) -> Callable[[str], str]:
    def edit(ptx):
        _lines_with(ptx, needle)
        return "\n".join(line for line in ptx.splitlines() if needle not in line)
    return edit


def _rewrite_nth(needle: str, n: int, fn) -> Callable[[str], str]:
    """Rewrite the n-th line containing ``needle`` with ``fn(line) -> line``."""
    def edit(ptx):
        lines = ptx.splitlines()
        i = _lines_with(ptx, needle)[n]
        new = fn(lines[i])
        if new == lines[i]:
            raise ValueError(f"the mutation left line {i + 1} unchanged: {lines[i].strip()}")
        lines[i] = new
        return "\n".join(lines)
    return edit


def _scoped(line: str, pattern: str, make) -> str:
    """Replace the operand register that ``pattern`` captures (group 1) by ``t1`` computed in
    an inline scope: ``{ .reg .b32 t<2>; <make(reg)>; <line with t1> }``."""
    m = re.search(pattern, line)
    if m is None:
        return line
    reg = m.group(1)
    body = line[:m.start(1)] + "mut1" + line[m.end(1):]
    return f"{{ .reg .b32 mut<2>; {make(reg)}; {body.strip()} }}"


def _flip_parity(line):
    return _scoped(line, r"try_wait\.parity\S*\s+\S+,\s*\[[^\]]+\],\s*(%r\d+)",
                   lambda r: f"xor.b32 mut1, {r}, 1")


def _shift_tmem_columns(line):
    return _scoped(line, r"tcgen05\.ld\S*\s+\{[^}]*\},\s*\[(%r\d+)\]",
                   lambda r: f"add.s32 mut1, {r}, 32")


def _one_more_arrival(line):
    return _scoped(line, r"mbarrier\.init\S*\s+\[[^\]]+\],\s*(%r\d+)",
                   lambda r: f"add.s32 mut1, {r}, 1")


def _halve_expect_tx(n: int) -> Callable[[str], str]:
    """Halve the byte count of the n-th ``mbarrier.arrive.expect_tx`` (its ``mov`` source)."""
    def edit(ptx):
        lines = ptx.splitlines()
        i = _lines_with(ptx, "mbarrier.arrive.expect_tx")[n]
        reg = re.search(r",\s*(%r\d+);", lines[i]).group(1)
        for j in range(i - 1, -1, -1):
            m = re.match(rf"^(\s*mov\.b32\s+{re.escape(reg)},\s*)(\d+);", lines[j])
            if m:
                lines[j] = f"{m.group(1)}{int(m.group(2)) // 2};"
                return "\n".join(lines)
        raise ValueError(f"no mov defines {reg} before line {i + 1}")
    return edit


def _commit_at_issue(ptx):
    """Every ``tcgen05.commit`` to a run-time barrier address (the K/V stages' empty barriers)
    becomes a plain arrive: the slot is freed when its MMAs are issued, not completed."""
    out, n = [], 0
    for line in ptx.splitlines():
        m = re.match(r"^(\s*)tcgen05\.commit\.cta_group::1\.mbarrier::arrive::one"
                     r"\.shared::cluster\.b64\s+\[(%r\d+)\];", line)
        if m:
            line = f"{m.group(1)}mbarrier.arrive.shared::cluster.b64 _, [{m.group(2)}];"
            n += 1
        out.append(line)
    if not n:
        raise ValueError("no 1-CTA tcgen05.commit to a run-time barrier address")
    return "\n".join(out)


def _silence_vote(line):
    m = re.match(r"^(\s*)vote\.sync\.ballot\.b32\s+(%r\d+),", line)
    return line if m is None else f"{m.group(1)}mov.b32 {m.group(2)}, 0;"


CATALOGUE: tuple[Mutation, ...] = (
    Mutation("drop_wait_st", "every tcgen05.wait::st removed (P and rescaled O unwaited)",
             _drop("tcgen05.wait::st")),
    Mutation("flip_parity", "the first mbarrier wait's phase parity flipped",
             _rewrite_nth("mbarrier.try_wait.parity", 0, _flip_parity)),
    Mutation("tmem_column", "the first tcgen05.ld reads 32 columns further right",
             _rewrite_nth("tcgen05.ld.", 0, _shift_tmem_columns)),
    Mutation("drop_cluster_arrive", "the cluster-scope mbarrier arrives removed",
             _drop("mbarrier.arrive.shared::cluster.b64")),
    Mutation("cta_scope_arrive", "the cluster-scope mbarrier arrives made CTA-scope",
             lambda ptx: ptx.replace("mbarrier.arrive.shared::cluster.b64",
                                     "mbarrier.arrive.shared.b64")),
    Mutation("arrival_count", "the first mbarrier expects one arrival more",
             _rewrite_nth("mbarrier.init", 0, _one_more_arrival)),
    Mutation("expect_tx_half", "the Q tile's expected bytes halved (2-CTA: one CTA's half)",
             _halve_expect_tx(1)),
    Mutation("drop_proxy_fence", "fence.proxy.async removed before the O TMA store",
             _drop("fence.proxy.async")),
    Mutation("free_slot_early", "K/V slots released when their MMAs issue, not complete",
             _commit_at_issue, config="1cta"),
    Mutation("skip_vote", "the correction vote always says no rescale",
             _rewrite_nth("vote.sync.ballot", 0, _silence_vote)),
)
BY_NAME = {m.name: m for m in CATALOGUE}


def mutation_inputs():
    from fa_sm100.emulation.cases import Case, make_inputs

    return make_inputs(Case(name="mutate", seqlen_q=128, seqlen_k=384, head_dim=64,
                            head_dim_v=64, inputs="rising_order", slope=0.1))


def run_mutation(mut: Mutation, policy: str) -> str:
    """How the layers see ``mut`` under ``policy``: "report: ..." (the emulator names the
    fault), "values: ..." (the run completes with results that differ from the numerics
    emulation or break the float64 rule) or "missed"."""
    from fa_sm100.config import config_from_overrides
    from fa_sm100.emulation import emulate_sm100_fwd
    from fa_sm100.ptxemu.memory import EmulationError
    from fa_sm100.ptxemu.sm100_run import run_forward
    from fa_sm100.testing import attention_reference, check_against_reference

    cfg = config_from_overrides(list(CONFIGS[mut.config]))
    q, k, v = mutation_inputs()
    scale = 1.0 / math.sqrt(64)
    try:
        run = run_forward(cfg, q, k, v, scale, ptx_edit=mut.edit, policy=policy)
    except EmulationError as err:
        return "report: " + _first_sentence(str(err))
    out, _ = emulate_sm100_fwd(q, k, v, scale, config=cfg)
    diff = int((run.out.view(torch.int16) != out.view(torch.int16)).sum())
    ref, _ = attention_reference(q, k, v, scale)
    plain, _ = attention_reference(q, k, v, scale, dtype=q.dtype, upcast=False)
    try:
        check_against_reference(run.out, ref, plain, atol=1e-3, what="O")
        rule = ""
    except AssertionError:
        rule = ", breaks the float64 rule"
    return f"values: differ from the emulation{rule}" if diff else "missed"


# What an emulator report says, by the words it uses (the table names the kind of fault the
# emulator saw, not the warp or line, which depend on the schedule)
_REPORT_KINDS = (
    ("deadlock", "deadlock"),
    ("overlap an asynchronous write", "TMEM accessed under a pending asynchronous write"),
    ("asynchronous read still pending", "TMEM written under a tcgen05.ld not yet waited"),
    ("MMA operand in shared", "MMA operand read under a pending TMA load"),
    ("asynchronous read of it is pending", "shared memory overwritten before its read"),
    ("fence.proxy.async", "generic store not fenced for the async proxy"),
    ("uninitialized", "uninitialized read"),
    ("another CTA's window", "CTA-scope access to the peer CTA's shared memory"),
)


def _first_sentence(text: str) -> str:
    for needle, kind in _REPORT_KINDS:
        if needle in text:
            return kind
    text = text.splitlines()[0]
    return re.sub(r"^cta\d+\.warp\d+ line \d+ \([^)]*\): ", "", text)[:100]


def run_catalogue(names=None, policies=POLICIES, log=None) -> dict:
    """{mutation name: {policy: outcome}} for the catalogue (or ``names``)."""
    results = {}
    for mut in CATALOGUE:
        if names and mut.name not in names:
            continue
        results[mut.name] = {}
        for policy in policies:
            if log:
                log(f"{mut.name} under {policy} ...")
            results[mut.name][policy] = run_mutation(mut, policy)
    return results


def caught(outcomes: dict) -> bool:
    return any(o != "missed" for o in outcomes.values())


def render_table(results: dict) -> str:
    """The markdown table of docs/verification.md."""
    policies = list(next(iter(results.values())))
    head = "| fault | " + " | ".join(f"`{p}` schedule" for p in policies) + " |"
    rows = [head, "|" + "---|" * (len(policies) + 1)]
    for name, outcomes in results.items():
        mut = BY_NAME[name]
        cells = [outcomes[p].replace("|", "/") for p in policies]
        rows.append(f"| `{name}` ({mut.config}): {mut.what} | " + " | ".join(cells) + " |")
    return "\n".join(rows)
