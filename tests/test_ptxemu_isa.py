"""PTX emulator, hand-written PTX: instruction semantics against values computed by NumPy
(or exactly with fractions), and the run-time checks (deadlock, out-of-bounds, uninitialized
shared memory, unsupported instructions) each provoked on purpose."""

from fractions import Fraction

import numpy as np
import pytest
import torch

from fa_sm100.ptxemu import (EmulationError, UnsupportedInstruction, emulate, launch_from_ptx,
                             parse_ptx)

HEADER = ".version 8.8\n.target sm_100a\n.address_size 64\n"

BINARY = HEADER + """
.visible .entry k(.param .u64 pa, .param .u64 pb, .param .u64 pout)
.reqntid 32, 1, 1
{
    .reg .b32 %r<12>;
    .reg .b64 %rd<12>;
    .reg .pred %p<4>;
    ld.param.u64 %rd1, [pa];
    ld.param.u64 %rd2, [pb];
    ld.param.u64 %rd3, [pout];
    mov.u32 %r1, %tid.x;
    mul.wide.u32 %rd4, %r1, 4;
    add.s64 %rd5, %rd1, %rd4;
    add.s64 %rd6, %rd2, %rd4;
    add.s64 %rd7, %rd3, %rd4;
    ld.global.b32 %r2, [%rd5];
    ld.global.b32 %r3, [%rd6];
    BODY
    st.global.b32 [%rd7], %r4;
    ret;
}
"""


def run_binary(body, a, b, seed=0):
    """Run BODY (computing %r4 from %r2 = a[i], %r3 = b[i]) on 32 lanes; returns raw u32."""
    ta = torch.from_numpy(np.ascontiguousarray(a).view(np.uint32).copy())
    tb = torch.from_numpy(np.ascontiguousarray(b).view(np.uint32).copy())
    out = torch.zeros(32, dtype=torch.int32)
    cap = launch_from_ptx(BINARY.replace("BODY", body), block=(32, 1, 1),
                          params=[ta.data_ptr(), tb.data_ptr(), out.data_ptr()])
    emulate(cap, [ta, tb, out], seed=seed)
    return out.numpy().view(np.uint32)


def f32(x):
    return np.asarray(x, dtype=np.float32)


def round_f32_exact(q: Fraction) -> np.float32:
    """Round an exact rational to f32, nearest-even, by comparing the neighbours exactly."""
    r = np.float32(float(q))
    cands = [np.nextafter(r, np.float32(-np.inf)), r, np.nextafter(r, np.float32(np.inf))]
    best = min(cands, key=lambda c: (abs(Fraction(float(c)) - q),
                                     int(np.array(c).view(np.uint32)) & 1))
    return np.float32(best)


