"""Issue rates of the backward loop's per-element instructions on the GPU at hand (sm_90a).

Round 35's question: which pipe does the loop's math wait on? Each variant runs one PTX
sequence in 8 independent chains per thread (4 times per loop turn), 1024 threads per CTA,
one CTA per SM, and reads the SM's cycles with %clock64. It prints instructions and results per
clock per SM (an instruction on a pair gives 2 results) and, for the mixes, whether the two
kinds share a pipe: the mix's time over the sum of its parts' times (1.0: one pipe) and over
the larger part (1.0: two pipes, fully overlapped).

The kernels are PTX written here (no nvcc), built with ptxas for sm_90a; the SASS of each is
disassembled (nvdisasm) and each loop's opcodes counted, so what every PTX form becomes is on
record. `--sass-only` does that much on a machine without a GPU.

    python docs/data/round35/pipe_throughput.py [--out DIR] [--sass-only] [--ptxas P] [--nvdisasm N]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import pathlib
import re
import shutil
import subprocess
import tempfile

from fa_sm100.compile_tools import find_nvdisasm

CHAINS = 8
REPEAT = 4
THREADS = 1024
ITERS = 2048

# name -> (PTX for one step of one chain, in place on the b32 register X, C a loop-invariant
# register; results per step)
OPS = {
    "ex2.f32": ("ex2.approx.ftz.f32 X, X;", 1),
    "ex2.f16x2": ("ex2.approx.f16x2 X, X;", 2),
    "ex2.bf16x2": ("ex2.approx.ftz.bf16x2 X, X;", 2),
    "cvt.bf16x2.f32": ("cvt.rn.bf16x2.f32 X, X, X;", 2),
    "cvt.f16x2.f32": ("cvt.rn.f16x2.f32 X, X, X;", 2),
    "fma.f32": ("fma.rn.f32 X, X, 0f3F800001, 0f3F000000;", 1),
    "fma.bf16x2": ("fma.rn.bf16x2 X, X, X, X;", 2),
    "fma.f16x2": ("fma.rn.f16x2 X, X, X, X;", 2),
    # round to nearest even by integer ops (one float into both halves, as a pair would cost)
    "rne_int.bf16x2": ("{ .reg .b32 t, r; shr.u32 t, X, 16; and.b32 t, t, 1; add.u32 r, X, 0x7fff;"
                       " add.u32 r, r, t; shr.u32 t, X, 15; and.b32 t, t, 1; add.u32 t, X, t;"
                       " add.u32 t, t, 0x7fff; prmt.b32 X, r, t, 0x7632; }", 2),
    "prmt": ("prmt.b32 X, X, X, 0x7632;", 1),
    "shfl.idx": ("shfl.sync.idx.b32 X, X, C, 0x1f, 0xffffffff;", 1),
}
MIXES = {
    "ex2.f32+cvt.bf16x2.f32": ("ex2.f32", "cvt.bf16x2.f32"),
    "ex2.f32+fma.f32": ("ex2.f32", "fma.f32"),
    "cvt.bf16x2.f32+fma.f32": ("cvt.bf16x2.f32", "fma.f32"),
    "ex2.f32+prmt": ("ex2.f32", "prmt"),
    "ex2.f32+fma.bf16x2": ("ex2.f32", "fma.bf16x2"),
    "ex2.f32+shfl.idx": ("ex2.f32", "shfl.idx"),
    "cvt.bf16x2.f32+shfl.idx": ("cvt.bf16x2.f32", "shfl.idx"),
}


def ident(name: str) -> str:
    return "k_" + re.sub(r"[^A-Za-z0-9]", "_", name)


def kernel_ptx(name: str, bodies: list[str]) -> str:
    regs = ", ".join(f"v{j}" for j in range(CHAINS))
    init = "\n".join(f"  add.u32 v{j}, v0, {j};" for j in range(1, CHAINS))
    steps = "\n".join("  " + b.replace("X", f"v{j}")
                      for _ in range(REPEAT) for j in range(CHAINS) for b in bodies)
    fold = "\n".join(f"  xor.b32 acc, acc, v{j};" for j in range(CHAINS))
    return f"""
