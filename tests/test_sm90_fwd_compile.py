"""sm_90a compile contract of the SM90 forward (issue 6 item 5), cross-compiled on the CPU.

Contract, read from the cubin/SASS through ``fa_sm100.inspection.inspect_kernel``: HGMMA
(warpgroup MMA) present, exactly one GEMM per issue site (no duplicated or lost k-steps), the
config's setmaxnreg values in the code, 128 x (1 + consumers) threads, no local memory and no
spills, SMEM within the sm_90a budget, TMA loads and the TMA store of O.
"""

import collections
import re

import pytest

from fa_sm100.config import launch_registers
from fa_sm100.hopper.config import (SM90_SMEM_BUDGET, Sm90FwdConfig,
                                    sm90_fwd_config_from_overrides)
from fa_sm100.inspection import inspect_kernel
from kept_sass import read_kept_sass


def expected_hgmma(cfg) -> int:
    """HGMMA instructions the mainloop code should contain (one per k-step per GEMM site)."""
    qk, pv = cfg.head_dim // 16, cfg.n_block // 16
    # one step per loop over KV tiles: causal masked + unmasked; a window adds the left run
    loops = 3 if cfg.local else 2 if cfg.causal else 1
    if cfg.intra_wg_overlap:
        return qk + loops * (qk + pv) + pv  # first S; the loops' overlapped steps; last PV
    return (1 + loops) * (qk + pv)  # first serial step, then one per loop


CASES = [
    [],  # hdim 128, non-causal, ping-pong + intra-warpgroup overlap
    ["head_dim=64", "causal=true"],  # three consumer warpgroups, causal mask loops
    ["head_dim=256", "causal=true"],  # no ping-pong, O rescaled before the PV GEMM
    ["intra_wg_overlap=false", "pingpong=false", "causal=true"],
    ["causal=true", "persistent=true", "dynamic_schedule=false"],  # every gridDim.x-th tile
    ["causal=true", "head_dim=192", "head_dim_v=128"],  # dynamic schedule, 221 KiB of SMEM
    # Note [Warpgroup epilogues] and Note [Two Q stages]: the defaults up to 8k keys
    ["causal=true", "head_dim=64", "num_consumer_wg=2", "wg_epilogue=true", "q_stage=2"],
    ["causal=true", "wg_epilogue=true", "q_stage=2"],  # 225 KiB of SMEM
    # sliding windows (run-time bounds): the left-edge run is a third loop
    ["local=true"],
    ["local=true", "causal=true", "head_dim=64", "intra_wg_overlap=false", "pingpong=false"],
    # Note [Varlen]: packed sequences (a local kernel whose lengths come from cu_seqlens; O
    # stored through the ragged view), with the epilogues and buffers of each head dim
    ["varlen=true", "causal=true"],
    ["varlen=true", "causal=true", "wg_epilogue=true", "q_stage=2"],
    ["varlen=true", "head_dim=64"],
    ["varlen=true", "head_dim=192", "head_dim_v=128", "softcap=true"],
    ["varlen=true", "head_dim=256", "causal=true"],  # O in Q's buffer
    # Note [Paged K/V]: each key block's TMA source from its page-table slot
    ["varlen=true", "page_size=64", "n_block=64"],
    ["varlen=true", "page_size=256", "causal=true"],
]


