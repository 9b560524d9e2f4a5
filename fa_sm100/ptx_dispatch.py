"""Which warps of a CTA reach which ``setmaxnreg`` in a kernel's PTX.

The inspect report must not only find each declared ``setmaxnreg`` value somewhere in the
code: the value must be executed by the warps of the role that declares it (a build that swaps
two roles' budgets has the same values, in the wrong warpgroups). Warp-specialized kernels
dispatch on the warp index, ``warp = tid.x / 32`` made warp-uniform with ``shfl.sync.idx``, and
the DSL lowers ``if warp == 14:`` / ``if warp < 8:`` / ``if warp // 4 == 2:`` to a ``setp`` on
that value and a branch. So for each warp ``w``:

1. evaluate every register that is defined once, unpredicated, from ``%tid.x`` and immediates
   through the integer ops below (``tid.x >> 5`` is ``w``; any other use of ``tid.x`` is
   lane-dependent, hence unknown), and every predicate ``setp`` computes from such values;
2. walk the control flow from the entry: a branch whose predicate is known for ``w`` goes one
   way, any other branch both ways (a loop bound, an elected lane, ...);
3. collect the ``setmaxnreg`` instructions on the reachable paths.

The result over-approximates (a data-dependent branch keeps both sides) but never misses a
``setmaxnreg`` a warp can execute. The PTX is parsed by ``fa_sm100.ptxemu.parser``.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

from fa_sm100.config import WARP_SIZE

# Integer ops evaluated on known values; 32-bit results.
_MASK = 0xFFFFFFFF
_BINARY = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "and": lambda a, b: a & b,
    "or": lambda a, b: a | b,
    "xor": lambda a, b: a ^ b,
    "shl": lambda a, b: a << b,
    "shr": lambda a, b: a >> b,
    "div": lambda a, b: a // b if b else None,
    "rem": lambda a, b: a % b if b else None,
    "min": min,
    "max": max,
}
_COMPARE = {
    "eq": lambda a, b: a == b, "ne": lambda a, b: a != b,
    "lt": lambda a, b: a < b, "le": lambda a, b: a <= b,
    "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b,
    "lo": lambda a, b: a < b, "ls": lambda a, b: a <= b,
    "hi": lambda a, b: a > b, "hs": lambda a, b: a >= b,
}


class DispatchUnknown(ValueError):
    """The PTX cannot be read for warp dispatch (no such entry, unparsable, no tid.x)."""


class _Tid:
    """``%tid.x``: differs across the lanes of a warp; only ``>> 5`` (or ``/ 32``) is known."""


_TID = _Tid()


def _signed(v: int) -> int:
    v &= _MASK
    return v - (1 << 32) if v & 0x80000000 else v


def _dests(ins) -> list:
    from fa_sm100.ptxemu.parser import Pair, Reg

    if not ins.operands:
        return []
    d = ins.operands[0]
    if isinstance(d, Pair):
        return [x.name for x in (d.first, d.second) if isinstance(x, Reg)]
    return [d.name] if isinstance(d, Reg) else []


def _evaluate(ins, env: dict, warp: int):
    """The value ``ins`` gives its (single) destination for ``warp``, or None if unknown."""
    from fa_sm100.ptxemu.parser import Imm, Not, Reg, Special

    def val(op):
        if isinstance(op, Imm) and isinstance(op.value, int) and op.is_float_bits is None:
            return op.value
        if isinstance(op, Reg):
            return env.get(op.name)
        if isinstance(op, Not):
            inner = val(op.operand)
            return (not inner) if isinstance(inner, bool) else None
        if isinstance(op, Special) and op.name == "%tid.x":
            return _TID
        return None

    parts = ins.parts
    op, src = parts[0], [val(o) for o in ins.operands[1:]]
    if op in ("mov", "cvt") and len(src) == 1:
        return src[0]
    if op == "shfl" and "idx" in parts and src and isinstance(src[0], int) \
            and not isinstance(src[0], bool):
        return src[0]  # warp-uniform value read from any lane: itself
    if "pred" in parts and op in ("not", "and", "or", "xor"):
        if not all(isinstance(s, bool) for s in src):
            return None
        if op == "not":
            return not src[0]
        return {"and": all, "or": any, "xor": lambda v: v[0] != v[1]}[op](src)
    if op == "selp" and len(src) == 3 and isinstance(src[2], bool):
        return src[0] if src[2] else src[1]
    if op == "setp" and len(parts) >= 3 and parts[1] in _COMPARE and len(src) == 2:
        a, b = src
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in src):
            return None
        if parts[-1].startswith("s"):
            a, b = _signed(a), _signed(b)
        else:
            a, b = a & _MASK, b & _MASK
        return _COMPARE[parts[1]](a, b)
    if op in _BINARY and len(src) == 2:
        a, b = src
        if a is _TID and isinstance(b, int):
            if op == "shr" and b >= 5:
                return warp >> (b - 5)
            if op == "div" and b > 0 and b % WARP_SIZE == 0:
                return warp // (b // WARP_SIZE)
            return None
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in src):
            return None
        if parts[-1].startswith("s") and op in ("shr", "div", "rem", "min", "max"):
            a, b = _signed(a), _signed(b)
        r = _BINARY[op](a, b)
        return None if r is None else r & _MASK
    return None


def _known_values(instrs, defs: Counter, warp: int) -> dict:
    """Register -> value for ``warp`` (ints and predicate bools), single-definition registers
    only (``defs``: register -> number of definitions), evaluated in program order."""
    env: dict = {}
    for ins in instrs:
        dests = _dests(ins)
        if ins.pred is not None or not dests or any(defs[d] != 1 for d in dests):
            continue
        v = _evaluate(ins, env, warp)
        if v is None:
            continue
        if len(dests) == 2 and ins.parts[0] == "setp" and isinstance(v, bool):
            env[dests[0]], env[dests[1]] = v, not v  # setp p|q: q is the complement
        elif len(dests) == 1:
            env[dests[0]] = v
    return env


def _reachable(instrs, labels: dict, env: dict) -> set:
    """Indices of the instructions ``env``'s warp can reach from the entry."""

    def guard(ins) -> Optional[bool]:
        if ins.pred is None:
            return True
        g = env.get(ins.pred.name)
        if not isinstance(g, bool):
            return None
        return (not g) if ins.pred_neg else g

    seen: set = set()
    stack = [0]
    while stack:
        i = stack.pop()
        while i < len(instrs) and i not in seen:
            seen.add(i)
            ins = instrs[i]
            g = guard(ins)
            op = ins.parts[0]
            if op == "bra":
                target = labels[ins.operands[0].name]
                if g is True:
                    i = target
                    continue
                if g is None:
                    stack.append(target)
            elif op in ("ret", "exit", "trap") and g is True:
                break
            i += 1
    return seen


