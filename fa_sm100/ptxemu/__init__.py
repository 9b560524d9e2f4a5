"""A PTX-level functional emulator for small problems (issue 9).

``capture_launch`` cross-compiles a CuTe-DSL host function and records its launch through a
stand-in for the CUDA driver; ``emulate`` executes the kernel's own PTX on the CPU with
per-thread program counters, a seeded warp scheduler and checked memory, barriers and
mbarriers. See docs/ptx_emulator.md for what a run proves and what it cannot.
"""

from .capture import Capture, TensorMap, capture_launch, compile_kernel
from .decode import UnsupportedInstruction
from .emulator import build_launch, emulate, instruction_coverage, launch_from_ptx, write_trace
from .memory import EmulationError
from .parser import PtxParseError, parse_ptx

__all__ = ["Capture", "TensorMap", "capture_launch", "compile_kernel", "emulate",
           "build_launch", "launch_from_ptx", "instruction_coverage", "write_trace",
           "EmulationError", "UnsupportedInstruction", "PtxParseError",
           "parse_ptx"]
