"""fa_sm100.nsight and scripts/ncu_bwd.py --summary on small Nsight Compute CSV exports written
here in ncu's own layout (CPU only)."""

import gzip
import math

import pytest
from script_loader import load_script

from fa_sm100 import nsight

OURS = "kernel_cutlass_kernel_fa_sm100hopperbwd_kernelSm90FlashBackward_object_at_0"
FA4 = "kernel_cutlass_kernel_flash_attncuteflash_bwd_sm90FlashAttentionBackwardSm90_object"

DETAILS_HEAD = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
                '"Block Size","Grid Size","Device","CC","Section Name","Metric Name",'
                '"Metric Unit","Metric Value"\n')


def _details(rows):
    """rows: (id, kernel, metric, unit, value)."""
    return DETAILS_HEAD + "".join(
        f'"{i}","1","python","host","{k}","1","7","(384, 1, 1)","(2048, 1, 1)","0","9.0",'
        f'"GPU Speed Of Light Throughput","{m}","{u}","{v}"\n' for i, k, m, u, v in rows)


def _raw(kernels):
    """kernels: [(id, name, {metric: value})], one metric set for all."""
    metrics = list(kernels[0][2])
    head = ['"ID"', '"Kernel Name"'] + [f'"{m}"' for m in metrics]
    units = ['""', '""'] + ['"cycle"' if "cycles" in m else '""' for m in metrics]
    lines = [",".join(head), ",".join(units)]
    for i, name, values in kernels:
        lines.append(",".join([f'"{i}"', f'"{name}"'] + [f'"{values[m]}"' for m in metrics]))
    return "\n".join(lines) + "\n"


SOURCE_HEAD = ('"Address","Source","Warp Stall Sampling (All Samples)",'
               '"Warp Stall Sampling (Not-issued Samples)","Instructions Executed",'
               '"stall_barrier","stall_short_sb"\n')


def _source(kernels):
    """kernels: [(name, [(source, samples, executed)])]."""
    text = ""
    for name, rows in kernels:
        text += f'"Kernel Name","{name}",\n' + SOURCE_HEAD
        for n, (src, samples, executed) in enumerate(rows):
            text += (f'"0x7f00{n:04x}0","      {src}","{samples}","{samples}","{executed}",'
                     f'"0","{samples}"\n')
    return text


LOOP = [("SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R3", 5, 2),  # before the loop
        ("HGMMA.64x80x16.F32.BF16 R192, gdesc[UR12], RZ, !UPT", 700, 40),
        ("HGMMA.64x80x16.F32.BF16 R192, gdesc[UR16], R192", 30, 40),
        ("SHFL.IDX PT, R10, R17, R7, 0x1f", 20, 40),
        ("FFMA R193, R193, UR20, -R10", 90, 40),
        ("@!P1 BRA 0x7f00", 11, 40),
        ("FSEL R192, R192, -INF , P2", 3, 4),  # the masked blocks only
        ("MUFU.EX2 R193, R193", 60, 40)]


def test_kernel_times_convert_units_and_read_thousands_separators(tmp_path):
    path = tmp_path / "x_details.csv"
    path.write_text(_details([
        (0, "fill", "Duration", "us", "1.89"), (0, "fill", "Elapsed Cycles", "cycle", "3,655"),
        (0, "fill", "SM Frequency", "Mhz", "1,930"),
        (1, OURS, "Duration", "ms", "7.78"), (1, OURS, "Elapsed Cycles", "cycle", "13,769,267"),
        (1, OURS, "SM Frequency", "Ghz", "1.75"), (1, OURS, "DRAM Frequency", "Ghz", "3.2")]))
    got = nsight.kernel_times(str(path))
    assert list(got) == ["0: fill", f"1: {OURS}"]
    assert got["0: fill"] == pytest.approx({"duration_us": 1.89, "cycles": 3655, "sm_ghz": 1.93})
    assert got[f"1: {OURS}"] == pytest.approx({"duration_us": 7780.0, "cycles": 13769267,
                                               "sm_ghz": 1.75})
    path.write_text(_details([(0, "fill", "Duration", "fortnight", "1")]))
    with pytest.raises(ValueError, match="unknown unit 'fortnight'"):
        nsight.kernel_times(str(path))


def test_raw_metrics_skip_the_units_row_and_text_values_and_stalls_sort(tmp_path):
    m = {"gpc__cycles_elapsed.max": "13,769,267", "device__attribute_display_name": "H200",
         "smsp__pcsamp_sample_count": "855,579",
         "smsp__pcsamp_warps_issue_stalled_barrier": "123765",
         "smsp__pcsamp_warps_issue_stalled_barrier_not_issued": "114061",
         "smsp__pcsamp_warps_issue_stalled_warpgroup_arrive": "126667",
         "smsp__pcsamp_warps_issue_stalled_sleeping": ""}
    path = tmp_path / "x_raw.csv"
    path.write_text(_raw([(2, OURS, m), (3, "post", {**m, "gpc__cycles_elapsed.max": "93,898"})]))
    got = nsight.raw_metrics(str(path))
    assert set(got) == {f"2: {OURS}", "3: post"}
    ours = got[nsight.find_kernel(got, "Sm90FlashBackward")]
    assert ours["gpc__cycles_elapsed.max"] == 13769267
    assert "device__attribute_display_name" not in ours
    assert got["3: post"]["gpc__cycles_elapsed.max"] == 93898
    stalls = nsight.stall_samples(ours)
    assert list(stalls) == ["warpgroup_arrive", "barrier", "sample_count"]  # NaN left out
    assert stalls["barrier"] == 123765 and stalls["sample_count"] == 855579


