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


def test_gpt2_dst_tiny(capsys):
    pytest.importorskip("transformers")
    gpt2 = load("gpt2_dst")
    assert gpt2.main(["--tiny", "--steps", "4", "--update-every", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for impl in ("snack", "dense_mask", "dense"):
        assert f"\n{impl}" in out


def test_graph_inference_tiny(capsys):
    pytest.importorskip("networkx")
    graph = load("graph_inference")
    assert graph.main(["--tiny", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count(" us ") >= 3