def test_fma_single_rounding_including_a_double_rounding_trap():
    rng = np.random.default_rng(0)
    a, b = f32(rng.standard_normal(32)), f32(rng.standard_normal(32))
    # lane 0: a*b + a, computed in f64 then rounded to f32, would land on a tie and round
    # the wrong way; the exact result is just below the midpoint.
    a[0] = np.float32(2.0 ** -24 * (1 + 2.0 ** -18))
    b[0] = np.float32(1 - 2.0 ** -18)
    c0 = np.float32(1 + 2.0 ** -23)
    body = "fma.rn.f32 %r4, %r2, %r3, %r5;"
    c = a.copy()
    c[0] = c0
    got = run_binary("mov.b32 %r5, %r2;\n setp.eq.u32 %p1, %r1, 0;\n"
                     f"@%p1 mov.b32 %r5, 0f{int(f32(c0).view(np.uint32)):08X};\n" + body, a, b)
    want = np.array([round_f32_exact(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
                     for x, y, z in zip(a, b, c)], dtype=np.float32)
    assert want[0] == c0                      # the trap is real
    naive = np.float32(np.float64(a[0]) * np.float64(b[0]) + np.float64(c0))
    assert naive != want[0]
    np.testing.assert_array_equal(got.view(np.float32), want)


@pytest.mark.parametrize("src_t", ["bf16", "f16"])
def test_mixed_precision_fma_and_add_widen_16_bit_sources(src_t):
    """sm_100's ``fma.rn.f32.bf16 d, a, b, c`` / ``add.rn.f32.bf16 d, a, c`` (what LLVM makes of
    a 16-bit product summed in f32): a and b are the low halves of %r2, %r3 read as 16-bit
    floats, widened exactly, the result rounded once as f32. Reading the 16-bit bits as f32
    gives subnormal garbage, which is what the emulator did before it modelled these forms."""
    rng = np.random.default_rng(2)
    t16 = torch.bfloat16 if src_t == "bf16" else torch.float16
    a16 = torch.from_numpy(rng.standard_normal(32).astype(np.float32)).to(t16)
    b16 = torch.from_numpy(rng.standard_normal(32).astype(np.float32)).to(t16)
    bits = lambda t: t.view(torch.int16).numpy().view(np.uint16).astype(np.uint32)  # noqa: E731
    a, b = bits(a16), bits(b16)
    c = np.float32(0.3125)
    prologue = (f"mov.b32 %r5, 0f{int(c.view(np.uint32)):08X};\n"
                "cvt.u16.u32 %rs1, %r2;\n cvt.u16.u32 %rs2, %r3;\n")
    decl = ".reg .b16 %rs<3>;\n"
    fma = run_binary(decl + prologue + f"fma.rn.f32.{src_t} %r4, %rs1, %rs2, %r5;", a, b)
    add = run_binary(decl + prologue + f"add.rn.f32.{src_t} %r4, %rs1, %r5;", a, b)
    x, y = a16.double().numpy(), b16.double().numpy()
    want_fma = np.array([round_f32_exact(Fraction(float(p)) * Fraction(float(q)) + Fraction(float(c)))
                         for p, q in zip(x, y)], dtype=np.float32)
    np.testing.assert_array_equal(fma.view(np.float32), want_fma)
    np.testing.assert_array_equal(add.view(np.float32), (x + np.float64(c)).astype(np.float32))


def test_packed_integer_dot_products_dp4a_dp2a():
    """dp4a: c + the four byte products of a and b; dp2a.lo/.hi: c + a's two 16-bit halves
    times bytes 0, 1 / 2, 3 of b; signed lanes for .s32, wrapping at 32 bits (LLVM emits
    dp2a.lo.u32.u32 for index arithmetic in the SM90 dQ postprocess)."""
    rng = np.random.default_rng(3)
    a = rng.integers(0, 2 ** 32, 32, dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 2 ** 32, 32, dtype=np.uint64).astype(np.uint32)
    c = 0x7FFFFFF0

    def lanes(x, bits, signed):
        v = [(int(x) >> (bits * i)) & ((1 << bits) - 1) for i in range(32 // bits)]
        return [u - (1 << bits) if signed and u >= 1 << (bits - 1) else u for u in v]

    for op, signed, pick in (("dp4a.u32.u32", False, None), ("dp4a.s32.s32", True, None),
                             ("dp2a.lo.u32.u32", False, slice(0, 2)),
                             ("dp2a.hi.s32.s32", True, slice(2, 4))):
        got = run_binary(f"mov.b32 %r5, {c};\n {op} %r4, %r2, %r3, %r5;", a, b)
        want = []
        for x, y in zip(a, b):
            la = lanes(x, 8 if pick is None else 16, signed)
            lb = lanes(y, 8, signed)
            lb = lb if pick is None else lb[pick]
            want.append((c + sum(p * q for p, q in zip(la, lb))) & 0xFFFFFFFF)
        np.testing.assert_array_equal(got, np.array(want, dtype=np.uint32), err_msg=op)


def test_prmt_may_select_from_a_register_nothing_wrote():
    """LLVM passes undef registers to prmt for don't-care bytes; reading them there is not an
    error (anywhere else it is), and the bytes taken from the written operand are exact."""
    a = np.arange(32, dtype=np.uint32) * 0x01010101
    b = np.zeros(32, dtype=np.uint32)
    got = run_binary("prmt.b32 %r4, %r2, %r9, 0x4410;", a, b)  # %r9: never written
    np.testing.assert_array_equal(got & 0xFFFF, a & 0xFFFF)
    with pytest.raises(EmulationError, match="read before it was written"):
        run_binary("add.u32 %r4, %r2, %r9;", a, b)


def test_cvt_bf16x2_packs_hi_lo_round_nearest_even():
    rng = np.random.default_rng(1)
    a, b = f32(rng.standard_normal(32) * 100), f32(rng.standard_normal(32))
    a[0] = np.float32(1 + 2.0 ** -8)          # exactly halfway between two bf16: to even
    b[0] = np.float32(1 + 3 * 2.0 ** -8)      # halfway, rounds up to even
    got = run_binary("cvt.rn.bf16x2.f32 %r4, %r2, %r3;", a, b)
    hi = torch.from_numpy(a).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    lo = torch.from_numpy(b).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(got, (hi.astype(np.uint32) << 16) | lo)
    assert got[0] >> 16 == 0x3F80 and got[0] & 0xFFFF == 0x3F82


def test_shifts_clamp_at_register_width():
    a = np.array([-(2 ** 31) + 5, 12345, -7, 1] * 8, dtype=np.int32)
    b = np.array(list(range(0, 40, 5)) * 4, dtype=np.uint32)[:32]
    sar = run_binary("shr.s32 %r4, %r2, %r3;", a, b).view(np.int32)
    np.testing.assert_array_equal(sar, a >> np.minimum(b, 31).astype(np.int32))
    shl = run_binary("shl.b32 %r4, %r2, %r3;", a, b)
    want = np.where(b >= 32, 0, (a.view(np.uint32).astype(np.uint64) << np.minimum(b, 31))
                    & 0xFFFFFFFF).astype(np.uint32)
    np.testing.assert_array_equal(shl, want)


def test_mul_hi_signed_and_unsigned():
    rng = np.random.default_rng(2)
    a = rng.integers(-2 ** 31, 2 ** 31, 32).astype(np.int32)
    b = rng.integers(-2 ** 31, 2 ** 31, 32).astype(np.int32)
    hs = run_binary("mul.hi.s32 %r4, %r2, %r3;", a, b).view(np.int32)
    np.testing.assert_array_equal(hs, ((a.astype(np.int64) * b) >> 32).astype(np.int32))
    hu = run_binary("mul.hi.u32 %r4, %r2, %r3;", a, b)
    au, bu = a.view(np.uint32).astype(np.uint64), b.view(np.uint32).astype(np.uint64)
    np.testing.assert_array_equal(hu, ((au * bu) >> 32).astype(np.uint32))


def test_float_max_nan_and_unordered_compare_select():
    a = f32([np.nan, 1.0, -2.0, np.nan] * 8)
    b = f32([3.0, np.nan, -1.0, np.nan] * 8)
    mx = run_binary("max.f32 %r4, %r2, %r3;", a, b).view(np.float32)
    np.testing.assert_array_equal(mx[:3], f32([3.0, 1.0, -1.0]))
    assert np.isnan(mx[3])
    sel = run_binary("setp.ltu.f32 %p1, %r2, %r3;\n selp.b32 %r4, 1, 2, %p1;", a, b)
    np.testing.assert_array_equal(sel[:4], [1, 1, 1, 1])
    sel = run_binary("setp.lt.f32 %p1, %r2, %r3;\n selp.b32 %r4, 1, 2, %p1;", a, b)
    np.testing.assert_array_equal(sel[:4], [2, 2, 1, 2])


def test_copysign_takes_the_first_operands_sign():
    """PTX's operand order (the sign from a, the magnitude from b), the reverse of C's."""
    a = f32([-1.0, 2.0, -0.0, 0.0, -3.0, 5.0, -np.inf, 1.0] * 4)
    b = f32([4.0, -4.0, 7.0, -7.0, -0.5, np.inf, 2.0, -0.0] * 4)
    got = run_binary("copysign.f32 %r4, %r2, %r3;", a, b).view(np.float32)
    np.testing.assert_array_equal(got, np.copysign(np.abs(b), a))
    assert np.signbit(got[2]) and not np.signbit(got[7])


def test_cvt_float_to_int_saturates_and_rounds_to_even():
    a = f32([2.5, -2.5, 3.5, 1e10, -1e10, np.nan, 0.49999997, -0.5] * 4)
    got = run_binary("cvt.rni.s32.f32 %r4, %r2;", a, a).view(np.int32)
    np.testing.assert_array_equal(got[:8], [2, -2, 4, 2 ** 31 - 1, -2 ** 31, 0, 0, 0])


def test_ex2_ftz_flushes_subnormal_input_and_packed_f32x2_add():
    a = f32([1e-40, 3.0, -1.5, 0.25] * 8)
    got = run_binary("ex2.approx.ftz.f32 %r4, %r2;", a, a).view(np.float32)
    np.testing.assert_array_equal(got[:4], f32([1.0, 8.0, 2.0 ** -1.5, 2.0 ** 0.25]))
    rng = np.random.default_rng(3)
    x, y = f32(rng.standard_normal(32)), f32(rng.standard_normal(32))
    body = ("mov.b64 %rd8, {%r2, %r3};\n mov.b64 %rd9, {%r3, %r2};\n"
            "add.rn.f32x2 %rd10, %rd8, %rd9;\n mov.b64 {%r5, %r6}, %rd10;\n"
            "sub.f32 %r4, %r5, %r6;")
    got = run_binary(body, x, y).view(np.float32)
    np.testing.assert_array_equal(got, (x + y) - (y + x))       # element-wise, not crossed
    body = ("mov.b64 %rd8, {%r2, %r3};\n mul.rn.f32x2 %rd10, %rd8, %rd8;\n"
            "mov.b64 {%r5, %r6}, %rd10;\n add.f32 %r4, %r5, %r6;")
    got = run_binary(body, x, y).view(np.float32)
    np.testing.assert_array_equal(got, x * x + y * y)


# ------------------------------------------------------------------------------------------
# checks

MBAR_DEADLOCK = HEADER + """
.extern .shared .align 1024 .b8 smem[];
.visible .entry k()
.reqntid 64, 1, 1
{
    .reg .b32 %r<8>;
    .reg .pred %p<4>;
    mov.u32 %r1, %tid.x;
    mov.b32 %r2, smem;
    setp.ne.u32 %p1, %r1, 0;
    @%p1 bra SKIP;
    mbarrier.init.shared.b64 [%r2], 1;
SKIP:
    bar.sync 0;
    mov.b32 %r3, 0;
WAIT:
    mbarrier.try_wait.parity.shared.b64 %p2, [%r2], %r3;
    @!%p2 bra WAIT;
    ret;
}
"""


def test_deadlock_names_each_warps_blocked_instruction():
    cap = launch_from_ptx(MBAR_DEADLOCK, block=(64, 1, 1), dynamic_smem=64)
    with pytest.raises(EmulationError) as e:
        emulate(cap, [], seed=0)
    msg = str(e.value)
    assert "deadlock" in msg
    assert "cta0.warp0" in msg and "cta0.warp1" in msg
    assert msg.count("mbarrier.try_wait.parity.shared.b64") == 2
    assert "1 arrivals" in msg


NAMED_BARRIER = HEADER + """
.visible .entry k()
.reqntid 64, 1, 1
{
    .reg .b32 %r<4>;
    .reg .pred %p<2>;
    mov.u32 %r1, %tid.x;
    setp.ge.u32 %p1, %r1, 32;
    @%p1 bra DONE;
    bar.sync 1, 64;
DONE:
    ret;
}
"""


def test_named_barrier_missing_warp_is_a_deadlock():
    cap = launch_from_ptx(NAMED_BARRIER, block=(64, 1, 1))
    with pytest.raises(EmulationError, match=r"bar.sync 1 \(32/64 threads arrived\)"):
        emulate(cap, [], seed=1)


def test_out_of_bounds_global_read_is_reported():
    a = np.zeros(31, dtype=np.float32)          # one element short for 32 lanes
    ta = torch.from_numpy(a)
    tb = torch.zeros(32)
    out = torch.zeros(32)
    cap = launch_from_ptx(BINARY.replace("BODY", "add.f32 %r4, %r2, %r3;"),
                          params=[ta.data_ptr(), tb.data_ptr(), out.data_ptr()])
    with pytest.raises(EmulationError, match="outside every buffer"):
        emulate(cap, [ta, tb, out])


UNINIT = HEADER + """
.extern .shared .align 1024 .b8 smem[];
.visible .entry k(.param .u64 pout)
.reqntid 32, 1, 1
{
    .reg .b32 %r<8>;
    .reg .b64 %rd<4>;
    ld.param.u64 %rd1, [pout];
    mov.b32 %r2, smem;
    ld.shared.b32 %r3, [%r2+12];
    st.global.b32 [%rd1], %r3;
    ret;
}
"""


def test_uninitialized_shared_read_is_reported():
    out = torch.zeros(1)
    cap = launch_from_ptx(UNINIT, params=[out.data_ptr()], dynamic_smem=64)
    with pytest.raises(EmulationError, match="uninitialized shared memory at 0x40c"):
        emulate(cap, [out])


def test_unsupported_instruction_names_opcode_and_line_before_running():
    text = BINARY.replace("BODY", "frobnicate.b32 %r4, %r2;")
    line = text.splitlines().index("    frobnicate.b32 %r4, %r2;") + 1
    out = torch.zeros(32)
    cap = launch_from_ptx(text, params=[0, 0, out.data_ptr()])
    with pytest.raises(UnsupportedInstruction, match=rf"line {line}: .*'frobnicate.b32'"):
        emulate(cap, [out])


def test_parser_scopes_inline_asm_labels_and_registers():
    """CuTe's inline asm repeats the label LAB_WAIT and the register P1 in every block: each
    { } scope must resolve its own."""
    text = HEADER + """
.visible .entry k()
.reqntid 32, 1, 1
{
    .reg .b32 %r<2>;
    mov.u32 %r1, 0;
    { .reg .pred P1; LAB_WAIT: setp.eq.u32 P1, %r1, 0; @P1 bra.uni DONE; bra.uni LAB_WAIT; DONE: }
    { .reg .pred P1; LAB_WAIT: setp.eq.u32 P1, %r1, 0; @P1 bra.uni DONE; bra.uni LAB_WAIT; DONE: }
    ret;
}
"""
    k = parse_ptx(text).kernels["k"]
    targets = [i.operands[0].name for i in k.instrs if i.opcode.startswith("bra")]
    assert len(set(targets)) == 4
    preds = {i.pred.name for i in k.instrs if i.pred is not None}
    assert len(preds) == 2
    emulate(launch_from_ptx(text), [])



def test_inline_asm_register_families_keep_scope_and_index_apart():
    """A register family declared inside inline asm (``.reg .b64 tmp<12>;``, as FA4's PTX has)
    runs: ``tmp1`` of scope 2 and ``tmp21`` must not be confused, and two blocks declaring the
    same family each get their own registers."""
    text = HEADER + """
.visible .entry k(.param .u64 pout)
.reqntid 32, 1, 1
{
    .reg .b64 %rd<4>;
    .reg .b32 %r<4>;
    ld.param.u64 %rd1, [pout];
    { .reg .b32 tmp<24>; mov.u32 tmp1, 5; mov.u32 tmp21, 7; add.u32 %r1, tmp1, tmp21; }
    { .reg .b32 tmp<2>; mov.u32 tmp1, 100; add.u32 %r2, %r1, tmp1; }
    mov.u32 %r3, %tid.x;
    mul.wide.u32 %rd2, %r3, 4;
    add.s64 %rd3, %rd1, %rd2;
    st.global.b32 [%rd3], %r2;
    ret;
}
"""
    out = torch.zeros(32, dtype=torch.int32)
    emulate(launch_from_ptx(text, block=(32, 1, 1), params=[out.data_ptr()]), [out])
    assert (out == 112).all()

SETMAXNREG = HEADER + """
.visible .entry k()
.reqntid 512, 1, 1
{
    .reg .b32 %r<4>;
    .reg .pred %p<2>;
    mov.u32 %r1, %tid.x;
    setp.lt.u32 %p1, %r1, 128;
    @%p1 bra INC;
    setmaxnreg.dec.sync.aligned.u32 DEC_TO;
    bra.uni DONE;
INC:
    setmaxnreg.inc.sync.aligned.u32 INC_TO;
DONE:
    ret;
}
"""


@pytest.mark.parametrize("seed", (0, 1, 2, 3))
def test_setmaxnreg_inc_waits_for_registers_released_by_dec(seed):
    """512 threads start with 128 registers each (the whole 64K file). Warpgroup 0 raising
    to 240 must wait until the others have dropped to 24, whatever the schedule."""
    cap = launch_from_ptx(SETMAXNREG.replace("DEC_TO", "24").replace("INC_TO", "240"),
                          block=(512, 1, 1))
    m = emulate(cap, [], seed=seed)
    alloc = m.ctas[0].reg_alloc
    assert [alloc[w] for w in range(16)] == [240] * 4 + [24] * 12
    assert sum(alloc.values()) * 32 <= 64 * 1024


def test_setmaxnreg_over_the_register_file_deadlocks():
    cap = launch_from_ptx(SETMAXNREG.replace("DEC_TO", "120").replace("INC_TO", "256"),
                          block=(512, 1, 1))
    with pytest.raises(EmulationError, match="register file exhausted"):
        emulate(cap, [], seed=0)


def test_instruction_coverage_lists_what_is_not_modelled():
    from fa_sm100.ptxemu import instruction_coverage
    text = BINARY.replace("BODY", "tcgen05.cp.cta_group::1.128x256b [%r2], %rd1;\n"
                                  "tcgen05.wait::ld.sync.aligned;\n add.f32 %r4, %r2, %r3;")
    counts, missing = instruction_coverage(text)
    assert counts["add.f32"] == 1 and counts["ld.global.b32"] == 2
    assert dict(missing) == {"tcgen05.cp.cta_group::1.128x256b": 1}


def _round_mode_exact(q: Fraction, mode: str) -> np.float32:
    r = np.float32(float(q))
    cands = [np.nextafter(r, np.float32(-np.inf)), r, np.nextafter(r, np.float32(np.inf))]
    vals = [(Fraction(float(c)), c) for c in cands]
    if mode == "rm":
        return max((c for f, c in vals if f <= q), key=lambda c: float(c))
    if mode == "rp":
        return min((c for f, c in vals if f >= q), key=lambda c: float(c))
    if mode == "rz":
        ok = [c for f, c in vals if abs(f) <= abs(q) and (f == 0 or (f > 0) == (q > 0))]
        return max(ok, key=lambda c: abs(float(c)))
    return round_f32_exact(q)


@pytest.mark.parametrize("mode", ("rn", "rz", "rm", "rp"))
def test_directed_rounding_of_add_mul_fma(mode):
    """The rounding modifier is honoured: exact rational results rounded per mode."""
    rng = np.random.default_rng(4)
    a, b = f32(rng.standard_normal(32)), f32(rng.standard_normal(32) * 1e-3)
    F = lambda x: Fraction(float(x))  # noqa: E731
    got = run_binary(f"add.{mode}.f32 %r4, %r2, %r3;", a, b).view(np.float32)
    np.testing.assert_array_equal(got, [_round_mode_exact(F(x) + F(y), mode) for x, y in zip(a, b)])
    got = run_binary(f"mul.{mode}.f32 %r4, %r2, %r3;", a, b).view(np.float32)
    np.testing.assert_array_equal(got, [_round_mode_exact(F(x) * F(y), mode) for x, y in zip(a, b)])
    got = run_binary(f"fma.{mode}.f32 %r4, %r2, %r3, %r2;", a, b).view(np.float32)
    np.testing.assert_array_equal(got, [_round_mode_exact(F(x) * F(y) + F(x), mode)
                                        for x, y in zip(a, b)])


def test_packed_add_rm_gives_floor_by_the_magic_number():
    """The kernel's ex2 emulation floors x with add.rm.f32x2 x, 1.5*2^23 (then subtracts it
    back): rounding toward -inf is what makes it a floor."""
    x = f32([2.7, -2.3, 5.0, -0.5, 0.49, -7.99, 123.5, -0.0] * 4)
    magic = f32(np.full(32, 1.5 * 2 ** 23))
    body = ("mov.b64 %rd8, {%r2, %r2};\n mov.b64 %rd9, {%r3, %r3};\n"
            "add.rm.f32x2 %rd10, %rd8, %rd9;\n sub.f32x2 %rd11, %rd10, %rd9;\n"
            "mov.b64 {%r4, %r5}, %rd11;")
    got = run_binary(body, x, magic).view(np.float32)
    np.testing.assert_array_equal(got, np.floor(x))


def test_uninitialized_register_read_is_reported():
    text = BINARY.replace("BODY", "add.f32 %r4, %r2, %r9;")        # %r9 never written
    out = torch.zeros(32)
    ta, tb = torch.zeros(32), torch.zeros(32)
    cap = launch_from_ptx(text, params=[ta.data_ptr(), tb.data_ptr(), out.data_ptr()])
    with pytest.raises(EmulationError, match=r"register %r9 is read before it was written"):
        emulate(cap, [ta, tb, out])


def test_spin_without_progress_hits_the_step_limit():
    """A loop that never blocks (here: spinning on a flag nobody sets, with ld.shared instead
    of mbarrier.try_wait) cannot be told from progress; the step limit stops it."""
    text = HEADER + """
.extern .shared .align 1024 .b8 smem[];
.visible .entry k()
.reqntid 32, 1, 1
{
    .reg .b32 %r<4>;
    .reg .pred %p<2>;
    mov.b32 %r1, smem;
    st.shared.b32 [%r1], 0;
SPIN:
    ld.shared.b32 %r2, [%r1];
    setp.eq.u32 %p1, %r2, 0;
    @%p1 bra SPIN;
    ret;
}
"""
    cap = launch_from_ptx(text, dynamic_smem=64)
    with pytest.raises(EmulationError, match="step limit 5000 reached"):
        emulate(cap, [], max_steps=5000)


def test_three_input_max_min():
    """sm_100's ``max{.NaN}.f32 d, a, b, c`` (the kernel's row-max reduction uses it): all
    three inputs count; .NaN makes any NaN win. (A two-input reading once made rows take a
    wrong max.)"""
    rng = np.random.default_rng(5)
    a, b = f32(rng.standard_normal(32)), f32(rng.standard_normal(32))
    a[3], b[4] = np.nan, np.nan
    c = a * b + f32(0.5)
    got = run_binary("mul.f32 %r5, %r2, %r3;\n add.f32 %r5, %r5, 0f3F000000;\n"
                     "max.f32 %r4, %r2, %r3, %r5;", a, b).view(np.float32)
    np.testing.assert_array_equal(got, np.fmax(np.fmax(a, b), c))
    got = run_binary("mul.f32 %r5, %r2, %r3;\n add.f32 %r5, %r5, 0f3F000000;\n"
                     "max.NaN.f32 %r4, %r2, %r3, %r5;", a, b).view(np.float32)
    want = np.where(np.isnan(a) | np.isnan(b) | np.isnan(c), np.nan, np.fmax(np.fmax(a, b), c))
    np.testing.assert_array_equal(got, want.astype(np.float32))
    ai = rng.integers(-100, 100, 32).astype(np.int32)
    bi = rng.integers(-100, 100, 32).astype(np.int32)
    got = run_binary("sub.s32 %r5, 0, %r2;\n min.s32 %r4, %r2, %r3, %r5;", ai, bi).view(np.int32)
    np.testing.assert_array_equal(got, np.minimum(np.minimum(ai, bi), -ai))


def test_min_max_relu_s32_clamp_negative_results_to_zero():
    """``min.relu.s32`` / ``max.relu.s32`` (the compiler fuses max(min(a, b), 0) into one):
    the result of the min or max, 0 where it is negative."""
    rng = np.random.default_rng(8)
    a = rng.integers(-100, 100, 32).astype(np.int32)
    b = rng.integers(-100, 100, 32).astype(np.int32)
    got = run_binary("min.relu.s32 %r4, %r2, %r3;", a, b).view(np.int32)
    np.testing.assert_array_equal(got, np.maximum(np.minimum(a, b), 0))
    got = run_binary("max.relu.s32 %r4, %r2, %r3;", a, b).view(np.int32)
    np.testing.assert_array_equal(got, np.maximum(np.maximum(a, b), 0))


def test_extra_source_operands_are_refused():
    out = torch.zeros(32)
    cap = launch_from_ptx(BINARY.replace("BODY", "add.f32 %r4, %r2, %r3, %r3;"),
                          params=[0, 0, out.data_ptr()])
    with pytest.raises(UnsupportedInstruction, match="3 source operands"):
        emulate(cap, [out])


def test_bit_manipulation_ops():
    rng = np.random.default_rng(6)
    a = rng.integers(0, 2 ** 32, 32, dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 2 ** 32, 32, dtype=np.uint64).astype(np.uint32)
    a[0], a[1] = 0, 0x80000000
    pc = run_binary("popc.b32 %r4, %r2;", a, b)
    np.testing.assert_array_equal(pc, [bin(int(x)).count("1") for x in a])
    cz = run_binary("clz.b32 %r4, %r2;", a, b)
    np.testing.assert_array_equal(cz, [32 - int(x).bit_length() for x in a])
    br = run_binary("brev.b32 %r4, %r2;", a, b)
    np.testing.assert_array_equal(br, [int(f"{int(x):032b}"[::-1], 2) for x in a])
    # bfe: 7 bits from position 5, unsigned and sign-extended
    bu = run_binary("bfe.u32 %r4, %r2, 5, 7;", a, b)
    np.testing.assert_array_equal(bu, (a >> 5) & 0x7F)
    bs = run_binary("bfe.s32 %r4, %r2, 5, 7;", a, b).view(np.int32)
    f = ((a >> 5) & 0x7F).astype(np.int32)
    np.testing.assert_array_equal(bs, np.where(f & 0x40, f - 128, f))
    # bfi: insert the low 9 bits of a into b at position 11
    bi = run_binary("bfi.b32 %r4, %r2, %r3, 11, 9;", a, b)
    mask = np.uint32(0x1FF << 11)
    np.testing.assert_array_equal(bi, (b & ~mask) | ((a << np.uint32(11)) & mask))
    # prmt default mode: selector 0x5140 picks bytes 0, 4, 1, 5 of {b, a}
    pr = run_binary("prmt.b32 %r4, %r2, %r3, 0x5140;", a, b)
    x = a.astype(np.uint64) | (b.astype(np.uint64) << np.uint64(32))
    byte = lambda i: (x >> np.uint64(8 * i)) & np.uint64(0xFF)  # noqa: E731
    want = byte(0) | (byte(4) << np.uint64(8)) | (byte(1) << np.uint64(16)) | (byte(5) << np.uint64(24))
    np.testing.assert_array_equal(pr, want.astype(np.uint32))
    # lop3 with LUT 0x96: a ^ b ^ c (c = a here)
    lp = run_binary("lop3.b32 %r4, %r2, %r3, %r2, 0x96;", a, b)
    np.testing.assert_array_equal(lp, a ^ b ^ a)
    lp = run_binary("lop3.b32 %r4, %r2, %r3, 0x0F0F0F0F, 0xE8;", a, b)   # majority
    c = np.uint32(0x0F0F0F0F)
    np.testing.assert_array_equal(lp, (a & b) | (a & c) | (b & c))


CP_ASYNC = HEADER + """
.extern .shared .align 16 .b8 smem[];
.visible .entry k(.param .u64 pin, .param .u64 pout)
.reqntid 32, 1, 1
{
    .reg .b32 %r<12>;
    .reg .b64 %rd<8>;
    ld.param.u64 %rd1, [pin];
    ld.param.u64 %rd2, [pout];
    mov.u32 %r1, %tid.x;
    mul.wide.u32 %rd3, %r1, 4;
    add.s64 %rd4, %rd1, %rd3;
    mov.b32 %r2, smem;
    shl.b32 %r3, %r1, 2;
    add.u32 %r4, %r2, %r3;
    cp.async.ca.shared.global [%r4], [%rd4], 4;
    cp.async.commit_group;
    cp.async.ca.shared.global [%r4+128], [%rd4+128], 4;
    cp.async.commit_group;
    cp.async.ca.shared.global [%r4+256], [%rd4+256], 4, 0;
    cp.async.commit_group;
    cp.async.wait_group 2;
    ld.shared.b32 %r5, [%r4];
    EXTRA
    cp.async.wait_all;
    ld.shared.b32 %r6, [%r4+128];
    ld.shared.b32 %r7, [%r4+256];
    add.u32 %r8, %r5, %r6;
    add.u32 %r8, %r8, %r7;
    add.s64 %rd5, %rd2, %rd3;
    st.global.b32 [%rd5], %r8;
    ret;
}
"""


def _cp_async_run(extra: str, seed: int):
    words = torch.arange(1, 97, dtype=torch.int32) * 7
    out = torch.zeros(32, dtype=torch.int32)
    cap = launch_from_ptx(CP_ASYNC.replace("EXTRA", extra), params=[words.data_ptr(),
                          out.data_ptr()], dynamic_smem=384)
    emulate(cap, [words, out], seed=seed)
    return words, out


def test_cp_async_wait_group_waits_for_all_but_the_newest_groups():
    """``cp.async.wait_group 2`` after three groups: the oldest group has landed whatever the
    order the copies complete in (they complete in random order here; counting the groups
    still in flight instead let a read of the oldest see a pending copy); ``src-size`` 0
    zero-fills; ``wait_all`` waits for the rest. Reading the newest group before its wait is
    reported."""
    for seed in range(12):
        words, out = _cp_async_run("", seed)
        assert torch.equal(out, words[:32] + words[32:64]), seed
    caught = 0
    for seed in range(12):
        try:
            _cp_async_run("ld.shared.b32 %r9, [%r4+256];", seed)
        except EmulationError as e:
            assert "pending" in str(e)
            caught += 1
    assert caught > 0


RED_V4 = HEADER + """
.visible .entry k(.param .u64 pacc, .param .u64 pval)
.reqntid 64, 1, 1
{
    .reg .b32 %r<12>;
    .reg .b64 %rd<8>;
    ld.param.u64 %rd1, [pacc];
    ld.param.u64 %rd2, [pval];
    mov.u32 %r1, %tid.x;
    and.b32 %r2, %r1, 31;
    mul.wide.u32 %rd3, %r1, 16;
    add.s64 %rd4, %rd2, %rd3;
    ld.global.v4.f32 {%r4, %r5, %r6, %r7}, [%rd4];
    mul.wide.u32 %rd5, %r2, 16;
    add.s64 %rd6, %rd1, %rd5;
    red.relaxed.gpu.global.add.v4.f32 [%rd6], {%r4, %r5, %r6, %r7};
    ret;
}
"""


def test_vector_red_adds_each_element_into_its_own_word():
    """Two threads (of two warps) add four floats each into the same 16 bytes: every word
    ends as its initial value plus both addends (the SM100 backward's dQ adds; an emulator
    that added only the first word's old value passed one adder and failed two)."""
    rng = np.random.default_rng(0)
    init = rng.standard_normal((32, 4)).astype(np.float32)
    vals = rng.standard_normal((64, 4)).astype(np.float32)
    acc, tv = torch.from_numpy(init.copy()), torch.from_numpy(vals)
    cap = launch_from_ptx(RED_V4, block=(64, 1, 1), params=[acc.data_ptr(), tv.data_ptr()])
    emulate(cap, [acc, tv])
    want = init.astype(np.float64) + vals[:32] + vals[32:]
    np.testing.assert_allclose(acc.numpy(), want, rtol=1e-6, atol=1e-6)