@pytest.mark.compile
@pytest.mark.parametrize("overrides", CASES, ids=lambda o: ",".join(o) or "default")
def test_sm90_fwd_compile_contract(overrides):
    cfg = sm90_fwd_config_from_overrides(overrides)
    rep = inspect_kernel("sm90_fwd", "sm_90a", overrides)
    assert rep["arch"] == "sm_90a" and rep["kernel"] == "sm90_fwd"
    assert rep["threads_per_cta"] == cfg.num_threads
    assert rep["cluster"] == [1, 1, 1]
    assert rep["sass"]["HGMMA"] == expected_hgmma(cfg), rep["sass"]
    assert rep["sass"]["USETMAXREG"] == 2  # producer gives registers away, consumers take them
    assert rep["setmaxnreg"] == {"producer": cfg.regs_producer, "consumer": cfg.regs_consumer}
    # ptxas launches the CTA with the registers fa_sm100.config.launch_registers predicts, and
    # the warps' setmaxnreg requests fill that pool without exceeding it (else they hang)
    assert rep["regs_at_launch"] == launch_registers(cfg.num_threads)
    assert rep["registers_after_setmaxnreg"] == cfg.registers_used() <= (
        cfg.num_threads * rep["regs_at_launch"])
    assert rep["spill_bytes"] == 0 and rep["local_bytes"] == 0
    assert rep["smem_bytes"] == cfg.smem_bytes() <= SM90_SMEM_BUDGET
    assert rep["sass"]["UTMALDG"] > 0 and rep["sass"]["UTMASTG"] > 0
    assert rep["sass"]["MUFU.EX2"] > 0
    assert not [w for w in rep["warnings"] if "setmaxnreg" in w], rep["warnings"]


@pytest.mark.compile
def test_four_consumer_warpgroups_would_ask_for_registers_the_cta_never_gets(monkeypatch):
    """Why ``validate()`` allows two or three consumer warpgroups, read from a cubin built past
    it: four make 640 threads, which ptxas launches with 96 registers each (61440 in all).
    The producer's 24 leave 112 per consumer thread; 120 would need 64512, and the report
    flags the hang (on an H200, ``setmaxnreg.inc`` past the pool never returned, round 23).
    At 112, 64-key tiles are the widest without spills: CHANGELOG.md."""
    monkeypatch.setattr(Sm90FwdConfig, "validate", lambda self: self)
    four = ["head_dim=64", "head_dim_v=64", "num_consumer_wg=4", "m_block=256",
            "regs_producer=24", "kv_multicast=false", "persistent=false",
            "dynamic_schedule=false", "pingpong=false", "skip_empty_wg=false"]
    rep = inspect_kernel("sm90_fwd", "sm_90a", four + ["n_block=64", "regs_consumer=120"])
    assert rep["threads_per_cta"] == 640
    assert rep["regs_at_launch"] == launch_registers(640) == 96
    assert rep["registers_after_setmaxnreg"] == 128 * (24 + 4 * 120) > 640 * 96
    assert any("never free up" in w for w in rep["warnings"]), rep["warnings"]
    fits = inspect_kernel("sm90_fwd", "sm_90a", four + ["n_block=64", "regs_consumer=112"])
    assert fits["registers_after_setmaxnreg"] == 128 * (24 + 4 * 112) <= 640 * 96
    assert fits["spill_bytes"] == 0
    assert not any("never free up" in w for w in fits["warnings"]), fits["warnings"]
    wider = inspect_kernel("sm90_fwd", "sm_90a", four + ["n_block=80", "regs_consumer=112"])
    assert wider["spill_bytes"] > 0


@pytest.mark.compile
def test_dynamic_schedule_fetches_once_per_tile_and_resets_the_counter():
    """Note [Dynamic tile schedule] in the SASS: the default causal kernel (persistent, dynamic)
    has one atomic add on the tile counter (the producer's fetch) and one store to it (the
    reset by the launch's last fetch, predicated); the tile index reaches the consumers
    through SMEM (one STS by the producer, one LDS per tile by the consumers). Persistent CTAs
    that take every gridDim.x-th tile, and one tile per CTA, touch no counter."""
    dynamic = inspect_kernel("sm90_fwd", "sm_90a", ["causal=true", "write_lse=false"])
    assert dynamic["config"]["persistent"] and dynamic["config"]["dynamic_schedule"]
    ops = dynamic["sass"]  # counts by opcode and by each modifier
    assert ops.get("ATOMG", 0) == 1 and ops.get("ATOMG.ADD", 0) == 1, ops
    assert ops.get("STG", 0) == 1, ops  # the counter's reset; O leaves by TMA, no LSE here
    assert ops.get("STS", 0) == 1 and ops.get("LDS", 0) == 1, ops
    assert dynamic["spill_bytes"] == 0 and dynamic["local_bytes"] == 0
    for overrides in (["causal=true", "dynamic_schedule=false"],
                      ["causal=true", "persistent=false"]):
        ops = inspect_kernel("sm90_fwd", "sm_90a", overrides)["sass"]
        assert not any(op.startswith("ATOM") for op in ops), (overrides, ops)


