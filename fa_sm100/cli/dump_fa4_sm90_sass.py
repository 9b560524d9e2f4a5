"""Cross-compile FlashAttention-4's SM90 forward (or backward) on a machine with no GPU, keep
its PTX, cubin and SASS, and (``--diff``) compare its main loop with ours instruction by
instruction.

    python scripts/dump_fa4_sm90_sass.py --hdim 256 --out /tmp/fa4_h256
    python scripts/dump_fa4_sm90_sass.py --hdim 128 --out /tmp/cmp_h128 --diff
    python scripts/dump_fa4_sm90_sass.py --hdim 128 --diff --pythonpath /tmp/triton_site
    python scripts/dump_fa4_sm90_sass.py --mode bwd --hdim 128 --causal --diff

``--mode bwd`` compiles FA4's backward (``_flash_attn_bwd`` with its own SM90 tile choice) and
keeps the main kernel's cubin (the one with HGMMAs; the pre/postprocess are skipped); ours is
``sm90_bwd`` with its ``select_bwd_config`` defaults for the same problem.

FA4 is compiled in a child process through its public ``flash_attn_func`` under torch's
FakeTensorMode (FLASH_ATTENTION_ARCH=sm_90 selects the SM90 kernel, CUTE_DSL_ARCH=sm_90a the
target, FLASH_ATTENTION_NUM_SMS the SM count of an H100/H200), so it builds the same
``FlashAttentionForwardSm90`` object it would on an H200 (its ``_tile_size_fwd_sm90`` tiles);
the constructor arguments it used are printed. As in the benchmark, the inputs do not require
grad, so FA4 writes no LSE (ours does unless ``--set write_lse=false``).

Files in --out: ``fa4/*.sm_90a.{ptx,cubin}`` and ``fa4.sass``; with --diff also ``ours/`` and
``ours.sass`` (``scripts/inspect.py --kernel sm90_fwd`` for the same head dims and causality,
``--set`` overrides passed through).

The "main loop" of a kernel is the loop closed by a conditional backward branch that holds the
most HGMMAs (the consumers' unmasked n-block loop; out-of-line mbarrier retry stubs branch back
unconditionally and are skipped). --diff prints both loops' instruction counts by kind.

Needs flash-attn-4 and what ``import flash_attn.cute`` imports (triton, einops): put them on
the child's path with --pythonpath when they are not installed; nvdisasm as for inspect.py.
"""

from __future__ import annotations


import argparse
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