.visible .entry {ident(name)}(.param .u64 p_out, .param .u64 p_cycles, .param .u32 p_iters)
.maxntid {THREADS}, 1, 1
{{
  .reg .b32 {regs}, tid, bid, i, n, acc, C;
  .reg .b64 t0, t1, po, pc, off;
  .reg .pred p;
  mov.u32 tid, %tid.x;
  mov.u32 bid, %ctaid.x;
  mad.lo.u32 v0, tid, 77, 0x3f000000;
  mul.lo.u32 C, tid, 3;
  and.b32 C, C, 31;
{init}
  ld.param.u32 n, [p_iters];
  bar.sync 0;
  mov.u64 t0, %clock64;
  mov.u32 i, 0;
LOOP:
{steps}
  add.u32 i, i, 1;
  setp.lt.u32 p, i, n;
  @p bra LOOP;
  bar.sync 0;
  mov.u64 t1, %clock64;
  mov.u32 acc, 0;
{fold}
  ld.param.u64 po, [p_out];
  ld.param.u64 pc, [p_cycles];
  cvta.to.global.u64 po, po;
  cvta.to.global.u64 pc, pc;
  mad.lo.u32 i, bid, {THREADS}, tid;
  mul.wide.u32 off, i, 4;
  add.u64 po, po, off;
  st.global.u32 [po], acc;
  setp.ne.u32 p, tid, 0;
  @p bra DONE;
  mul.wide.u32 off, bid, 8;
  add.u64 pc, pc, off;
  sub.s64 t1, t1, t0;
  st.global.u64 [pc], t1;
DONE:
  ret;
}}
"""


def variants() -> dict[str, tuple[list[str], list[int]]]:
    out = {name: ([body], [per]) for name, (body, per) in OPS.items()}
    for name, (a, b) in MIXES.items():
        out[name] = ([OPS[a][0], OPS[b][0]], [OPS[a][1], OPS[b][1]])
    return out


def find_ptxas(given: str | None) -> str:
    """``--ptxas``, else ptxas on PATH, in /usr/local/cuda/bin or in an nvidia wheel's bin."""
    if given:
        return given
    path = shutil.which("ptxas")
    if path:
        return path
    if pathlib.Path("/usr/local/cuda/bin/ptxas").exists():
        return "/usr/local/cuda/bin/ptxas"
    try:
        import nvidia
        for root in nvidia.__path__:
            for cand in pathlib.Path(root).glob("*/bin/ptxas"):
                return str(cand)
    except ImportError:
        pass
    raise SystemExit("ptxas not found: pass --ptxas")


def build(out_dir: pathlib.Path, ptxas: str, nvdisasm: str) -> tuple[pathlib.Path, dict]:
    vs = variants()
    ptx = ".version 8.0\n.target sm_90a\n.address_size 64\n" + "".join(
        kernel_ptx(n, v[0]) for n, v in vs.items())
    src = out_dir / "pipe_throughput.ptx"
    src.write_text(ptx)
    cubin = out_dir / "pipe_throughput.cubin"
    subprocess.run([ptxas, "-arch=sm_90a", "-O3", "-o", str(cubin), str(src)], check=True)
    sass = subprocess.run([nvdisasm, "-c", str(cubin)], check=True, capture_output=True,
                          text=True).stdout
    (out_dir / "pipe_throughput.sass").write_text(sass)
    return cubin, vs