SMEM_CASES = [[], ["persistent=true"], ["causal=true"], ["causal=true", "head_dim=64"],
              ["causal=true", "head_dim=192", "head_dim_v=128"], ["head_dim=256", "causal=true"],
              ["head_dim=64", "persistent=true", "num_consumer_wg=2"],
              ["causal=true", "q_stage=2", "wg_epilogue=true"],
              ["head_dim=64", "persistent=true", "q_stage=2"]]


@pytest.mark.compile
@pytest.mark.parametrize("overrides", SMEM_CASES, ids=lambda o: ",".join(o) or "default")
def test_smem_bytes_is_the_kernels_shared_storage_size(overrides):
    """``Sm90FwdConfig.smem_bytes`` (what validate() holds to the 227 KiB budget, what picks
    persistence and what the compile contract reports) equals the size of the kernel's
    SharedStorage struct, which is what a launch asks for: with and without the separate O
    buffer and the dynamic schedule's tile pipeline."""
    import cutlass.cute as cute

    from fa_sm100.hopper.fwd_kernel import Sm90FwdKernel

    cfg = sm90_fwd_config_from_overrides(overrides)
    kernel = Sm90FwdKernel(cfg)
    size = {}

    @cute.jit
    def probe():
        layouts = [kernel._q_smem_layout(),
                   kernel._smem_layout(cfg.n_block, cfg.head_dim, cfg.kv_stage),
                   kernel._smem_layout(cfg.n_block, cfg.head_dim_v, cfg.kv_stage),
                   kernel._o_smem_layout()]
        size["struct"] = kernel._shared_storage(*layouts).size_in_bytes()

    cute.compile(probe, options="--gpu-arch sm_90a")
    assert size["struct"] == cfg.smem_bytes() <= SM90_SMEM_BUDGET