def setmaxnreg_by_warp(ptx: str, entry: str, num_warps: int) -> list[list[tuple[str, int]]]:
    """For each warp 0..num_warps-1, the (direction, registers) of every ``setmaxnreg`` it can
    reach in ``entry``, in program order. Raises DispatchUnknown when the PTX cannot be read."""
    from fa_sm100.ptxemu.parser import Imm, PtxParseError, parse_ptx

    try:
        kernel = parse_ptx(ptx).kernels.get(entry)
    except (PtxParseError, ValueError, KeyError, IndexError) as e:
        raise DispatchUnknown(f"the PTX could not be parsed: {type(e).__name__}: {e}") from e
    if kernel is None:
        raise DispatchUnknown(f"the PTX has no entry {entry!r}")
    if kernel.reqntid is not None and tuple(kernel.reqntid)[1:] not in ((), (1,), (1, 1)):
        raise DispatchUnknown(f".reqntid {kernel.reqntid} is not 1-D: tid.x / 32 is not the warp")
    instrs = kernel.instrs
    sites = [i for i, ins in enumerate(instrs) if ins.parts[0] == "setmaxnreg"]
    for i in sites:
        if not (instrs[i].operands and isinstance(instrs[i].operands[0], Imm)):
            raise DispatchUnknown(f"PTX line {instrs[i].line}: setmaxnreg without an immediate")
    defs = Counter(name for ins in instrs for name in _dests(ins))
    out = []
    for warp in range(num_warps):
        env = _known_values(instrs, defs, warp)
        seen = _reachable(instrs, kernel.labels, env)
        out.append([(instrs[i].parts[1], int(instrs[i].operands[0].value))
                    for i in sites if i in seen])
    return out
