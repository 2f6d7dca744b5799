"""The end-to-end examples stay alive: a few CPU steps of each at tiny sizes."""

import importlib.util
import sys
from pathlib import Path

import pytest

from snack import benchmark

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_gpt2_dst_tiny(capsys, tmp_path):
    pytest.importorskip("transformers")
    gpt2 = load("gpt2_dst")
    assert gpt2.main(["--tiny", "--steps", "4", "--update-every", "2", "--device", "cpu", "--dtypes", "fp32,bf16",
                      "--eval-every", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for impl in ("snack", "dense_mask", "dense"):
        for dtype in ("fp32", "bf16"):
            assert f"\n{impl:<12}{dtype:>6}" in out
    assert_report(tmp_path, "gpt2", ("snack", "dense_mask", "dense"))
    # Held-out perplexity of every run: finite, above 1, below a uniform guess over 256 bytes' by a
    # margin only training gives; snack and Dense+Mask (same weights, masks and updates) agree.
    _, rows = benchmark.read_csv(tmp_path / "gpt2_cpu.csv")
    ppl = {(r["impl"], r["dtype"]): float(r["heldout_ppl"]) for r in rows}
    assert all(1.0 < v < 256.0 for v in ppl.values()), ppl
    for dtype in ("fp32", "bf16"):
        assert ppl[("snack", dtype)] == pytest.approx(ppl[("dense_mask", dtype)], rel=2e-2)
    assert "held-out ppl" in (tmp_path / "gpt2_cpu.md").read_text()


def test_gpt2_heldout_text_is_never_trained_on(tmp_path, monkeypatch):
    gpt2 = load("gpt2_dst")
    for i in range(20):  # whole files, each its own byte
        (tmp_path / f"m{i:02d}.py").write_bytes(bytes([65 + i]) * 100)
    monkeypatch.setattr(gpt2.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    train, heldout = gpt2.load_corpus(1800)
    held = {i for i in range(20) if i % gpt2.HELDOUT_EVERY == gpt2.HELDOUT_EVERY - 1}  # files 9 and 19
    assert set(heldout.tolist()) == {65 + i for i in held} and heldout.numel() == 200
    assert set(train.tolist()) == {65 + i for i in range(20) if i not in held} and train.numel() == 1800


def test_graph_inference_tiny(capsys, tmp_path):
    pytest.importorskip("networkx")
    graph = load("graph_inference")
    assert graph.main(["--tiny", "--device", "cpu", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count(" us ") >= 3
    assert_report(tmp_path, "graph", ("snack", "dense_mask", "dense"))


def assert_report(folder, name, impls):
    """The result files of an example: a CSV with a provenance header and a row per implementation,
    a Markdown report and a plot."""
    lines = (folder / f"{name}_cpu.csv").read_text().splitlines()
    assert lines[0].startswith("# ") and any(line.startswith("# commit: ") for line in lines)
    rows = [line for line in lines if not line.startswith("#")][1:]
    assert sorted({row.split(",")[0] for row in rows}) == sorted(impls)
    assert (folder / f"{name}_cpu.md").read_text().startswith("# ")
    assert (folder / f"{name}_cpu.png").stat().st_size > 0


def test_mobilenet_tiny(capsys, tmp_path):
    mobilenet = load("mobilenet")
    assert mobilenet.main(["--tiny", "--device", "cpu", "--out", str(tmp_path)]) == 0
    assert_report(tmp_path, "mobilenet", ("snack", "snack_unfused", "dense"))
    _, rows = benchmark.read_csv(tmp_path / "mobilenet_cpu.csv")
    timed = [r for r in rows if r["latency_us"] == r["latency_us"]]
    assert len(timed) == 2 * 2 * 2 * 3  # batches x dtypes x layouts x impls
    # snack, snack_unfused (the same weights), then dense
    for fused, unfused, dense in zip(timed[0::3], timed[1::3], timed[2::3]):
        assert (fused["impl"], unfused["impl"], dense["impl"]) == ("snack", "snack_unfused", "dense")
        assert fused["weight_mib"] == unfused["weight_mib"] < dense["weight_mib"]
    trained = [r for r in rows if r["accuracy"] == r["accuracy"]]
    assert sorted(r["impl"] for r in trained) == ["dense", "snack"] and all(0 <= r["accuracy"] <= 1 for r in trained)
    assert "Accuracy" in (tmp_path / "mobilenet_cpu.md").read_text()


def test_sparse_transformer_tiny(capsys, tmp_path):
    example = load("sparse_transformer")
    assert example.main(["--tiny", "--steps", "2", "--device", "cpu", "--impls", "snack,snack_dense_attention,dense",
                         "--out", str(tmp_path)]) == 0
    assert_report(tmp_path, "sparse_transformer", ("snack", "snack_dense_attention", "dense"))
    _, rows = benchmark.read_csv(tmp_path / "sparse_transformer_cpu.csv")
    assert all(r["heldout_loss"] > 0 and r["step_ms"] > 0 for r in rows)