@pytest.mark.compile
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_kv_multicast_multicasts_every_k_and_v_load(head_dim, tmp_path):
    """Note [K/V multicast] in the SASS: a (2, 1, 1) cluster in which every K and V load is a
    multicast TMA load and Q's is not (TMA boxes are 64 elements wide: head_dim / 64 per
    tile; K and V are each loaded at two places, the tile's first and the overlapped loop's),
    and the main loop keeps the one-tile kernel's GEMMs, exp2s and barriers, with the K and V
    releases as cluster-wide (remote) arrives instead of local ones. Note [Persistent
    multicast]: the same with persistent CTAs, whose tile loop holds the main loop. Note [Peer
    release]: the releases' cluster address is not re-derived in the main loop (no ``PRMT``,
    the SASS of ``mapa``), which has fewer instructions than with the DSL's release. Note [Odd
    m blocks]: the producer also holds a load of the peer's share of each K and V tile (the
    tile's own loads when a cluster pairs the last m blocks of two heads); the main loop is the
    same without them (``multicast_odd_m=false``)."""
    loops, tile_loops = {}, {}
    variants = (("multicast", ["kv_multicast=true", "persistent=false"]),
                ("one", ["persistent=false"]),
                ("persistent", ["kv_multicast=true", "persistent=true"]),
                ("dsl_release", ["kv_multicast=true", "persistent=true", "peer_release=false"]),
                ("no_odd", ["kv_multicast=true", "persistent=true", "multicast_odd_m=false"]))
    for name, extra in variants:
        overrides = [f"head_dim={head_dim}"] + extra
        rep = inspect_kernel("sm90_fwd", "sm_90a", overrides, keep_dir=tmp_path / name)
        assert rep["spill_bytes"] == 0 and rep["local_bytes"] == 0
        sass = read_kept_sass(tmp_path / name)
        loops[name] = _main_kv_loop(sass)
        tile_loops[name] = _tile_loops(sass)
        if name != "one":
            assert rep["config"]["kv_multicast"]
            assert rep["config"]["persistent"] == (name != "multicast")
            assert rep["config"]["peer_release"] == (name != "dsl_release")
            assert rep["config"]["multicast_odd_m"] == (name != "no_odd")
            assert not rep["config"]["dynamic_schedule"]
            assert rep["cluster"] == [2, 1, 1]
            boxes = head_dim // 64
            ops = rep["sass"]
            shares = 2 if name != "no_odd" else 1  # this CTA's share (and the peer's)
            assert ops.get("UTMALDG.MULTICAST", 0) == (2 * boxes + 2 * boxes) * shares, ops
            # Q: loaded at two places where the first K tile goes first (O in Q's buffer)
            q_sites = 2 if rep["config"]["o_in_q_buffer"] or rep["config"]["k_before_q"] else 1
            assert ops["UTMALDG"] - ops["UTMALDG.MULTICAST"] == q_sites * boxes, ops
            assert ops["HGMMA"] == expected_hgmma(sm90_fwd_config_from_overrides(overrides))
    one = loops["one"]
    kept = lambda ops: {k: v for k, v in ops.items()
                        if k.split(".")[0] in ("HGMMA", "MUFU", "BAR", "WARPGROUP")}
    local = "SYNCS.ARRIVE.TRANS64.ART0"
    remote = lambda ops: sum(n for op, n in ops.items()
                             if op.startswith("SYNCS.ARRIVE.TRANS64.RED"))
    assert one[local] == 2 and remote(one) == 0, one  # releases of K and V, in this CTA
    # the same main loop but for a few instructions of scheduling (0-4 per KV tile measured;
    # which is why select_sm90_fwd_config turns the switch on only for an odd m block count)
    no_odd, odd = loops["no_odd"], loops["persistent"]
    assert kept(no_odd) == kept(odd) and abs(sum(no_odd.values()) - sum(odd.values())) <= 4
    for name in ("multicast", "persistent", "dsl_release"):
        mc = loops[name]
        assert sum(mc.values()) > 100 and kept(mc) == kept(one), (name, mc - one, one - mc)
        assert mc[local] == 0 and remote(mc) == 2, mc  # ... in both CTAs of the cluster
    assert loops["dsl_release"]["PRMT"] >= 2  # a mapa per release
    assert loops["multicast"]["PRMT"] == loops["persistent"]["PRMT"] == 0
    assert sum(loops["persistent"].values()) < sum(loops["dsl_release"].values())
    assert (tile_loops["one"] == tile_loops["multicast"] == 0
            < tile_loops["persistent"] == tile_loops["dsl_release"] == tile_loops["no_odd"])


def _hgmma_count(ops: collections.Counter) -> int:
    return sum(n for op, n in ops.items() if op.startswith("HGMMA"))


def _hgmma_bodies(sass: str) -> list:
    """(first address, last address, opcode counts) of every loop of the SASS that holds an
    HGMMA, in address order: the KV loops of the main loop and, with persistent CTAs, the tile
    loop around them."""
    from fa_sm100.compile_tools import sass_loops, sass_opcode

    bodies = [(body[0][0], body[-1][0], collections.Counter(sass_opcode(t) for _, t in body))
              for body in sass_loops(sass)]
    return [b for b in bodies if _hgmma_count(b[2])]


def _hgmma_loops(sass: str) -> list:
    """(HGMMAs, instructions, opcode counts) of each loop of ``_hgmma_bodies``."""
    return [(_hgmma_count(ops), sum(ops.values()), ops) for _, _, ops in _hgmma_bodies(sass)]


def _holds_another(body, bodies) -> bool:
    """Whether the loop ``body`` (of ``_hgmma_bodies``) holds another of ``bodies``."""
    a, b, _ = body
    return any(a <= a2 and b2 <= b and (a, b) != (a2, b2) for a2, b2, _ in bodies)


def _tile_loops(sass: str) -> int:
    """How many HGMMA loops hold another one: the persistent tile loops around the KV loops."""
    bodies = _hgmma_bodies(sass)
    return sum(_holds_another(body, bodies) for body in bodies)


