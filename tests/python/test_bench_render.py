"""The benchmark summaries rebuilt from result files (no GPU): bench/spmm.py --render states each
target, and where the floor target is missed, the row-by-row evidence."""

import pytest

from bench import conv_paths, cpu, host, spmm, tile_view_splits
from snack import benchmark


def write_results(path, snack_us):
    """A result file for 16384x4096, uniform, 90%, N = 1 and 16: snack at snack_us[N], baselines 10x slower."""
    info = {"gpu": "Test GPU", "commit": "0123456789", "copy_bandwidth": "4000 GB/s (test)"}
    rows = []
    for n, floor in ((1, 13.5), (16, 13.8)):
        for impl, scale in (("snack", 1.0), ("dense", 10.0), ("dense_mask", 10.0), ("cusparse_csr", 10.0)):
            rows.append(dict(op="fwd", M=16384, K=4096, N=n, sparsity=0.9, pattern="uniform", dtype="fp32",
                             impl=impl, median_us=snack_us[n] * scale, floor_us=floor))
    benchmark.write_csv(path / "spmm_test_gpu.csv", info, spmm.COLUMNS, rows)


def rendered(path, name: str = "spmm_test_gpu") -> str:
    """The summary bench/spmm.py --render rebuilds from the result files in `path`: `name`.md."""
    assert spmm.main(["--render", "--out", str(path)]) == 0
    return (path / f"{name}.md").read_text()


def test_render_states_the_missed_floor_target_row_by_row(tmp_path):
    write_results(tmp_path, {1: 27.0, 16: 55.2})
    md = rendered(tmp_path)
    assert "min 25%, max 50% (target >= 60%) MISSED" in md
    assert "| 1 | 0.9 | 13.5 | 27.0 | 50% | 22.5 | 2000 |" in md
    assert "| 16 | 0.9 | 13.8 | 55.2 | 25% | 23.0 | 1000 |" in md
    assert "geomean speedup over cusparse_csr: **10.00x** (target >= 3x) met" in md
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib")
    assert (tmp_path / "spmm_test_gpu.png").stat().st_size > 0


def test_render_without_evidence_where_the_floor_target_is_met(tmp_path):
    write_results(tmp_path, {1: 20.0, 16: 20.0})
    md = rendered(tmp_path)
    assert "(target >= 60%) met" in md
    assert "row by row" not in md


def test_render_of_a_run_given_fragments_summarizes_the_planners_choice_over_them(tmp_path):
    # --impls without the plain `snack` row: the planner given tile fragments stands for snack, and
    # the floor's evidence is the 16-bit kernels', not fp32's.
    info = {"gpu": "Test GPU", "commit": "0123456789", "copy_bandwidth": "3000 GB/s (test)"}
    rows = [dict(op="fwd", M=16384, K=4096, N=16, sparsity=0.9, pattern="uniform", dtype="bf16", impl=impl,
                 median_us=us, floor_us=13.8)
            for impl, us in (("snack_fragments", 27.6), ("snack_wgmma_fragments", 30.0), ("dense", 55.2))]
    benchmark.write_csv(tmp_path / "spmm_test_gpu_bf16.csv", info, spmm.COLUMNS, rows)
    md = rendered(tmp_path, "spmm_test_gpu_bf16")
    assert "snack is `snack_fragments`" in md
    assert "| 16384x4096 | 16 | 0.9 | uniform | 13.8 | 27.6 | 55.2 | - | - | - | 50% |" in md
    assert "| 2.00x |" in md
    assert "slower than dense in 0 of 1 rows" in md
    assert "tile fragments with `mma.sync`" in md and "L1 gathers of X^T" not in md
    assert "| snack | wgmma_fragments | dense | choice / best |" in md
    assert "| 16384x4096 | 16 | 0.9 | uniform | 27.6 | 30.0 | 55.2 | 0.92 |" in md


def test_render_needs_result_files(tmp_path):
    assert spmm.main(["--render", "--out", str(tmp_path)]) == 1


