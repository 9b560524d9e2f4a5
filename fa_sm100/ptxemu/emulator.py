"""Run a captured launch on the emulated machine."""

from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

from .capture import Capture, LaunchRecord
from .decode import HANDLERS, UnsupportedInstruction
from .machine import Launch, Machine
from .memory import RESERVED_SMEM, GlobalMemory
from .parser import parse_ptx
from layouts.smem import align_up


def build_launch(cap: Capture, index: int = 0) -> Launch:
    rec = cap.launches[index]
    kernel = cap.kernel
    offsets, pos = {}, 0
    for p in kernel.params:
        pos = align_up(pos, p.align)
        offsets[p.name] = pos
        pos += p.size
    shared, off = {}, RESERVED_SMEM
    for v in cap.module.shared_vars:
        if not v.extern:
            off = align_up(off, v.align)
            shared[v.name] = off
            off += v.size
    static = off - RESERVED_SMEM
    for v in cap.module.shared_vars:
        if v.extern:
            off = align_up(off, v.align)
            shared[v.name] = off
    static = max(static, off - RESERVED_SMEM)
    if kernel.reqntid is not None and tuple(kernel.reqntid) != tuple(rec.block):
        raise ValueError(f"launch block {rec.block} differs from the kernel's .reqntid "
                         f"{kernel.reqntid}")
    return Launch(kernel=kernel, grid=rec.grid, block=rec.block, cluster=rec.cluster,
                  dynamic_smem=rec.dynamic_smem, param_bytes=rec.param_bytes,
                  param_offsets=offsets, tensormaps=dict(enumerate(cap.tensormaps)),
                  static_smem=static, shared_offsets=shared, launch_regs=cap.launch_regs)


def emulate(cap: Capture, buffers: Sequence, seed: int = 0, index: Optional[int] = None,
            trace: Optional[list] = None, max_steps: int = 2_000_000, policy: str = "random",
            strict_fences: bool = False):
    """Execute the captured launch(es) on the CPU. ``buffers`` are the contiguous CPU
    tensors whose memory the kernel may touch (its global memory); results land in them.
    ``policy``: when asynchronous operations complete (``machine.parse_policy``);
    ``strict_fences``: check Note [tcgen05 thread-sync fences].
    Returns the last Machine (for inspection of step counts and traces)."""
    gmem = GlobalMemory()
    for i, t in enumerate(buffers):
        if not t.is_contiguous():
            raise ValueError(f"buffer {i} is not contiguous")
        gmem.register(t.data_ptr(), t.numel() * t.element_size(), f"buffer{i}")
    machine = None
    for li in ([index] if index is not None else range(len(cap.launches))):
        machine = Machine(build_launch(cap, li), gmem, seed=seed, max_steps=max_steps,
                          trace=trace, policy=policy, strict_fences=strict_fences)
        machine.run()
    return machine


def launch_from_ptx(ptx: str, grid=(1, 1, 1), block=(32, 1, 1), params: Sequence = (),
                    dynamic_smem: int = 0, cluster=(1, 1, 1), tensormaps=None):
    """A Launch for hand-written PTX: ``params`` are NumPy scalars (their bytes are the
    parameter values) or ints (64-bit), one per ``.param`` of the single kernel."""
    import numpy as np
    mod = parse_ptx(ptx)
    kernel = next(iter(mod.kernels.values()))
    if len(params) != len(kernel.params):
        raise ValueError(f"kernel has {len(kernel.params)} parameters, {len(params)} given")
    buf = bytearray()
    for p, v in zip(kernel.params, params):
        while len(buf) % p.align:
            buf.append(0)
        raw = (np.uint64(v).tobytes() if isinstance(v, int) else np.asarray(v).tobytes())
        if len(raw) != p.size:
            raise ValueError(f"parameter {p.name} takes {p.size} bytes, got {len(raw)}")
        buf += raw
    cap = Capture(ptx, mod, [LaunchRecord(tuple(grid), tuple(block), tuple(cluster),
                                          dynamic_smem, bytes(buf))], list(tensormaps or []))
    return cap


def instruction_coverage(ptx: str) -> tuple:
    """(opcode -> count, unsupported opcode -> count) over every kernel of ``ptx``: which of
    the kernel's instructions the emulator models today."""
    counts, missing = Counter(), Counter()
    for k in parse_ptx(ptx).kernels.values():
        for ins in k.instrs:
            counts[ins.opcode] += 1
            factory = HANDLERS.get(ins.opcode.split(".")[0])
            try:
                if factory is None:
                    raise UnsupportedInstruction(ins.opcode)
                factory(ins, k)                # decoding rejects unmodelled variants
            except UnsupportedInstruction:
                missing[ins.opcode] += 1
    return counts, missing


def write_trace(trace: list, path: str, kernel, roles: Optional[dict] = None):
    """Per-warp event trace as JSON: one event per executed warp instruction, in execution
    order (``step`` is the logical time: the emulator has no clock). ``roles`` maps a warp id
    to its role name (e.g. ``WarpRoles.role_warps()`` inverted) for readers that group by
    role."""
    import json
    events = []
    for i, (cl, gid, pc, n) in enumerate(trace):
        ev = {"cluster": cl, "warp": gid, "step": i, "line": kernel.instrs[pc].line,
              "op": kernel.instrs[pc].opcode, "lanes": n}
        if roles:
            ev["role"] = roles.get(int(gid.rsplit("warp", 1)[1]), "")
        events.append(ev)
    with open(path, "w") as f:
        json.dump({"kernel": kernel.name, "time": "logical (execution order)",
                   "events": events}, f)