def _main_kv_loop(sass: str) -> collections.Counter:
    """Opcode counts of the KV loop with the most HGMMAs (ties: the shortest) among the loops
    that hold no other loop with an HGMMA: the main loop, with or without a tile loop around."""
    bodies = _hgmma_bodies(sass)
    inner = [body[2] for body in bodies if not _holds_another(body, bodies)]
    return max(inner, key=lambda ops: (_hgmma_count(ops), -sum(ops.values())))


def _kv_loops(sass: str) -> list:
    """(HGMMAs, instructions) of every loop of the SASS that holds an HGMMA, sorted."""
    return sorted((h, n) for h, n, _ in _hgmma_loops(sass))


def _innermost(loops: list) -> list:
    """The loops with the fewest HGMMAs: the KV loops (the others are the tile loops around
    them, which also hold the epilogue)."""
    fewest = min(loop[0] for loop in loops)
    return [loop for loop in loops if loop[0] == fewest]


@pytest.mark.compile
@pytest.mark.parametrize("overrides", [["head_dim=64", "persistent=true"],
                                       ["head_dim=128", "persistent=true", "causal=true",
                                        "pingpong=true"],
                                       ["head_dim=128", "persistent=true", "causal=true"],
                                       ["head_dim=64", "persistent=false"],
                                       ["head_dim=128", "intra_wg_overlap=false",
                                        "pingpong=true"]],
                         ids=["d64-persistent", "d128-causal-pingpong", "d128-causal",
                              "d64-one-tile", "d128-serial"])
def test_empty_warpgroups_skip_the_work_and_keep_the_kv_loops(overrides, tmp_path):
    """Note [Empty warpgroups]: the skip adds a branch around the tile's main loop whose other
    side has waits, releases and (with ping-pong) ping-pong barriers but no HGMMA and no exp2
    (the HGMMA and MUFU.EX2 counts are those without the skip, more mbarrier operations, and
    more named barriers with ping-pong, as many without), and the KV loops of the main loop
    keep their HGMMAs and are no longer."""
    reps, loops = {}, {}
    for on in (True, False):
        keep = tmp_path / str(on)
        reps[on] = inspect_kernel("sm90_fwd", "sm_90a", overrides + [f"skip_empty_wg={on}"],
                                  keep_dir=keep)
        assert reps[on]["spill_bytes"] == 0 and reps[on]["local_bytes"] == 0
        loops[on] = _kv_loops(read_kept_sass(keep))
    on, off = reps[True]["sass"], reps[False]["sass"]
    assert reps[True]["config"]["skip_empty_wg"] and not reps[False]["config"]["skip_empty_wg"]
    assert on["HGMMA"] == off["HGMMA"] and on["MUFU.EX2"] == off["MUFU.EX2"]
    assert on["SYNCS"] > off["SYNCS"]
    if reps[True]["config"]["pingpong"]:
        assert on["BAR.SYNC"] > off["BAR.SYNC"]
    else:
        assert on["BAR.SYNC"] == off["BAR.SYNC"]
    # the KV loops: as many, with the same HGMMAs, none longer (ptxas saves an instruction or
    # two in some)
    kv_on, kv_off = _innermost(loops[True]), _innermost(loops[False])
    assert len(kv_on) == len(kv_off) > 0, loops
    assert all(a[0] == b[0] and b[1] - 2 <= a[1] <= b[1] for a, b in zip(kv_on, kv_off)), loops


@pytest.mark.compile
@pytest.mark.parametrize("overrides", [["head_dim=64", "causal=true", "num_consumer_wg=2"],
                                       ["head_dim=64", "num_consumer_wg=3"],
                                       ["head_dim=128"]],
                         ids=["d64-causal-2wg", "d64-3wg", "d128"])
