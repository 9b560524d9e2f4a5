"""The paired A/B timing (``fa_sm100.benchmarking.paired_rounds`` / ``paired_speedups``) and
its command line ``scripts/ab_bench.py``: the round order, the paired ratios, the report, and
that bad variants stop the run before any GPU work. CPU only: a fake clock stands in for the
GPU."""

import itertools

import pytest

from fa_sm100.benchmarking import calls_per_round, paired_rounds, paired_speedups
from plain_text import words
from script_loader import load_script


def _script():
    return load_script("ab_bench")


def test_rounds_time_every_run_once_in_a_carry_over_balanced_order():
    """Over a cycle of round_order (n rounds for an even count of runs, 2n for an odd one)
    each run is first equally often and each ordered pair runs back to back equally often."""
    from collections import Counter

    from fa_sm100.benchmarking import round_order

    for n in range(1, 8):
        names = [f"r{i}" for i in range(n)]
        cycle = n if n % 2 == 0 else 2 * n
        firsts, pairs = Counter(), Counter()
        for rnd in range(cycle):
            order = round_order(names, rnd)
            assert sorted(order) == names
            assert order == round_order(names, rnd + cycle)  # the same every run
            firsts[order[0]] += 1
            pairs.update(zip(order, order[1:]))
        assert set(firsts.values()) == {cycle // n} and len(firsts) == n
        if n > 1:
            assert len(pairs) == n * (n - 1) and len(set(pairs.values())) == 1, pairs
    order, rounds_done = [], []
    times = paired_rounds({"default": "a", "v": "b", "fa4": "c"}, 6,
                          lambda run: order.append(run) or 1.0, on_round=rounds_done.append)
    assert rounds_done == list(range(6))
    assert sorted(order) == sorted("abc" * 6)
    assert {k: len(v) for k, v in times.items()} == {"default": 6, "v": 6, "fa4": 6}


def test_default_rounds_are_whole_cycles_of_the_order():
    """The benchmark's default rounds per cell: at least MIN_ROUNDS, in whole cycles (6 for
    the backward's three providers, 8 for the forward's four); --repeat below 1 is refused."""
    from fa_sm100.benchmarking import MIN_ROUNDS, order_cycle, whole_cycles

    assert [order_cycle(n) for n in range(1, 6)] == [2, 2, 6, 4, 10]
    assert (whole_cycles(MIN_ROUNDS, 3), whole_cycles(MIN_ROUNDS, 4)) == (6, 8)
    assert whole_cycles(MIN_ROUNDS, 5) == 10 and whole_cycles(7, 2) == 8
    bench = load_script("benchmark")
    assert bench.parse_args([]).repeat is None
    with pytest.raises(SystemExit):
        bench.parse_args(["--repeat", "0"])


def test_a_carry_over_from_the_run_before_cancels_in_the_paired_ratio():
    """A run that leaves the GPU faster for the next one (a slow kernel lets it cool): the
    run after it measures 4% faster. Rotated, the same run would follow it in every round
    (round 25: the zero fill, 4% faster after a 0.6x kernel); in round_order every run follows
    it equally often, and two equal runs stay at a paired 1.00."""
    from fa_sm100.benchmarking import round_order

    runs = {"default": "default", "zf": "zf", "slow": "slow", "fa4": "fa4"}
    last = [None]

    def measure(name):
        ms = 1.0 if last[0] != "slow" else 1.0 / 1.04
        last[0] = name
        return ms

    times = paired_rounds(runs, 8, measure)
    assert paired_speedups(times, "default")["zf"][0] == pytest.approx(1.0)
    names = list(runs)

    def follower(order):  # the run right after "slow" in a round (None: slow ran last)
        i = order.index("slow")
        return order[i + 1] if i + 1 < len(order) else None

    assert {follower(names[k:] + names[:k]) for k in range(4)} == {"fa4", None}  # rotated
    assert {follower(round_order(names, r)) for r in range(4)} >= {"default", "zf", "fa4"}


def test_paired_speedups_cancel_a_drift_that_medians_of_times_do_not():
    """A clock that slows every round by 10% (a drift shared by all runs): a variant 2% faster
    than the default is 1.02x in every round's ratio, while its raw times overlap the
    default's."""
    slowdown = itertools.count()
    base_ms = {"default": 1.0, "v": 1.0 / 1.02}

    def measure(name):
        return base_ms[name] * (1.0 + 0.1 * (next(slowdown) // 2))

    times = paired_rounds({"default": "default", "v": "v"}, 6, measure)
    assert max(times["v"]) > min(times["default"])  # the raw times alone do not separate them
    mid, lo, hi = paired_speedups(times, "default")["v"]
    # the order alternates (v first in odd rounds): both of a round share its clock
    assert mid == pytest.approx(1.02, rel=1e-9) and lo == pytest.approx(1.02, rel=1e-9)
    assert hi == pytest.approx(1.02, rel=1e-9)
    assert paired_speedups(times, "default")["default"] == (1.0, 1.0, 1.0)


def test_paired_speedups_report_median_and_extremes():
    times = {"default": [1.0, 1.0, 1.0], "v": [0.5, 1.0, 2.0]}
    assert paired_speedups(times, "default")["v"] == (1.0, 0.5, 2.0)


def test_calls_per_round_fill_the_round():
    assert calls_per_round(2.0, 150.0) == 75
    assert calls_per_round(100.0, 150.0) == 3  # never fewer than the minimum
    assert calls_per_round(0.0, 150.0) == 3


class _FakeCuda:
    """What ``duty_cycled_ms`` asks of ``torch.cuda``, on a fake timeline: each call of the
    timed function takes the next of ``durations`` ms; a sleep of c cycles takes
    c / SLEEP_CYCLES_PER_MS ms. ``log`` records calls and sleeps in stream order."""

    def __init__(self, durations):
        self.durations, self.now, self.log = list(durations), 0.0, []
        cuda = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.at = None

            def record(self):
                self.at = cuda.now

            def elapsed_time(self, end):
                return end.at - self.at

            def synchronize(self):
                pass

        self.Event = Event

    def call(self, ms=None):
        ms = self.durations.pop(0) if ms is None else ms
        self.now += ms
        self.log.append(("call", ms))

    def _sleep(self, cycles):
        from fa_sm100.benchmarking import SLEEP_CYCLES_PER_MS

        self.now += cycles / SLEEP_CYCLES_PER_MS
        self.log.append(("sleep", cycles / SLEEP_CYCLES_PER_MS))

    def synchronize(self):
        pass


def test_top_clock_timing_sleeps_after_every_call_and_takes_the_median():
    """Note [top-clock timing]: every call between its own events, each followed by a sleep
    at least as long as the given call time; the median call, not the mean."""
    from types import SimpleNamespace

    from fa_sm100.benchmarking import duty_cycled_ms

    cuda = _FakeCuda([2.0, 2.1, 9.0, 2.0, 1.9])
    ms = duty_cycled_ms(cuda.call, 5, 2.5, SimpleNamespace(cuda=cuda))
    assert ms == 2.0  # 9.0 (a preempted call, say) moves the median not at all
    assert [kind for kind, _ in cuda.log] == ["call", "sleep"] * 5
    assert all(t == pytest.approx(2.5) for kind, t in cuda.log if kind == "sleep")


def test_duty_cycled_rounds_give_each_run_its_energy_less_the_sleeps():
    """The sleeps last as long as one call of the default; a round times the sleeps alone, then
    every run (in ``round_order``); a run's joules per call are the sequence's less the sleeps'
    over the calls, here 0.3 J per ms at a constant 300 W (NVML's counter faked on the fake
    timeline)."""
    from types import SimpleNamespace

    from fa_sm100.benchmarking import duty_cycled_calls, duty_cycled_rounds

    cuda = _FakeCuda([])
    nvml = SimpleNamespace(energy_mj=lambda: cuda.now * 300.0, sm_mhz=lambda: 1980)
    runs = {"default": lambda: cuda.call(2.0), "slow": lambda: cuda.call(3.0)}
    seen = []
    res = duty_cycled_rounds(runs, 2, 4, SimpleNamespace(cuda=cuda), nvml,
                             lambda rnd, sleep_j: seen.append((rnd, sleep_j)))
    assert seen == [(0, pytest.approx(0.6)), (1, pytest.approx(0.6))]  # 2 ms sleeps at 300 W
    assert res["default"] == [(pytest.approx(0.6), 2.0, 1980)] * 2
    assert res["slow"] == [(pytest.approx(0.9), 3.0, 1980)] * 2
    # a round: the sleeps alone, then the runs in round_order (round 1: slow first)
    kinds = [kind if kind == "sleep" else ms for kind, ms in cuda.log[1:]]
    assert kinds[:8] == ["sleep"] * 4 + [2.0, "sleep"] * 2
    assert kinds[20:28] == ["sleep"] * 4 + [3.0, "sleep"] * 2  # round 0 took 20 entries
    assert duty_cycled_calls(None, 3, 1.0, SimpleNamespace(cuda=cuda)) == []  # sleeps alone
    assert [kind for kind, _ in cuda.log[-3:]] == ["sleep"] * 3


def test_top_clock_is_a_flag_of_the_timing_only():
    ab = _script()
    assert ab.parse_args(["--top-clock"]).top_clock
    assert not ab.parse_args([]).top_clock


def test_format_cell_names_each_provider_with_its_paired_ratio():
    ab = _script()
    times = {"default": [2.0, 2.2, 2.0], "nofence": [2.1, 2.31, 2.1], "fa4": [1.9, 2.09, 1.9]}
    text = ab.format_cell("hdim 128", times, 60)
    lines = text.splitlines()
    assert lines[0] == "hdim 128: 3 rounds of 60 calls"
    assert lines[2].split()[:3] == ["nofence", "2.1000", "ms"]
    # three rounds are too few for a 95% interval of the median
    assert "x0.952 vs default [n/a] (rounds 0.952-0.952)" in lines[2]
    assert words(lines[-2]) == "over fa4: default 0.950x, nofence 0.905x"
    assert words(lines[-1]) == "over fa4, paired: default 0.950x [n/a], nofence 0.905x [n/a]"


def test_format_cell_gives_the_interval_of_each_paired_ratio_from_six_rounds():
    ab = _script()
    # nofence over default by round: 0.90, 0.95, 1.00, 1.05, 1.10, 0.98 (six rounds: the
    # 95% interval of the median is the lowest to the highest)
    default = [1.0] * 6
    nofence = [1.0 / r for r in (0.90, 0.95, 1.00, 1.05, 1.10, 0.98)]
    fa4 = [1.02] * 6
    lines = ab.format_cell("c", {"default": default, "nofence": nofence, "fa4": fa4},
                           9).splitlines()
    assert "x1.000 vs default [0.900, 1.100] (rounds 0.900-1.100)" in lines[2]
    assert "x1.000 vs default [1.000, 1.000]" in lines[1]
    assert lines[-1] == ("  over fa4, paired: default 1.020x [1.020, 1.020], "
                         "nofence 1.020x [0.918, 1.122]")


@pytest.mark.parametrize("argv,message", [
    (["--variant", "x:nonsense=1"], "BwdConfig has no field 'nonsense'"),
    (["--variant", "x:tile_m=100"], "tile_m=100"),
    (["--variant", "x_rounds:early_dv=true"], "may not end in '_rounds'"),
    (["--mode", "fwd", "--variant", "x:n_block=100"], "n_block=100"),
    (["--mode", "fwd", "--hdim", "256", "--seqlen", "1024",
      "--variant", "p:persistent=true,o_in_q_buffer=false"], "SMEM"),  # O's own 64 KiB
])
def test_bad_variants_stop_before_any_gpu_work(argv, message, capsys, monkeypatch):
    ab = _script()
    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # importing torch would fail
    assert ab.main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--variant", "bad"], ["--variant", "default:tile_m=64"],
                                  ["--rounds", "1"], ["--hdim", "96"], ["--seqlen", "3000"],
                                  ["--heads", "16", "0"],
                                  ["--mode", "fwd", "--fa4-variant", "ss"],
                                  ["--mode", "fwd", "--fa4-variant", "fa4:tile_mn=192x192"],
                                  ["--mode", "fwd", "--variant", "x:persistent=true",
                                   "--fa4-variant", "x:tile_mn=192x192"],
                                  ["--mode", "bwd", "--fa4-variant", "ss:tile_mn=192x192"],
                                  ["--mode", "fwd", "--no-fa4", "--fa4-variant", "ss:tile_mn=192x192"],
                                  ["--probe", "dq_reduce"], ["--probe", "dq_reduce=all"],
                                  ["--probe", "nothing=none"],
                                  ["--probe", "dq_reduce=none+dq_reduce=half"],
                                  ["--probe", "dq_reduce=none+"],
                                  ["--probe", "dq_reduce=none", "--probe", "dq_reduce=none"],
                                  ["--mode", "fwd", "--probe", "dq_reduce=none"],
                                  ["--window", "a", "0"], ["--window", "-1", "0"],
                                  ["--window", "none", "none"], ["--window", "64"],
                                  ["--mode", "fwd", "--window", "64", "0"],
                                  ["--mode", "fwd", "--deterministic"]])
def test_malformed_arguments_are_usage_errors(argv):
    with pytest.raises(SystemExit) as e:
        _script().parse_args(argv)
    assert e.value.code == 2


def test_variants_reach_the_configs_of_every_cell():
    ab = _script()
    (name, fields), = ab.parse_variants(["nofence:dv_before_fence=false,q_stage=1"], "bwd")
    assert name == "nofence" and fields == {"dv_before_fence": False, "q_stage": 1}
    cfg = ab.cell_config("bwd", 128, 1024, True, fields)
    assert (cfg.dv_before_fence, cfg.q_stage, cfg.tile_m, cfg.stats_first) == (False, 1, 64, True)
    fwd = ab.cell_config("fwd", 128, 4096, False, {"persistent": True})
    assert fwd.persistent and not fwd.write_lse  # as the benchmark: no LSE unless asked
    # hdim 64 at 8k: 43 m blocks of 192 rows and 2 x 32 (batch, head) pairs, so the last m
    # blocks pair across heads (Note [Odd m blocks])
    odd = ab.cell_config("fwd", 64, 8192, False, {})
    assert odd.kv_multicast and odd.odd_m_pairs and odd.num_m_blocks(8192) == 43
    assert not ab.cell_config("fwd", 64, 8192, False, {"multicast_odd_m": False}).kv_multicast


def test_window_and_deterministic_choose_the_defaults_of_that_problem():
    """--window / --deterministic reach every config of a backward cell as ``sm90_bwd`` would
    choose it (here: no multicast, no staggered sweeps, no first stores), and the label."""
    ab = _script()
    a = ab.parse_args(["--window", "256", "none", "--deterministic"])
    assert a.problem == {"window_left": 256, "window_right": None, "deterministic": True}
    assert ab.parse_args(["--window", "NONE", "0"]).problem == {"window_left": None,
                                                                "window_right": 0}
    assert ab.parse_args([]).problem == {}
    plain = ab.cell_config("bwd", 128, 4096, False, {})
    cfg = ab.cell_config("bwd", 128, 4096, False, {"q_stage": 1}, problem=a.problem)
    assert plain.qdo_multicast and plain.stagger_m and plain.dq_first_store
    assert (cfg.window_left, cfg.window_right, cfg.deterministic, cfg.q_stage) == (
        256, None, True, 1)
    assert not (cfg.qdo_multicast or cfg.stagger_m or cfg.dq_first_store)
    assert ab.problem_label(a.problem) == " window (256, None) deterministic"
    assert ab.problem_label({}) == ""
    with pytest.raises(ValueError, match="forward"):
        ab.cell_config("fwd", 128, 4096, False, {}, problem={"deterministic": True})


@pytest.mark.parametrize("spec", ["x:deterministic=true", "x:window_left=64", "x:causal=true",
                                  "x:head_dim=64"])
def test_variants_may_not_change_the_problem(spec, capsys, monkeypatch):
    """A variant that set ``deterministic`` ran non-deterministic kernels under that name
    (``sm90_bwd`` takes the problem from its arguments); such fields stop the run."""
    ab = _script()
    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # importing torch would fail
    assert ab.main(["--mode", "bwd", "--seqlen", "4096", "--variant", spec]) == 2
    assert "names the problem" in capsys.readouterr().err


def test_every_benchmark_refuses_variants_that_name_the_problem():
    """``fa_sm100.config.parse_variant`` serves ab_bench, the grid's ``--ours-variant`` (both
    modes) and the SM100 configs alike."""
    from fa_sm100.config import FmhaConfig, parse_variant
    from fa_sm100.hopper.bwd_config import BwdConfig
    from fa_sm100.hopper.config import Sm90FwdConfig

    with pytest.raises(ValueError, match="causal, window_left name the problem"):
        parse_variant("y:causal=true,window_left=3,q_stage=1", BwdConfig)
    with pytest.raises(ValueError, match="head_dim names the problem"):
        parse_variant("y:head_dim=64", Sm90FwdConfig)
    with pytest.raises(ValueError, match="num_sms names the problem"):
        parse_variant("y:num_sms=100", FmhaConfig)
    assert parse_variant("y:q_stage=1", BwdConfig) == ("y", {"q_stage": 1})


def test_launch_bound_flags_calls_the_host_cannot_keep_ahead_of():
    from fa_sm100.benchmarking import launch_bound

    assert launch_bound(0.8, 0.82) and launch_bound(1.0, 0.5)
    assert not launch_bound(0.1, 0.8) and not launch_bound(0.7, 0.8)


def test_paired_ratio_takes_the_fastest_peer_of_each_round():
    from fa_sm100.benchmarking import paired_ratio

    # round 2 is slow for everyone (a shared drift): its ratio is the same as the others'
    times = {"ours": [1.0, 1.0, 2.0], "fa4": [0.9, 1.1, 1.8], "cudnn": [1.2, 0.95, 2.4]}
    assert paired_ratio(times, "ours", ["fa4", "cudnn"]) == pytest.approx(0.9)
    assert paired_ratio(times, "ours", ["cudnn"]) == pytest.approx(1.2)
    # a peer dropped after its first round (run_cell empties its list) or missing altogether
    assert paired_ratio({"ours": [1.0, 2.0], "fa4": []}, "ours", ["fa4", "cudnn"]) is None
    assert paired_ratio({"ours": [1.0, 2.0], "fa4": [0.5]}, "ours", ["fa4"]) == 0.5
    assert paired_ratio({"ours": [], "fa4": [1.0]}, "ours", ["fa4"]) is None


def test_fa4_variants_become_options_of_fa4s_forward():
    ab = _script()
    got = ab.parse_fa4_variants(["ss192:tile_mn=192x192,mma_pv_is_rs=false",
                                 "noov:intra_wg_overlap=False", "rs:mma_pv_is_rs=on"])
    assert got == [("ss192", {"tile_mn": (192, 192), "mma_pv_is_rs": False}),
                   ("noov", {"intra_wg_overlap": False}),
                   ("rs", {"mma_pv_is_rs": True})]  # booleans spelt as for --variant
    seen = []

    def fake_fwd(q, k, v, **kwargs):  # _flash_attn_fwd returns (out, lse, ...)
        seen.append((q, k, v, kwargs))
        return ("out", "lse")

    run = ab.fa4_forward_call(fake_fwd, "q", "k", "v", True, got[0][1])
    assert seen == []  # nothing runs until the call is timed
    assert run() == "out"
    assert seen == [("q", "k", "v", {"causal": True, "tile_mn": (192, 192),
                                      "mma_pv_is_rs": False})]


@pytest.mark.parametrize("spec,message", [
    ("x:tile_m=64", "'tile_m=64' is not field=value with a field of"),
    ("x:tile_mn=190x192", "tile_mn='190x192': expected MxN"),
    ("x:tile_mn=192", "tile_mn='192': expected MxN"),
    ("x:mma_pv_is_rs=maybe", "mma_pv_is_rs='maybe': expected true or false"),
])
def test_bad_fa4_variants_stop_before_any_gpu_work(spec, message, capsys, monkeypatch):
    ab = _script()
    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # importing torch would fail
    assert ab.main(["--mode", "fwd", "--fa4-variant", spec]) == 2
    assert message in capsys.readouterr().err


def test_heads_replace_the_cells_head_count():
    ab = _script()
    assert ab.cell_heads(128, None) == [16] and ab.cell_heads(64, None) == [32]
    assert ab.cell_heads(128, [16, 17, 33]) == [16, 17, 33]
    assert ab.parse_args(["--heads", "16", "17"]).heads == [16, 17]


def test_variants_that_build_the_default_kernels_are_named(capsys):
    """A switch the kernel does not read in a cell (``effective()``) makes the variant an A/A
    check of noise; ab_bench names such variants per cell (round 24 timed ``stats_first`` at
    hdim 128 16k, 80-row blocks, as +0.5-1.0% over 12-16 rounds before this was noticed), and
    only those: a switch that changes the kernel is not named."""
    ab = _script()
    variants = ab.parse_variants(["sf:stats_first=true", "edv:early_dv=true",
                                  "same:qdo_cluster=4,qdo_multicast=false",
                                  "dflt:stats_first=false"], "bwd")
    wide = ab.same_kernel_variants("bwd", 128, 16384, True, variants)
    assert wide == {"sf": ["stats_first"], "dflt": ["stats_first"]}, wide
    # short causal hdim 128 runs 64-row blocks, with stats_first=true already by default;
    # turning multicast off there changes nothing either (no multicast at 1k causal)
    short = ab.same_kernel_variants("bwd", 128, 1024, True, variants)
    assert short == {"sf": ["stats_first"],
                     "same": ["qdo_cluster", "qdo_multicast"]}, short
    fwd = ab.parse_variants(["pr:peer_release=false", "odd:multicast_odd_m=false"], "fwd")
    # hdim 64 non-causal 8k multicasts (43 m blocks, Note [Odd m blocks]): both switches count
    assert ab.same_kernel_variants("fwd", 64, 8192, False, fwd) == {}
    # causal: no multicast, so neither switch is read
    assert ab.same_kernel_variants("fwd", 64, 8192, True, fwd) == {
        "pr": ["peer_release"], "odd": ["multicast_odd_m"]}
    # main() names them before it looks for a GPU (none here: it stops with status 2)
    argv = ["--mode", "bwd", "--hdim", "128", "--seqlen", "1024", "16384", "--causal", "true",
            "--variant", "sf:stats_first=true", "--variant", "edv:early_dv=true"]
    assert ab.main(argv) == 2
    notes = [line for line in capsys.readouterr().out.splitlines() if "ab_bench: note" in line]
    assert len(notes) == 2 and all("variant sf (stats_first)" in n for n in notes), notes
    assert "seqlen 1024 causal" in notes[0] and "seqlen 16384 causal" in notes[1]
    text = ab.format_cell("[1/1] x", {"default": [1.0, 1.0], "sf": [1.0, 1.01]}, 3, {"sf"})
    assert text.splitlines()[2].endswith("[same kernel as default: A/A]")
    assert not text.splitlines()[1].endswith("A/A]")


def test_probes_are_timed_unchecked_and_marked(monkeypatch):
    """A cost probe's run calls the default's run inside the probe (every call, so each finds
    the probed kernel: Note [cost probes]); its line in the cell says it was not checked."""
    from fa_sm100.hopper import probes

    ab = _script()
    seen = []
    call = ab.probed_call(lambda: seen.append(probes.compile_tag()) or "grads",
                          (("dq_reduce", "copy"),))
    assert seen == []  # nothing runs until it is timed
    assert call() == "grads" and call() == "grads"
    assert seen == [(("dq_reduce", "copy"),)] * 2
    assert probes.compile_tag() == ()  # closed after each call
    pairs = probes.parse_probe_set("pointwise=none+dq_reduce=none")  # two at once
    assert ab.probe_set_name(pairs) == "pointwise=none+dq_reduce=none"
    seen.clear()
    assert ab.probed_call(lambda: seen.append(probes.compile_tag()), pairs)() is None
    assert seen == [(("dq_reduce", "none"), ("pointwise", "none"))]
    assert probes.compile_tag() == ()
    name = ab.PROBE_PREFIX + "dq_reduce=none"
    text = ab.format_cell("hdim 128", {"default": [2.0, 2.0], name: [1.9, 1.9]}, 10)
    line, = [x for x in text.splitlines() if name in x]
    assert "x1.053 vs default" in line and line.endswith("[probe: results not checked]")
    assert "probe" not in text.splitlines()[1]  # the default's line


def test_a_probe_with_nothing_to_probe_stops_before_any_gpu_work(capsys, monkeypatch):
    """hdim 256 adds dQ from registers ("red"): there is no bulk reduce to probe."""
    ab = _script()
    monkeypatch.setitem(__import__("sys").modules, "torch", None)  # importing torch would fail
    assert ab.main(["--mode", "bwd", "--hdim", "128", "256", "--seqlen", "4096",
                    "--probe", "dq_reduce=none"]) == 2
    assert "dq_accum='red'" in capsys.readouterr().err