def write_rounds(path, name, snack_us, dense_us, commit):
    info = {"gpu": "Test GPU", "commit": commit}
    rows = [dict(op="fwd", M=64, K=32, N=n, sparsity=0.9, pattern="uniform", dtype="fp32", impl=impl,
                 median_us=us, floor_us=1.0)
            for n, (s, d) in enumerate(zip(snack_us, dense_us), start=1) for impl, us in (("snack", s), ("dense", d))]
    benchmark.write_csv(path / name, info, spmm.COLUMNS, rows)
    return str(path / name)


def test_compare_matches_rows_and_takes_each_rows_fastest_round(tmp_path):
    from bench import compare
    before = [write_rounds(tmp_path, "b1.csv", [10.0, 20.0], [5.0, 5.0], "aaa"),
              write_rounds(tmp_path, "b2.csv", [12.0, 18.0], [5.0, 6.0], "aaa")]
    after = [write_rounds(tmp_path, "a1.csv", [5.0, 36.0], [5.0, 5.0], "bbb")]
    out = tmp_path / "out"
    assert compare.main(["--before", *before, "--after", *after, "--name", "t", "--out", str(out)]) == 0
    info, rows = benchmark.read_csv(out / "compare_t_test_gpu.csv")
    ratios = {(r["row"], r["snack"]): r["ratio"] for r in rows}
    assert ratios[("fwd 64x32 N=1 0.9 uniform fp32 snack", "True")] == pytest.approx(0.5)   # 5 / min(10, 12)
    assert ratios[("fwd 64x32 N=2 0.9 uniform fp32 snack", "True")] == pytest.approx(2.0)   # 36 / min(20, 18)
    assert ratios[("fwd 64x32 N=2 0.9 uniform fp32 dense", "False")] == pytest.approx(1.0)
    md = (out / "compare_t_test_gpu.md").read_text()
    assert "| kernel | median_us | snack | 2 | 1.000 | 0.500 | 2.000 |" in md
    assert "commit aaa" in md and "commit bbb" in md