from fa_sm100.compile_tools import sass_main_loop, sass_opcode
from fa_sm100.machines import HOPPER_SMS


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("fwd", "bwd"), default="fwd", help="forward or backward kernel")
    p.add_argument("--hdim", type=int, default=128, help="head dim of Q/K (default 128)")
    p.add_argument("--hdim-v", type=int, default=None, help="head dim of V (default: --hdim)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--seqlen", type=int, default=8192, help="problem size FA4 is asked for")
    p.add_argument("--num-sms", type=int, default=HOPPER_SMS,
                   help=f"SM count FA4 assumes (H100/H200: {HOPPER_SMS})")
    p.add_argument("--out", default="/tmp/fa4_sm90_sass", help="output folder (default %(default)s)")
    p.add_argument("--pythonpath", default=None,
                   help="prepended to the FA4 child's PYTHONPATH (e.g. where triton/einops are)")
    p.add_argument("--diff", action="store_true",
                   help="also compile ours and print both main loops' instruction counts")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="with --diff: a config override for ours (Sm90FwdConfig / BwdConfig; repeatable)")
    p.add_argument("--full-opcodes", action="store_true",
                   help="with --diff: count opcodes with all modifiers (default: by base opcode)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- FA4 compile (child process) ------------------------------------------------------------

def _child(args) -> int:
    """Runs with CUTE_DSL_* and FLASH_ATTENTION_* set by the parent: compile FA4, report args."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    import flash_attn.cute.flash_bwd_sm90 as bwd_mod
    import flash_attn.cute.flash_fwd_sm90 as fwd_mod
    from flash_attn.cute.interface import _flash_attn_bwd, flash_attn_func

    cls = (bwd_mod.FlashAttentionBackwardSm90 if args.mode == "bwd"
           else fwd_mod.FlashAttentionForwardSm90)
    seen = []
    original_init = cls.__init__

    def init(self, *a, **kw):
        original_init(self, *a, **kw)
        seen.append((a, kw))

    cls.__init__ = init
    dtype = getattr(torch, args.dtype)
    hdim_v = args.hdim_v or args.hdim
    heads = max(1, 2048 // args.hdim)
    batch = max(1, 16384 // args.seqlen)
    with FakeTensorMode():
        q = torch.empty(batch, args.seqlen, heads, args.hdim, dtype=dtype, device="cuda")
        k = torch.empty(batch, args.seqlen, heads, args.hdim, dtype=dtype, device="cuda")
        v = torch.empty(batch, args.seqlen, heads, hdim_v, dtype=dtype, device="cuda")
        if args.mode == "bwd":
            out, dout = (torch.empty(batch, args.seqlen, heads, hdim_v, dtype=dtype, device="cuda")
                         for _ in range(2))
            lse = torch.empty(batch, heads, args.seqlen, dtype=torch.float32, device="cuda")
            _flash_attn_bwd(q, k, v, out, dout, lse, causal=args.causal)
        else:
            flash_attn_func(q, k, v, causal=args.causal)
    if not seen:
        print(f"FA4 did not construct {cls.__name__}", file=sys.stderr)
        return 1
    a, kw = seen[-1]
    print("FA4_ARGS " + json.dumps({"args": [repr(x) for x in a],
                                    "kwargs": {k: repr(v) for k, v in kw.items()}}))
    return 0


_FA4_CLASS = {"fwd": "FlashAttentionForwardSm90", "bwd": "FlashAttentionBackwardSm90"}


def compile_fa4(args, out: Path) -> Path:
    """Compile FA4 into out/fa4; return the disassembled SASS's path (out/fa4.sass)."""
    from fa_sm100.compile_tools import disassemble, find_nvdisasm

    nvdisasm = find_nvdisasm()
    dump = out / "fa4"
    dump.mkdir(parents=True, exist_ok=True)
    for old in list(dump.glob("*.sm_90a.*")):
        old.unlink()
    from fa_sm100.cli import child_env

    env = child_env(CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_ARCH="sm_90",
               FLASH_ATTENTION_NUM_SMS=str(args.num_sms), CUTE_DSL_KEEP="ptx,cubin",
               CUTE_DSL_DUMP_DIR=str(dump))
    if args.pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (args.pythonpath, env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", __spec__.name, "--child", "--mode", args.mode, "--hdim", str(args.hdim),
           "--dtype", args.dtype, "--seqlen", str(args.seqlen)]
    if args.hdim_v:
        cmd += ["--hdim-v", str(args.hdim_v)]
    if args.causal:
        cmd.append("--causal")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise SystemExit(f"compiling FA4's SM90 {args.mode} failed (exit {proc.returncode}):\n{tail}")
    for line in proc.stdout.splitlines():
        if line.startswith("FA4_ARGS "):
            info = json.loads(line[len("FA4_ARGS "):])
            print(f"FA4 {_FA4_CLASS[args.mode]}(" + ", ".join(
                info["args"] + [f"{k}={v}" for k, v in info["kwargs"].items()]) + ")")
    # the backward also compiles its pre/postprocess: keep the kernel with tensor-core MMAs
    texts = {c: disassemble(c, nvdisasm) for c in sorted(dump.glob("*.sm_90a.cubin"))}
    mma = [c for c, text in texts.items() if "HGMMA" in text]
    if len(mma) != 1:
        raise SystemExit(f"expected one FA4 cubin with HGMMAs in {dump}, found {[c.name for c in mma]}")
    sass = out / "fa4.sass"
    sass.write_text(texts[mma[0]])
    return sass


def compile_ours(args, out: Path) -> Path:
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"
    from fa_sm100.inspection import inspect_kernel

    overrides = [f"head_dim={args.hdim}", f"causal={args.causal}", f"dtype={args.dtype}"]
    if args.hdim_v:
        overrides.append(f"head_dim_v={args.hdim_v}")
    keep = out / "ours"
    keep.mkdir(parents=True, exist_ok=True)
    kernel = "sm90_bwd" if args.mode == "bwd" else "sm90_fwd"
    inspect_kernel(kernel, "sm_90a", overrides + list(args.overrides), keep_dir=keep)
    sass_files = sorted(keep.glob("*.sass"))
    sass = out / "ours.sass"
    sass.write_text(sass_files[-1].read_text())
    return sass


# ---- SASS main-loop analysis ----------------------------------------------------------------

def main_loop(text: str):
    """``compile_tools.sass_main_loop``, with a failure as the script's exit message."""
    try:
        return sass_main_loop(text)
    except ValueError as e:
        raise SystemExit(str(e))


def histogram(body, full: bool) -> collections.Counter:
    h = collections.Counter()
    for _, instr in body:
        op = sass_opcode(instr)
        h[op if full or op.startswith("HGMMA") else op.split(".")[0]] += 1
    return h


def print_diff(named_bodies, full: bool) -> None:
    hists = [(name, histogram(body, full), body) for name, body in named_bodies]
    for name, _, body in hists:
        print(f"{name}: main loop {body[0][0]:#x}..{body[-1][0]:#x}, {len(body)} instructions")
    keys = sorted(set().union(*(h for _, h, _ in hists)),
                  key=lambda k: (-max(h[k] for _, h, _ in hists), k))
    print(f"{'opcode':34}" + "".join(f"{name:>10}" for name, _, _ in hists))
    for k in keys:
        vals = [h[k] for _, h, _ in hists]
        print(f"{k:34}" + "".join(f"{v:10d}" for v in vals) + ("" if len(set(vals)) == 1 else "  *"))
    print(f"{'TOTAL':34}" + "".join(f"{len(b):10d}" for _, _, b in hists))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return _child(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fa4_sass = compile_fa4(args, out)
    print(f"FA4 SASS: {fa4_sass}")
    if args.diff:
        ours_sass = compile_ours(args, out)
        print(f"our SASS: {ours_sass}")
        print_diff([("fa4", main_loop(fa4_sass.read_text())),
                    ("ours", main_loop(ours_sass.read_text()))], args.full_opcodes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