def test_tile_boundary_switches_keep_the_kv_loops(overrides, tmp_path):
    """Note [Warpgroup epilogues] and Note [Two Q stages] in the SASS of a persistent kernel:
    the two EPILOGUE barriers of every consumer thread (named barrier 1, 128 x warpgroups
    threads) become two barriers of one warpgroup's 128 threads (their id in a register:
    EPILOGUE_WG0 + w); O leaves by one TMA store site either way; the GEMMs, exp2s and TMA
    loads stay as many; the KV loops keep their HGMMAs and grow by at most 2% (the Q stage's
    descriptor)."""
    reps, loops = {}, {}
    for name, extra in (("off", []), ("on", ["wg_epilogue=true", "q_stage=2"])):
        keep = tmp_path / name
        reps[name] = inspect_kernel("sm90_fwd", "sm_90a", overrides + ["persistent=true"] + extra,
                                    keep_dir=keep)
        assert reps[name]["spill_bytes"] == 0 and reps[name]["local_bytes"] == 0
        sass = read_kept_sass(keep)
        loops[name] = _kv_loops(sass)
        reps[name]["bars"] = collections.Counter(
            re.findall(r"BAR\.SYNC\.DEFER_BLOCKING (\S+), (0x[0-9a-f]+) ;", sass))
    on, off = reps["on"], reps["off"]
    assert on["config"]["wg_epilogue"] and on["config"]["q_stage"] == 2
    assert not off["config"]["wg_epilogue"] and off["config"]["q_stage"] == 1
    for op in ("HGMMA", "MUFU.EX2", "UTMALDG", "UTMASTG"):
        assert on["sass"][op] == off["sass"][op], op
    consumers = hex(128 * on["config"]["num_consumer_wg"])
    assert off["bars"][("0x1", consumers)] == 2, off["bars"]
    assert not any(threads == "0x80" for _, threads in off["bars"]), off["bars"]
    assert ("0x1", consumers) not in on["bars"], on["bars"]
    per_wg = [(bid, n) for (bid, threads), n in on["bars"].items() if threads == "0x80"]
    assert len(per_wg) == 1 and per_wg[0][0].startswith("R") and per_wg[0][1] == 2, on["bars"]
    # every loop with an HGMMA keeps its HGMMAs; the KV loops (fewest HGMMAs; the others are
    # the tile loops around them, which hold the epilogue) grow by at most 2%
    assert [h for h, _ in loops["on"]] == [h for h, _ in loops["off"]], loops
    kv_on, kv_off = ([n for _, n in _innermost(loops[k])] for k in ("on", "off"))
    assert len(kv_on) == len(kv_off) > 0, loops
    assert all(a <= 1.02 * b for a, b in zip(kv_on, kv_off)), loops


@pytest.mark.compile
@pytest.mark.parametrize("overrides", [["head_dim=128"], ["head_dim=256", "causal=true"],
                                       ["head_dim=64", "intra_wg_overlap=false"]],
                         ids=["d128", "d256-causal-before-pv", "d64-serial"])
def test_rescale_threshold_branches_around_the_o_rescale(overrides, tmp_path):
    """Note [Rescale threshold] in the SASS: without a threshold no warp vote; with one, every
    KV loop votes once (VOTE.ANY) and keeps its O rescale (as many FMULs, plus one per row for
    the growth) behind a branch; the GEMMs and exp2s stay as many, and a loop gains at most 24
    instructions (15-18 measured: the vote, the branch, a compare and select per row, moves)."""
    loops = {}
    for name, extra in (("off", ["rescale_threshold=0"]), ("on", ["rescale_threshold=8"])):
        keep = tmp_path / name
        rep = inspect_kernel("sm90_fwd", "sm_90a", overrides + extra, keep_dir=keep)
        assert rep["spill_bytes"] == 0 and rep["local_bytes"] == 0
        assert rep["config"]["rescale_threshold"] == (8.0 if name == "on" else 0.0)
        loops[name] = _innermost(_hgmma_loops(read_kept_sass(keep)))
    rows = 2  # accumulator rows per thread
    assert len(loops["on"]) == len(loops["off"]) > 0
    for (h_on, n_on, on), (h_off, n_off, off) in zip(loops["on"], loops["off"]):
        assert h_on == h_off and on["MUFU.EX2"] == off["MUFU.EX2"]
        assert off["VOTE.ANY"] == 0 and on["VOTE.ANY"] == 1, (on, off)
        assert on["FMUL"] == off["FMUL"] + rows, (on["FMUL"], off["FMUL"])
        assert on["BRA"] == off["BRA"] + 1 and n_off < n_on <= n_off + 24, (n_on, n_off)