def test_the_16bit_backward_summary_states_each_ratio(tmp_path):
    from bench import layer
    info = {"gpu": "Test GPU", "commit": "0123456789"}
    rows = [dict(op=op, M=4096, K=4096, N=16, sparsity=0.9, pattern="uniform", dtype="bf16", impl=impl,
                 median_us=us, floor_us=5.0)
            for op, impl, us in (("fwd", "snack", 20.0), ("fwd", "snack_tile_view", 21.0), ("dx", "snack", 25.0),
                                 ("dx", "snack_global_x", 35.0), ("dx", "snack_global_xt", 32.0),
                                 ("dx", "snack_tensor_core", 40.0), ("dx", "snack_tile_view", 25.0),
                                 ("dx", "dense", 50.0), ("dw", "snack", 30.0), ("dw", "snack_tensor_core", 45.0),
                                 ("dw", "snack_tile_view", 33.0), ("dw", "snack_tile_view_wgmma", 28.0),
                                 ("dw", "snack_rows", 30.0), ("dw", "dense", 15.0))]
    rows += [dict(op="dw_adamw", M=4096, K=4096, N=16, sparsity=0.9, pattern="uniform", dtype="bf16", impl=impl,
                  median_us=us, floor_us=5.0)
             for impl, us in (("snack_fused", 60.0), ("snack_fused_rows", 60.0), ("snack_fused_tensor_core", 90.0),
                              ("snack_unfused", 80.0))]
    for r in rows:
        r["tflops"] = 1.0
    md = layer.summarize_16bit(rows, info)
    # dX row kernels: the faster of global_x and global_xt; dW tile_view_wgmma beside tile_view.
    assert ("| 4096x4096 | 16 | 0.9 | 20.0 | 21.0 | 25.0 | 32.0 | 40.0 | 25.0 | 50.0 | 2.00x | 1.25x | 30.0 | 45.0 "
            "| 33.0 | 28.0 | 30.0 | 15.0 | 0.50x |") in md
    # dW with AdamW's step: the planner's fused kernel, each forced one ("-" where it did not run), unfused.
    assert "| 4096x4096 | 16 | 0.9 | 60.0 | 60.0 | - | 90.0 | - | 80.0 |" in md
    assert "dX / forward, geomean: 1.25 (target <= 1.3)" in md
    # --render rebuilds the same summary, and its plot, from the result file.
    benchmark.write_csv(tmp_path / "backward_test_gpu_bf16.csv", info, layer.BACKWARD_COLUMNS, rows)
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib")
    assert layer.main(["--render", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "backward_test_gpu_bf16.md").read_text() == md
    assert (tmp_path / "backward_test_gpu_bf16.png").stat().st_size > 0


def test_the_layer_summary_keeps_each_precision_apart(tmp_path):
    from bench import layer
    info = {"gpu": "Test GPU", "commit": "0123456789"}
    rows = [dict(M=4096, K=4096, N=2048, sparsity=0.9, dtype=dtype, impl=impl, optimizer="adamw", gpu_us=us,
                 graph_us=us, wall_us=us, peak_mib=10.0)
            for dtype, snack_us, dense_us in (("fp32", 100.0, 400.0), ("bf16_autocast", 200.0, 100.0))
            for impl, us in (("snack", snack_us), ("dense", dense_us))]
    md = layer.summarize(rows, [], info)
    assert "| 4096x4096 | 2048 | 0.9 | fp32 | adamw |" in md and "| 4.00x |" in md
    assert "| 4096x4096 | 2048 | 0.9 | bf16_autocast | adamw |" in md and "| 0.50x |" in md
    with pytest.raises(ValueError):
        with layer.precision_mode("fp64"):
            pass


def test_the_weight_gradient_paths_sit_side_by_side(tmp_path):
    # A backward-only run's dW rows: one line per problem with every path's time and useful TFLOP/s,
    # "-" where a path did not run; re-rendered from its CSV with a plot.
    from bench import layer
    info = {"gpu": "Test GPU", "commit": "0123456789"}
    rows = [dict(op="dw", M=4096, K=4096, N=1024, sparsity=0.9, pattern="uniform", dtype="fp32", impl=impl,
                 median_us=us, floor_us=5.0, tflops=tf)
            for impl, us, tf in (("snack", 700.0, 4.9), ("snack_vector", 900.0, 3.8), ("snack_staged", 690.0, 5.0),
                                 ("dense", 670.0, 5.1), ("cusparse_sddmm", 2800.0, 1.2))]
    md = layer.summarize([], rows, info)
    assert "| 4096x4096 | 1024 | 0.9 | 700 / 4.9 | - | 900 / 3.8 | 690 / 5.0 | - | - | 670 / 5.1 | 2800 / 1.2 |" in md
    benchmark.write_csv(tmp_path / "backward_test_gpu_kernels.csv", info, layer.BACKWARD_COLUMNS, rows)
    assert layer.main(["--render", "--out", str(tmp_path)]) == 0
    assert "690 / 5.0" in (tmp_path / "backward_test_gpu_kernels.md").read_text()
    if benchmark.pyplot() is not None:
        assert (tmp_path / "backward_test_gpu_kernels.png").stat().st_size > 0


def test_tile_view_splits_summary_names_the_planners_count_against_the_best():
    rows = [dict(op="fwd", M=4096, K=4096, N=32, sparsity=0.9, splits=c, median_us=t, planner_splits=6)
            for c, t in ((2, 33.0), (6, 23.1), (8, 27.2))]
    rows += [dict(op="dx", M=4096, K=4096, N=64, sparsity=0.9, splits=c, median_us=t, planner_splits=8)
             for c, t in ((2, 40.0), (6, 30.0), (8, 33.0))]
    md = tile_view_splits.summarize(rows, {"gpu": "Test GPU"}, [2, 3, 6, 8], [], [])
    assert "| fwd | 4096x4096 | 32 | 0.9 | 33.0 | - | 23.1 | 27.2 | 6 | 6 | 1.00 |" in md
    assert "| dx | 4096x4096 | 64 | 0.9 | 40.0 | - | 30.0 | 33.0 | 8 | 6 | 1.10 |" in md
    assert "- dx: the planner's count runs 1.100x the best count's time" in md


def test_host_benchmark_runs_and_reports_every_phase(tmp_path):
    assert host.main(["--device", "cpu", "--layers", "2", "--reps", "5", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "host_cpu.md").read_text()
    for phase in ("inference", "forward", "step"):
        row = next(line for line in md.splitlines() if line.startswith(f"| {phase} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 5 and cells[-1].endswith("x"), row  # phase, three impls, snack / dense
    _, rows = benchmark.read_csv(tmp_path / "host_cpu.csv", int_columns=("layers", "features", "rows"))
    assert len(rows) == 7 and all(float(r["us_per_layer"]) > 0 for r in rows)


def test_cpu_benchmark_runs_and_checks_the_planners_choice(tmp_path):
    args = ["--shapes", "96x200", "--sparsities", "0.5,0.9", "--batches", "3,64", "--dtypes", "fp32,bf16",
            "--min-seconds", "0", "--out", str(tmp_path)]
    assert cpu.main(args) == 0
    md = (tmp_path / "spmm_cpu.md").read_text()
    for op in cpu.OPS:
        assert f"### {op}" in md
    rows = [line for line in md.splitlines() if line.startswith("| 96x200 |")]
    assert len(rows) == 3 * 2 * 2  # ops x dtypes x batches, a cell per sparsity
    assert all(row.count("x)") == 2 for row in rows), rows
    assert "- within 10% of the faster path in" in md and "of 12 rows" in md  # 3 ops x 2 dtypes x 2 sparsities
    _, results = benchmark.read_csv(tmp_path / "spmm_cpu.csv")
    assert {r["impl"] for r in results} == {"dense", "snack", "snack_loops", "snack_dense_blocks"}
    assert all(float(r["median_us"]) > 0 for r in results)


def test_conv_paths_report_names_the_planners_path_against_the_fastest(tmp_path):
    # MobileNetV1's distinct pointwise layers at width 1 (the last five 512 -> 512 blocks are one row).
    layers = conv_paths.pointwise_layers(1.0)
    assert layers[0] == (32, 64, 112) and layers[-1] == (1024, 1024, 7) and len(layers) == 9
    info = {"gpu": "Test GPU", "commit": "0123456789"}
    rows = [dict(width=1.0, batch=64, dtype="fp32", in_channels=256, out_channels=256, side=28, plan="dense_blocks",
                 snack_us=90.0, in_place_us=250.0, pixel_rows_us=330.0, dense_blocks_us=88.0, cudnn_us=85.0),
            dict(width=1.0, batch=1, dtype="bf16", in_channels=1024, out_channels=1024, side=7, plan="in_place",
                 snack_us=18.0, in_place_us=18.0, pixel_rows_us=12.0, dense_blocks_us=20.0, cudnn_us=15.0)]
    conv_paths.write_report(tmp_path / "conv_paths_test_gpu", info, rows)
    md = (tmp_path / "conv_paths_test_gpu.md").read_text()
    assert "| 1 | 64 | fp32 | 256->256 | 28 | dense_blocks | 90.0 | 250.0 | 330.0 | 88.0 | 85.0 | 1.00 | 0.94x |" in md
    assert "| 1.50 | 0.83x |" in md  # in place, 18 us, against the pixel rows' 12
    assert "within 10% of the fastest in 1 of 2 rows" in md
    _, back = benchmark.read_csv(tmp_path / "conv_paths_test_gpu.csv", int_columns=("batch",))
    assert [r["plan"] for r in back] == ["dense_blocks", "in_place"]


def test_dw_tile_view_summary_names_the_planners_kernel_against_the_best_and_dense(tmp_path):
    from bench import dw_tile_view
    info = {"gpu": "Test GPU", "commit": "0123456789"}
    rows = [dict(M=4096, K=4096, N=64, sparsity=0.9, dtype="bf16", impl=impl, median_us=us,
                 planner="tile_view_wgmma", rel_error=1e-3)
            for impl, us in (("snack", 20.0), ("tile_view", 22.0), ("wgmma_1", 20.0), ("wgmma_2", 21.0),
                             ("dense", 17.0))]
    md = dw_tile_view.summarize(rows, info)
    assert "| 4096x4096 | 64 | 0.9 | 20.0 | 22.0 | 20.0 | 21.0 | 17.0 | tile_view_wgmma | wgmma_1 | 1.00 | 0.85x |" in md
    assert "snack faster in 0 of 1 problems" in md
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib")
    dw_tile_view.plot(rows, tmp_path / "dw.png", info)
    assert (tmp_path / "dw.png").stat().st_size > 0