def loop_opcodes(sass: str) -> dict[str, dict[str, int]]:
    """Per kernel: the opcodes between the two clock reads (the timed loop), counted."""
    out = {}
    for part in re.split(r"\n\s*\.text\.", sass)[1:]:
        fname = part.split(":", 1)[0].strip()
        body = part.split("CS2R", 1)[-1].rsplit("CS2R", 1)[0]
        hist: dict[str, int] = {}
        for op in re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", body):
            hist[op] = hist.get(op, 0) + 1
        out[fname] = dict(sorted(hist.items(), key=lambda kv: -kv[1]))
    return out


def run(cubin: pathlib.Path, vs: dict) -> dict:
    import torch
    from cuda.bindings import driver as cu

    torch.zeros(1, device="cuda")  # a context
    err, mod = cu.cuModuleLoad(str(cubin).encode())
    assert err == cu.CUresult.CUDA_SUCCESS, err
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = torch.empty(sms * THREADS, dtype=torch.int32, device="cuda")
    cyc = torch.empty(sms, dtype=torch.int64, device="cuda")
    results = {}
    for name, (_, pers) in vs.items():
        err, fn = cu.cuModuleGetFunction(mod, ident(name).encode())
        assert err == cu.CUresult.CUDA_SUCCESS, (name, err)
        samples = []
        for rep in range(5):
            args = [ctypes.c_void_p(out.data_ptr()), ctypes.c_void_p(cyc.data_ptr()),
                    ctypes.c_uint32(ITERS)]
            ptrs = (ctypes.c_void_p * 3)(*[ctypes.addressof(a) for a in args])
            err, = cu.cuLaunchKernel(fn, sms, 1, 1, THREADS, 1, 1, 0, 0, ctypes.addressof(ptrs), 0)
            assert err == cu.CUresult.CUDA_SUCCESS, (name, err)
            torch.cuda.synchronize()
            if rep:  # the first launch warms up
                samples.append(sorted(cyc.tolist())[sms // 2])
        cycles = min(samples)
        steps = THREADS * ITERS * REPEAT * CHAINS
        results[name] = {"cycles": cycles,
                         "instr_per_clk_per_sm": steps * len(pers) / cycles,
                         "results_per_clk_per_sm": steps * sum(pers) / cycles}
    for name, (a, b) in MIXES.items():
        ta, tb, tm = results[a]["cycles"], results[b]["cycles"], results[name]["cycles"]
        results[name]["mix_over_sum"] = tm / (ta + tb)
        results[name]["mix_over_max"] = tm / max(ta, tb)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--sass-only", action="store_true")
    ap.add_argument("--ptxas")
    ap.add_argument("--nvdisasm")
    args = ap.parse_args()
    out_dir = pathlib.Path(args.out or tempfile.mkdtemp(prefix="pipes_"))
    out_dir.mkdir(parents=True, exist_ok=True)
    cubin, vs = build(out_dir, find_ptxas(args.ptxas), args.nvdisasm or find_nvdisasm())
    ops = loop_opcodes((out_dir / "pipe_throughput.sass").read_text())
    for fname, hist in ops.items():
        print(f"SASS {fname}: " + ", ".join(f"{o} x{n}" for o, n in list(hist.items())[:6]))
    record = {"chains": CHAINS, "repeat": REPEAT, "threads": THREADS, "iters": ITERS,
              "loop_opcodes": ops}
    if not args.sass_only:
        import torch
        record["device"] = torch.cuda.get_device_name(0)
        record["results"] = run(cubin, vs)
        print(f"device: {record['device']}; {THREADS} threads, 1 CTA per SM, {CHAINS} chains")
        for name, r in record["results"].items():
            mix = (f"   mix/sum {r['mix_over_sum']:.2f}  mix/max {r['mix_over_max']:.2f}"
                   if "mix_over_sum" in r else "")
            print(f"{name:26s} {r['instr_per_clk_per_sm']:7.1f} instr/clk/SM "
                  f"{r['results_per_clk_per_sm']:7.1f} results/clk/SM{mix}")
    (out_dir / "pipe_throughput.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
