"""The end-to-end examples stay alive: a few CPU steps of each at tiny sizes."""

import importlib.util
import sys
from pathlib import Path

import pytest

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
                      "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for impl in ("snack", "dense_mask", "dense"):
        for dtype in ("fp32", "bf16"):
            assert f"\n{impl:<12}{dtype:>6}" in out
    assert_report(tmp_path, "gpt2", ("snack", "dense_mask", "dense"))


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