def test_find_kernel_needs_exactly_one_match():
    names = [f"1: {OURS}", f"2: {FA4}", "3: kernel_flash_attn_bwd_postprocess"]
    assert nsight.find_kernel(names, "Sm90FlashBackward") == f"1: {OURS}"
    with pytest.raises(ValueError, match="0 kernels match"):
        nsight.find_kernel(names, "Sm100")
    with pytest.raises(ValueError, match="2 kernels match"):
        nsight.find_kernel(names, "kernel_cutlass")


def test_main_loop_is_what_runs_as_often_as_the_busiest_hgmma(tmp_path):
    path = tmp_path / "x_source.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write(_source([("fill", [("STG.E [R2], RZ", 1, 4)]), (OURS, LOOP)]))
    rows = nsight.source_rows(str(path))
    assert list(rows) == ["fill", OURS]
    loop = nsight.main_loop(rows[OURS])
    assert [nsight.opcode(r["Source"]) for r in loop] == [
        "HGMMA.64x80x16.F32.BF16", "HGMMA.64x80x16.F32.BF16", "SHFL.IDX", "FFMA", "BRA",
        "MUFU.EX2"]
    assert nsight.loop_opcodes(rows[OURS])["HGMMA.64x80x16.F32.BF16"] == 2
    samples = nsight.loop_samples(rows[OURS])
    assert samples["HGMMA.64x80x16.F32.BF16"] == 730 and samples["BRA"] == 11
    assert samples["total"] == 700 + 30 + 20 + 90 + 11 + 60
    assert list(samples)[0] == "HGMMA.64x80x16.F32.BF16"
    with pytest.raises(ValueError, match="no HGMMA"):
        nsight.main_loop(rows["fill"])


def test_side_by_side_marks_missing_values():
    lines = nsight.side_by_side({"ours": {"a": 1.0, "b": 2.0}, "fa4": {"a": 3.0}})
    assert lines[0].split() == ["ours", "fa4"]
    assert lines[1].split() == ["a", "1", "3"] and lines[2].split() == ["b", "2", "-"]


def _script():
    return load_script("ncu_bwd")


def test_summary_puts_the_main_kernels_side_by_side(tmp_path, capsys):
    cell = "h128_16384_full"
    for label, name, cycles, active in (("default", OURS, "13,769,267", "74.69"),
                                        ("fa4", FA4, "13,376,255", "76.76")):
        (tmp_path / f"{label}_{cell}_details.csv").write_text(_details([
            (1, name, "Duration", "ms", "7.8"), (1, name, "Elapsed Cycles", "cycle", cycles)]))
        (tmp_path / f"{label}_{cell}_raw.csv").write_text(_raw([(1, name, {
            "gpc__cycles_elapsed.max": cycles,
            "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed": active,
            "smsp__pcsamp_sample_count": "100",
            "smsp__pcsamp_warps_issue_stalled_warpgroup_arrive": "60"})]))
        (tmp_path / f"{label}_{cell}_source.csv").write_text(_source([(name, LOOP)]))
    png = tmp_path / "stalls.png"
    _script().summarize(str(tmp_path), png=str(png))
    out = capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in out
    assert f"== {cell}" in out
    row = next(line for line in out.splitlines() if "tensor pipe active %" in line)
    assert row.split()[-2:] == ["74.7", "76.8"]
    row = next(line for line in out.splitlines() if line.strip().startswith("elapsed cycles"))
    assert row.split()[-2:] == ["13,769,267.0", "13,376,255.0"]
    assert any(line.split()[:1] == ["SHFL.IDX"] for line in out.splitlines())
    with pytest.raises(SystemExit, match="no \\*_details.csv"):
        _script().summarize(str(tmp_path), "h64_1024_causal")


def test_profile_refuses_a_bad_probe_before_running_ncu():
    with pytest.raises(ValueError, match="unknown probe"):
        _script().main(["--who", "default", "probe:nothing=none"])
    assert math.isnan(nsight._number(""))


def test_summary_without_raw_pages_has_nothing_to_plot(tmp_path):
    (tmp_path / "default_h64_1024_causal_details.csv").write_text(_details([
        (1, OURS, "Duration", "us", "90.5")]))
    _script().summarize(str(tmp_path))  # times only: no raw page needed
    with pytest.raises(SystemExit, match="no raw page"):
        _script().summarize(str(tmp_path), png=str(tmp_path / "x.png"))
