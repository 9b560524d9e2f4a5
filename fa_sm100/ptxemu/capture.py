"""Obtain a kernel's PTX and its launch without a GPU.

Method (a stand-in for the CUDA driver entry points, no C compiler needed):
1. ``cute.compile(host_fn, *fake_args, options="--gpu-arch sm_100a --keep-ptx ...")``
   cross-compiles; the PTX comes back in ``compiled.artifacts.PTX``.
2. The compiled host module (LLVM dialect, ``compiled.ir_module``) is re-parsed with every
   CUDA runtime/driver symbol it calls renamed (``@_cudaLaunchKernelEx`` ->
   ``@faemu__cudaLaunchKernelEx``) and JIT-compiled again by MLIR's ExecutionEngine with
   no runtime library; the renamed symbols are bound to Python ctypes callbacks
   (``raw_register_runtime``) before anything is materialized.
3. The host function is called with real CPU tensors (``from_dlpack``). Its calls reach the
   callbacks: ``_cudaLaunchKernelEx`` records grid, block, dynamic SMEM, the cluster
   attribute and the bytes of every kernel parameter; ``_cuTensorMapEncodeTiled`` records
   the tensor-map arguments and writes a 128-byte descriptor carrying a tag and the record's
   id, so the emulator finds the tensor map from the kernel parameter. Any other driver call
   the host code makes returns an error that names it. (CuTe DSL 4.8 itself encodes its
   tensor maps inline in the host code instead; the emulator decodes those bytes, see
   ``tensormap.py``.)
The kernel parameters are exactly what the host code would hand the GPU: pointers into the
CPU tensors, which the emulator registers as global memory.
"""

from __future__ import annotations

import ctypes
import re
import tempfile
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .parser import PtxModule, parse_ptx

TMAP_MAGIC = 0x54_4D_41_50_45_4D_55_00      # "\0UMEPAMT" tag in the first 8 bytes
_PREFIX = "faemu_"


@dataclass
class TensorMap:
    """The arguments of one cuTensorMapEncodeTiled call."""
    dtype: int                     # CUtensorMapDataType
    rank: int
    address: int
    dims: tuple                    # elements per dimension, innermost first
    strides: tuple                 # bytes, for dimensions 1..rank-1
    box: tuple
    element_strides: tuple
    interleave: int
    swizzle: int                   # CUtensorMapSwizzle: 0 none, 1 32B, 2 64B, 3 128B, ...
    l2_promotion: int
    oob_fill: int

    elem_size: int = 0             # set when decoded from descriptor bytes

    @property
    def elem_bytes(self) -> int:
        if self.elem_size:
            return self.elem_size
        # CUtensorMapDataType of the driver call
        return {0: 1, 1: 2, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2, 10: 4, 11: 4,
                12: 4}.get(self.dtype, 0)


@dataclass
class LaunchRecord:
    grid: tuple
    block: tuple
    cluster: tuple
    dynamic_smem: int
    param_bytes: bytes
    attrs: dict = field(default_factory=dict)


@dataclass
class Capture:
    ptx: str
    module: PtxModule
    launches: list
    tensormaps: list
    compiled: object = None
    launch_regs: Optional[int] = None      # registers per thread at launch (from the cubin)

    @property
    def kernel(self):
        if len(self.module.kernels) != 1:
            raise ValueError(f"expected one kernel in the PTX, found {list(self.module.kernels)}")
        return next(iter(self.module.kernels.values()))


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint32 * 3), ("block", ctypes.c_uint32 * 3),
                ("smem", ctypes.c_size_t), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.c_void_p), ("nattrs", ctypes.c_uint32)]


class _LaunchAttr(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int32), ("pad", ctypes.c_uint8 * 4), ("val", ctypes.c_uint8 * 64)]


_CLUSTER_ATTR = 4                            # cudaLaunchAttributeClusterDimension


def compile_kernel(host_fn, fake_args, arch: str = "sm_100a"):
    """Cross-compile ``host_fn``; returns (compiled function, PTX text). The cubin's
    per-kernel register count (what a launch starts with) is kept as
    ``compiled.emu_launch_regs`` (kernel name -> registers per thread)."""
    import cutlass.cute as cute
    from fa_sm100.compile_tools import cubin_attributes
    with tempfile.TemporaryDirectory() as d:
        compiled = cute.compile(host_fn, *fake_args,
                                options=f"--gpu-arch {arch} --keep-ptx --keep-cubin "
                                        f"--dump-dir {d}")
        ptx = compiled.artifacts.PTX
        if ptx and not ptx.lstrip().startswith("//") and "\n" not in ptx:
            with open(ptx) as f:
                ptx = f.read()
        cubin = compiled.artifacts.CUBIN
        if isinstance(cubin, str):
            with open(cubin, "rb") as f:
                cubin = f.read()
    if not ptx:
        raise RuntimeError("the compile produced no PTX")
    regs = {}
    if cubin:
        regs = {k: v["registers"] for k, v in cubin_attributes(cubin).items()
                if "registers" in v}
    compiled.emu_launch_regs = regs
    return compiled, ptx


