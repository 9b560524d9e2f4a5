"""Parser for the subset of PTX that CuTe DSL emits (kernel entries, register and shared
declarations, predicated instructions, labels and the ``{ ... }`` scopes of inline asm).

The output is plain data: a ``PtxModule`` with one ``PtxKernel`` per ``.entry``. Each
instruction keeps its source line so the executor can name it in every error. Anything the
parser does not understand raises ``PtxParseError`` with the line; nothing is skipped
silently except comments, ``.pragma`` and the module header directives.
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from typing import Optional, Union


class PtxParseError(ValueError):
    pass


# ----------------------------------------------------------------------------------------
# Operands


@dataclass(frozen=True)
class Reg:
    name: str           # unique name (scoped registers are renamed "P1@3")


@dataclass(frozen=True)
class Imm:
    value: Union[int, float]
    is_float_bits: Optional[str] = None   # "f32" / "f64" when written as 0fXXXXXXXX / 0dXXX..


@dataclass(frozen=True)
class Special:
    name: str           # "%tid.x", "%laneid", "%cluster_ctarank", ...


@dataclass(frozen=True)
class Sym:
    name: str           # a variable, parameter or label name


@dataclass(frozen=True)
class Addr:
    base: Union[Reg, Sym, Imm]
    offset: int = 0


@dataclass(frozen=True)
class TensorRef:        # [tmap, {coords}] of cp.async.bulk.tensor
    tmap: object
    coords: tuple


@dataclass(frozen=True)
class Vec:
    items: tuple


@dataclass(frozen=True)
class Not:              # "!%p1" as a source operand (vote, setp combine, selp)
    operand: object


@dataclass(frozen=True)
class Pair:             # "%r18|%p2" (elect.sync) or "_|%p2"
    first: object
    second: object


@dataclass(frozen=True)
class Sink:             # "_"
    pass


Operand = Union[Reg, Imm, Special, Sym, Addr, Vec, Pair, Sink]


@dataclass
class Instr:
    line: int
    text: str
    opcode: str                      # full dotted opcode, e.g. "mbarrier.try_wait.parity.shared.b64"
    operands: list
    pred: Optional[Reg] = None
    pred_neg: bool = False

    @property
    def parts(self) -> list:
        return self.opcode.split(".")


@dataclass
class Param:
    name: str
    size: int
    align: int


@dataclass
class SharedVar:
    name: str
    size: int                        # 0 for the extern dynamic array
    align: int
    extern: bool


@dataclass
class PtxKernel:
    name: str
    params: list
    reqntid: Optional[tuple]
    reg_types: dict                  # register prefix or scoped name -> PTX type ("b32", "pred")
    instrs: list
    labels: dict                     # scoped label name -> instruction index
    maxnreg: Optional[int] = None
    explicit_cluster: Optional[tuple] = None


@dataclass
class PtxModule:
    target: str
    shared_vars: list = field(default_factory=list)
    kernels: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------
# Lexing

_COMMENT_LINE = re.compile(r"//.*")
_COMMENT_BLOCK = re.compile(r"/\*.*?\*/", re.S)
_REG_RANGE = re.compile(r"^(%?[A-Za-z_$][\w$]*)<(\d+)>$")
_INT = re.compile(r"^-?(0[xX][0-9a-fA-F]+|\d+)U?$")
_FLOAT_BITS = re.compile(r"^0([fFdD])([0-9a-fA-F]+)$")
SPECIAL_REGS = {
    "%tid", "%ntid", "%ctaid", "%nctaid", "%laneid", "%warpid", "%nwarpid", "%clusterid",
    "%nclusterid", "%cluster_ctaid", "%cluster_nctaid", "%cluster_ctarank",
    "%cluster_nctarank", "%smid", "%nsmid", "%gridid", "%lanemask_eq", "%lanemask_lt",
    "%lanemask_le", "%lanemask_gt", "%lanemask_ge", "%dynamic_smem_size",
    "%total_smem_size", "%aggr_smem_size", "%is_explicit_cluster", "%clock", "%clock64",
    "%globaltimer", "%globaltimer_lo", "%globaltimer_hi",
}


def _statements(text: str):
    """Yield (line, statement) pairs; statements are split on ';', '{', '}' and labels."""
    text = _COMMENT_BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    buf, start_line = [], None
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = _COMMENT_LINE.sub("", raw)
        i = 0
        while i < len(line):
            ch = line[i]
            if ch == '"':                     # string literal (pragmas)
                j = line.index('"', i + 1)
                buf.append(line[i:j + 1])
                i = j + 1
                continue
            cur = "".join(buf).strip()
            if ch == ":" and re.fullmatch(r"[A-Za-z_$][\w$]*", cur) and line[i + 1:i + 2] != ":":
                yield (start_line or lineno, cur + ":")
                buf, start_line = [], None
                i += 1
                continue
            if (ch == "{" and cur and not cur.startswith(".")) or \
                    (ch == "}" and cur.count("{") > cur.count("}")):
                # a brace inside a statement is a vector operand ({%r1, %r2}), not a scope
                buf.append(ch)
                i += 1
                continue
            if ch in ";{}":
                stmt = "".join(buf).strip()
                if stmt:
                    yield (start_line or lineno, stmt)
                if ch in "{}":
                    yield (lineno, ch)
                buf, start_line = [], None
                i += 1
                continue
            if not buf and not ch.isspace() and start_line is None:
                start_line = lineno
            buf.append(ch)
            i += 1
        # labels end a line: "$L__BB0_2:" or "LAB_WAIT:"
        stmt = "".join(buf).strip()
        m = re.match(r"^([A-Za-z_$][\w$]*)\s*:$", stmt)
        if m or re.match(r"^\.(version|target|address_size|loc|file)\b", stmt):
            yield (start_line or lineno, stmt)
            buf, start_line = [], None
        elif buf:
            buf.append(" ")


def _split_operands(s: str) -> list:
    out, depth, cur = [], 0, []
    for ch in s:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        out.append("".join(cur).strip())
    return out


def _parse_int(tok: str) -> int:
    tok = tok.rstrip("U")
    neg = tok.startswith("-")
    body = tok[1:] if neg else tok
    v = int(body, 16) if body.lower().startswith("0x") else int(body, 10)
    return -v if neg else v


# ----------------------------------------------------------------------------------------
# Parser


class _Scope:
    def __init__(self, sid: int, parent: Optional["_Scope"]):
        self.sid, self.parent = sid, parent
        self.regs: dict = {}      # declared name -> unique name
        self.labels: dict = {}    # declared label -> unique label


class _KernelParser:
    def __init__(self, name: str):
        self.name = name
        self.params: list = []
        self.reqntid = None
        self.maxnreg = None
        self.cluster = None
        self.reg_types: dict = {}
        self.instrs: list = []
        self.labels: dict = {}
        self.scope_count = 0
        self.scope: Optional[_Scope] = None
        self.pending: list = []   # (instr, label operand index, scope) to resolve at the end

    def push(self):
        self.scope_count += 1
        self.scope = _Scope(self.scope_count, self.scope)

    def pop(self):
        self.scope = self.scope.parent

    def declare_reg(self, typ: str, name: str):
        m = _REG_RANGE.match(name)
        if m:                       # "%r<24>": a family sharing a prefix
            prefix = m.group(1)
            # a family of an inner scope (inline asm): "tmp@7." + index, so that the scope id
            # and the register's index stay apart ("tmp@2" + "1" would read as scope 21)
            uniq = (prefix if self.scope.parent is None or self.scope.sid == 1
                    else f"{prefix}@{self.scope.sid}.")
            self.scope.regs[prefix + "<>"] = uniq
            self.reg_types[uniq + "<>"] = typ
            return
        uniq = name if self.scope.sid == 1 else f"{name}@{self.scope.sid}"
        self.scope.regs[name] = uniq
        self.reg_types[uniq] = typ

    def lookup_reg(self, tok: str) -> Optional[str]:
        s = self.scope
        m = re.match(r"^(%?[A-Za-z_$][\w$]*?)(\d+)$", tok)
        while s is not None:
            if tok in s.regs:
                return s.regs[tok]
            if m and (m.group(1) + "<>") in s.regs:
                return s.regs[m.group(1) + "<>"] + m.group(2)
            s = s.parent
        return None

    def operand(self, tok: str, line: int):
        tok = tok.strip()
        if tok == "_":
            return Sink()
        if tok.startswith("[") and tok.endswith("]"):
            inner = tok[1:-1].strip().replace(" ", "")
            items = _split_operands(inner)
            if len(items) > 1:                 # [tensormap, {c0, c1, ...}] (TMA)
                return TensorRef(self.operand(items[0], line),
                                 tuple(self.operand(t, line) for t in items[1:]))
            m = re.match(r"^(.*?)(?:\+(-?(?:0[xX][0-9a-fA-F]+|\d+)))?$", inner)
            base_tok, off = m.group(1), m.group(2)
            if re.fullmatch(r"-?(0[xX][0-9a-fA-F]+|\d+)", base_tok):
                return Addr(Imm(_parse_int(base_tok)), _parse_int(off) if off else 0)
            base = self.operand(base_tok, line)
            return Addr(base, _parse_int(off) if off else 0)
        if tok.startswith("{") and tok.endswith("}"):
            return Vec(tuple(self.operand(t, line) for t in _split_operands(tok[1:-1])))
        if tok.startswith("!"):
            return Not(self.operand(tok[1:], line))
        if "|" in tok:
            a, b = tok.split("|")
            return Pair(self.operand(a, line), self.operand(b, line))
        m = _FLOAT_BITS.match(tok)
        if m:
            kind = "f32" if m.group(1) in "fF" else "f64"
            return Imm(int(m.group(2), 16), is_float_bits=kind)
        if _INT.match(tok):
            return Imm(_parse_int(tok))
        base = tok.split(".")[0]
        if base in SPECIAL_REGS:
            return Special(tok)
        uniq = self.lookup_reg(tok)
        if uniq is not None:
            return Reg(uniq)
        if re.fullmatch(r"[A-Za-z_$%][\w$.]*", tok):
            return Sym(tok)
        raise PtxParseError(f"line {line}: cannot parse operand {tok!r}")

    def instruction(self, stmt: str, line: int):
        pred, neg = None, False
        m = re.match(r"^@(!?)(\S+)\s+(.*)$", stmt, re.S)
        if m:
            neg = m.group(1) == "!"
            p = self.lookup_reg(m.group(2))
            if p is None:
                raise PtxParseError(f"line {line}: unknown predicate {m.group(2)!r}")
            pred = Reg(p)
            stmt = m.group(3)
        parts = stmt.split(None, 1)
        opcode = parts[0]
        ops_text = parts[1] if len(parts) > 1 else ""
        operands = [self.operand(t, line) for t in _split_operands(ops_text)] if ops_text else []
        ins = Instr(line=line, text=stmt.strip(), opcode=opcode, operands=operands,
                    pred=pred, pred_neg=neg)
        if opcode.split(".")[0] in ("bra", "brx", "call"):
            self.pending.append((ins, self.scope))
        self.instrs.append(ins)

    def label(self, name: str):
        uniq = name if self.scope.sid == 1 else f"{name}@{self.scope.sid}"
        self.scope.labels[name] = uniq
        self.labels[uniq] = len(self.instrs)

    def finish(self) -> PtxKernel:
        for ins, scope in self.pending:
            if ins.opcode.split(".")[0] != "bra":
                raise PtxParseError(f"line {ins.line}: unsupported control transfer "
                                    f"{ins.opcode!r}")
            target = ins.operands[0]
            if not isinstance(target, Sym):
                raise PtxParseError(f"line {ins.line}: branch target is not a label")
            s = scope
            while s is not None and target.name not in s.labels:
                s = s.parent
            if s is None:
                raise PtxParseError(f"line {ins.line}: unknown label {target.name!r}")
            ins.operands[0] = Sym(s.labels[target.name])
        return PtxKernel(self.name, self.params, self.reqntid, self.reg_types, self.instrs,
                         self.labels, self.maxnreg, self.cluster)


_DIRECTIVES_IGNORED = (".version", ".target", ".address_size", ".pragma", ".loc", ".file")


def parse_ptx(text: str) -> PtxModule:
    """Parse PTX text into a ``PtxModule``. Raises ``PtxParseError`` (with the line)."""
    mod = PtxModule(target="")
    kp: Optional[_KernelParser] = None
    header: list = []               # tokens of an .entry header being collected
    in_params = False
    for line, stmt in _statements(text):
        if kp is None:
            if stmt.startswith(".target"):
                mod.target = stmt.split()[1]
                continue
            if stmt.startswith(_DIRECTIVES_IGNORED):
                continue
            m = re.match(r"^(?:\.extern\s+|\.visible\s+)?\.shared\s+(?:\.align\s+(\d+)\s+)?"
                         r"\.(\w+)\s+([\w$]+)\[(\d*)\]$", stmt)
            if m:
                align = int(m.group(1) or 1)
                size = int(m.group(4)) if m.group(4) else 0
                mod.shared_vars.append(SharedVar(m.group(3), size, align,
                                                 stmt.startswith(".extern")))
                continue
            m = re.match(r"^\.visible\s+\.entry\s+([\w$]+)\s*\((.*)\)\s*(.*)$", stmt, re.S)
            if m is None and stmt.startswith((".visible .entry", ".entry")):
                # params are split on ';'? no: entries use ',' inside '(...)'
                raise PtxParseError(f"line {line}: cannot parse entry header")
            if m:
                kp = _KernelParser(m.group(1))
                for ptxt in _split_operands(m.group(2)):
                    pm = re.match(r"^\.param\s+(?:\.align\s+(\d+)\s+)?\.(\w+)\s+([\w$]+)"
                                  r"(?:\[(\d+)\])?$", ptxt.strip())
                    if pm is None:
                        raise PtxParseError(f"line {line}: cannot parse parameter {ptxt!r}")
                    typ = pm.group(2)
                    width = int(re.sub(r"\D", "", typ) or 8) // 8 if typ != "pred" else 1
                    size = width * int(pm.group(4)) if pm.group(4) else width
                    kp.params.append(Param(pm.group(3), size, int(pm.group(1) or width)))
                _kernel_directives(kp, m.group(3), line)
                continue
            if stmt == "{" or stmt == "}":
                raise PtxParseError(f"line {line}: brace outside a kernel")
            raise PtxParseError(f"line {line}: unsupported module-level statement {stmt!r}")
        # inside a kernel (after the header)
        if stmt == "{":
            kp.push()
            continue
        if stmt == "}":
            kp.pop()
            if kp.scope is None:
                k = kp.finish()
                mod.kernels[k.name] = k
                kp = None
            continue
        if kp.scope is None:        # directives between ')' and '{'
            _kernel_directives(kp, stmt, line)
            continue
        if stmt.endswith(":") and re.match(r"^[A-Za-z_$][\w$]*\s*:$", stmt):
            kp.label(stmt[:-1].strip())
            continue
        if stmt.startswith(".reg"):
            m = re.match(r"^\.reg\s+\.(\w+)\s+(.*)$", stmt)
            if m is None:
                raise PtxParseError(f"line {line}: cannot parse {stmt!r}")
            for name in _split_operands(m.group(2)):
                kp.declare_reg(m.group(1), name.strip())
            continue
        if stmt.startswith(".pragma") or stmt.startswith(".loc"):
            continue
        if stmt.startswith(".shared") or stmt.startswith(".local"):
            raise PtxParseError(f"line {line}: kernel-local {stmt.split()[0]} variables are "
                                "not supported")
        if stmt.startswith("."):
            raise PtxParseError(f"line {line}: unsupported directive {stmt!r}")
        kp.instruction(stmt, line)
    if kp is not None:
        raise PtxParseError(f"kernel {kp.name}: missing closing brace")
    return mod


def _kernel_directives(kp: _KernelParser, text: str, line: int):
    for m in re.finditer(r"\.(\w+)\s+([\d,\s]+)", text):
        nums = tuple(int(x) for x in m.group(2).replace(" ", "").split(",") if x)
        key = m.group(1)
        if key == "reqntid":
            kp.reqntid = nums + (1,) * (3 - len(nums))
        elif key == "maxnreg":
            kp.maxnreg = nums[0]
        elif key in ("explicitcluster", "reqnctapercluster"):
            kp.cluster = nums + (1,) * (3 - len(nums))
        elif key in ("maxntid", "minnctapersm", "maxclusterrank"):
            pass
        else:
            raise PtxParseError(f"line {line}: unsupported kernel directive .{key}")


def f32_from_bits(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]