@pytest.mark.compile
def test_hdim64_kv_tile_is_the_widest_that_keeps_the_gemms_overlapped(tmp_path):
    """Why hdim 64 stays at 128-key tiles (CHANGELOG.md): with three consumer
    warpgroups at 160 registers, the default tile compiles without spills and its KV loop
    has 4 WARPGROUP instructions (an ARRIVE before each of its two GEMMs, a DEPBAR for S and
    one for O); one more 16-key step (n_block 144) spills, and ptxas then fences its HGMMAs one
    by one (more than twice as many WARPGROUP instructions), which gives up the GEMM/softmax
    overlap the tile exists for."""
    from fa_sm100.hopper.config import select_sm90_fwd_config

    assert select_sm90_fwd_config(64, seqlen_q=16384, seqlen_k=16384).n_block == 128
    base = ["head_dim=64", "write_lse=false", "persistent=true", "kv_multicast=true"]
    reps, loops = {}, {}
    for n in (128, 144):
        keep = tmp_path / str(n)
        reps[n] = inspect_kernel("sm90_fwd", "sm_90a", base + [f"n_block={n}"], keep_dir=keep)
        loops[n] = _main_kv_loop(read_kept_sass(keep))
    warpgroup = {n: sum(c for op, c in ops.items() if op.startswith("WARPGROUP"))
                 for n, ops in loops.items()}
    assert reps[128]["spill_bytes"] == 0 and reps[128]["local_bytes"] == 0
    assert warpgroup[128] == 4, loops[128]
    assert reps[144]["spill_bytes"] > 0
    assert warpgroup[144] > 2 * warpgroup[128], loops[144]
    assert any(op.startswith("STL") for op in loops[144]), loops[144]  # spills in the KV loop


@pytest.mark.compile
def test_packed_16bit_exp2_is_one_sfu_op_per_element_on_sm90a():
    """Why the softmax cannot halve its SFU work with packed exp2 (CHANGELOG.md):
    sm_90a has ``ex2.approx.ftz.bf16x2`` / ``ex2.approx.f16x2`` in PTX, but ptxas issues one
    MUFU.EX2 per 16-bit half (two per packed operand, no packed SFU instruction), so MUFU.EX2
    per element is the same as in float32."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32
    from cutlass._mlir.dialects import llvm
    from cutlass.cute.runtime import make_fake_compact_tensor
    from cutlass.cutlass_dsl import T, dsl_user_op

    from fa_sm100.compile_tools import cross_compile, sass_full_histogram

    chain = 8  # dependent packed exp2s per thread
    for ptx, mufu in (("ex2.approx.ftz.bf16x2", "MUFU.EX2.BF16"), ("ex2.approx.f16x2",
                                                                  "MUFU.EX2.F16")):
        @dsl_user_op
        def exp2_x2(a, *, loc=None, ip=None, ptx=ptx):
            return Int32(llvm.inline_asm(
                T.i32(), [Int32(a).ir_value(loc=loc, ip=ip)], f"{ptx} $0, $1;", "=r,r",
                has_side_effects=False, is_align_stack=False,
                asm_dialect=llvm.AsmDialect.AD_ATT))

        @cute.kernel
        def kernel(x: cute.Tensor, y: cute.Tensor):
            tidx, _, _ = cute.arch.thread_idx()
            v = x[tidx]
            for _ in cutlass.range_constexpr(chain):
                v = exp2_x2(v)
            y[tidx] = v

        @cute.jit
        def host(x: cute.Tensor, y: cute.Tensor):
            kernel(x, y).launch(grid=[1, 1, 1], block=[128, 1, 1])

        x, y = (make_fake_compact_tensor(cutlass.Int32, (128,)) for _ in range(2))
        hist = sass_full_histogram(cross_compile(host, (x, y), "sm_90a").sass)
        sfu = {op: n for op, n in hist.items() if op.startswith("MUFU")}
        assert sfu == {mufu: 2 * chain}, (ptx, sfu)