class _DriverStandIn:
    """ctypes callbacks standing in for the CUDA runtime/driver calls of the host code."""

    def __init__(self, kernel_params: list):
        self.kernel_params = kernel_params
        self.launches: list = []
        self.tensormaps: list = []
        self.unsupported: list = []
        self._keep: list = []

    def callbacks(self, names):
        I32, P = ctypes.c_int32, ctypes.c_void_p
        table = {
            "_cudaLaunchKernelEx": (ctypes.CFUNCTYPE(I32, P, P, P), self.launch),
            "_cuTensorMapEncodeTiled": (ctypes.CFUNCTYPE(
                I32, P, I32, ctypes.c_uint32, P, P, P, P, P, I32, I32, I32, I32), self.encode),
            "_cudaGetDevice": (ctypes.CFUNCTYPE(I32, P), self.get_device),
            "_cudaDeviceGetAttribute": (ctypes.CFUNCTYPE(I32, P, I32, I32), self.attribute),
        }
        out = {}
        for n in names:
            if n in table:
                proto, fn = table[n]
            else:
                proto, fn = ctypes.CFUNCTYPE(I32), self._unsupported(n)
            cb = proto(fn)
            self._keep.append(cb)
            out[n] = ctypes.cast(cb, ctypes.c_void_p).value
        return out

    def _unsupported(self, name):
        def fn():
            self.unsupported.append(name)
            return 999
        return fn

    def get_device(self, p):
        ctypes.c_int32.from_address(p).value = 0
        return 0

    def attribute(self, p, attr, dev):
        ctypes.c_int32.from_address(p).value = 232448 if attr == 97 else 0
        return 0

    def launch(self, cfg_p, kernel, args_p):
        cfg = _LaunchConfig.from_address(cfg_p)
        attrs = {}
        cluster = (1, 1, 1)
        for i in range(cfg.nattrs):
            a = _LaunchAttr.from_address(cfg.attrs + i * ctypes.sizeof(_LaunchAttr))
            vals = tuple(np.frombuffer(bytes(a.val[:12]), dtype=np.uint32).tolist())
            attrs[a.id] = vals
            if a.id == _CLUSTER_ATTR:
                cluster = vals
        argv = (ctypes.c_void_p * len(self.kernel_params)).from_address(args_p)
        buf = bytearray()
        for i, prm in enumerate(self.kernel_params):
            while len(buf) % prm.align:
                buf.append(0)
            buf += ctypes.string_at(argv[i], prm.size)
        self.launches.append(LaunchRecord(tuple(cfg.grid), tuple(cfg.block), cluster,
                                          int(cfg.smem), bytes(buf), attrs))
        return 0

    def encode(self, out, dtype, rank, addr, dims, strides, box, estr, inter, swz, l2, oob):
        def arr(p, n, t):
            return tuple(t.from_address(p + i * ctypes.sizeof(t)).value for i in range(n))
        tm = TensorMap(dtype, rank, addr or 0, arr(dims, rank, ctypes.c_uint64),
                       arr(strides, rank - 1, ctypes.c_uint64), arr(box, rank, ctypes.c_uint32),
                       arr(estr, rank, ctypes.c_uint32), inter, swz, l2, oob)
        desc = np.zeros(16, dtype=np.uint64)
        desc[0] = TMAP_MAGIC
        desc[1] = len(self.tensormaps)
        self.tensormaps.append(tm)
        ctypes.memmove(out, desc.tobytes(), 128)
        return 0


def capture_launch(host_fn, fake_args, real_args, arch: str = "sm_100a",
                   compiled=None, ptx: Optional[str] = None) -> Capture:
    """Compile ``host_fn`` for ``arch`` and run its host code against the driver stand-in.

    ``real_args`` are the host function's arguments with CPU tensors in place of GPU ones
    (``cutlass.cute.runtime.from_dlpack``) and ``cuda.bindings.driver.CUstream(0)`` for the
    stream. Returns the PTX, the parsed module and every recorded launch."""
    from cutlass._mlir import ir
    from cutlass._mlir.execution_engine import ExecutionEngine

    if compiled is None:
        compiled, ptx = compile_kernel(host_fn, fake_args, arch)
    module = parse_ptx(ptx)
    if len(module.kernels) != 1:
        raise ValueError(f"capture handles one kernel per host function, found "
                         f"{list(module.kernels)}")
    kernel = next(iter(module.kernels.values()))
    text = str(compiled.ir_module)
    names = sorted(set(re.findall(r"llvm\.func @(_cu\w+)\(", text)))
    for n in names:
        text = re.sub(rf"@{n}\b", f"@{_PREFIX}{n}", text)
    stand_in = _DriverStandIn(kernel.params)
    with compiled.ir_module.context:
        host = ir.Module.parse(text)
    engine = ExecutionEngine(host, opt_level=0, shared_libs=[])
    for n, addr in stand_in.callbacks(names).items():
        engine.raw_register_runtime(_PREFIX + n, ctypes.c_void_p(addr))
    exe_args, _ = compiled.execution_args.generate_execution_args(tuple(real_args), {})
    result = ctypes.c_int32(0)
    packed = (ctypes.c_void_p * (len(exe_args) + 1))()
    for i, a in enumerate(exe_args):
        packed[i] = a if type(a) is ctypes.c_void_p else ctypes.c_void_p(a).value
    packed[len(exe_args)] = ctypes.addressof(result)
    fn = engine.raw_lookup(compiled.function_name)
    if not fn:
        raise RuntimeError(f"host entry {compiled.function_name} not found in the JIT module")
    ctypes.CFUNCTYPE(None, ctypes.c_void_p)(fn)(packed)
    if stand_in.unsupported:
        raise RuntimeError(f"the host code called {stand_in.unsupported}, which the driver "
                           "stand-in does not model")
    if result.value != 0:
        raise RuntimeError(f"the host code returned CUDA error {result.value}")
    if not stand_in.launches:
        raise RuntimeError("the host code launched no kernel")
    cap = Capture(ptx, module, stand_in.launches, stand_in.tensormaps, compiled)
    cap.launch_regs = getattr(compiled, "emu_launch_regs", {}).get(kernel.name)
    cap._engine = engine                      # keep the callbacks' owner alive
    cap._stand_in = stand_in
    return cap
