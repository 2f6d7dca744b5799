import pytest
import torch

import snack  # noqa: F401  (loads the operator library)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: none is visible to torch here")
    for item in items:
        if "cuda" in item.keywords or "[cuda" in item.nodeid:
            item.add_marker(skip)


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)
